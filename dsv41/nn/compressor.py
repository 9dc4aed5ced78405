"""The compressor of a Full layer (DESIGN §3.3): one latent entry per `ratio` tokens, before RoPE.

V4.1 ratio 2: entry_i = norm(Σ_{t∈group i} softmax_t(wgate x_t) ⊙ wkv x_t), softmax per channel over
the group's tokens, pooling in fp32 (the released checkpoint keeps these projections in higher
precision). V4.1 ratio 1: entry_t = norm(wkv x_t), no gate. Only complete groups produce entries;
the caller rotates entry i at position ratio·i and publishes it.
V4 (compat, DESIGN §4): `CompressorV4`, the CSA (ratio 4, overlapped) and HCA (ratio 128) compressors
with a learned position bias.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41.nn.linear import Dense
from dsv41.nn.norm import RMSNorm
from dsv41.nn.policy import Policy


class Compressor(nnx.Module):
    def __init__(self, dim: int, latent: int, ratio: int, eps: float, *, policy: Policy, rngs: nnx.Rngs):
        self.ratio = ratio
        self.overlap, self.position_bias = False, None  # V4's overlapped windows and slot bias (CompressorV4)
        self.wkv = Dense(dim, latent, ("embed", "kv"), policy=policy, rngs=rngs)
        self.wgate = Dense(dim, latent, ("embed", "kv"), policy=policy, rngs=rngs) if ratio > 1 else None
        self.norm = RMSNorm(latent, eps, "kv")

    def __call__(self, x_BSD):
        """Pre-RoPE latents [B, S // ratio, K] of the complete groups of x."""
        if self.wgate is None:
            return self.norm(self.wkv(x_BSD))
        b, s, _ = x_BSD.shape
        t = s // self.ratio
        x = x_BSD[:, : t * self.ratio].astype(jnp.float32)
        hi = jax.lax.Precision.HIGHEST
        kv = jnp.dot(x, self.wkv.w[...].astype(jnp.float32), precision=hi).reshape(b, t, self.ratio, -1)
        gate = jnp.dot(x, self.wgate.w[...].astype(jnp.float32), precision=hi).reshape(b, t, self.ratio, -1)
        latent = jnp.sum(kv * jax.nn.softmax(gate, axis=2), axis=2)
        return self.norm(latent.astype(x_BSD.dtype))


class CompressorV4(nnx.Module):
    """V4 (compat, DESIGN §4) compressor: gated pooling of `ratio` tokens with a learned position bias.

    entry_i = norm(Σ_slot softmax_slot(wgate x + bias) ⊙ wkv x), softmax per channel, pooling in fp32.
    HCA (no overlap): the slots are the `ratio` tokens of window i. CSA (overlap): wkv and wgate give
    two series per token, Ca (first `latent` channels) and Cb (the rest), and entry i pools 2·ratio
    slots, Ca of window i−1 and Cb of window i (8 tokens, stride 4 at ratio 4); window 0 has no
    predecessor, its Ca slots get no weight. Only complete windows produce entries.
    """

    def __init__(self, dim: int, latent: int, ratio: int, overlap: bool, eps: float, *, policy: Policy,
                 rngs: nnx.Rngs):
        self.ratio, self.latent, self.overlap = ratio, latent, overlap
        width = 2 * latent if overlap else latent
        self.wkv = Dense(dim, width, ("embed", "kv"), policy=policy, rngs=rngs)
        self.wgate = Dense(dim, width, ("embed", "kv"), policy=policy, rngs=rngs)
        self.position_bias = nnx.Param(jnp.zeros((ratio, width), jnp.float32), out_sharding=(None, "kv"),
                                       eager_sharding=False)
        self.norm = RMSNorm(latent, eps, "kv")

    def __call__(self, x_BSD):
        """Pre-RoPE latents [B, S // ratio, K] of the complete windows of x."""
        b, s, _ = x_BSD.shape
        t, r, k = s // self.ratio, self.ratio, self.latent
        if t == 0:
            return jnp.zeros((b, 0, k), x_BSD.dtype)
        x = x_BSD[:, : t * r].astype(jnp.float32)
        hi = jax.lax.Precision.HIGHEST
        kv = jnp.dot(x, self.wkv.w[...].astype(jnp.float32), precision=hi).reshape(b, t, r, -1)
        gate = jnp.dot(x, self.wgate.w[...].astype(jnp.float32), precision=hi).reshape(b, t, r, -1)
        gate = gate + self.position_bias[...].astype(jnp.float32)
        if self.overlap:
            prev_kv = jnp.concatenate([jnp.zeros_like(kv[:, :1, :, :k]), kv[:, :-1, :, :k]], axis=1)
            prev_gate = jnp.concatenate([jnp.full_like(gate[:, :1, :, :k], -jnp.inf), gate[:, :-1, :, :k]], axis=1)
            kv = jnp.concatenate([prev_kv, kv[..., k:]], axis=2)
            gate = jnp.concatenate([prev_gate, gate[..., k:]], axis=2)
        latent = jnp.sum(kv * jax.nn.softmax(gate, axis=2), axis=2)
        return self.norm(latent.astype(x_BSD.dtype))
