"""Text generation from a registered gpt model: POST {prefix}/generate, streamed or whole.

    serve run serve_apps.generator:app config=configs/pycode_gpt.yaml --route-prefix /v1/models/pycode-gpt
    curl -sN localhost:8000/v1/models/pycode-gpt/generate -H 'content-type: application/json' \
         -d '{"prompt": "def ", "max_tokens": 64, "seed": 0, "stream": true}'

Arguments: config, model, alias | version | traffic, tracking_uri (see flotilla.serve._builder).
"""

from flotilla.serve import build_app


def app(args: dict):
    return build_app(args, "generator")
