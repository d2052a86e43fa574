"""Baseline (b) of benchmarks/serve_throughput.py: plain FastAPI + uvicorn, one forward per request.

    python benchmarks/_plain_fastapi.py BUNDLE_DIR PORT

The same bundle, the same preprocessing (`InferenceBundle.predict`), one torch thread, one
uvicorn worker on 127.0.0.1 — the way a model is usually put behind HTTP without a serving layer.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import uvicorn  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from flotilla.bundle import load_bundle  # noqa: E402

torch.set_num_threads(1)
bundle = load_bundle(sys.argv[1])
app = FastAPI()


class Body(BaseModel):
    instances: list[list[float]]


@app.post("/predict")
def predict(body: Body) -> dict:
    out = bundle.predict(np.asarray(body.instances, dtype="float64"))
    return {"predictions": out["predictions"], "probabilities": out.get("probabilities")}


@app.post("/noop")
def noop(body: Body) -> dict:
    """The same request and a same-sized answer without the model: what HTTP alone costs here."""
    return {"predictions": [0] * len(body.instances), "probabilities": [[0.1] * 10] * len(body.instances)}


@app.get("/healthz")
def healthz() -> dict:
    return {"ok": True}


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning", access_log=False)
