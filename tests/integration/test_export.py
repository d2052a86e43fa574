"""ONNX, int8 and 4-bit variants: `flotilla export` on the session's registered digits MLP and small GPT,
their parity gates, and the same rows over HTTP through each runtime.

The variants join the session's logged models (their artifacts are shared by every store copy);
the registry tags go to this module's copy. Serving elsewhere in the suite uses `serve.runtime`'s
default, torch, which never reads them.
"""

from __future__ import annotations

import numpy as np
import pytest
import requests

from flotilla.bundle import load_bundle
from flotilla.cli import main
from tests.integration._helpers import digits_spec, digits_val_rows, store_uri
from tests.services import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def store(ray_cluster, digits_champion, gpt_champion, tmp_path_factory):
    import mlflow

    directory = tmp_path_factory.mktemp("export")
    uri = digits_champion.store_copy(directory)
    mlflow.set_tracking_uri(uri)  # `models:/m-...` sources resolve through the global URI
    return directory


def export(capsys, store, model: str, *overrides: str) -> tuple[int, str]:
    args = ["export", "--model", model, "--tracking-uri", store_uri(store)]
    for o in overrides:
        args += ["--set", o]
    code = main(args)
    out = capsys.readouterr()
    return code, out.out + out.err


def test_digits_variants_pass_their_gate_answer_over_http_like_torch_and_a_failed_one_is_never_served(
        store, digits_champion, capsys):
    from mlflow import MlflowClient
    from ray import serve

    from flotilla.errors import ServeError, TrackingError
    from flotilla.serve import RUNTIME_HEADER, deploy, plan_deployment
    from flotilla.track import load_registered_bundle

    code, out = export(capsys, store, "digits@champion")
    assert code == 0, out
    assert "onnx-int8" in out and "gate passed" in out, out
    client = MlflowClient(store_uri(store))
    tags = client.get_model_version("digits", "1").tags
    # The int8 variant keeps accuracy within half a point of torch on the 352 validation rows.
    for variant in ("onnx", "onnx-int8"):
        assert tags[f"flotilla.runtime.{variant}"].startswith("passed: val_accuracy"), tags
    assert tags["flotilla.runtime.auto"] in ("torch", "onnx", "onnx-int8")
    metrics = client.get_run(client.get_model_version("digits", "1").run_id).data.metrics
    assert metrics["variant.onnx.max_difference"] < 1e-4 and metrics["variant.onnx-int8.max_difference"] < 0.2

    # The same rows over HTTP through each runtime agree with the torch bundle within the gate.
    torch_bundle = load_bundle(digits_champion.outcome.bundle_path)
    rows, labels = digits_val_rows(digits_champion.spec)
    rows = rows.iloc[:64]
    expected = torch_bundle.predict_arrays(rows)
    port = free_port()
    common = [f"serve.port={port}", "serve.replica.num_cpus=0.5", "serve.autoscaling.max_replicas=1",
              "serve.health_check_period_s=2", "serve.graceful_shutdown_timeout_s=1"]
    try:
        for runtime in ("onnx-int8", "onnx", "auto"):
            endpoint = deploy(plan_deployment(digits_spec(store, f"serve.runtime={runtime}", *common)))
            response = requests.post(f"{endpoint.url}/predict", json={"instances": rows.to_numpy().tolist()}, timeout=60)
            assert response.status_code == 200, response.text
            answered = response.headers[RUNTIME_HEADER]
            assert answered == (tags["flotilla.runtime.auto"] if runtime == "auto" else runtime)
            body = response.json()
            probabilities = np.asarray(body["probabilities"])
            assert np.abs(probabilities - expected["probabilities"]).max() < (0.2 if answered == "onnx-int8" else 1e-4)
            agree = np.mean(np.asarray(body["predictions"]) == expected["predictions"])
            assert agree >= (0.95 if answered == "onnx-int8" else 1.0), (runtime, agree)
            assert requests.get(endpoint.url, timeout=30).json()["runtimes"] == {"1": answered}
    finally:
        serve.shutdown()

    # A variant that fails its gate is recorded as failed, with why, and never served.
    code, out = export(capsys, store, "digits/1", "export.variants=[onnx-int8]", "export.max_accuracy_drop=-0.01")
    assert code == 0 and "onnx-int8   " in out and "gate FAILED: val_accuracy" in out, out
    verdict = client.get_model_version("digits", "1").tags["flotilla.runtime.onnx-int8"]
    assert verdict.startswith("failed: val_accuracy") and "at most -1" in verdict, verdict
    with pytest.raises(ServeError, match=r"serve.runtime=onnx-int8: digits v1: its onnx-int8 variant failed its gate \(val_accuracy .*largest probability difference.*\); it is never served"):
        plan_deployment(digits_spec(store, "serve.runtime=onnx-int8", *common))
    with pytest.raises(TrackingError, match="failed its gate"):  # nor by a replica that loads it anyway
        load_registered_bundle(client, "digits", "1", runtime="onnx-int8")
    assert load_registered_bundle(client, "digits", "1", runtime="auto").runtime in ("torch", "onnx")


def test_gpt_variants_carry_the_kv_cache_and_generate_like_torch(store, gpt_champion, capsys):
    from mlflow import MlflowClient

    from flotilla.track import load_registered_bundle

    code, out = export(capsys, store, "pycode-gpt/1")
    assert code == 0, out
    client = MlflowClient(store_uri(store))
    tags = client.get_model_version("pycode-gpt", "1").tags
    for variant in ("onnx", "onnx-int8", "onnx-int4"):  # perplexity within 2 % of torch's on the validation windows
        assert tags[f"flotilla.runtime.{variant}"].startswith("passed: val_perplexity"), tags

    torch_bundle = load_registered_bundle(client, "pycode-gpt", "1")
    onnx = load_registered_bundle(client, "pycode-gpt", "1", runtime="onnx")
    int8 = load_registered_bundle(client, "pycode-gpt", "1", runtime="onnx-int8")
    assert (onnx.runtime, int8.runtime) == ("onnx", "onnx-int8")
    # The graph takes and returns the cache: incremental decoding through ONNX Runtime writes what
    # recomputing the window writes, past the context (64) too, and what torch writes.
    greedy = dict(max_tokens=150, temperature=0.0)
    text = onnx.generate("def main(", **greedy)
    assert text == onnx.generate("def main(", cache=False, **greedy)
    assert text == torch_bundle.generate("def main(", **greedy)
    sampled = int8.generate("import os\n", max_tokens=100, temperature=0.8, top_k=20, seed=0)
    assert sampled == int8.generate("import os\n", max_tokens=100, temperature=0.8, top_k=20, seed=0, cache=False)
    int4 = load_registered_bundle(client, "pycode-gpt", "1", runtime="onnx-int4")  # 4-bit weights, the same cache
    assert int4.generate("def main(", **greedy) == int4.generate("def main(", cache=False, **greedy)
