"""Generation (greedy against a teacher-forced loop over `forward`, sampling against the closed-form
nucleus distribution), the tokenizers against Python's UTF-8 codec and the `tokenizers` library, and
`dsv41 generate`.

Compilation dominates the time (~20 s a step on CPU): every generation here (the command's too, in
process) has one row, a cache of 6 tokens and prefill chunks of 1 token, so prefill and decode share one
compiled step, and every forward call has 5 tokens. The ragged batch (other shapes) and the command in a
fresh process are marked slow.
"""

import dataclasses
import subprocess
import sys

import jax
import numpy as np
import pytest

import dsv41
from dsv41 import cache as cache_lib
from dsv41 import cli
from dsv41 import generate as gen
from dsv41 import sharding
from dsv41.tokenizer import ByteTokenizer, JsonTokenizer, load_tokenizer

PROMPT = [104, 105]  # "hi"
NEW = 4


@pytest.fixture(scope="module")
def model():
    cfg = dsv41.load_config("tiny")
    return dsv41.init_params(cfg, jax.random.key(0)), cfg


@pytest.fixture(scope="module")
def greedy(model):
    return gen.generate(*model, PROMPT, max_new_tokens=NEW, chunk=1)


def forward_last(params, cfg, ids, width=len(PROMPT) + NEW - 1):
    """Teacher-forced logits at the last of `ids`, padded to one width (causal: the padding is unseen)."""
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :len(ids)] = ids
    return np.asarray(dsv41.forward(params, cfg, tokens))[0, len(ids) - 1]


def forward_greedy(params, cfg, prompt, new, width=len(PROMPT) + NEW - 1, limit=None):
    """The independent greedy loop: argmax of forward's logits at the last token (the first `limit`),
    appended, repeated."""
    seq = list(prompt)
    for _ in range(new):
        seq.append(int(np.argmax(forward_last(params, cfg, seq, width)[:limit])))
    return seq[len(prompt):]


@pytest.mark.slow
def test_greedy_equals_a_teacher_forced_loop_over_forward(model, greedy):
    assert greedy == forward_greedy(*model, PROMPT, NEW)


@pytest.mark.slow
def test_vocab_limit_draws_only_the_ids_below_it(model):
    assert gen.generate(*model, PROMPT, max_new_tokens=NEW, chunk=1, vocab_limit=100) == \
        forward_greedy(*model, PROMPT, NEW, limit=100)
    sampled = gen.generate(*model, PROMPT, max_new_tokens=NEW, chunk=1, vocab_limit=3, temperature=1.0)
    assert len(sampled) == NEW and max(sampled) < 3


@pytest.mark.slow
def test_a_ragged_batch_in_chunks_equals_each_prompt_alone(model):
    """Prompts of 5 and 3 tokens prefilled in chunks of 2 aligned to their ends (row 0: 1 + 2 + 2 tokens,
    the first chunk padded; row 1: 0 + 1 + 2) give forward's logits at each last token; generated as a
    batch, each row equals its own greedy loop over forward, the short row cut at its stop token."""
    params, cfg = model
    prompts, new = [[7, 200, 31, 4, 99], [12, 5, 250]], 3
    progress = []
    # A capacity of 12, as the device-loop tests' default: the decode step is compiled once for the module.
    logits, cache = gen.prefill_chunked(params, cfg, dsv41.init_cache(cfg, 2, 12), prompts, chunk=2,
                                        on_progress=lambda done, total: progress.append((done, total)))
    for row, p in enumerate(prompts):
        np.testing.assert_allclose(np.asarray(logits[row]), forward_last(params, cfg, p, width=7), atol=1e-5, rtol=0)
    assert progress == [(1, 8), (4, 8), (8, 8)] and cache.lengths.tolist() == [5, 3]
    expected = [forward_greedy(params, cfg, p, new, width=7) for p in prompts]
    stop = expected[1][1]
    cut = [e[:e.index(stop)] if stop in e else e for e in expected]
    assert gen.generate_batch(params, cfg, prompts, max_new_tokens=new, chunk=2, max_len=12) == expected
    assert gen.generate_batch(params, cfg, prompts, max_new_tokens=new, chunk=2, max_len=12,
                              stop_tokens=[stop]) == cut


@pytest.mark.slow
def test_sampling_is_deterministic_given_the_seed(model):
    run = lambda seed: gen.generate(*model, PROMPT, max_new_tokens=NEW, temperature=1.0, seed=seed, chunk=1)
    first = run(1)
    assert run(1) == first
    assert run(2) != first


@pytest.mark.slow
def test_a_tiny_nucleus_is_greedy(model, greedy):
    assert gen.generate(*model, PROMPT, max_new_tokens=NEW, temperature=1.0, top_p=1e-6, seed=3,
                        chunk=1) == greedy


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8), (2.0, 0.5)])
def test_sampler_draws_the_nucleus_distribution(temperature, top_p):
    """20,000 draws against softmax(logits / T) cut to its nucleus and renormalised (numpy, float64)."""
    logits = np.array([2.0, 1.0, 0.5, -1.0, 1.0])
    p = np.exp(logits / temperature) / np.exp(logits / temperature).sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    nucleus = order[before < top_p] if top_p < 1 else order
    expected = np.zeros_like(p)
    expected[nucleus] = p[nucleus] / p[nucleus].sum()
    n = 20_000
    ids = np.asarray(gen.sample(np.tile(logits, (n, 1)).astype(np.float32), jax.random.key(0), temperature, top_p))
    freq = np.bincount(ids, minlength=len(logits)) / n
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert (np.abs(freq - expected) <= 5 * sigma + 1e-12).all(), (freq, expected)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 2, 1.0), (0.7, 3, 0.8), (1.0, 1, 1.0)])
def test_sampler_draws_the_top_k_then_nucleus_distribution(temperature, top_k, top_p):
    """20,000 draws (one key a row) against softmax(logits / T) cut to the top_k ids, renormalised, cut to
    its nucleus and renormalised again (numpy, float64); ties go to the lower id."""
    logits = np.array([2.0, 1.0, 0.5, -1.0, 1.0])
    order = np.argsort(-logits, kind="stable")[:top_k]
    p = np.zeros_like(logits)
    p[order] = np.exp(logits[order] / temperature) / np.exp(logits[order] / temperature).sum()
    before = np.cumsum(p[order]) - p[order]
    nucleus = order[before < top_p] if top_p < 1 else order
    expected = np.zeros_like(p)
    expected[nucleus] = p[nucleus] / p[nucleus].sum()
    n = 20_000
    ids = np.asarray(gen.sample(np.tile(logits, (n, 1)).astype(np.float32), jax.random.key(1), temperature, top_p,
                                top_k))
    freq = np.bincount(ids, minlength=len(logits)) / n
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert (np.abs(freq - expected) <= 5 * sigma + 1e-12).all(), (freq, expected)


ENGRAM = ('{"layers": [1, 4], "max_ngram": 3, "heads_per_ngram": 2, "row_dim": 16, '
          '"compressed_vocab_size": 256, "prime_floor": 100, "pad_id": 2}')


@pytest.mark.slow
def test_the_device_loop_hashes_engram_ngrams_as_the_host_does():
    """tiny with Engram at layers 1 and 4 (tables scaled up, so that the rows looked up move the logits): the
    device loop hashes each step's n-grams on the device and moves the cache's look-back itself; its greedy
    tokens equal the host loop's (int64 NumPy hashes) for a ragged batch in blocks of 2, with the identity
    token map and with one that merges ids, and the two maps give different tokens (the rows matter). Tables
    in host memory (read by the sharded steps only) are refused before any step runs, naming the field."""
    cfg = dsv41.load_config("tiny", [f"architecture.engram={ENGRAM}"])
    params = dsv41.init_params(cfg, jax.random.key(0))
    for k in range(2):
        table = params["engram"][k]["table"]
        table.set_value(table.get_value() * 30)
    prompts = [[104, 105, 3, 7, 9], [11, 12]]
    identity = np.arange(cfg.architecture.vocab_size)
    run = lambda loop, token_map: gen.generate_batch(params, cfg, prompts, max_new_tokens=7, chunk=4, loop=loop,
                                                     block=2, token_map=token_map)
    host = run("host", identity)
    assert run("device", identity) == host
    merged = run("host", identity // 2)
    assert run("device", identity // 2) == merged != host
    # A look-back slot before a row's start hashes as the pad id whatever the cache holds there: both loops mask
    # it by the row's length. Row 1 holds 1 token, so the first of its 2 look-back slots is before its start.
    short = [prompts[0], [11]]
    want = gen.generate_batch(params, cfg, short, max_new_tokens=7, chunk=4, loop="host", token_map=identity)
    for loop in ("host", "device"):
        logits, cache = gen.prefill_chunked(params, cfg, dsv41.init_cache(cfg, 2, 12), short, chunk=4,
                                            token_map=identity)
        view = cache_lib.host_view(cache)
        assert view.recent_tokens[1].tolist() == [-1, 11]
        bad = view.recent_tokens.copy()
        bad[1, 0] = 77
        cache = cache_lib.with_mirror(dataclasses.replace(cache, recent_tokens=jax.numpy.asarray(bad)),
                                        view.lengths, bad)
        assert gen.generate_from(params, cfg, cache, logits, max_new_tokens=7, loop=loop, block=2,
                                 token_map=identity) == want, loop
    on_host = sharding.shard_params(params, cfg, jax.make_mesh((1,), ("data",)), engram_host=True)
    for loop in ("host", "device"):
        with pytest.raises(dsv41.ConfigError, match="'engram_host' = True: expected the Engram tables in device"):
            gen.generate(on_host, cfg, PROMPT, max_new_tokens=2, loop=loop)


@pytest.mark.slow
def test_the_device_loop_equals_the_host_loop(model):
    """Greedy, a ragged batch with per-row stops: `loop="device"` (lax.while_loop, blocks of 3 tokens, so a
    row ends inside a block and the loop spans calls) gives the host loop's tokens; so does sampling with the
    same seed (the same sampler and keys; a rounding-level logit difference could flip a draw, and did not
    here)."""
    prompts = [[104, 105, 3, 7, 9], [11, 12]]
    run = lambda loop, **kw: gen.generate_batch(*model, prompts, max_new_tokens=7, chunk=4, loop=loop, block=3, **kw)
    greedy = run("host")
    assert run("device") == greedy
    stop = greedy[0][2]
    stopped = run("host", stop_tokens=[stop])
    assert stopped[0] == greedy[0][:greedy[0].index(stop)]
    assert run("device", stop_tokens=[stop]) == stopped
    sampled = run("host", temperature=1.0, top_k=5, seed=3)
    assert run("device", temperature=1.0, top_k=5, seed=3) == sampled != greedy


def test_a_fixed_capacity_gives_the_same_tokens_and_a_short_one_is_refused(model):
    """max_len: the cache's capacity (gemma's cache_length); a larger one than the request needs changes no
    token (the steps cover the filled part of each row), one too small is refused naming the field."""
    # The device-loop test's prompts, tokens and chunks: the default capacity's programs are compiled once.
    prompts = [[104, 105, 3, 7, 9], [11, 12]]
    run = lambda **kw: gen.generate_batch(*model, prompts, max_new_tokens=7, chunk=4, **kw)
    assert run(max_len=256, loop="device", block=3) == run()
    with pytest.raises(ValueError, match=r"max_len: 11: expected an int of at least .* = 12"):
        run(max_len=11)


def test_generation_continues_from_a_prefilled_cache(model):
    """`generate_from` after a prefill of the user's own: the teacher-forced greedy tokens over `forward`;
    more tokens than the cache can hold and logits of the wrong shape are refused, naming the argument."""
    params, cfg = model
    prefilled = lambda: gen.prefill_chunked(params, cfg, dsv41.init_cache(cfg, 1, len(PROMPT) + NEW), [PROMPT],
                                            chunk=1)
    logits, cache = prefilled()
    assert gen.generate_from(params, cfg, cache, logits, max_new_tokens=NEW) == [forward_greedy(*model, PROMPT, NEW)]
    logits, cache = prefilled()
    with pytest.raises(ValueError, match=r"max_new_tokens: 9: row 0 holds 2 tokens; expected at most \d+ more"):
        gen.generate_from(params, cfg, cache, logits, max_new_tokens=9)
    with pytest.raises(ValueError, match=r"logits_BV: shape \(2, \d+\): expected \(1, \d+\)"):
        gen.generate_from(params, cfg, cache, np.zeros((2, cfg.architecture.vocab_size)), max_new_tokens=1)


@pytest.mark.slow
def test_the_device_loop_updates_the_cache_in_place(model):
    """The compiled block of decode steps holds no copy of a cache store: a whole-cache copy per step (as a
    `lax.cond` that passed the cache through did, on every store) would make a token's cost follow the cache's
    capacity. Counted in the optimised HLO of `_sample_block`, for every uint8 store leaf of the cache."""
    params, cfg = model
    b = 2
    cache = dsv41.init_cache(cfg, b, cfg.context_window)
    logits = jax.numpy.zeros((b, cfg.architecture.vocab_size), jax.numpy.float32)
    rows = gen.Sampling.of(b, vocab_limit=cfg.architecture.vocab_size, max_new_tokens=8)
    none = jax.numpy.zeros((b,), jax.numpy.int32), jax.numpy.zeros((b,), bool)
    hlo = gen._sample_block.lower(dsv41.model.config_key(cfg), None, 4, params, cache, logits, rows, *none).compile()
    lines = hlo.as_text().splitlines()
    stores = {f"u8[{','.join(map(str, x.shape))}]" for x in jax.tree.leaves(cache.compressed) if x.ndim == 4}
    assert stores
    copied = {shape for shape in stores for line in lines if " copy(" in line and shape in line.split(" copy(")[0]}
    assert not copied, copied


@pytest.mark.slow
def test_a_stop_token_ends_generation_and_is_not_returned(model, greedy):
    stop = greedy[1]
    streamed = []
    out = gen.generate(*model, PROMPT, max_new_tokens=NEW, stop_tokens=[stop], on_token=streamed.append,
                       chunk=1)
    assert out == streamed == greedy[:greedy.index(stop)]
    assert len(out) < NEW


@pytest.mark.parametrize("prompt, kwargs, message", [
    ([], {}, r"prompt_ids: \[\]: expected at least one token"),
    (PROMPT, {"max_new_tokens": 0}, "max_new_tokens: 0: expected a positive integer"),
    (PROMPT, {"max_new_tokens": -3}, "max_new_tokens: -3"),
    (PROMPT, {"temperature": -0.5}, "temperature: -0.5: expected >= 0"),
    (PROMPT, {"top_p": 0.0}, r"top_p: 0.0: expected a value in \(0, 1\]"),
    (PROMPT, {"top_p": 1.5}, "top_p: 1.5"),
    ([104, 256, -1], {}, r"prompt_ids: ids \[256, -1\]: expected integers in 0..255"),
    (PROMPT, {"stop_tokens": [300]}, r"stop_tokens: ids \[300\]"),
    ([1] * 500, {"max_new_tokens": 13}, "500 tokens \\+ max_new_tokens 13 = 513: .*maximum context length of 512"),
    ([1] * 600, {}, "maximum context length"),
    (PROMPT, {"vocab_limit": 0}, r"vocab_limit: 0: expected None or an integer in 1..256"),
    (PROMPT, {"vocab_limit": 300}, "vocab_limit: 300"),
    (PROMPT, {"top_k": -1}, r"top_k: -1: expected an integer >= 0"),
    (PROMPT, {"loop": "gpu"}, "loop: 'gpu': expected 'host' or 'device'"),
    (PROMPT, {"loop": "device", "block": 0}, "block: 0: expected a positive integer"),
    (PROMPT, {"seed": 2**32}, "seed: 4294967296: expected an integer in 0..4294967295"),
])
@pytest.mark.slow
def test_bad_requests_are_refused(model, prompt, kwargs, message):
    with pytest.raises(ValueError, match=message):
        gen.generate(*model, prompt, **{"max_new_tokens": 1, **kwargs})


TEXT = "héllo, 世界 🙂!"


def test_byte_tokenizer_round_trip_and_streaming():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8")) and tok.decode(ids) == TEXT
    stream, pieces = tok.stream(), []
    for i in ids:
        pieces.append(stream.step(i))
        assert TEXT.startswith("".join(pieces))  # never half a character
    assert "".join(pieces) + stream.flush() == TEXT
    assert pieces[ids.index(0xF0):ids.index(0xF0) + 4] == ["", "", "", "🙂"]


def test_byte_streaming_equals_one_shot_decoding_of_invalid_utf8():
    """Random bytes (mostly invalid UTF-8): stream + flush equals Python's decode(errors="replace")."""
    rng = np.random.default_rng(0)
    tok = ByteTokenizer()
    samples = [[0xE4, 0xB8], [0xFF, 0x68], [0xF0, 0x9F, 0x99]] + [
        rng.choice([0x41, 0x80, 0xBF, 0xC3, 0xE4, 0xED, 0xF0, 0xF4, 0xFF], size=12).tolist() for _ in range(200)]
    for ids in samples:
        stream = tok.stream()
        streamed = "".join(stream.step(i) for i in ids) + stream.flush()
        assert streamed == tok.decode(ids) == bytes(ids).decode("utf-8", errors="replace"), ids


def test_byte_tokenizer_errors():
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match=r"token ids \[256, 300\]: expected ids in 0..255"):
        tok.decode([65, 256, 300])
    with pytest.raises(ValueError, match=r"stop: 'ab': encodes to 2 tokens"):
        tok.token_id("ab")
    assert tok.token_id("\n") == 10
    with pytest.raises(dsv41.ConfigError, match="architecture.vocab_size.*100.*at least 256"):
        load_tokenizer(dsv41.load_config("tiny", ["architecture.vocab_size=100"]))


@pytest.fixture
def word_level(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "ü": 3, "<eos>": 4}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path / "tokenizer.json"


def test_tokenizer_json_round_trip(word_level):
    tok = load_tokenizer(dsv41.load_config("tiny"), word_level)
    assert isinstance(tok, JsonTokenizer) and tok.vocab_size == 5
    ids = tok.encode("hello world ü")
    assert ids == [1, 2, 3] and tok.decode(ids) == "hello world ü"
    stream = tok.stream()
    assert "".join(stream.step(i) for i in ids) + stream.flush() == "hello world ü"
    assert tok.token_id("<eos>") == 4 and tok.token_id("world") == 2
    with pytest.raises(ValueError, match=r"token ids \[7\]: expected ids in 0..4"):
        tok.decode([1, 7])
    with pytest.raises(ValueError, match="encodes to 2 tokens"):
        tok.token_id("hello world")
    with pytest.raises(dsv41.ConfigError, match="at least 5"):
        load_tokenizer(dsv41.load_config("tiny", ["architecture.vocab_size=4"]), word_level)


@pytest.fixture(scope="module")
def greedy_h(model):
    """The command's prompt "h" (one token: its prefill shares decode's compiled step), 5 new tokens."""
    return forward_greedy(*model, [104], 5)


@pytest.mark.slow
def test_cli_generate_streams_the_greedy_text(greedy_h, capsys):
    """In process, so it reuses the module's compiled steps; the same parameters (seed 0)."""
    assert cli.main(["generate", "--config", "tiny", "--prompt", "h", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr()
    assert out.out == ByteTokenizer().decode(greedy_h) + "\n"
    assert "prompt 1 tokens, generated 5 tokens, prefill " in out.err and " tokens/s" in out.err
    assert "prefill:" in out.err.split("prompt 1 tokens")[0]  # the progress bar came first


@pytest.mark.slow
def test_cli_generate_on_the_device_loop_prints_the_same_text(greedy_h, capsys):
    args = ["generate", "--config", "tiny", "--prompt", "h", "--max-new-tokens", "5", "--loop", "device", "--block", "2"]
    assert cli.main(args) == 0
    out = capsys.readouterr()
    assert out.out == ByteTokenizer().decode(greedy_h) + "\n"
    assert "generated 5 tokens, prefill " in out.err and "decode 5 tokens in " in out.err


@pytest.mark.slow
def test_cli_generate_stops_at_a_stop_token(greedy_h, capsys):
    argv = ["generate", "--config", "tiny", "--prompt", "h", "--max-new-tokens", "5", "--stop", str(greedy_h[2])]
    assert cli.main(argv) == 0
    out = capsys.readouterr()
    assert out.out == ByteTokenizer().decode(greedy_h[:greedy_h.index(greedy_h[2])]) + "\n"
    assert "stopped at a stop token" in out.err


@pytest.mark.slow
def test_cli_generate_with_a_tokenizer_json_a_prompt_file_and_sampling(model, word_level, tmp_path, capsys):
    """"hello" is one token of the 5-id tokenizer; the command draws only those 5 ids (vocab_limit)."""
    (tmp_path / "prompt.txt").write_text("hello")
    argv = ["generate", "--config", "tiny", "--prompt-file", str(tmp_path / "prompt.txt"), "--tokenizer",
            str(word_level), "--max-new-tokens", "5", "--temperature", "1", "--top-p", "0.9", "--seed", "0"]
    assert cli.main(argv) == 0
    out = capsys.readouterr()
    ids = gen.generate(*model, [1], max_new_tokens=5, temperature=1.0, top_p=0.9, seed=0, vocab_limit=5)
    assert out.out == JsonTokenizer(word_level).decode(ids) + "\n"
    assert "prompt 1 tokens, generated 5 tokens" in out.err


def main_exit_code(argv) -> int:
    try:
        return cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        return e.code


@pytest.mark.parametrize("args, message", [
    (["--prompt", "hi", "--max-new-tokens", "0"], "dsv41: error: max_new_tokens: 0: expected a positive integer"),
    (["--prompt", "hi", "--top-p", "2"], "dsv41: error: top_p: 2.0"),
    (["--prompt", "hi", "--stop", "ab"], "dsv41: error: stop: 'ab': encodes to 2 tokens"),
    (["--prompt", "x" * 600], "maximum context length"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "dsv41: error: --prompt-file: '/nonexistent/prompt.txt'"),
    (["--prompt", "hi", "--tokenizer", "/nonexistent/tokenizer.json"], "tokenizer: '/nonexistent/tokenizer.json'"),
    (["--prompt", "hi", "--max-new-tokens", "many"], "invalid int value: 'many'"),
    (["--prompt", "hi", "--top-k", "-2"], "dsv41: error: top_k: -2: expected an integer >= 0"),
    (["--prompt", "hi", "--loop", "device", "--block", "0"], "dsv41: error: block: 0: expected a positive integer"),
    (["--prompt", "hi", "--loop", "gpu"], "invalid choice: 'gpu'"),
    (["--prompt", "hi", "--seed", "-1"], "dsv41: error: seed: -1: expected an integer in 0..4294967295"),
    ([], "one of the arguments --prompt --prompt-file is required"),
])
def test_cli_bad_arguments_exit_2(args, message, capsys):
    assert main_exit_code(["generate", "--config", "tiny", *args]) == 2
    out = capsys.readouterr()
    assert message in out.err and out.out == "", out.err


def run(*args):
    return subprocess.run([sys.executable, "-m", "dsv41", "generate", *args], capture_output=True, text=True,
                          timeout=300)


def test_python_m_dsv41_generate_help_and_a_bad_argument():
    out = run("--help")
    assert out.returncode == 0 and "prints 71832):\n  dsv41 generate --config passkey --prompt" in out.stdout
    out = run("--config", "tiny", "--prompt", "hi", "--temperature", "-1")
    assert out.returncode == 2 and "dsv41: error: temperature: -1.0: expected >= 0" in out.stderr


@pytest.mark.slow
def test_python_m_dsv41_generate():
    """The whole command in a fresh process, on the shapes the in-process commands above run (its programs
    come from the session's compile cache when one of them ran first)."""
    out = run("--config", "tiny", "--prompt", "h", "--max-new-tokens", "5")
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("\n") and "prompt 1 tokens, generated 5 tokens" in out.stderr
