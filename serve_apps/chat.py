"""OpenAI-compatible completions from a fine-tuned pretrained model (`model.kind: hf_causal_lm`).

    serve run serve_apps.chat:app config=configs/instruct_lora.yaml --route-prefix /v1/models/instruct-lora
    curl -s localhost:8000/v1/models/instruct-lora/v1/chat/completions -H 'content-type: application/json' \
         -d '{"model": "instruct-lora", "messages": [{"role": "user", "content": "What is 2 plus 3?"}]}'

An OpenAI client: `OpenAI(base_url="http://127.0.0.1:8000/v1/models/instruct-lora/v1", api_key="unused")`.
Arguments: config, model, alias | version | traffic, tracking_uri (see flotilla.serve._builder).
"""

from flotilla.serve import build_app


def app(args: dict):
    return build_app(args, "chat")
