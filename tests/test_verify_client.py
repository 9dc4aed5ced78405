"""dsv41.verify_client against a real `dsv41 serve` (a subprocess on 127.0.0.1 serving the shipped passkey
model): the server's prompt tokens equal the prompt's bytes (the byte tokenizer), and each cell's accuracy
and answers equal those of the same prompts decoded in this process by `passkey.accuracy`. Bad arguments
and an endpoint that cannot be reached or refuses the key are errors naming the flag or the status."""

import contextlib

import pytest

import serving
from dsv41 import passkey
from dsv41.errors import ConfigError
from dsv41.verify_client import client_report, format_client

KEY = "sk-verify"
MODEL = "dsv41-passkey"
CONTEXT, DEPTHS, N, SEED = 1024, [0.1, 0.5, 0.9], 2, 3


@contextlib.contextmanager
def running_server(tmp_path_factory, *extra):
    """A `dsv41 serve` of the passkey model (`serving.running_server`); yields its base URL with /v1. Two slots
    and one prefill width keep the warm-up's compiles few; 1,024-token prompts fit 2,048."""
    with serving.running_server(tmp_path_factory, "--slots", "2", "--prefill-chunks", "512", "--max-model-len",
                                "2048", *extra) as base:
        yield base + "/v1"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory, "--api-key", KEY) as base:
        yield base


@pytest.mark.slow
def test_client_report_matches_the_model_decoded_in_process(server):
    seen = []
    report = client_report(server + "/", api_key=KEY, model=None, contexts=[CONTEXT], depths=DEPTHS, n=N,
                           seed=SEED, max_tokens=(1, 16), progress=seen.append)
    assert (report["mode"], report["base_url"], report["model"], report["max_tokens"]) == \
        ("client", server, MODEL, [1, 16])
    assert seen == report["rows"] and [(r["context"], r["depth"]) for r in report["rows"]] == \
        [(CONTEXT, d) for d in DEPTHS]

    cfg, params = passkey.load_trained()
    for row in report["rows"]:
        assert row["seed"] == SEED + 1000 * DEPTHS.index(row["depth"])  # each cell its own filler
        prompts, answers = passkey.examples(CONTEXT, row["depth"], N, row["seed"])
        # The byte tokenizer: one token per prompt byte, the 5 answer digits left out of the context.
        assert row["prompt_tokens"] == row["expected_prompt_tokens"] == [len(p) for p in prompts] == [CONTEXT - 5] * N
        assert row["completion_tokens_large"] == [16] * N  # no stop token: the passkey model has no EOS
        assert row["answers"] == [a.decode() for a in answers]
        lat = row["latency_s"]
        assert len(lat["small"]) == len(lat["large"]) == N and min(lat["small"] + lat["large"]) > 0
        assert row["mean_latency_small_s"] == pytest.approx(sum(lat["small"]) / N)
        assert row["decode_s"] == pytest.approx(row["mean_latency_large_s"] - row["mean_latency_small_s"])
        # Every request its own filler: the server's prefix cache restores none of them (the latencies hold
        # every prompt's whole prefill).
        assert row["cached_tokens"] == {"small": [0] * N, "large": [0] * N}

        truth = passkey.accuracy(params, cfg, CONTEXT, row["depth"], N, seed=row["seed"])
        assert truth["answers"] == row["answers"]
        assert [d[:5] for d in row["decoded"]] == truth["decoded"]
        assert row["accuracy"] == truth["accuracy"]

    text = format_client(report)
    assert text.startswith("## Client mode") and f"`{server}`" in text and f"`{MODEL}`" in text
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(DEPTHS)
    assert table[1].startswith(f"| {CONTEXT} | 0.1 | {CONTEXT - 5:.1f} |")
    assert table[1].endswith(f"| {report['rows'][0]['accuracy']:.1%} |")
    assert "understates the decode time" not in text


@pytest.mark.slow
def test_a_wrong_key_or_model_is_the_servers_error(server):
    with pytest.raises(ValueError, match=r"GET .*/v1/models: HTTP 401: Incorrect API key provided"):
        client_report(server, api_key="sk-wrong", model=None, contexts=[CONTEXT], depths=[0.5], n=1)
    with pytest.raises(ValueError, match=r"POST .*/v1/completions: HTTP 401: Incorrect API key provided"):
        client_report(server, api_key=None, model=MODEL, contexts=[CONTEXT], depths=[0.5], n=1)
    with pytest.raises(ValueError, match=r"HTTP 404: The model 'gpt-4' does not exist"):
        client_report(server, api_key=KEY, model="gpt-4", contexts=[CONTEXT], depths=[0.5], n=1)


@pytest.mark.parametrize("kwargs, flag", [
    (dict(base_url="127.0.0.1:8000/v1"), "--base-url"),
    (dict(contexts=[]), "--contexts"),
    (dict(contexts=[1024, 0]), "--contexts"),
    (dict(contexts=[40]), "--contexts"),  # too short for the needle, the question and the answer
    (dict(contexts=[1024.5]), "--contexts"),
    (dict(depths=[0.5, 1.5]), "--depths"),
    (dict(depths=[-0.1]), "--depths"),
    (dict(n=0), "--n"),
    (dict(max_tokens=(16, 1)), "--max-tokens"),
    (dict(timeout_s=0), "--timeout"),
    (dict(timeout_s=float("nan")), "--timeout"),
])
def test_bad_arguments_name_their_flag(kwargs, flag):
    args = dict(base_url="http://127.0.0.1:9/v1", api_key=None, model=MODEL, contexts=[1024], depths=[0.5], n=1)
    with pytest.raises(ConfigError, match=f"'{flag}' = "):
        client_report(**{**args, **kwargs})


def test_an_endpoint_that_cannot_be_reached_names_base_url():
    url = f"http://127.0.0.1:{serving.free_port()}/v1"  # nothing listens there
    for model in (None, MODEL):  # GET /models, then POST /completions
        with pytest.raises(ValueError, match=r"--base-url: could not reach http://127\.0\.0\.1:\d+/v1/\w+ "
                                             r"\(connection refused\)"):
            client_report(url, api_key=None, model=model, contexts=[1024], depths=[0.5], n=1)
