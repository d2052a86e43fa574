"""Models: built-in `mlp` and `gpt`, or a user factory `package.module:function`.

    model = build_model(spec.model.model_dump(), schema)

The factory is called as `factory(model_spec: dict, schema: dict)` and must return a
`torch.nn.Module`; `schema` describes the data (task, feature count, classes, vocab).
"""

from flotilla.models._factory import build_model, load_factory
from flotilla.models._gpt import GPT, KVCache, flops_per_token
from flotilla.models._mlp import MLP

__all__ = ["GPT", "MLP", "KVCache", "build_model", "flops_per_token", "load_factory"]
