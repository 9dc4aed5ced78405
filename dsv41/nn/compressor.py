"""The compressor of a Full layer (DESIGN §3.3): one latent entry per `ratio` tokens, before RoPE.

V4.1 ratio 2: entry_i = norm(Σ_{t∈group i} softmax_t(wgate x_t) ⊙ wkv x_t), softmax per channel over
the group's tokens, pooling in fp32 (the released checkpoint keeps these projections in higher
precision). V4.1 ratio 1: entry_t = norm(wkv x_t), no gate. Only complete groups produce entries;
the caller rotates entry i at position ratio·i and publishes it.
V4 (compat, DESIGN §4): `CompressorV4`, the CSA (ratio 4, overlapped) and HCA (ratio 128) compressors
with a learned position bias per slot of the group.

One mechanism, two ways in: `step` takes the compressor's state (the leftover projections of the
unfinished group) and new tokens and returns the completed entries with the new state (prefill, decode);
`__call__` is the same projection and pooling over a whole sequence from an empty state, with each
group's tokens read by a reshape instead of a gather (the teacher-forced forward and training).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41.nn.linear import Dense
from dsv41.nn.norm import RMSNorm
from dsv41.nn.policy import Policy

HI = jax.lax.Precision.HIGHEST


class Compressor(nnx.Module):
    def __init__(self, dim: int, latent: int, ratio: int, eps: float, *, policy: Policy, rngs: nnx.Rngs):
        self.ratio, self.latent = ratio, latent
        self.overlap, self.position_bias = False, None  # V4's overlapped windows and slot bias (CompressorV4)
        self.wkv = Dense(dim, latent, ("embed", "kv"), policy=policy, rngs=rngs)
        self.wgate = Dense(dim, latent, ("embed", "kv"), policy=policy, rngs=rngs) if ratio > 1 else None
        self.norm = RMSNorm(latent, eps, "kv")

    def _project(self, x_BSD, positions_BS):
        """[B, S, 2·width] fp32: wkv·x | wgate·x (+ the slot's bias), what the pooling reads of a token."""
        x = x_BSD.astype(jnp.float32)
        kv = jnp.dot(x, self.wkv.weight().astype(jnp.float32), precision=HI)
        gate = jnp.dot(x, self.wgate.weight().astype(jnp.float32), precision=HI)
        if self.position_bias is not None:
            gate = gate + self.position_bias[...].astype(jnp.float32)[jnp.mod(positions_BS, self.ratio)]
        return jnp.concatenate([kv, gate], axis=-1)

    def _pool(self, members_BEMC, exists_BEM, dtype):
        """Latents [B, E, K] of groups whose members' projections are given ([B, E, back + ratio, 2·width],
        `exists`: the member is a real token, not before the sequence). Overlapped: the first `ratio`
        members (the previous group) pool through the first half of the channels, the rest the second."""
        kv, gate = jnp.split(members_BEMC, 2, axis=-1)
        if self.overlap:
            first = (jnp.arange(kv.shape[2]) < self.ratio)[:, None]
            k = self.latent
            kv = jnp.where(first, kv[..., :k], kv[..., k:])
            gate = jnp.where(first, gate[..., :k], gate[..., k:])
        exists = exists_BEM[..., None]
        kv, gate = jnp.where(exists, kv, 0.0), jnp.where(exists, gate, -jnp.inf)
        return self.norm(jnp.sum(kv * jax.nn.softmax(gate, axis=2), axis=2).astype(dtype))

    def __call__(self, x_BSD):
        """Pre-RoPE latents [B, S // ratio, K] of the complete groups of x (a whole sequence)."""
        if self.wgate is None:  # ratio 1: every token is its own entry
            return self.norm(self.wkv(x_BSD))
        b, s, _ = x_BSD.shape
        m, t = self.ratio, s // self.ratio
        proj = self._project(x_BSD[:, : t * m], jnp.arange(t * m))
        proj = proj.reshape(b, t, m, proj.shape[-1])
        exists = jnp.ones((t, m), bool)
        if self.overlap:  # group i also pools group i − 1 (group −1: nothing)
            proj = jnp.concatenate([jnp.concatenate([jnp.zeros_like(proj[:, :1]), proj[:, :-1]], axis=1), proj],
                                   axis=2)
            exists = jnp.concatenate([jnp.broadcast_to(jnp.arange(t)[:, None] > 0, (t, m)), exists], axis=1)
        return self._pool(proj, jnp.broadcast_to(exists, (b, t, exists.shape[1])), x_BSD.dtype)

    def step(self, x_BSD, lengths_B, counts_B, leftover_BRC):
        """The groups completed by S new tokens per row, folding in the state (the leftover tokens'
        projections, fp32, zeros before the start); rows hold `lengths_B` tokens and bring `counts_B`.

        Returns (latent [B, E, K], entry index [B, E], done [B, E], new leftover [B, R, C]).
        """
        m = self.ratio
        b, s, _ = x_BSD.shape
        if self.wgate is None:
            positions = lengths_B[:, None] + jnp.arange(s)
            return self(x_BSD), positions, jnp.arange(s) < counts_B[:, None], leftover_BRC
        back = m if self.overlap else 0  # positions an entry pools before its own group
        held = leftover_BRC.shape[1]  # back + ratio − 1 tokens (`cache` sizes it)
        proj = self._project(x_BSD, lengths_B[:, None] + jnp.arange(s))  # [B, S, 2·width]
        base = lengths_B // m * m - back                                 # position of leftover slot 0
        rows = jnp.arange(b)

        def fetch(pos):  # [B, ...] positions -> their projections (from this chunk or the leftover)
            r = rows.reshape(-1, *([1] * (pos.ndim - 1)))
            lead = (slice(None),) + (None,) * (pos.ndim - 1)
            from_chunk = proj[r, jnp.clip(pos - lengths_B[lead], 0, s - 1)]
            from_left = leftover_BRC[r, jnp.clip(pos - base[lead], 0, held - 1)]
            return jnp.where((pos >= lengths_B[lead])[..., None], from_chunk, from_left)

        e_max = (s + m - 1) // m
        new_len = lengths_B + counts_B
        entry = lengths_B[:, None] // m + jnp.arange(e_max)                   # [B, E]
        done = (entry + 1) * m <= new_len[:, None]
        member = m * entry[..., None] - back + jnp.arange(back + m)            # [B, E, M] positions
        latent = self._pool(fetch(member), member >= 0, x_BSD.dtype)
        pos = (new_len // m * m - back)[:, None] + jnp.arange(held)            # the new leftover's positions
        keep = ((pos >= 0) & (pos < new_len[:, None]))[..., None]
        return latent, entry, done, jnp.where(keep, fetch(pos), 0.0)


class CompressorV4(Compressor):
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
