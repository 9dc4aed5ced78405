"""The `dsv41` command line (DESIGN §11). Reports print a table, or one JSON object with --json."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap

from dsv41 import accounting, compile_cache, plan
from dsv41 import config as config_lib
from dsv41.config import family, load_config

REPORT_CONFIGS = ("deepseek_v1_67b", "deepseek_v32", "v4_flash", "v41_flash")
BASELINE = "v41_flash"


def _add_config_args(p: argparse.ArgumentParser, default: str | None, repeat: bool = False) -> None:
    help_config = "config name in configs/ or a .json/.toml/.py path"
    if repeat:
        p.add_argument("--config", action="append", default=[], help=help_config + " (repeatable)")
    else:
        p.add_argument("--config", default=default, help=f"{help_config} (default: {default})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set csa2.indexer.top_k=64 (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _add_compile_cache_args(p: argparse.ArgumentParser) -> None:
    """The flags of the commands that compile: JAX's persistent compilation cache (dsv41.compile_cache)."""
    g = p.add_argument_group("compile cache", "Compiled programs are kept on disk, so a second run of the same "
                             "shapes does not compile them again.").add_mutually_exclusive_group()
    g.add_argument("--compile-cache", metavar="DIR",
                   help=f"keep them in DIR (default: ${compile_cache.ENV}, else $XDG_CACHE_HOME/dsv41/jax or "
                        f"~/.cache/dsv41/jax; {compile_cache.ENV}={compile_cache.OFF} turns the cache off)")
    g.add_argument("--no-compile-cache", action="store_true", help="compile everything afresh, with no cache")


def _use_compile_cache(args) -> None:
    if args.no_compile_cache:
        compile_cache.disable()
    else:
        compile_cache.enable(args.compile_cache, option="--compile-cache")


def _ratio_text(x: float) -> str:
    return f"{x:.3g}×"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def cmd_plan(args) -> int:
    cfg = load_config(args.config, args.set)
    records = plan.layer_plan(cfg)
    counts = plan.counts(records)
    if args.json:
        out = {"model": cfg.model, "layers": [dict(dataclasses.asdict(r), rope=r.rope) for r in records],
               "counts": counts}
        print(json.dumps(out))
        return 0
    dash = lambda v: "-" if v is None else v
    rows = [[r.index, r.stage, r.mode, r.ratio, dash(r.kv_source), dash(r.index_source),
             dash(r.candidate_source), "yes" if r.engram else "", r.rope] for r in records]
    print(f"{cfg.model}: {len(records)} layers")
    print(_table(rows, ["layer", "stage", "mode", "ratio", "kv_source", "index_source", "pool_source",
                        "engram", "rope"]))
    print("counts: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return 0


def cmd_kv_report(args) -> int:
    names = list(REPORT_CONFIGS) + list(args.config)
    baseline = accounting.kv_bytes_per_token(load_config(BASELINE))["total"]
    models = []
    for name in names:
        cfg = load_config(name, args.set if name in args.config else ())
        kv = accounting.kv_bytes_per_token(cfg)
        kv["config"] = name
        kv["ratio_to_v41_flash"] = kv["total"] / baseline
        kv["ratio_text"] = _ratio_text(kv["ratio_to_v41_flash"])
        if family(cfg) != "layout":
            kv["per_layer"] = {str(k): v for k, v in kv["per_layer"].items()}
        models.append(kv)
    if args.json:
        print(json.dumps({"unit": "bytes of global KV per token", "baseline": "DeepSeek-V4.1-Flash",
                          "models": models}))
        return 0
    rows = [[m["model"], f"{m['total']:,}", f"{m['main']:,}", f"{m['index']:,}",
             m["ratio_text"], f"{m['gb_per_million_tokens']:.3f}"] for m in models]
    print("Global KV cache per token (computed from each config's formats and layer plan)")
    print(_table(rows, ["model", "bytes/token", "main", "indexer", "vs V4.1-Flash", "GB per 1M tokens"]))
    for m in models:
        if "without_sharing" not in m:
            continue
        e, w = m["entry_bytes"], m["window_ring_layout"]
        print(f"\n{m['model']} ({m['config']}): entries main {e['main']} B, indexer key {e['index']} B, "
              f"window row {e['window']} B")
        print(f"  without cross-layer sharing: {m['without_sharing']:,} bytes/token")
        print(f"  window rings per sequence: {w['layers']} layers × {w['window']} × {w['row_bytes']} B = "
              f"{m['window_ring_bytes_per_sequence']:,} B ({m['window_ring_bytes_per_sequence'] / 1e6:.2f} MB)")
    return 0


def cmd_params(args) -> int:
    from dsv41 import params

    counts = params.count_params(load_config(args.config, args.set))
    if args.json:
        print(json.dumps(counts))
        return 0
    total = counts["total"]
    rows = [[name, f"{n:,}", f"{n / 1e9:.3f}", f"{100 * n / total:.2f}%"] for name, n in counts["components"].items()]
    print(f"{counts['model']}: parameters by component (shapes only, jax.eval_shape)")
    print(_table(rows, ["component", "parameters", "billions", "share"]))
    print(f"total {total / 1e9:.2f}B = backbone {counts['backbone'] / 1e9:.2f}B + Engram tables "
          f"{counts['engram_tables'] / 1e9:.2f}B; active per generated token {counts['active_per_token'] / 1e9:.2f}B")
    for key, value in counts["published"].items():
        print(f"published {key}: {value / 1e9:.0f}B; ours {counts[key] / 1e9:.2f}B")
    return 0


def cmd_generate(args) -> int:
    import time
    from pathlib import Path

    from dsv41 import generate as generate_lib
    from dsv41 import progress, tokenizer as tokenizer_lib
    from dsv41.convert import command_params

    cfg = load_config(args.config, [*args.set, *config_lib.weight_format_overrides(args.weight_format)])
    tok = tokenizer_lib.load_tokenizer(cfg, args.tokenizer)
    if args.prompt_file is not None:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"--prompt-file: {args.prompt_file!r}: expected a readable text file "
                             f"({e.strerror})") from e
    else:
        text = args.prompt
    prompt = tok.encode(text)
    stop = [int(s) if s.lstrip("-").isdigit() else tok.token_id(s) for s in args.stop]
    # vocab_limit: an untrained model draws the embedding's padding rows too, which the tokenizer cannot decode.
    request = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   top_k=args.top_k, stop_tokens=stop, vocab_limit=tok.vocab_size, loop=args.loop, block=args.block,
                   seed=args.seed)
    generate_lib.check_request(cfg, [prompt], chunk=512, **request)  # before the slow part: bad input fails fast
    params, weights = command_params(cfg, args.config, args.weights, seed=args.seed)
    if weights is None:
        print(f"no --weights: random parameters (seed {args.seed}); the numbers are real, the text is not",
              file=sys.stderr)
    if args.prefix_cache is not None:
        from dsv41.prefix_cache import PrefixCache

        request["prefix_cache"] = PrefixCache(cfg, params, args.prefix_cache)

    bar = progress.bar(total=len(prompt), desc="prefill", unit="tok", leave=False)
    stream, times = tok.stream(), []

    prefilled = [None]

    def on_prefill_progress(done, total):
        bar.update(done - bar.n)
        if done == total:
            bar.close()
            prefilled[0] = time.perf_counter()

    def on_token(token):
        times.append(time.perf_counter())
        sys.stdout.write(stream.step(token))
        sys.stdout.flush()

    pc = request.get("prefix_cache")
    before = dataclasses.replace(pc.counters) if pc is not None else None
    start = time.perf_counter()
    out = generate_lib.generate(params, cfg, prompt, on_token=on_token,
                                on_prefill_progress=on_prefill_progress, **request)
    end = time.perf_counter()
    sys.stdout.write(stream.flush() + "\n")
    sys.stdout.flush()
    # The first decode step compiles: the rate counts the steps after it. The device loop hands its ids
    # over a block at a time, so its figure is the whole loop, compile included.
    if args.loop == "device":
        rate = f"{len(out)} tokens in {end - prefilled[0]:.2f} s (the loop's compile included)"
    else:
        rate = f"{(len(times) - 2) / (times[-1] - times[1]):.1f} tokens/s" if len(times) > 2 else "n/a"
    stopped = ", stopped at a stop token" if len(out) < args.max_new_tokens else ""
    print(f"prompt {len(prompt)} tokens, generated {len(out)} tokens{stopped}, "
          f"prefill {(times[0] if times else end) - start:.2f} s, decode {rate}", file=sys.stderr)
    if pc is not None:
        print(prefix_cache_summary(before, pc.counters, pc.block, len(prompt)), file=sys.stderr)
    return 0


def prefix_cache_summary(before, after, block: int, prompt_tokens: int) -> str:
    """What the prefix cache did for one prompt, from its counters before and after: tokens restored,
    where the rings came from, tokens replayed and recomputed, and every entry it rejected."""
    d = {f.name: getattr(after, f.name) - getattr(before, f.name) for f in dataclasses.fields(after)}
    restored = d["hits"] * block
    rings = "" if not restored else (", rings from the pool" if d["pool_hits"] else
                                     ", rings rebuilt by bounded replay" if d["replays"] else ", rings from disk")
    rejected = {k: d[k] for k in ("corrupt", "truncated", "foreign", "expired") if d[k]}
    return (f"prefix cache: {restored} of {prompt_tokens} prompt tokens restored ({d['hits']} blocks{rings}), "
            f"{d['replayed_tokens']} replayed, {prompt_tokens - restored} recomputed, {d['writes']} blocks saved; "
            f"rejected entries: " + (", ".join(f"{v} {k}" for k, v in rejected.items()) or "none"))


def cmd_demo(args) -> int:
    from dsv41 import demo, progress

    status = progress.Status()
    try:
        report = demo.run(args.config, args.prompt_tokens, args.new_tokens, args.chunk, args.seed, progress=status,
                          depth=args.depth)
    finally:
        status.close()
    if args.json:
        print(json.dumps(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsv41", description="DeepSeek-V4.1-Flash in JAX: the passkey demo through the compressed KV cache "
        "(demo), KV bytes per token (kv-report), layer plans (plan), parameter counts (params), text generation "
        "(generate), training (train), checkpoint conversion (convert), TPU compile reports (compile-report), "
        "passkey accuracy (passkey), an OpenAI-compatible server (serve) and the compression's verification "
        "(verify).",
        epilog="example: dsv41 kv-report --json")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="a long passkey prompt through the compressed cache of the trained model: "
                                    "retrieval, bytes, prefill times, decode speed",
                       epilog="example: dsv41 demo --prompt-tokens 8192 --depth 0.25")
    p.add_argument("--config", default="passkey",
                   help="config name (default: passkey, the trained model shipped with its weights; other "
                        "configs run with random weights)")
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--depth", type=float, default=0.5, help="where the passkey sits in the filler, in [0, 1]")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens per compiled call)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="also print the measurements as one JSON object")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("plan", help="print the per-layer plan of a config",
                       epilog="example: dsv41 plan --config v41_flash",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(p, default="v41_flash")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("params", help="parameter counts by component (no memory needed at full size)",
                       epilog="example: dsv41 params --config v41_flash")
    _add_config_args(p, default="v41_flash")
    p.set_defaults(func=cmd_params)

    p = sub.add_parser("kv-report", help="global KV bytes per token of V1, V3.2, V4-Flash, V4.1-Flash",
                       epilog="example: dsv41 kv-report --config tiny --set kv_cache.global_kv_dtype=fp8_e4m3")
    _add_config_args(p, default=None, repeat=True)
    p.set_defaults(func=cmd_kv_report)

    p = sub.add_parser(
        "generate", help="generate text from a prompt (--weights, else the config's shipped weights, else random "
                         "parameters from --seed)",
        description=textwrap.fill(
            "Streams the generated text to stdout; prefill progress and a summary (prompt and generated tokens, "
            "prefill seconds, decode tokens/s) go to stderr. Prefill seconds run to the first token and include "
            "compilation; the decode rate leaves out the first decode step, which compiles.", 100),
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the example stays one line, to copy as it is
        epilog="example (the shipped passkey model; prints 71832):\n  "
               + """dsv41 generate --config passkey --prompt "The grass is green. The pass key is 71832. Remember it. """
               + """The sky is blue. What is the pass key? The pass key is " --max-new-tokens 5""")
    p.add_argument("--config", default="small", help="config name in configs/ or a .json/.toml/.py path "
                                                     "(default: small)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set architecture.moe.top_k=1 (repeatable)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a UTF-8 text file")
    p.add_argument("--tokenizer", metavar="PATH", help="a tokenizer.json (default: UTF-8 bytes as ids 0..255)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="at most this many new tokens (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass in (0, 1] (default: 1)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample among the K most likely ids, before top-p (default: 0, every id)")
    p.add_argument("--loop", choices=("host", "device"), default="host",
                   help="decode loop: one dispatch per token from Python, streaming each (host, default), or "
                        "lax.while_loop on the device, streaming a block at a time (device)")
    p.add_argument("--block", type=int, default=32, metavar="N",
                   help="tokens per device-loop call with --loop device (default: 32)")
    p.add_argument("--stop", action="append", default=[], metavar="ID|TEXT",
                   help="stop at this token, given as an id or as text that is one token; not printed "
                        "(repeatable)")
    config_lib.add_weight_format_argument(p)
    p.add_argument("--weights", metavar="PATH",
                   help="a .safetensors weights file of the config (`dsv41 train --export`, `dsv41 convert`); "
                        "default: the weights shipped with --config (passkey's), else random parameters from --seed")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seeds the sampling, and the parameters when no weights are loaded (default: 0)")
    p.add_argument("--prefix-cache", metavar="DIR",
                   help="reuse and store the global KV of prompt prefixes in DIR (DESIGN §7; V4.1)")
    p.set_defaults(func=cmd_generate)

    from dsv41 import compile_report, convert, passkey, server, train, verify

    train.add_parser(sub).set_defaults(func=train.run)
    convert.add_parser(sub).set_defaults(func=convert.run)
    # Not compile-report: JAX writes its TPU programs to the cache but cannot load them back without a TPU.
    compile_report.add_parser(sub)
    passkey.add_parser(sub)
    server.add_parser(sub)
    verify.add_parser(sub)
    for name in ("demo", "generate", "train", "passkey", "serve", "verify"):
        p = sub.choices[name]
        _add_compile_cache_args(p)
        p.set_defaults(compiles=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dsv41 import distributed

    distributed.reserve_collective_threads()  # before the CPU client starts
    try:
        if getattr(args, "compiles", False):
            _use_compile_cache(args)
        return args.func(args)
    except ValueError as e:  # ConfigError and the generate arguments' errors: bad input, not a bug
        print(f"dsv41: error: {e}", file=sys.stderr)
        return 2
