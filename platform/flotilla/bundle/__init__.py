"""The inference bundle: the contract between training and serving.

One protocol (`Bundle`), one loader (`load_bundle`), and the formats behind it:
    _torch   Flotilla's own models (mlp, gpt, custom): safetensors + model/preprocessors/metrics JSON
    _hf      a fine-tuned Hugging Face causal LM, in the pretrained model's own format
    _onnx    ONNX variants inside a bundle (`flotilla export`) and the runtime that serves them
Nothing is unpickled: weights come from safetensors, everything else from JSON.
"""

from flotilla.bundle._hf import (ADAPTER_DIR, AdapterSet, HFBundle, TextDecoder, is_adapter_bundle, lineage_tags, load_hf_bundle,
                                 weights_file, write_hf_bundle)
from flotilla.bundle._load import BUNDLE_COPYING, bundle_kind, find_bundle, load_bundle, serving_app
from flotilla.bundle._onnx import (ONNX_FILE, RUNTIMES, VARIANTS_DIR, VARIANTS_JSON, OnnxCache, OnnxCausalLM,
                                   OnnxModel,
                                   choose_runtime, read_variants)
from flotilla.bundle._protocol import Bundle
from flotilla.bundle._sampling import sample_token
from flotilla.bundle._torch import (ALLOW_IN_SERVE, ALLOW_ON_COMMAND_LINE, BUNDLE_FILES, GENERATE_DEFAULTS, METRICS_JSON, MODEL_JSON, PREPROCESSORS_JSON,
                                    WEIGHTS, InferenceBundle, file_sha256, load_torch_bundle, read_bundle_metrics,
                                    write_bundle)

__all__ = [
    "ALLOW_IN_SERVE", "ALLOW_ON_COMMAND_LINE", "ADAPTER_DIR", "BUNDLE_COPYING", "BUNDLE_FILES", "GENERATE_DEFAULTS", "METRICS_JSON", "MODEL_JSON", "ONNX_FILE", "PREPROCESSORS_JSON",
    "RUNTIMES", "VARIANTS_DIR", "VARIANTS_JSON", "WEIGHTS", "AdapterSet", "Bundle", "HFBundle", "InferenceBundle", "OnnxCache",
    "OnnxCausalLM", "OnnxModel", "TextDecoder", "bundle_kind", "choose_runtime", "file_sha256", "find_bundle", "is_adapter_bundle", "lineage_tags", "load_bundle",
    "load_hf_bundle", "load_torch_bundle", "read_bundle_metrics", "read_variants", "sample_token", "serving_app", "weights_file",
    "write_bundle", "write_hf_bundle",
]
