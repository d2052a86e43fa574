"""GPU checks: NCCL, bf16 chosen by `auto`, ZeRO-3 on CUDA, a bf16 LoRA fine-tune. Skipped on machines without CUDA.

Run on a GPU machine with: .venv/bin/python -m pytest tests/gpu -q
"""

from __future__ import annotations

import pytest
import torch

from flotilla.bundle import load_bundle
from flotilla.pipeline import run_training

from ..integration._helpers import digits_spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def gpu_ray():
    import ray

    from flotilla.runtime import ensure_ray

    if ray.is_initialized():
        ray.shutdown()
    ensure_ray(num_cpus=4, num_gpus=torch.cuda.device_count(), include_dashboard=False, address="local")
    yield
    ray.shutdown()


def _workers() -> int:
    return min(2, torch.cuda.device_count())  # NCCL needs one GPU per rank


def test_zero3_bf16_nccl_on_gpu(gpu_ray, tmp_path):
    spec = digits_spec(
        tmp_path, f"train.num_workers={_workers()}", "train.gpus_per_worker=1", "train.zero_stage=3",
        "train.precision=auto", "train.epochs=6",
    )
    outcome = run_training(spec)
    m = outcome.metrics
    assert m["backend"] == "nccl"
    expected = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    assert m["precision"] == expected
    assert m["val_accuracy"] >= 0.93
    bundle = load_bundle(outcome.bundle_path)
    assert bundle.metrics["bundle_check_max_abs_diff"] < 0.1  # bf16 forward vs fp32 master weights


def test_zero_plus_plus_int8_on_gpu(gpu_ray, tmp_path):
    """`train.comm.compression: int8` at ZeRO-3 on GPUs is DeepSpeed's ZeRO++ (quantized weights and
    gradients); it trains the digits model like the uncompressed run above."""
    spec = digits_spec(
        tmp_path, f"train.num_workers={_workers()}", "train.gpus_per_worker=1", "train.zero_stage=3",
        "train.precision=auto", "train.epochs=6", "train.comm.compression=int8",
    )
    outcome = run_training(spec)
    assert outcome.metrics["backend"] == "nccl"
    assert outcome.metrics["val_accuracy"] >= 0.93


def test_gpt_zero3_on_gpu_reports_mfu(gpu_ray, tmp_path):
    from flotilla.spec import load_spec

    from ..integration._helpers import ROOT, store_uri

    spec = load_spec(ROOT / "configs" / "pycode_gpt.yaml", [
        "name=gpt-gpu", f"train.storage_path={tmp_path}", f"track.uri={store_uri(tmp_path)}", "model.width=256",
        f"train.num_workers={_workers()}", "train.gpus_per_worker=1", "train.zero_stage=3", "train.epochs=2",
        "train.batch_size=16", "train.grad_accum=1",
    ])
    outcome = run_training(spec)
    first, last = outcome.history
    assert last["val_loss"] < first["val_loss"]
    assert 0 < last["mfu"] < 1


def test_lora_bf16_zero3_on_gpu_learns_and_bundles(gpu_ray, tmp_path):
    """A LoRA fine-tune of a tiny local Llama (nothing downloaded) in bf16 under ZeRO-3 over NCCL."""
    from flotilla.models._hf_tiny import build_tiny_llama
    from flotilla.spec import load_spec

    from ..integration._helpers import ROOT, store_uri

    pretrained = build_tiny_llama(tmp_path / "tiny-llama")
    spec = load_spec(ROOT / "configs" / "instruct_lora.yaml", [
        f"model.pretrained={pretrained}", f"train.storage_path={tmp_path / 'runs'}", f"track.uri={store_uri(tmp_path)}",
        f"train.num_workers={_workers()}", "train.gpus_per_worker=1", "train.zero_stage=3", "train.precision=auto",
        "train.epochs=3", "train.lr=0.01", "model.gradient_checkpointing=true",
    ])
    outcome = run_training(spec)
    m = outcome.metrics
    assert m["backend"] == "nccl" and m["zero_stage"] == 3
    assert m["precision"] == ("bf16" if torch.cuda.is_bf16_supported() else "fp16")
    losses = [e["val_loss"] for e in outcome.history]
    assert losses[-1] < losses[0], losses
    bundle = load_bundle(outcome.bundle_path)
    assert bundle.metrics["bundle_check_max_abs_diff"] < 0.1  # a bf16 forward against the fp32 merged weights
    assert bundle.generate("What is 2 plus 3?", max_tokens=4, temperature=0, chat=True) is not None
