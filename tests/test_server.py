"""`dsv41 serve` as a client sees it: a real server in a subprocess on 127.0.0.1, driven by the official
`openai` client and by `requests`. The answers are checked against independent truths: the passkey
digits hidden in each prompt, the byte tokenizer's counts (a UTF-8 byte is a token), the same prompt
served alone and cold."""

import concurrent.futures
import json
import os
import threading
import time

import pytest

import serving
from dsv41 import passkey

pytestmark = pytest.mark.slow

KEYS = ("sk-first", "sk-second")
MODEL = "dsv41-passkey"
MAX_LEN = 8192


def running_server(tmp_path_factory, *extra, env=()):
    """A `dsv41 serve` of the passkey model with two API keys (`serving.running_server`); yields its base URL."""
    return serving.running_server(tmp_path_factory, "--prefill-chunks", "64,512", "--max-model-len", str(MAX_LEN),
                                  *[a for k in KEYS for a in ("--api-key", k)], *extra, env=env)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory, "--slots", "8") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server + "/v1", api_key=KEYS[1], max_retries=0, timeout=300)


def _prompts(context, n, seed):
    prompts, answers = passkey.examples(context, 0.5, n, seed=seed)
    return [bytes(p).decode() for p in prompts], [a.decode() for a in answers]


def _metric(server, name) -> float:
    import requests

    for line in requests.get(server + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    raise AssertionError(f"/metrics has no {name}")


def test_models_lists_the_model_with_its_context_window(client):
    (m,) = client.models.list().data
    assert m.id == MODEL and m.max_model_len == MAX_LEN


def test_completions_and_chat_streamed_and_not_retrieve_the_passkey_with_exact_usage(client):
    prompts, answers = _prompts(2048, 2, seed=11)
    for prompt, answer in zip(prompts, answers):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
        assert r.choices[0].text == answer and r.choices[0].finish_reason == "length"
        # The byte tokenizer: one token per UTF-8 byte of the prompt and of the output.
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt.encode()), 5)
        assert r.usage.total_tokens == r.usage.prompt_tokens + 5 and r.usage.prompt_tokens_details.cached_tokens >= 0

        c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=5,
                                           temperature=0)
        assert c.choices[0].message.content == answer and c.usage.prompt_tokens == len(prompt.encode())

        for chat in (False, True):
            kw = dict(model=MODEL, max_tokens=5, temperature=0, stream=True, stream_options={"include_usage": True})
            stream = (client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw) if chat
                      else client.completions.create(prompt=prompt, **kw))
            chunks = list(stream)
            text = "".join((ch.choices[0].delta.content or "") if chat else ch.choices[0].text
                           for ch in chunks if ch.choices)
            assert text == answer
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
            usage = chunks[-1].usage
            assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), 5)
            assert usage.prompt_tokens_details.cached_tokens is not None


def test_stop_strings_end_the_output_before_them(client):
    prompt, answer = _prompts(1024, 1, seed=5)
    r = client.completions.create(model=MODEL, prompt=prompt[0], max_tokens=5, temperature=0, stop=[answer[0][2]])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == answer[0][:2]


def test_a_repeated_prompt_is_restored_from_the_prefix_cache_with_the_same_output(client):
    prompt, _ = _prompts(1500, 1, seed=21)
    cold = client.completions.create(model=MODEL, prompt=prompt[0], max_tokens=12, temperature=0)
    warm = client.completions.create(model=MODEL, prompt=prompt[0], max_tokens=12, temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens > 0  # whole 256-token blocks, the last token left
    assert warm.usage.prompt_tokens_details.cached_tokens == (len(prompt[0]) - 1) // 256 * 256
    assert warm.choices[0].text == cold.choices[0].text


def test_errors_have_openai_status_type_and_code(server, client):
    import openai
    import requests

    def error(call):
        with pytest.raises(openai.APIStatusError) as e:
            call()
        return e.value.status_code, e.value.body

    for key in ("sk-wrong", ""):
        bad = openai.OpenAI(base_url=server + "/v1", api_key=key or "x", max_retries=0)
        assert error(lambda: bad.models.list())[0] == 401
    r = requests.get(server + "/v1/models", timeout=10)  # no Authorization header
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"

    status, body = error(lambda: client.completions.create(model="gpt-4", prompt="hi", max_tokens=1))
    assert status == 404 and body["code"] == "model_not_found" and body["param"] == "model"

    status, body = error(lambda: client.completions.create(model=MODEL, prompt="x" * 8000, max_tokens=500))
    assert status == 400 and body["code"] == "context_length_exceeded"
    assert f"maximum context length is {MAX_LEN} tokens" in body["message"] and "8500" in body["message"]
    status, body = error(lambda: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x" * 9000}], max_tokens=1))
    assert status == 400 and body["code"] == "context_length_exceeded" and body["param"] == "messages"

    for field, value in (("temperature", "hot"), ("temperature", 7), ("top_p", 0), ("max_tokens", 0),
                         ("max_tokens", 1.5), ("stop", [1, 2]), ("n", 2), ("seed", -1)):
        status, body = error(lambda: client.completions.create(model=MODEL, prompt="hi", **{field: value}))
        assert status == 400 and body["type"] == "invalid_request_error" and body["param"] == field, (field, body)
        assert field in body["message"]
    status, body = error(lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "wizard"}]))
    assert status == 400 and body["param"].startswith("messages[0]")

    headers = {"Authorization": f"Bearer {KEYS[0]}", "Content-Type": "application/json"}
    r = requests.post(server + "/v1/completions", data=b'{"model": ', headers=headers, timeout=10)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = requests.post(server + "/v1/completions", data=json.dumps({"prompt": "hi"}), headers=headers, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_a_plain_requests_script_reads_usage(server):
    """The script users already run, with only its URL changed (the first key of two)."""
    import requests

    for n in (10, 300, 2000):
        r = requests.post(server + "/v1/chat/completions", timeout=300,
                          headers={"Authorization": f"Bearer {KEYS[0]}"},
                          json={"model": MODEL, "messages": [{"role": "user", "content": "a" * n}], "max_tokens": 3})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (n, 3, n + 3)
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 0


def test_concurrent_greedy_requests_equal_each_alone(client):
    prompts, answers = _prompts(2048, 8, seed=31)
    ask = lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, prompts))
    # Alone: new prompts each time would be cold; these are restored from the prefix cache (same bytes, and
    # the rings from the pool: the state of a cold prefill) and run one at a time.
    alone = [ask(p) for p in prompts]
    assert together == alone
    assert sum(t[:5] == a for t, a in zip(together, answers)) >= 7


def test_a_client_that_goes_away_frees_its_slot_and_no_program_compiles_under_load(server, client):
    import requests

    stream = client.completions.create(model=MODEL, prompt="The pass key is 1", max_tokens=4000, stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 30
    while requests.get(server + "/health", timeout=10).json()["running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert requests.get(server + "/health", timeout=10).json()["running"] == 0

    # Load: 16 streams of mixed lengths at once, /health polled throughout; every stream completes.
    health, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            health.append(requests.get(server + "/health", timeout=10).status_code)
            time.sleep(0.2)

    def one(i):
        n = 100 + 97 * i
        chunks = list(client.completions.create(model=MODEL, prompt="z" * n, max_tokens=16 + i, temperature=0.7,
                                                seed=i, stream=True, stream_options={"include_usage": True}))
        return chunks[-1].usage.completion_tokens, [c.choices[0].finish_reason for c in chunks if c.choices][-1]

    watcher = threading.Thread(target=poll)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            done = list(pool.map(one, range(16)))
    finally:
        stop.set()
        watcher.join(timeout=30)
    assert done == [(16 + i, "length") for i in range(16)]
    assert health and set(health) == {200}
    assert _metric(server, "dsv41_compiles_after_warmup_total") == 0
    assert _metric(server, "dsv41_request_errors_total") == 0


def test_a_server_on_a_mesh_of_eight_devices_answers_like_one_device(tmp_path_factory, client):
    """`--mesh data=2,expert=4` on 8 simulated CPU devices: the sharded steps (rows over data × expert,
    experts over expert) serve the same passkey prompts; greedy answers equal the one-device server's."""
    import openai

    prompts, answers = _prompts(1024, 8, seed=41)
    ask = lambda c, p: c.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0).choices[0].text
    one_device = [ask(client, p) for p in prompts]
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    # One prefill width (the prompts fit one chunk of 1,024): each sharded program costs a compile.
    with running_server(tmp_path_factory, "--slots", "8", "--mesh", "data=2,expert=4", "--no-prefix-cache",
                        "--prefill-chunks", "1024", env={"XLA_FLAGS": flags}) as base:
        mesh = openai.OpenAI(base_url=base + "/v1", api_key=KEYS[0], max_retries=0, timeout=300)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            on_mesh = list(pool.map(lambda p: ask(mesh, p), prompts))
        assert _metric(base, "dsv41_compiles_after_warmup_total") == 0
    assert on_mesh == one_device
    assert sum(a == b for a, b in zip(on_mesh, answers)) >= 7


def test_the_readme_serve_blocks_run_as_written(tmp_path):
    """The README's `dsv41 serve` line, as written (its defaults: port 8000, 8 slots of the context window, the
    prefix cache in `$DSV41_PREFIX_CACHE`, here a temporary directory), then its `openai` snippet, as written,
    in another process. Were port 8000 taken on this machine, both would get another port instead (the one
    change), so that the suite does not depend on it. The snippet's answer is the key in its prompt."""
    import socket

    import readme

    command = readme.block("Serve (OpenAI-compatible)", "bash")
    snippet = readme.block("Serve (OpenAI-compatible)", "python")
    port = 8000
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            port = serving.free_port()
            command += f" --port {port}"
            snippet = snippet.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    work = readme.workdir(tmp_path)
    with serving.serving(["bash", "-c", f"exec {command}"], port, tmp_path / "server.log", env=readme.env(work),
                         cwd=work):
        out = readme.run_python(snippet, work, timeout=300)
    assert out.returncode == 0, readme.failure(out)
    (prompt,), (answer,) = passkey.examples(context=2048, depth=0.5, n=1)
    assert out.stdout.split() == [answer.decode(), answer.decode(), str(len(prompt))]
    assert "# 08855 08855 2043" in snippet   # what the README says it prints
    log = (tmp_path / "server.log").read_text()
    assert f"serving dsv41-passkey on http://127.0.0.1:{port}/v1 (8 slots of 16384 tokens" in log
