"""The numerics policy: parameter storage and init scale, matmul compute and matmul precision, stated once.

Whatever the policy, the numerically fragile parts run in float32 (DESIGN §3.1, §3.3, §3.6):
norms, softmaxes, mHC, the router, the ratio-2 compressor pooling; and the parameters the released
checkpoint stores in F32 (mHC, attention sinks, router biases) are kept in float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dsv41.errors import ConfigError

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
PLAIN = {"float32": "f32", "bfloat16": "bf16"}  # the weight format of plain parameters of each dtype


@dataclasses.dataclass(frozen=True)
class Lowering:
    """How the same arithmetic is traced: part of the module structure (the graphdef), so of every jit key.

    layout: the routed experts' `moe.ExpertLayout` on a mesh (None: one device); the Pallas kernels run per
    device over its token axes. experts_per_pick: the experts as one matmul per (token, pick) instead of
    `ragged_dot`, and unroll_index_heads: the indexer's head loop unrolled — both only so that XLA's cost
    analysis, which counts a ragged_dot as dense and a loop body once, counts what is computed (FLOP
    reports); the results are the same. unroll_layers: the layer stacks and the Sinkhorn iterations as
    unrolled Python loops instead of `lax.scan` / `fori_loop` (the same arithmetic, traced once per layer:
    for the same cost analysis, never for speed). sequence: an `attend.SequenceLayout`, the whole-sequence
    forward sequence (context) parallel on a mesh (None: each row's tokens on one device). weights: an object
    whose `at_use(w, logical axes)` gives a weight as its matmul reads it (`dsv41.sharding.WeightUse`: FSDP
    weights gathered per layer, each where it is used; None: as stored).
    """
    layout: object = None
    sequence: object = None
    weights: object = None
    experts_per_pick: bool = False
    unroll_index_heads: bool = False
    unroll_layers: bool = False


FLOP_COUNTING = Lowering(experts_per_pick=True, unroll_index_heads=True, unroll_layers=True)


@dataclasses.dataclass(frozen=True)
class Policy:
    param_dtype: jnp.dtype
    compute_dtype: jnp.dtype
    init_std: float = 0.02  # std of the normal init of weights (`architecture.initializer_range`)
    lowering: Lowering = Lowering()
    # `dsv41.nn.weights.FORMATS`: "shipped" holds the matrices the release quantises in its formats (the other
    # parameters in param_dtype); "f32" / "bf16" every parameter as param_dtype.
    weight_format: str = "f32"
    # `runtime.kernels` (`dsv41.kernels.dispatch`): the matmuls of weights held as shipped run the Pallas
    # weight kernels where it picks them, else the XLA path dequantises in the program.
    kernels: str = "reference"

    @property
    def precision(self):
        # fp32 compute means fp32 matmuls on every backend (TPUs otherwise pass bf16 by default).
        return jax.lax.Precision.HIGHEST if self.compute_dtype == jnp.float32 else jax.lax.Precision.DEFAULT

    def at_use(self, w, axes):
        """The weight w (logical axes `axes`) as a matmul reads it (`Lowering.weights`)."""
        return w if self.lowering.weights is None else self.lowering.weights.at_use(w, axes)

    def dot(self, x, w):
        """x @ w in the compute dtype (w stored [in, out])."""
        return jnp.dot(x.astype(self.compute_dtype), w.astype(self.compute_dtype), precision=self.precision)


def from_config(cfg, lowering: Lowering | None = None) -> Policy:
    out = []
    for field in ("param_dtype", "compute_dtype"):
        name = cfg.runtime[field]
        if name not in DTYPES:
            raise ConfigError(f"runtime.{field}", name, f"expected one of {list(DTYPES)}")
        out.append(DTYPES[name])
    return Policy(*out, init_std=float(cfg.architecture.initializer_range), lowering=lowering or Lowering(),
                  weight_format=weight_format(cfg), kernels=cfg.runtime.kernels)


def weight_format(cfg) -> str:
    """The config's weight format (`runtime.weight_format`; unset: the one `runtime.param_dtype` names)."""
    fmt = cfg.runtime.get("weight_format", "") or PLAIN[cfg.runtime.param_dtype]
    if fmt not in ("shipped", *PLAIN.values()):
        raise ConfigError("runtime.weight_format", fmt, "expected one of ['shipped', 'bf16', 'f32']")
    if fmt != "shipped" and fmt != PLAIN[cfg.runtime.param_dtype]:
        raise ConfigError("runtime.weight_format", fmt,
                          f"expected '{PLAIN[cfg.runtime.param_dtype]}' with runtime.param_dtype "
                          f"{cfg.runtime.param_dtype!r} (or 'shipped'; set runtime.param_dtype for the other)")
    return fmt


FP32 = Policy(jnp.float32, jnp.float32)
