"""JSON predictions from a registered tabular model: POST {prefix}/predict.

    serve run serve_apps.classifier:app model=digits alias=champion --route-prefix /v1/models/digits
    curl -s localhost:8000/v1/models/digits/predict -H 'content-type: application/json' \
         -d '{"instances": [[0, 0, 5, 13, 9, 1, 0, 0, ...]]}'

Arguments: config, model, alias | version | traffic, tracking_uri (see flotilla.serve._builder).
"""

from flotilla.serve import build_app


def app(args: dict):
    return build_app(args, "classifier")
