"""The OpenAI-compatible server, driven by the real `openai` client against `python -m s3d_jax.serve`
started as a subprocess on a tiny random model that has the bundled tokenizer."""

import concurrent.futures
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from reference import drafting_chat_model as chat_model
from reference import users_env

import s3d_jax
from s3d_jax import checkpoint
from s3d_jax.serve.app import create_app
from s3d_jax.serve.engine import Engine
from s3d_jax.serve.lane import Lane

pytestmark = pytest.mark.needs("bundled_model")  # its tokenizer and chat template
NAME = "tiny"
SLOTS, QUEUE, MAX_LEN = 3, 4, 256
QUESTIONS = [f"Question {i}: what is {i} plus {i}?" for i in range(7)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model = chat_model()
    return checkpoint.save(tmp_path_factory.mktemp("served") / NAME, model.params, model.config, model.tokenizer)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir, *extra, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """The server on a free port (the bundled model where `model_dir` is None), once it answers /health;
    `env` adds to its environment."""
    port = free_port()
    model = ["--model", str(model_dir)] if model_dir else []
    command = [sys.executable, "-m", "s3d_jax.serve", *model, "--port", str(port), "--max-batch", str(SLOTS),
               "--max-queue", str(QUEUE), "--max-len", str(MAX_LEN), "--max-new-tokens", "24", *extra]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600  # compiling every batch and cache size, on a machine that other tests share
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server exited with {server.returncode}:\n{server.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return server, url
        except httpx.TransportError:
            time.sleep(0.5)
    server.kill()
    raise AssertionError("the server did not come up")


@pytest.fixture(scope="module")
def served(model_dir):
    process, url = start_server(model_dir)
    yield process, url
    process.send_signal(signal.SIGTERM)
    process.wait(60)


@pytest.fixture(scope="module")
def server(served):
    return served[1]


def client(url, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=retries, timeout=120)


def streamed_text(stream) -> tuple[str, str]:
    text, finish = "", None
    for chunk in stream:
        choice = chunk.choices[0]
        text += (choice.delta.content or "") if hasattr(choice, "delta") else choice.text
        finish = choice.finish_reason or finish
    return text, finish


def metrics(url) -> dict:
    return metrics_from(httpx.get(f"{url}/metrics").text)


def test_chat_and_completions_streamed_equal_whole_and_plain_greedy(server):
    c, model = client(server), chat_model()
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    whole = c.chat.completions.create(model=NAME, messages=messages, max_tokens=20)
    text, finish = streamed_text(c.chat.completions.create(model=NAME, messages=messages, max_tokens=20, stream=True))
    assert text == whole.choices[0].message.content and finish == whole.choices[0].finish_reason
    plain = s3d_jax.decode(model, messages, method="ar", max_new_tokens=20)
    assert whole.choices[0].message.content == plain.text  # S3D in a batch of slots decodes what plain greedy does alone
    assert whole.usage.completion_tokens == len(plain.tokens) and whole.usage.prompt_tokens > 0

    done = c.completions.create(model=NAME, prompt=QUESTIONS[1], max_tokens=12)
    text, finish = streamed_text(c.completions.create(model=NAME, prompt=QUESTIONS[1], max_tokens=12, stream=True))
    assert text == done.choices[0].text and finish == done.choices[0].finish_reason == "length"
    assert done.choices[0].text == s3d_jax.decode(model, QUESTIONS[1], method="ar", max_new_tokens=12).text
    assert [m.id for m in c.models.list()] == [NAME]


def test_stream_ends_with_usage_and_done(server):
    body = {"model": NAME, "prompt": QUESTIONS[2], "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"usage"' in events[-2] and '"completion_tokens": 5' in events[-2]
    # How its iterations went: the first token comes from the prefill, the other 4 from drafted iterations or plain steps.
    counts = json.loads(events[-2][len("data: "):])["usage"]["s3d"]
    assert 1 <= counts["drafted_iterations"] + counts["plain_iterations"] <= 4, counts
    lanes = metrics(server)
    assert lanes[("s3d_lane_rows", (("lane", "temperature=0,top_p=1"),))] >= 1
    in_force = [labels for (name, labels), value in lanes.items() if name == "s3d_lane_plan" and value == 1]
    assert len(in_force) == 1 and dict(in_force[0])["plan"].startswith("s3d"), in_force


def test_concurrent_greedy_requests_each_equal_the_request_alone(server):
    c = client(server, retries=20)  # 7 requests, 3 slots and 4 places in the queue: one may be told to retry
    alone = [c.completions.create(model=NAME, prompt=q, max_tokens=8 + 2 * i).choices[0].text for i, q in enumerate(QUESTIONS)]
    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:  # more requests than slots: some wait, then join
        together = list(pool.map(lambda iq: c.completions.create(model=NAME, prompt=iq[1], max_tokens=8 + 2 * iq[0]).choices[0].text,
                                 enumerate(QUESTIONS)))
    assert together == alone


def test_a_seeded_sampled_request_alone_is_reproducible(server):
    c = client(server)

    def sample(seed):
        return c.completions.create(model=NAME, prompt=QUESTIONS[5], max_tokens=16, temperature=0.9, top_p=0.95, seed=seed).choices[0].text

    first = sample(7)
    assert sample(7) == first and sample(8) != first  # its own lane, reseeded from the request's seed


def test_stop_strings_end_the_reply_before_them(server):
    c = client(server)
    full = c.completions.create(model=NAME, prompt=QUESTIONS[3], max_tokens=16).choices[0].text
    stop = full[5:8]
    cut = c.completions.create(model=NAME, prompt=QUESTIONS[3], max_tokens=16, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    text, finish = streamed_text(c.completions.create(model=NAME, prompt=QUESTIONS[3], max_tokens=16, stop=stop, stream=True))
    assert (text, finish) == (cut.choices[0].text, "stop")


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
    before = metrics(server).get(("s3d_requests_total", (("outcome", "cancelled"),)), 0)
    body = {"model": NAME, "prompt": QUESTIONS[4], "max_tokens": MAX_LEN // 2, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as response:
        next(response.iter_lines())  # one event, then the client goes away
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = metrics(server)
        if now.get(("s3d_requests_total", (("outcome", "cancelled"),)), 0) > before and now[("s3d_batch_occupancy", ())] == 0:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"the slot was not freed: {now}")
    assert client(server).completions.create(model=NAME, prompt=QUESTIONS[4], max_tokens=4).choices[0].finish_reason == "length"


@pytest.mark.parametrize(("body", "status", "param", "words"), [
    ({"model": NAME}, 400, "messages", "Field required"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}, 400, "max_tokens", "integer"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "temperature": 3}, 400, "temperature", "less than or equal"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n", "less than or equal"),
    ({"model": NAME, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", "'user'"),
    ({"model": NAME, "messages": []}, 400, "messages", "at least 1"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_LEN}, 400, "max_tokens",
     f"context window is {MAX_LEN} tokens"),
    ({"model": NAME, "messages": [{"role": "user", "content": "word " * MAX_LEN}]}, 400, "messages", "the prompt has"),
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model", "does not exist"),
])
def test_bad_requests_get_openai_error_bodies(server, body, status, param, words):
    response = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    error = response.json()["error"]
    assert response.status_code == status and error["param"] == param and words in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}


def test_malformed_json_and_the_client_s_own_errors(server):
    response = httpx.post(f"{server}/v1/completions", content=b'{"model": "tiny", "prompt": ', headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client(server).completions.create(model="other", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="context_length_exceeded|context window"):
        client(server).completions.create(model=NAME, prompt="word " * MAX_LEN)


def test_a_full_queue_refuses_with_retry_after_and_loses_nothing(server):
    prompts = [QUESTIONS[i % len(QUESTIONS)] for i in range(24)]  # 24 clients against 3 slots and 4 places in the queue
    refused, refused_before = [], metrics(server).get(("s3d_requests_total", (("outcome", "refused"),)), 0)

    def ask(prompt):
        for _ in range(200):
            response = httpx.post(f"{server}/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 16}, timeout=120)
            if response.status_code != 429:
                return response.json()["choices"][0]["text"]
            refused.append(response.headers["retry-after"])
            time.sleep(0.05)
        raise AssertionError("never admitted")

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, prompts))
    alone = {q: client(server).completions.create(model=NAME, prompt=q, max_tokens=16).choices[0].text for q in set(prompts)}
    assert refused and set(refused) == {"1"}
    assert answers == [alone[q] for q in prompts]  # every request answered, each as it would be alone
    assert metrics(server)[("s3d_requests_total", (("outcome", "refused"),))] == refused_before + len(refused)


def test_sigterm_finishes_the_requests_in_flight_then_exits(model_dir):
    process, url = start_server(model_dir)
    c = client(url)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(lambda q: streamed_text(c.completions.create(model=NAME, prompt=q, max_tokens=64, stream=True)), q)
                   for q in QUESTIONS[:2]]
        time.sleep(1.5)  # both requests are decoding
        process.send_signal(signal.SIGTERM)
        results = [s.result(timeout=120) for s in streams]
    assert all(finish in ("length", "stop") for _, finish in results)
    assert process.wait(60) == 0
    with pytest.raises(httpx.TransportError):  # it took no more requests
        httpx.get(f"{url}/health", timeout=2)


@pytest.mark.parametrize(("flags", "words"), [
    (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--mesh", "model=64"], "needs 64 devices"),
    (["--max-len", "4096"], "exceeds the model's context of 512"),
    (["--temperature", "-1"], "temperature"),
])
def test_the_command_line_refuses_bad_settings(model_dir, flags, words, capsys, monkeypatch):
    import uvicorn

    from s3d_jax.serve.__main__ import main

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("the server started"))
    assert main(["--model", str(model_dir), *flags]) == 2
    assert words in capsys.readouterr().err


def test_an_engine_failure_fails_its_requests_and_the_server_goes_on(monkeypatch):
    from fastapi.testclient import TestClient

    engine = Engine(chat_model(), slots=2, max_len=128).start()
    original, failures = Lane.advance, []

    def fail_once(self, iterations):
        if not failures:
            failures.append(1)
            raise RuntimeError("injected device fault")
        return original(self, iterations)

    monkeypatch.setattr(Lane, "advance", fail_once)
    with TestClient(create_app(engine, NAME)) as http:
        body = {"model": NAME, "prompt": QUESTIONS[0], "max_tokens": 8}
        failed = http.post("/v1/completions", json=body)
        assert failed.status_code == 500 and "injected device fault" in failed.json()["error"]["message"]
        ok = http.post("/v1/completions", json=body)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
        assert ok.json()["choices"][0]["text"] == s3d_jax.decode(engine.model, QUESTIONS[0], method="ar", max_new_tokens=8).text
        counts = metrics_from(http.get("/metrics").text)
    assert counts[("s3d_requests_total", (("outcome", "error"),))] == 1 and counts[("s3d_requests_total", (("outcome", "ok"),))] == 1
    assert requests_counted(counts) == 2  # the failed request once, as an error, not also as invalid
    assert np.isclose(counts[("s3d_batch_occupancy", ())], 0.0)


def test_a_full_queue_refuses_before_it_tokenizes(monkeypatch):
    """Clients retrying a full server cost it no tokenization (which shares the cores with decoding):
    the 429 comes before the prompt is read."""
    from fastapi.testclient import TestClient

    from s3d_jax import api

    engine = Engine(chat_model(), slots=1, max_len=128, max_queue=0).start(warm=False)
    monkeypatch.setattr(api, "encode", lambda *args, **kwargs: pytest.fail("a prompt was tokenized for a full queue"))
    with TestClient(create_app(engine, NAME)) as http:
        refused = http.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "Hi"}]})
        counts = metrics_from(http.get("/metrics").text)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
    assert refused.json()["error"]["code"] == "queue_full"
    assert counts[("s3d_requests_total", (("outcome", "refused"),))] == 1


def metrics_from(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text) for s in family.samples}


def requests_counted(counts: dict) -> int:
    return sum(value for (name, _), value in counts.items() if name == "s3d_requests_total")


# ------------------------------------------------------------------ hostile requests


def rss_mib(process: subprocess.Popen) -> float:
    status = open(f"/proc/{process.pid}/status").read()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
def test_a_huge_body_is_refused_with_413_unread_while_health_answers(served, chunked):
    process, url = served
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"hello " * 8738133 + b'"}]}'  # 50 MB
    before = rss_mib(process)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        content = (body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20)) if chunked else body
        refused = pool.submit(httpx.post, f"{url}/v1/chat/completions", content=content, timeout=30,
                              headers={"content-type": "application/json"})
        health = [httpx.get(f"{url}/health", timeout=1).status_code for _ in range(3)]  # each within a second
        response = refused.result()
        seconds = time.monotonic() - start
    error = response.json()["error"]
    assert response.status_code == 413 and error["code"] == "request_too_large" and "--max-request-bytes" in error["message"]
    assert seconds < 2 and health == [200] * 3
    assert rss_mib(process) - before < 100


def test_a_prompt_too_long_for_the_window_is_refused_before_it_is_tokenized(server):
    response = httpx.post(f"{server}/v1/completions", json={"model": NAME, "prompt": "hello " * 100_000}, timeout=30)
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded"
    assert "the prompt's 600000 characters are more than that many tokens can hold" in error["message"]


def test_any_integer_seed_is_taken_modulo_2_to_the_32(server):
    def sample(seed):
        body = {"model": NAME, "prompt": QUESTIONS[6], "max_tokens": 8, "temperature": 0.9, "seed": seed}
        response = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    assert sample(2**64 + 7) == sample(7) == sample(2**32 + 7)
    assert sample(-1) == sample(2**32 - 1)
    for seed in (2**63, 2**70):
        sample(seed)
    for bad in ("7", 7.5, True):
        response = httpx.post(f"{server}/v1/completions", json={"model": NAME, "prompt": "hi", "seed": bad}, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == "seed"


def test_every_request_is_counted_once_under_one_outcome(server):
    before = requests_counted(metrics(server))
    post = functools.partial(httpx.post, timeout=60)
    chat = f"{server}/v1/chat/completions"
    hi = [{"role": "user", "content": "hi"}]
    sent = [
        post(chat, json={"model": NAME, "messages": hi, "max_tokens": 4}),  # ok
        post(chat, json={"model": NAME, "messages": hi, "max_tokens": 4, "temperature": 0.5, "seed": 2**70}),  # ok, sampled
        post(chat, json={"model": NAME, "messages": hi, "max_tokens": 4, "stream": True}),  # ok, streamed
        post(chat, content=b'{"model": ', headers={"content-type": "application/json"}),  # not JSON
        post(chat, json={"model": NAME, "messages": hi, "seed": "7"}),  # a bad type
        post(chat, json={"model": "gpt-4", "messages": hi}),  # no such model
        post(chat, json={"model": NAME, "messages": [{"role": "user", "content": "word " * MAX_LEN}]}),  # over the window
        post(chat, content=b"{" + b" " * (8 << 20) + b"}", headers={"content-type": "application/json"}),  # over the body limit
    ]
    assert [r.status_code for r in sent] == [200, 200, 200, 400, 400, 404, 400, 413]
    assert requests_counted(metrics(server)) - before == len(sent)



@pytest.mark.slow
def test_bundled_model_served_concurrently_equals_plain_greedy_alone():
    """SmolLM2 with its drafter, four chats at once in four slots: each reply is plain greedy decoding's
    for that chat alone, token for token. At S3D's fixed defaults, so that every batch size drafts (a
    calibration per batch size would take minutes here and may choose plain steps; test_calibrate
    covers it)."""
    chats = ["What is the capital of France?", "Write a Python function that returns the n-th Fibonacci number.",
             "Give me three tips for sleeping better.", "Explain what a hash table is, briefly."]
    process, url = start_server(None, "--max-batch", "4", "--max-len", "128", env=users_env(S3D_JAX_CALIBRATE="0"))  # fits each chat, reply
    try:
        c, name = client(url), client(url).models.list().data[0].id

        def ask(chat):
            reply = c.chat.completions.create(model=name, messages=[{"role": "user", "content": chat}], max_tokens=48)
            return reply.choices[0].message.content

        with concurrent.futures.ThreadPoolExecutor(len(chats)) as pool:
            served = list(pool.map(ask, chats))
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    plain = s3d_jax.decode(s3d_jax.load(), chats, chat=True, method="ar", max_new_tokens=48)
    assert served == plain.text
