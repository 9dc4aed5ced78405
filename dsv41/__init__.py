"""dsv41: DeepSeek-V4.1-Flash in JAX / Flax / Pallas (see DESIGN.md §11 for the public API)."""

from dsv41.accounting import kv_bytes_per_token
from dsv41.config import load_config
from dsv41.errors import ConfigError
from dsv41.plan import LayerRecord, layer_plan

__all__ = ["ConfigError", "LayerRecord", "kv_bytes_per_token", "layer_plan", "load_config"]
