"""The XLA options dsv41's programs compile with, and `jit`: `jax.jit` under them.

XLA:CPU hands a fusion above a size threshold (about 4K elements) to YNNPACK, whose `exp` and reductions
round differently from XLA's own emitters. One token's arithmetic then depended on how many tokens
shared its program: `exp(x - max(x))` over the mHC mixing logits [4, 4, 1, S] differs in the last bit
between S = 200 (XLA's emitter) and S = 300 (YNNPACK) on 57 of 3,200 elements, and under `quant: qat` one
such bit that lands on an FP8 rounding boundary flips a stored value and moves later logits by 1e-4 to
1e-2 (issue 53: a prefill of N tokens against the teacher-forced forward over 257). With YNNPACK fusions
off an op rounds a row the same way whatever its token count (tests/test_batch_invariance.py); the model's
sums over keys are the other half (`nn.attention.Attention._weigh`, docs/batch_invariance.md).

Options are for the CPU only (None elsewhere) and only those this XLA knows: jax 0.11's may rename them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

# XLA:CPU's library fusions (YNNPACK): none, so each fusion is emitted by XLA itself, one way for any size.
# Dots are not fusions: XLA:CPU calls its GEMM, whose rounding of a row can depend on the row count
# (`dots_round_rows_alike`; docs/batch_invariance.md). Keeping YNNPACK for dots alone fixes that for float32
# dots of 2+ rows but not for bf16 ones under 8 rows, and it takes the elementwise ops next to a dot into
# the library above a size threshold: the model's prefill then differs from its forward by 7e-2.
_BATCH_INVARIANT = {"xla_cpu_experimental_ynn_fusion_type": ""}


@functools.lru_cache(maxsize=None)
def _known(name: str, value: str) -> bool:
    """Whether this jaxlib's XLA:CPU accepts the option (one trivial compile, once per process)."""
    try:
        jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(1.0).compile()
    except jax.errors.JaxRuntimeError:
        return False
    return True


def compiler_options(platform: str | None = None, **extra: str) -> dict | None:
    """The options of a program for `platform` (default: JAX's default backend): on the CPU the
    batch-invariant set above plus `extra`, the names this XLA knows; None on other platforms."""
    if (platform or jax.default_backend()) != "cpu":
        return None
    wanted = {**_BATCH_INVARIANT, **extra}
    return {name: value for name, value in wanted.items() if _known(name, value)} or None


@functools.lru_cache(maxsize=None)
def dots_round_rows_alike() -> bool:
    """Whether this machine's XLA:CPU gives row m of a float32 [M, 512] x [512, 512] dot the same bits for
    every M (checked at M = 1..12 and 109-111 against M = 300, once per process). On an AVX2 machine (AMD
    EPYC, 2 cores) its GEMM rounds the trailing 1-3 rows past a multiple of 6 its own way: False there."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((300, 512)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((512, 512)), jnp.float32)
    dot = jax.jit(lambda x: jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST), compiler_options=compiler_options())
    full = np.asarray(dot(x))
    return all(np.array_equal(np.asarray(dot(x[:m])), full[:m]) for m in (*range(1, 13), 109, 110, 111))


class jit:
    """`jax.jit(fun, **kwargs)` compiled with `compiler_options()`, decided at the first call (not at import,
    which would start JAX's backends): `jit(fun, static_argnums=…)`, or `functools.partial(jit, …)` as a
    decorator. Calls, `.lower` and `.trace` go to the jitted function."""

    def __init__(self, fun, **kwargs):
        self._fun, self._kwargs = fun, kwargs
        functools.update_wrapper(self, fun)

    @functools.cached_property
    def jitted(self):
        return jax.jit(self._fun, compiler_options=compiler_options(), **self._kwargs)

    @functools.cached_property
    def nested(self):
        # Inside another program (a traced argument) it is inlined there and compiles with that program's
        # options: jax takes compiler_options on the outermost jit only.
        return jax.jit(self._fun, **self._kwargs)

    def __call__(self, *args, **kwargs):
        traced = any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((args, kwargs)))
        return (self.nested if traced else self.jitted)(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self.jitted.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self.jitted.trace(*args, **kwargs)
