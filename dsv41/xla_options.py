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

# XLA:CPU's library fusions (YNNPACK): none, so each fusion is emitted by XLA itself, one way for any size.
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
