"""One OpenAI-compatible base URL for every language model the cluster serves, routed by `model`.

    serve run serve_apps.openai:app --route-prefix /v1
    OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused").models.list()

It finds the chat applications (`serve_apps.chat:app`) by itself, those deployed after it included.
Arguments: max_body_bytes (default 1000000).
"""

from flotilla.serve import openai_router


def app(args: dict):
    return openai_router(**(args or {}))
