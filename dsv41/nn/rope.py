"""RoPE on the last `rope_head_dim` channels, interleaved pairs (DESIGN §2, §3.2).

Two tables: "main" (θ = rope.theta) for window-only layers and "compressed" (θ = rope.compressed_theta,
with YaRN when rope.compressed_rope_type is "yarn", plain when "default") for every layer with a
compressed branch, used for everything in that layer: queries, window keys, compressed entries and the
indexer. YaRN's attention factor is 1 (the V4 reference does not scale cos/sin). The tables are built
in float32 like the reference's, so angles match bit for bit.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def default_inv_freq(theta: float, dim: int) -> np.ndarray:
    """θ^(-2i/dim) for i < dim/2, float32."""
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    return (np.float32(1.0) / np.power(np.float32(theta), exponents)).astype(np.float32)


def yarn_inv_freq(theta: float, dim: int, factor: float, original_max_position: int,
                  beta_fast: float, beta_slow: float) -> np.ndarray:
    """YaRN (arXiv 2309.00071): interpolate low frequencies by `factor`, keep high ones, ramp between."""

    def correction_dim(rotations):
        return dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (np.float32(1) - ramp).astype(np.float32)
    pos_freqs = np.power(np.float32(theta), np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    inv_extra = np.float32(1.0) / pos_freqs
    inv_inter = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    return (inv_inter * (np.float32(1) - extrapolation) + inv_extra * extrapolation).astype(np.float32)


def inv_freq_tables(cfg) -> dict[str, np.ndarray]:
    """{"main": ..., "compressed": ...} inverse frequencies of a config, float32 [rope_head_dim / 2]."""
    a = cfg.architecture
    r = a.rope
    if r.compressed_rope_type == "yarn":
        compressed = yarn_inv_freq(r.compressed_theta, a.rope_head_dim, r.yarn_factor,
                                   r.yarn_original_max_position, r.yarn_beta_fast, r.yarn_beta_slow)
    else:  # "default": plain RoPE at compressed_theta, as transformers' default rope type
        compressed = default_inv_freq(r.compressed_theta, a.rope_head_dim)
    return {"main": default_inv_freq(r.theta, a.rope_head_dim), "compressed": compressed}


def apply_rope(x, positions, inv_freq, inverse: bool = False):
    """Rotates the last 2·len(inv_freq) channels of x [..., S, (H,) K] at `positions` [..., S].

    Channel pairs (2i, 2i+1) rotate as complex numbers; `inverse` rotates back (the attention
    output carries the query's rotation, DESIGN §3.2). Angles and rotation in fp32.
    """
    rope_dim = 2 * inv_freq.shape[-1]
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [..., S, R/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if inverse:
        sin = -sin
    if x.ndim == positions.ndim + 2:  # a heads axis between S and K
        cos, sin = cos[..., None, :], sin[..., None, :]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    even, odd = rope[..., 0::2].astype(jnp.float32), rope[..., 1::2].astype(jnp.float32)
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(rope.shape)
    return jnp.concatenate([nope, rotated.astype(x.dtype)], axis=-1)
