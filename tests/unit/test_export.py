"""ONNX export without Ray: the graphs answer as the torch models do, the cache goes in and out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flotilla.errors import BundleError
from flotilla.bundle import OnnxModel, read_variants
from flotilla.export import export_onnx, quantize_int4, quantize_int8
from flotilla.models import GPT, MLP


def test_an_mlp_exports_with_a_dynamic_batch_and_its_int8_variant_stays_close(tmp_path):
    torch.manual_seed(0)
    model = MLP(12, [32, 16], 3, 0.0, "gelu").eval()
    bundle = SimpleNamespace(model=model, model_spec={"kind": "mlp"}, schema=SimpleNamespace(num_features=12))
    export_onnx(bundle, tmp_path / "fp32.onnx")
    quantize_int8(tmp_path / "fp32.onnx", tmp_path / "int8.onnx")
    x = torch.randn(7, 12)  # exported with 2 rows: any batch works
    with torch.no_grad():
        expected = model(x)
    assert torch.allclose(OnnxModel(tmp_path / "fp32.onnx")(x), expected, atol=1e-5)
    assert (OnnxModel(tmp_path / "int8.onnx")(x) - expected).abs().max() < 0.1
    assert read_variants(tmp_path) == {}  # no variants.json: nothing recorded


def test_a_gpt_graph_takes_and_returns_its_cache(tmp_path):
    torch.manual_seed(0)
    model = GPT(256, 16, 2, 2, 16).eval()
    bundle = SimpleNamespace(model=model, model_spec={"kind": "gpt"}, schema=SimpleNamespace(context=16))
    export_onnx(bundle, tmp_path / "gpt.onnx")
    onnx = OnnxModel(tmp_path / "gpt.onnx")
    tokens = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        expected = model(tokens)
    assert torch.allclose(onnx(tokens), expected, atol=1e-4)  # the whole sequence at once
    cache = onnx.new_cache(batch=2)
    pieces = [onnx.step(tokens[:, :5], cache)] + [onnx.step(tokens[:, i:i + 1], cache) for i in range(5, 12)]
    assert cache.length == 12 and torch.allclose(torch.cat(pieces, dim=1), expected, atol=1e-4)


def test_a_gpt_graph_in_4_bits_is_a_third_of_the_bytes_and_keeps_its_cache(tmp_path):
    torch.manual_seed(0)
    model = GPT(256, 16, 2, 2, 64).eval()
    bundle = SimpleNamespace(model=model, model_spec={"kind": "gpt"}, schema=SimpleNamespace(context=16))
    export_onnx(bundle, tmp_path / "gpt.onnx")
    quantize_int4(tmp_path / "gpt.onnx", tmp_path / "int4.onnx")
    assert (tmp_path / "int4.onnx").stat().st_size < 0.35 * (tmp_path / "gpt.onnx").stat().st_size
    int4 = OnnxModel(tmp_path / "int4.onnx")
    tokens = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        expected = torch.softmax(model(tokens), -1)
    whole = int4(tokens)
    assert (torch.softmax(whole, -1) - expected).abs().max() < 0.05  # 4-bit weights: close, not equal
    cache = int4.new_cache(batch=2)
    pieces = [int4.step(tokens[:, :5], cache)] + [int4.step(tokens[:, i:i + 1], cache) for i in range(5, 12)]
    assert cache.length == 12 and torch.allclose(torch.cat(pieces, dim=1), whole, atol=1e-4)


def test_only_mlp_gpt_and_hf_causal_lm_models_export():
    bundle = SimpleNamespace(model=torch.nn.Linear(3, 2), model_spec={"kind": "custom"}, schema=None)
    with pytest.raises(BundleError, match="builds ONNX variants of `mlp`, `gpt` and `hf_causal_lm` models; this "
                                          "bundle's model is `custom`: serve it with `--set serve.runtime=torch`"):
        export_onnx(bundle, "unused.onnx")
