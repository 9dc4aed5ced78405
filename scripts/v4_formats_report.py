"""V4 (compat) with its stored formats (`quant: qat`) against the released transformers V4, which quantises
nothing: how far the formats move a toy model's logits, and why.

For each toy of tests/test_v4_oracle.py (random weights, converted into dsv41) it prints, against transformers'
logits: max and mean |Δ| over the logits' std, top-1 agreement and mean KL(transformers ‖ dsv41), for dsv41 with
`quant: none` and with `quant: qat`; then, for the first toy, each format alone (FP8 records only, MXFP4
indexer only), and the window keys' FP8 error with Gaussian noise of the same relative RMS in its place
(indexer unquantised): if that noise moves the logits as much as FP8 does, the deviation is the format's
rounding meeting a toy whose small margins any 2-3 % perturbation flips, not a second difference.

    python scripts/v4_formats_report.py [--cases flash_like,hca16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_v4_oracle as oracle  # noqa: E402  (the toys and their transformers reference)

from dsv41 import config as config_lib  # noqa: E402
from dsv41 import kv_store, model  # noqa: E402
from dsv41.nn import indexer as indexer_lib  # noqa: E402


def kl(p_logits, q_logits) -> float:
    """Mean over positions of KL(softmax p ‖ softmax q), float64."""
    lp = p_logits - p_logits.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    lq = q_logits - q_logits.max(-1, keepdims=True)
    lq = lq - np.log(np.exp(lq).sum(-1, keepdims=True))
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


def row(case: str, label: str, ours, ref) -> str:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    sd = ref.std()
    return (f"| {case} | {label} | {np.abs(ours - ref).max() / sd:.2e} | {np.abs(ours - ref).mean() / sd:.2e} | "
            f"{(ours.argmax(-1) == ref.argmax(-1)).mean():.3f} | {kl(ref, ours):.2e} |")


def forward(case: dict, *overrides):
    cfg = config_lib.build(case["cfg"].to_dict(), list(overrides))
    return model.forward(case["params"], cfg, case["tokens"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="flash_like,hca16", help=f"toys, from {sorted(oracle.CASES)}")
    args = ap.parse_args(argv)
    names = [n for n in args.cases.split(",") if n]
    for n in names:
        if n not in oracle.CASES:
            raise SystemExit(f"--cases: {n!r}: expected names from {sorted(oracle.CASES)}")
    print("| toy | dsv41 | max abs / std | mean abs / std | top-1 | KL |")
    print("|---|---|---:|---:|---:|---:|")
    for n in names:
        case = oracle.reference_case(n)
        print(row(n, "quant none", forward(case), case["logits"]), flush=True)
        print(row(n, "quant qat", forward(case, "quant=qat"), case["logits"]), flush=True)

    # Each format alone, and noise of the FP8 error's size in its place (the first toy). The jitted forward is
    # keyed by the config: a distinct score_tile per variant makes each trace the replaced function.
    n = names[0]
    case = oracle.reference_case(n)
    record_fq, index_fq = kv_store.RopeSplitFP8.fake_quant, indexer_lib.Indexer.fake_quant
    identity = lambda self, x: x  # noqa: E731
    try:
        kv_store.RopeSplitFP8.fake_quant, indexer_lib.Indexer.fake_quant = record_fq, identity
        print(row(n, "qat, FP8 records only", forward(case, "quant=qat", "runtime.score_tile=64"), case["logits"]))
        kv_store.RopeSplitFP8.fake_quant, indexer_lib.Indexer.fake_quant = identity, index_fq
        print(row(n, "qat, MXFP4 indexer only", forward(case, "quant=qat", "runtime.score_tile=128"), case["logits"]))

        _, rec = model.forward_with_intermediates(case["params"], case["cfg"], case["tokens"])
        keys = np.asarray(rec[0]["attn"]["window_kv"], np.float64)
        window = kv_store.v4_records(config_lib.build(case["cfg"].to_dict(), ["quant=qat"]))[1]
        nope = window.nope
        stored = np.asarray(record_fq(window, jnp.asarray(keys, jnp.float32)), np.float64)
        eps = float(np.sqrt(((stored - keys)[..., :nope] ** 2).mean() / (keys[..., :nope] ** 2).mean()))

        def noisy(self, x):
            noise = jax.random.normal(jax.random.key(x.shape[1]), x[..., :self.nope].shape, jnp.float32)
            return jnp.concatenate([x[..., :self.nope] * (1 + eps * noise), x[..., self.nope:]], -1).astype(x.dtype)

        kv_store.RopeSplitFP8.fake_quant, indexer_lib.Indexer.fake_quant = noisy, identity
        print(row(n, f"noise of FP8's relative RMS ({eps:.4f}), no FP8", forward(case, "quant=qat",
                                                                               "runtime.score_tile=32"),
                  case["logits"]))
    finally:
        kv_store.RopeSplitFP8.fake_quant, indexer_lib.Indexer.fake_quant = record_fq, index_fq
    return 0


if __name__ == "__main__":
    sys.exit(main())
