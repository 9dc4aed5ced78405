"""`dsv41 verify`'s report (DESIGN §15): the PNG plots and report.md, drawn from the results dict alone
(`dsv41.verify.run_local` makes it; results.json holds it), so a saved results.json can be drawn again."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dsv41 import verify_client

PLOT_SIZE = (8.0, 5.0)  # inches at PLOT_DPI: every PNG is 800 × 500 pixels
PLOT_DPI = 100


def plots(results: dict, out: Path) -> list[str]:
    """The report's PNGs (PLOT_SIZE at PLOT_DPI each); returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []

    def save(fig, name):
        fig.savefig(out / name, dpi=PLOT_DPI)
        plt.close(fig)
        names.append(name)

    sw, mem = results.get("sweep") or [], results.get("memory") or {}
    if mem:
        fig, ax = plt.subplots(figsize=PLOT_SIZE)
        for name, row in mem.items():
            pts = row["by_context"]
            ax.plot([p["capacity"] for p in pts], [p["cache_bytes"] / 2**20 for p in pts], "o", label=f"{name} (pytree)")
            if row["formula_bytes"] is not None:
                caps = np.linspace(0, max(p["capacity"] for p in pts), 50)
                ax.plot(caps, (row["bytes_per_token_formula"] * caps + row["fixed_bytes_formula"]) / 2**20, "--",
                        label=f"{name}: {row['bytes_per_token_formula']:g} B/token × length + fixed")
        ax.set(xlabel="cache capacity (tokens)", ylabel="cache bytes (MiB)", title="KV cache memory against the formula")
        ax.legend(fontsize=8)
        fig.tight_layout()
        save(fig, "memory.png")
    if sw:
        ctx = [r["context"] for r in sw]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=PLOT_SIZE)
        a1.plot(ctx, [r["prefill_s"] for r in sw], "o-", label="prefill (s)")
        a1.plot(ctx, [r["latency_128_s"] for r in sw], "s-", label=f"latency, max_tokens {results['new_tokens']} (s)")
        a1.plot(ctx, [r["latency_1_s"] for r in sw], "^--", label="latency, max_tokens 1 (s)")
        a1.set(xscale="log", xlabel="context (tokens)", ylabel="seconds", title="Prefill and request latency")
        a1.legend(fontsize=8)
        a2.plot(ctx, [r["decode_ms_per_token"] for r in sw], "o-")
        a2.set(xscale="log", xlabel="context (tokens)", ylabel="ms per token", title="Steady decode", ylim=(0, None))
        fig.tight_layout()
        save(fig, "latency.png")
        fig, ax = plt.subplots(figsize=PLOT_SIZE)
        ax.plot(ctx, [r["decode_flops"]["raw_relative"] for r in sw], "o-", label="XLA decode FLOPs, raw")
        ax.plot(ctx, [r["decode_flops"]["weighted_relative"] for r in sw], "s-",
                label="precision-weighted (BF16 1, FP8 0.5, FP4 0.25)")
        for r_name, rows in (("V4.1-Flash (full size, weights as shipped)", results.get("full_size_flops") or []),):
            if rows:
                ax.plot([r["context"] for r in rows], [r["raw_relative"] for r in rows], "o:", label=f"{r_name}, raw")
                ax.plot([r["context"] for r in rows], [r["weighted_relative"] for r in rows], "s:",
                        label=f"{r_name}, weighted")
        ax.axhline(1.25, color="gray", ls=":", label="V4.1 report: +25 % from 4K to 1M")
        base = results["base_context"] if results["base_context"] in ctx else ctx[0]
        ax.set(xscale="log", xlabel="context (tokens)", ylabel=f"relative to {base}",
               title="Decode FLOPs per token against context", ylim=(0, None))
        ax.legend(fontsize=8)
        fig.tight_layout()
        save(fig, "flops.png")
    acc = results.get("accuracy") or {}
    if acc:
        panels = list(acc)
        cols = min(4, len(panels))
        rows_ = -(-len(panels) // cols)
        fig, axes = plt.subplots(rows_, cols, figsize=PLOT_SIZE, squeeze=False)
        for ax, name in zip(axes.flat, panels):
            cells = acc[name]
            cs, ds = sorted({r["context"] for r in cells}), sorted({r["depth"] for r in cells})
            grid = np.full((len(cs), len(ds)), np.nan)
            for r in cells:
                grid[cs.index(r["context"]), ds.index(r["depth"])] = r["accuracy"]
            ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            ax.set_xticks(range(len(ds)), [f"{d:g}" for d in ds], fontsize=6)
            ax.set_yticks(range(len(cs)), [str(c) for c in cs], fontsize=6)
            ax.set_title(name, fontsize=8)
            for (i, j), v in np.ndenumerate(grid):
                ax.text(j, i, f"{v:.0%}", ha="center", va="center", fontsize=6)
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        fig.suptitle("Passkey exact match: context (rows) × needle depth (columns)", fontsize=9)
        fig.tight_layout()
        save(fig, "accuracy.png")
    return names


def _cell(rows, context_depth) -> float:
    """The accuracy of the (context, depth) cell of `rows` (NaN where it was not measured)."""
    return next((r["accuracy"] for r in rows if (r["context"], r["depth"]) == context_depth), float("nan"))


def _md_table(header, rows) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def report_md(results: dict) -> str:
    """report.md: the plots, the tables and the doctor's findings."""
    lines = [f"# dsv41 verify: {results['model']}", "",
             f"{results['machine']}; weights: {results['weights']}; {results['wall_s']:.0f} s in all.", ""]
    sw = results.get("sweep")
    if sw:
        lines += ["## Context sweep (shipped variant)", "", "![latency](latency.png)", "", "![flops](flops.png)", ""]
        lines += _md_table(
            ["context", "prefill s", "compile s", f"latency max_tokens 1 / {results['new_tokens']} (s)", "difference s",
             "decode ms/token", "decode FLOPs/token raw", "weighted", "raw / weighted vs base"],
            [[r["context"], f"{r['prefill_s']:.2f}", f"{r['compile_s']:.1f}",
              f"{r['latency_1_s']:.2f} / {r['latency_128_s']:.2f}", f"{r['latency_difference_s']:.2f}",
              f"{r['decode_ms_per_token']:.2f}", f"{r['decode_flops']['raw']:.3e}", f"{r['decode_flops']['weighted']:.3e}",
              f"{r['decode_flops']['raw_relative']:.3f}× / {r['decode_flops']['weighted_relative']:.3f}×"] for r in sw])
        lines += ["", "Precision weighting: each matmul of the closed per-layer count (`dsv41.flop_model`, equal to XLA's "
                  "dots) at the format its operands are stored in (BF16 1, FP8 0.5, FP4 0.25: the attention over the "
                  "FP4 main entries and the indexer's FP4 scores, the window attention over the FP8 ring; the weights "
                  "at 1 in BF16, FP8 dense and MXFP4 routed experts as shipped), XLA's elementwise rest at 1 "
                  "(`dsv41.verify.decode_flops`).", ""]
    fs = results.get("full_size_flops")
    if fs:
        lines += ["### Full size (V4.1-Flash, the weights as shipped, lowered on this CPU)", ""]
        held = all("held" in r for r in fs)
        lines += _md_table(["context", "decode FLOPs/token raw", "weighted", f"raw / weighted vs {fs[0]['context']}"]
                           + (["as shipped: FLOPs/token with dequantisation", "parameter GB"] if held else []),
                           [[r["context"], f"{r['raw']:.3e}", f"{r['weighted']:.3e}",
                             f"{r['raw_relative']:.3f}× / {r['weighted_relative']:.3f}×"]
                            + ([f"{r['held']['flops_per_token']:.3e}", f"{r['held']['param_bytes'] / 1e9:.1f}"]
                               if held else []) for r in fs])
        lines += [""]
    mem = results.get("memory")
    if mem:
        lines += ["## Memory", "", "![memory](memory.png)", ""]
        lines += _md_table(
            ["variant", "B/token formula", "B/token measured", "cache bytes (pytree)", "formula", "process peak MiB",
             "before / after MiB"],
            [[name, f"{r['bytes_per_token_formula']:g}", f"{r['bytes_per_token_measured']:g}", f"{r['cache_bytes']:,}",
              "float cache" if r["formula_bytes"] is None else f"{r['formula_bytes']:,}",
              f"{r['request']['peak_during'] / 2**20:.0f}",
              f"{r['request']['before'] / 2**20:.0f} / {r['request']['after'] / 2**20:.0f}"] for name, r in mem.items()])
        if "shipped" in mem and "fp8-kv" in mem:
            r = results["fp8_over_fp4_main_kv"]
            lines += ["", f"FP8 / FP4 main KV bytes per token: {r['measured']:.4f} measured, {r['formats']:.4f} from the "
                      f"formats' bytes (main entry {r['fp8_entry_bytes']} B against {r['fp4_entry_bytes']} B)."]
        lines += [f"Process memory: {next(iter(mem.values()))['request']['source']}, sampled before, during and "
                  f"{results['settle_s']:g} s after the request.", ""]
    acc = results.get("accuracy")
    if acc:
        lines += ["## Accuracy: compressed against uncompressed", "", "![accuracy](accuracy.png)", ""]
        cells = sorted({(r["context"], r["depth"]) for rows in acc.values() for r in rows})
        logits = results.get("logits", {})
        lines += _md_table(["variant"] + [f"{c}@{d:g}" for c, d in cells]
                           + ["mean", "top-1 / KL vs uncompressed", "top-1 / KL vs quant none"],
                           [[name] + [f"{_cell(rows, cd):.0%}" for cd in cells]
                            + [f"{np.mean([r['accuracy'] for r in rows]):.0%}"]
                            + ([f"{logits[name]['top1_agreement']:.1%} / {logits[name]['mean_kl']:.2e}",
                                f"{logits[name]['top1_agreement_quant_none']:.1%} / {logits[name]['mean_kl_quant_none']:.2e}"]
                               if name in logits else ["—", "—"])
                            for name, rows in acc.items()])
        if logits:
            lines += ["", f"Logits: the {next(iter(logits.values()))['positions']} answer positions of the depth-0.5 "
                      f"prompts at {next(iter(logits.values()))['context']} tokens, the answer fed back; KL in nats."]
        lines += ["", "Variants: " + "; ".join(f"**{k}**: {v}" for k, v in results["variant_descriptions"].items()
                                                if k in acc) + ".", ""]
    if results.get("table"):
        lines += ["## Memory × latency × accuracy", ""]
        lines += _md_table(["variant", "context", "B/token", "cache MiB", "decode ms/token", "accuracy"],
                           [[t["variant"], t["context"], f"{t['bytes_per_token']:g}", f"{t['cache_mib']:.2f}",
                             "—" if t["decode_ms_per_token"] is None else f"{t['decode_ms_per_token']:.2f}",
                             "—" if t["accuracy"] is None else f"{t['accuracy']:.0%}"] for t in results["table"]])
        lines += [""]
    if results.get("client"):
        lines += [verify_client.format_client(results["client"]), ""]
    lines += ["## Doctor", ""]
    lines += _md_table(["check", "status", "detail"],
                       [[d["check"], d["status"], d["detail"]] for d in results["doctor"]])
    return "\n".join(lines) + "\n"


def write(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results["plots"] = plots(results, out)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=json_default) + "\n")
    (out / "report.md").write_text(report_md(results))


def json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    return str(x)
