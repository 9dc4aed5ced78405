"""dsv41: DeepSeek-V4.1-Flash in JAX / Flax / Pallas (see DESIGN.md §11 for the public API)."""

from dsv41.accounting import kv_bytes_per_token
from dsv41.config import load_config
from dsv41.errors import ConfigError
from dsv41.plan import LayerRecord, layer_plan

# The model API pulls in JAX and Flax; load it on first use so config tools start fast.
_LAZY = {
    "init_params": "dsv41.model",
    "forward": "dsv41.model",
    "init_cache": "dsv41.cache",
    "prefill": "dsv41.steps",
    "decode": "dsv41.steps",
    "bind": "dsv41.steps",
    "config_from_transformers": "dsv41.transformers_io",
    "params_from_transformers": "dsv41.transformers_io",
}

__all__ = ["ConfigError", "LayerRecord", "kv_bytes_per_token", "layer_plan", "load_config", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dsv41' has no attribute {name!r}")
