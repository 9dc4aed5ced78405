"""Running the whole-sequence model in the tests, jitted: called op by op (eagerly), one forward of a tiny config
compiles hundreds of small programs, which cost the suite minutes."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41 import model as model_lib
from dsv41 import xla_options


def forward(cfg, variables, tokens, **kwargs):
    """The Transformer's __call__ (logits, and the records with record=True) on `tokens` [B, S] from position 0;
    kwargs: its keyword arguments (record, forced, decoder_window_start), arrays or None."""
    tokens = jnp.asarray(tokens, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    record = kwargs.pop("record", False)
    return _forward(model_lib.config_key(cfg), record, variables, tokens, positions, kwargs)


@functools.partial(xla_options.jit, static_argnums=(0, 1))
def _forward(key, record, variables, tokens, positions, kwargs):
    return nnx.merge(model_lib.graphdef(key), variables)(tokens, positions, record=record, **kwargs)
