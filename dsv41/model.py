"""The public model API (DESIGN §11): `init_params` and the full-sequence `forward`.

Flax NNX inside, pure functions outside: the parameters are an `nnx.State` pytree; the module
structure (graphdef) is rebuilt from the config and merged with the parameters inside the jitted
function.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41 import config as config_lib
from dsv41 import engram_hash, xla_options
from dsv41.errors import ConfigError
from dsv41.nn import policy as policy_lib
from dsv41.nn.model import Transformer


def config_key(cfg) -> str:
    """A hashable, order-independent identity of a config (the static argument of jitted steps)."""
    return json.dumps(cfg.to_dict(), sort_keys=True)


@functools.lru_cache(maxsize=32)
def config_from_key(key: str):
    """The config a `config_key` was made from (built once per key)."""
    return config_lib.build(json.loads(key))


@functools.lru_cache(maxsize=32)
def _engram_layout(key: str) -> engram_hash.EngramLayout:
    return engram_hash.EngramLayout.from_config(config_from_key(key))


def engram_layout(cfg) -> engram_hash.EngramLayout:
    """The Engram hash layout of a config (its prime search runs once per config)."""
    return _engram_layout(config_key(cfg))


def build_model(cfg, rngs: nnx.Rngs, lowering: policy_lib.Lowering | None = None) -> Transformer:
    """The NNX module tree of a config with freshly initialised parameters (lowering: how it is traced)."""
    rows = {}
    if list(cfg.architecture.engram.layers):
        layout = engram_layout(cfg)
        rows = dict(zip(layout.layer_ids, layout.rows_per_layer))
    return Transformer(cfg, rows, policy=policy_lib.from_config(cfg, lowering), rngs=rngs)


@functools.lru_cache(maxsize=64)
def graphdef(key: str, lowering: policy_lib.Lowering | None = None):
    """The module structure of the config of `key` (a `config_key`), traced as `lowering` says: merged with
    parameters inside the jitted functions, so the key and the lowering are their static arguments."""
    cfg = config_from_key(key)
    return nnx.graphdef(nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0), lowering)))


def init_params(cfg, key: jax.Array) -> nnx.State:
    """Freshly initialised parameters of a config (normal(0.02) weights, unit norms, zero sinks/biases)."""
    return nnx.state(build_model(cfg, nnx.Rngs(params=key)))


def abstract_params(cfg) -> nnx.State:
    """Shapes and dtypes of the parameters without allocating them (jax.eval_shape)."""
    return nnx.state(nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0))))


def engram_ids(cfg, tokens, token_map=None) -> np.ndarray | None:
    """Host-side Engram hash ids [B, S, L_engram, C] (int64 NumPy) for tokens starting at position 0.

    token_map: raw id -> compressed id (`engram_hash.compressed_token_map(tokenizer)`); without one
    every token is its own class, which needs compressed_vocab_size == vocab_size (`engram_token_map`).
    """
    e = cfg.architecture.engram
    if not list(e.layers):
        return None
    return engram_hash.hash_ids(engram_layout(cfg), engram_token_map(cfg, token_map), e.pad_id, np.asarray(tokens))


def engram_token_map(cfg, token_map=None) -> np.ndarray:
    """The raw -> compressed id map an Engram model hashes with: `token_map`, or without one the identity
    (every token its own class), which needs compressed_vocab_size == vocab_size."""
    e, a = cfg.architecture.engram, cfg.architecture
    if token_map is not None:
        return token_map
    if e.compressed_vocab_size != a.vocab_size:
        raise ConfigError("architecture.engram.compressed_vocab_size", e.compressed_vocab_size,
                          f"expected a token map (raw id -> compressed id) or vocab_size ({a.vocab_size}) "
                          "when no tokenizer defines the compressed vocabulary")
    return engram_hash.identity_token_map(a.vocab_size)[0]


def forward(params: nnx.State, cfg, tokens, *, engram_ids_BSLC=None, token_map=None) -> jax.Array:
    """Teacher-forced logits [B, S, V] (fp32) of whole sequences `tokens` [B, S] starting at position 0."""
    tokens, positions, ids = _inputs(cfg, tokens, engram_ids_BSLC, token_map)
    return _forward(config_key(cfg), None, params, tokens, positions, ids)


def _inputs(cfg, tokens, engram_ids_BSLC, token_map):
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens: shape {tokens.shape}: expected [batch, seq]")
    vocab = cfg.architecture.vocab_size
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(f"tokens: ids in [{int(tokens.min())}, {int(tokens.max())}]: expected 0..{vocab - 1}")
    if engram_ids_BSLC is None:
        engram_ids_BSLC = engram_ids(cfg, np.asarray(tokens), token_map)
    if engram_ids_BSLC is not None:
        engram_ids_BSLC = jnp.asarray(engram_ids_BSLC, jnp.int32)  # rows < 2^31 (DESIGN §3.7: ~384M)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return tokens, positions, engram_ids_BSLC


def forward_with_intermediates(params: nnx.State, cfg, tokens, *, engram_ids_BSLC=None, token_map=None):
    """(logits, intermediates): as `forward`, plus what the layers record for inspection — per layer i,
    intermediates[i] = {name: array} nested like the layer's modules: the collapsed attention input
    ("attn_input"), the window keys, entries, indexer keys, picks and the candidate pool's block ids
    ("pool_ids"; with every query at once also as a mask, "pool_blocks") under "attn", and the routed experts
    (under "ffn")."""
    tokens, positions, ids = _inputs(cfg, tokens, engram_ids_BSLC, token_map)
    return _forward(config_key(cfg), None, params, tokens, positions, ids, True)


def forward_body(key: str, lowering, params, tokens_BS, positions_BS, engram_ids_BSLC, intermediates: bool = False):
    """The traced body of `forward` (jit it with key, lowering and intermediates static; `dsv41.sharding`
    jits it with shardings): logits [B, S, V], and the recorded intermediates when asked."""
    model = nnx.merge(graphdef(key, lowering), params)
    return model(tokens_BS, positions_BS, engram_ids_BSLC, record=intermediates)


_forward = xla_options.jit(forward_body, static_argnums=(0, 1, 6))
