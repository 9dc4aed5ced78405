"""The serving engine's scheduler, stepped by hand on the passkey model: what a request waits for, what
it gets, and what cannot stop the others. Truths: the passkey digits in each prompt, the same prompts
through `generate` one at a time, and step counts that follow from the schedule's definition."""

import pytest

from dsv41 import engine as engine_lib
from dsv41 import generate as generate_lib
from dsv41 import passkey
from dsv41.tokenizer import ByteTokenizer

pytestmark = pytest.mark.slow

# The shapes of tests/test_server.py's server (8 slots of 8,192 tokens, chunks of 64 and 512): the same
# programs, which the test session's compilation cache then holds once.
CHUNKS = (64, 512)


@pytest.fixture(scope="module")
def model():
    return passkey.load_trained()


@pytest.fixture(scope="module")
def engine(model):
    cfg, params = model
    eng = engine_lib.Engine(params, cfg, ByteTokenizer(), slots=8, max_model_len=8192, chunks=CHUNKS)
    eng.warmup()
    return eng


def _request(prompt, max_tokens, events, **sampling):
    params = engine_lib.SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    return engine_lib.Request(list(prompt), params, emit=events.append)


def test_greedy_answers_equal_generate_alone_and_the_passkeys(model, engine):
    cfg, params = model
    prompts, answers = passkey.examples(1024, 0.5, 10, seed=2)  # 10 requests for 8 slots: two wait
    events = [[] for _ in prompts]
    reqs = [engine.submit(_request(p, 5, e)) for p, e in zip(prompts, events)]
    for _ in range(200):
        if not engine.step():
            break
    # Before `generate` below compiles its own programs (the guard counts every compile of the process).
    assert engine.stats()["running"] == 0 and engine.compiles_after_warmup == 0
    alone = [generate_lib.generate(params, cfg, p, max_new_tokens=5) for p in prompts]
    assert [r.generated for r in reqs] == alone
    assert sum(bytes(r.generated) == a for r, a in zip(reqs, answers)) >= 9
    for r, e in zip(reqs, events):
        assert "".join(x.delta for x in e if x.kind == "text") == bytes(r.generated).decode()
        assert e[-1].kind == "done" and e[-1].finish_reason == "length"
        assert e[-1].usage == {"prompt_tokens": len(r.prompt), "completion_tokens": 5,
                               "total_tokens": len(r.prompt) + 5, "prompt_tokens_details": {"cached_tokens": 0}}


def test_a_short_request_waits_at_most_one_chunk_behind_a_long_prefill(engine):
    """A 3,000-token prompt needs 6 chunks of 512; a 40-token prompt arriving after the long one's first chunk
    gets its first token in the next step (its own chunk; the long one waits its turn), and a decoding
    request gets a token in every step meanwhile."""
    prompts, _ = passkey.examples(3000, 0.5, 1, seed=3)
    events = {k: [] for k in ("long", "short", "decoding")}
    decoding = engine.submit(_request(b"The pass key is 12345. " * 3, 64, events["decoding"]))
    engine.step()  # its prefill and first token
    long = engine.submit(_request(prompts[0], 2, events["long"]))
    engine.step()  # the long prompt's first chunk
    assert long.done_tokens == 512
    short = engine.submit(_request(b"x" * 40, 2, events["short"]))
    before = len(decoding.generated)
    engine.step()
    assert short.first_token_at is not None and long.done_tokens == 512  # the short one went first
    engine.step()
    assert long.done_tokens == 1024
    assert len(decoding.generated) == before + 2  # one token per step
    for _ in range(100):
        if not engine.step():
            break
    assert long.generated and events["long"][-1].kind == "done"


def test_stops_cancellation_and_a_failing_receiver_do_not_stop_the_others(engine):
    prompts, answers = passkey.examples(512, 0.5, 2, seed=4)
    events = {k: [] for k in ("stop_string", "stop_id", "cancelled", "broken", "fine")}
    answer = answers[0].decode()
    stop_string = engine.submit(_request(prompts[0], 5, events["stop_string"], stop=(answer[2:],)))
    stop_id = engine.submit(_request(prompts[0], 5, events["stop_id"], stop_token_ids=(answers[0][1],)))
    cancelled = engine.submit(_request(prompts[1], 5, events["cancelled"]))

    def broken_emit(event):
        raise ConnectionError("the client's socket is gone")

    broken = engine.submit(engine_lib.Request(list(prompts[1]), engine_lib.SamplingParams(max_tokens=5,
                                                                                          temperature=0.0),
                                              emit=broken_emit))
    fine = engine.submit(_request(prompts[1], 5, events["fine"]))
    engine.cancel(cancelled.id)
    for _ in range(100):
        if not engine.step():
            break
    cut = answer[:answer.find(answer[2:])]  # the output ends where the stop string first appears
    assert (stop_string.text, events["stop_string"][-1].finish_reason) == (cut, "stop")
    assert "".join(e.delta for e in events["stop_string"] if e.kind == "text") == cut
    cut = answer[:answer.index(answer[1])]  # ... or before the first stop id, which is generated, not shown
    assert (bytes(stop_id.generated[:-1]).decode(), stop_id.text, events["stop_id"][-1].finish_reason) == (
        cut, cut, "stop")
    assert events["cancelled"][-1].finish_reason == "cancelled" and not cancelled.generated
    assert broken.finished and len(broken.generated) == 5
    assert bytes(fine.generated) == answers[1] and events["fine"][-1].finish_reason == "length"
    assert engine.stats()["running"] == 0


def test_requests_the_engine_cannot_serve_are_refused_by_name(engine):
    def refused(prompt, **sampling):
        with pytest.raises(ValueError) as e:
            engine.submit(engine_lib.Request(prompt, engine_lib.SamplingParams(**sampling), emit=print))
        return str(e.value)

    assert "maximum context length is 8192 tokens" in refused([1] * 8000, max_tokens=200)
    assert "requested 8200 tokens" in refused([1] * 8000, max_tokens=200)
    assert refused([]).startswith("prompt: empty")
    assert refused([300]).startswith("prompt: token ids [300]")
    assert refused([1], temperature=-1).startswith("temperature: -1")
    assert refused([1], top_p=0).startswith("top_p: 0")
    assert refused([1], top_k=-2).startswith("top_k: -2")
    assert refused([1], stop_token_ids=(999,)).startswith("stop_token_ids: [999]")
    assert refused([1], seed=2 ** 32).startswith("seed: 4294967296")  # generate's keys take 32-bit seeds
    assert engine.stats()["waiting"] == 0


def test_host_memory_engram_tables_need_a_mesh(model):
    import dsv41
    cfg, params = model
    with pytest.raises(dsv41.ConfigError, match="engram_host.*expected a mesh"):
        engine_lib.Engine(params, cfg, ByteTokenizer(), slots=8, max_model_len=512, engram_host=True)


def test_rows_shorter_than_a_prefix_cache_block_are_refused_and_short_rows_warm_up(model, tmp_path):
    """Rows of `max_model_len` tokens that cannot hold a prefix-cache block and a token after it (the
    block's 256 tokens + 2) are refused by name with a prefix cache, and so is a row with no room for an
    output token; without one, rows barely longer than the smallest chunk warm up (the warm-up request fits
    the rows) and serve what `generate` gives alone."""
    import dsv41
    from dsv41.prefix_cache import PrefixCache
    cfg, params = model
    pc = PrefixCache(cfg, params, str(tmp_path))
    assert pc.block == 256 and engine_lib.prefix_cache_min_len(pc) == 258
    with pytest.raises(dsv41.ConfigError, match=r"'max_model_len' = 257: expected at least 258 .*256-token blocks"):
        engine_lib.Engine(params, cfg, ByteTokenizer(), slots=8, max_model_len=257, prefix_cache=pc)
    with pytest.raises(dsv41.ConfigError, match=r"'max_model_len' = 1: expected at least 2"):
        engine_lib.Engine(params, cfg, ByteTokenizer(), slots=8, max_model_len=1)
    eng = engine_lib.Engine(params, cfg, ByteTokenizer(), slots=8, max_model_len=258, chunks=(64,), prefix_cache=pc)
    eng.warmup()  # the block's request: 257 tokens and one output; then 64 tokens and two
    prompt = list(range(40, 240)) + list(range(40, 97))  # 257 tokens: one block saved, then restored
    for cached in (0, 256):
        req = eng.submit(_request(prompt, 1, []))
        for _ in range(100):
            if not eng.step():
                break
        assert req.cached == cached and len(req.generated) == 1 and eng.compiles_after_warmup == 0
    eng = engine_lib.Engine(params, cfg, ByteTokenizer(), slots=8, max_model_len=66, chunks=(64,))
    eng.warmup()  # a prompt of 64 tokens and two output tokens: 66
    prompt = list(b"the passkey is 31415. ") * 2
    events = []
    req = eng.submit(_request(prompt, 66 - len(prompt), events))
    for _ in range(100):
        if not eng.step():
            break
    assert len(req.generated) == 66 - len(prompt) and eng.compiles_after_warmup == 0
    assert req.generated == generate_lib.generate(params, cfg, prompt, max_new_tokens=66 - len(prompt))


def test_serve_turns_its_default_prefix_cache_off_for_rows_shorter_than_a_block(tmp_path, capsys, monkeypatch):
    """`dsv41 serve --max-model-len 200`: the default prefix cache could never save a block, so the server
    says so and serves without it; asked for by `--prefix-cache DIR`, the length is refused by name."""
    import dsv41
    from dsv41 import cli, server
    monkeypatch.setenv("DSV41_PREFIX_CACHE", str(tmp_path / "default"))  # the default's folder, not ~/.cache
    argv = ["serve", "--config", "passkey", "--max-model-len", "200", "--prefill-chunks", "64"]
    eng, _ = server.build(cli.build_parser().parse_args(argv))
    assert eng.prefix_cache is None and eng.max_model_len == 200
    assert "prefix cache off: rows of 200 tokens (--max-model-len) hold no 256-token block" in capsys.readouterr().err
    with pytest.raises(dsv41.ConfigError, match=r"'max_model_len' = 200: expected at least 258"):
        server.build(cli.build_parser().parse_args(argv + ["--prefix-cache", str(tmp_path)]))
