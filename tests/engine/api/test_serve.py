"""`moeferry serve`: real server processes with the demo model, driven by the official `openai` client.

One server per configuration for the whole module (the main one: defaults, queue size 1; one
with an API key; a short-lived one on 0.0.0.0 with --no-auth). Texts are checked against the
engine run in this process with the same prompt, template, sampling and seed.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from moeferry.engine.api.openai_api import ApiError, StopMatcher, parse_request
from tests.conftest import PYTHONPATH, ROOT

LONG_PROMPT = "def f(x):"  # the demo rambles on after this without an end-of-text token
QUESTION = "What is a list in Python?"


def repo_files() -> dict[str, int]:
    """Every file of the repository but git's and Python's caches, with its mtime (ns)."""
    skip = {".git", "__pycache__", ".pytest_cache", ".ruff_cache", ".venv"}
    return {str(p.relative_to(ROOT)): p.stat().st_mtime_ns for p in ROOT.rglob("*")
            if p.is_file() and not skip & set(p.relative_to(ROOT).parts)}


class Server:
    """`python -m moeferry.engine.cli serve demo ...` with its stderr collected line by line."""

    def __init__(self, home: Path, *args: str, env: dict | None = None, device: str = "cpu"):
        home.mkdir(parents=True, exist_ok=True)
        self.home = home
        self.repo_before = repo_files()
        full_env = {k: v for k, v in os.environ.items() if k != "MOEFERRY_API_KEY"}
        full_env.update(PYTHONPATH=PYTHONPATH, HOME=str(home), TMPDIR=str(home), XDG_CACHE_HOME=str(home / ".cache"),
                        HF_HOME=str(home / ".hf"), PYTHONDONTWRITEBYTECODE="1", HF_HUB_OFFLINE="1", **(env or {}))
        self.proc = subprocess.Popen([sys.executable, "-m", "moeferry.engine.cli", "serve", "demo", "--device", device,
                                      "--port", "0", *args], cwd=str(ROOT), env=full_env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        line = self.wait_for(r"serving '.*' at http://", 120)
        self.url = re.search(r"(http://\S+/v1)", line).group(1)
        self.port = int(re.search(r":(\d+)/v1", self.url).group(1))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float = 30) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            found = [ln for ln in self.lines if re.search(pattern, ln)]
            if found:
                return found[-1]
            if self.proc.poll() is not None and not found:
                time.sleep(0.2)
                raise AssertionError(f"the server exited ({self.proc.returncode}): {self.lines}")
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} within {timeout} s: {self.lines}")

    def client(self, key: str = "unused", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key, **{"timeout": 60, **kw})

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve") / "home", "--queue-size", "1")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client(max_retries=0)


@pytest.fixture(scope="module")
def reference():
    """The demo engine in this process: what the server should say."""
    from moeferry.engine.runtime.generate import SamplingSettings, load_engine

    engine = load_engine("demo", device="cpu")

    def reply(prompt, chat: bool, max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
              seed: int | None = None) -> str:
        settings = SamplingSettings(temperature, top_p, max_tokens, seed)
        return "".join(p.text for p in engine.stream(prompt, settings, chat=chat))
    return reply


def raw(method: str, url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body) of one plain HTTP request."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat_messages(text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": text}]


def streamed_text(stream, chat: bool = True) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join((c.choices[0].delta.content or "") if chat else c.choices[0].text
                   for c in chunks if c.choices)
    return text, chunks


# ---------------------------------------------------------------------------------------------
# Pure parts (no server)


def test_stop_matcher_cuts_across_pieces_and_holds_back_partial_matches():
    m = StopMatcher(["END", "\n\n"])
    assert m.feed("hello E") == ("hello ", False)  # "E" may start "END": held back
    assert m.feed("x") == ("Ex", False)            # it did not
    assert m.feed("fin\n") == ("fin", False)
    assert m.feed("\nmore") == ("", True)          # "\n\n" across two pieces
    m = StopMatcher(["stop"])
    assert m.feed("a st") == ("a ", False)
    assert m.feed("ill") == ("still", False)
    assert m.flush() == ""
    m = StopMatcher(["ab", "b"])
    assert m.feed("xab") == ("x", True)            # the earliest match wins


def searched_afresh(held: str, piece: str, stops: list[str]) -> tuple[str, str, bool]:
    """(text to send, text to hold, stopped) by searching held + piece from scratch: slow, plainly right."""
    text = held + piece
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    if found:
        return text[:min(found)], "", True
    keep = max((k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])),
               default=0)
    return text[:len(text) - keep], text[len(text) - keep:], False


def test_stop_matcher_agrees_with_a_search_from_scratch():
    import random

    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        m, held = StopMatcher(stops), ""
        while True:
            piece = "".join(rng.choices("abc", k=rng.randint(1, 3)))
            sent, held, stopped = searched_afresh(held, piece, stops)
            assert m.feed(piece) == (sent, stopped) and m.held == held, (stops, piece)
            if stopped or rng.random() < 0.1:
                break


def test_stop_matcher_is_quick_when_a_long_stop_keeps_matching():
    # a client that knows the reply (temperature 0) can send it as a stop with one more character: all the
    # reply is held back; searching it afresh for each piece took 6 s here, 30 s for 32,000 characters
    reply = "".join(f"line {i}: x = x + {i}\n" for i in range(800))[:16_000]
    m = StopMatcher([reply + "!", "never"])
    t0 = time.monotonic()
    assert [m.feed(reply[i:i + 4]) for i in range(0, len(reply), 4)] == [("", False)] * (len(reply) // 4)
    assert m.flush() == reply and time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("body, param, status", [
    (b"{not json", None, 400),
    (b"[1, 2]", None, 400),
    (json.dumps({"model": "demo", "messages": "hi"}).encode(), "messages", 400),
    (json.dumps({"model": "demo", "messages": [{"role": "robot", "content": "x"}]}).encode(), "messages[0].role", 400),
    (json.dumps({"model": "demo", "messages": [{"role": "user", "content": 3}]}).encode(), "messages[0].content", 400),
    (json.dumps({"model": "demo", "messages": chat_messages(), "temperature": "hot"}).encode(), "temperature", 400),
    (json.dumps({"model": "demo", "messages": chat_messages(), "stream": 1}).encode(), "stream", 400),
    (json.dumps({"model": "demo", "messages": chat_messages(), "max_tokens": True}).encode(), "max_tokens", 400),
    (json.dumps({"model": "demo", "messages": chat_messages(), "max_tokens": 1024}).encode(), "max_tokens", 400),
    (json.dumps({"model": "demo", "messages": chat_messages(), "top_p": 0}).encode(), "top_p", 400),
    (json.dumps({"model": "demo", "messages": chat_messages(), "stop": ["a"] * 5}).encode(), "stop", 400),
    (json.dumps({"model": "demo", "messages": chat_messages(), "n": 2}).encode(), "n", 400),
    (json.dumps({"model": "other", "messages": chat_messages()}).encode(), "model", 404),
    (b'{"model": "demo", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, 400),  # nested too deep
    (json.dumps({"model": "demo", "messages": chat_messages(), "seed": 10**30}).encode(), "seed", 400),
    (json.dumps({"model": "demo", "messages": chat_messages(), "seed": -2}).encode(), "seed", 400),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "a \\ud800 b"}]}', "messages[0].content", 400),
    (b'{"model": "demo", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages[0].content", 400),
    (json.dumps({"model": "demo", "messages": chat_messages(), "temperature": 10**400}).encode(), "temperature", 400),
    (json.dumps({"model": "demo", "messages": chat_messages(), "top_p": -10**400}).encode(), "top_p", 400),
])
def test_parse_request_refuses_bad_fields_naming_them(body, param, status):
    with pytest.raises(ApiError) as e:
        parse_request(body, True, "demo", 1024)
    assert (e.value.param, e.value.status) == (param, status)
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("field,value", [("model", "m" * 100_000), ("max_tokens", 10**4000), ("seed", 10**4000),
                                         ("temperature", "t" * 100_000)])
def test_an_error_repeats_at_most_a_short_piece_of_what_the_client_sent(field, value):
    body = {"model": "demo", "messages": chat_messages()} | {field: value}
    with pytest.raises(ApiError) as e:
        parse_request(json.dumps(body).encode(), True, "demo", 1024)
    assert e.value.param == field and len(e.value.body()["error"]["message"]) < 200


def test_a_lone_surrogate_in_a_prompt_is_refused_not_a_server_error():
    # JSON's \ud800 escape decodes to a str the tokenizer cannot take: it answered 500 (TypeError)
    with pytest.raises(ApiError) as e:
        parse_request(b'{"model": "demo", "prompt": "x\\ud800"}', False, "demo", 1024)
    assert (e.value.param, e.value.status) == ("prompt", 400)
    assert parse_request(b'{"model": "demo", "prompt": "\\ud83d\\ude00"}', False, "demo", 1024).prompt == "\U0001f600"


def test_parse_request_reads_the_fields_it_knows_and_ignores_others():
    body = {"model": "demo", "messages": [{"role": "developer", "content": [{"type": "text", "text": "Be "},
                                                                           {"type": "text", "text": "brief."}]},
                                          {"role": "user", "content": "hi"}],
            "max_completion_tokens": 7, "temperature": 1, "top_p": 0.5, "seed": 3, "stop": "\n",
            "stream": True, "stream_options": {"include_usage": True}, "presence_penalty": 0, "user": "me"}
    req = parse_request(json.dumps(body).encode(), True, "demo", 1024)
    assert req.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (req.max_tokens, req.temperature, req.top_p, req.seed, req.stop) == (7, 1.0, 0.5, 3, ["\n"])
    assert req.stream and req.include_usage
    body["seed"] = -1  # llama.cpp's "no seed"
    assert parse_request(json.dumps(body).encode(), True, "demo", 1024).seed is None


def test_a_client_that_left_the_queue_gives_its_place_up():
    from moeferry.engine.api.serve import Job, Scheduler

    release, started = threading.Event(), threading.Event()

    def runner(job):
        started.set()
        release.wait(10)

    def new_job():
        return Job(parse_request(b'{"model": "m", "prompt": "x"}', False, "m", 64), emit=lambda event: None)

    scheduler = Scheduler(runner, max_waiting=1)
    try:
        assert scheduler.submit(new_job()) and started.wait(10)  # runs
        gone = new_job()
        assert scheduler.submit(gone) and not scheduler.submit(new_job())  # waits; the queue is full
        gone.cancel.set()  # its client disconnected
        assert scheduler.submit(new_job())
    finally:
        release.set()
        scheduler.close()


# Mixtral-8x7B-Instruct-v0.1's original chat template: user/assistant turns only
MIXTRAL_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
                    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
                    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
                    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
                    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
                    "roles are supported!') }}{% endif %}{% endfor %}")


def test_a_connection_that_trickles_its_headers_is_closed_and_others_are_served():
    """slowloris: an unfinished request holds its socket only until the idle limit; a whole
    request on another connection is answered meanwhile and after."""
    from aiohttp import web

    from moeferry.engine.api.serve import ApiServer

    app = web.Application()
    app.router.add_get("/ok", lambda request: web.json_response({"ok": True}))
    server = ApiServer(app, "127.0.0.1", 0, idle_s=0.5)
    port = server.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
            slow.sendall(b"GET /ok HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
            assert raw("GET", f"http://127.0.0.1:{port}/ok") == (200, {"ok": True})
            start = time.monotonic()
            while time.monotonic() - start < 0.45:
                slow.sendall(b"X-Slow: 1\r\n")  # a header now and then: does not keep it open
                time.sleep(0.1)
            assert slow.recv(1024) == b""  # closed by the server, without a reply
            assert time.monotonic() - start < 5
        assert raw("GET", f"http://127.0.0.1:{port}/ok") == (200, {"ok": True})
    finally:
        server.stop()


def test_a_template_without_a_system_role_gets_the_system_text_in_the_first_message(tmp_path):
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from moeferry.engine.api.serve import encode_request
    from moeferry.engine.runtime.generate import Engine
    from tests.conftest import make_tokenizer

    make_tokenizer(120, tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    tok.chat_template = MIXTRAL_TEMPLATE
    engine = SimpleNamespace(tokenizer=tok)
    engine.encode = lambda prompt, chat: Engine.encode(engine, prompt, chat)
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    folded = [{"role": "user", "content": "Be brief.\n\nHi?"}]
    req = parse_request(json.dumps({"model": "m", "messages": system}).encode(), True, "m", 512)
    assert encode_request(engine, req) == engine.encode(folded, True)
    bad = parse_request(json.dumps({"model": "m", "messages": [{"role": "assistant", "content": "x"}]}).encode(),
                        True, "m", 512)
    with pytest.raises(ApiError) as e:
        encode_request(engine, bad)
    assert (e.value.status, e.value.param) == (400, "messages") and "alternate" in e.value.message


# ---------------------------------------------------------------------------------------------
# The main server


@pytest.mark.slow
def test_binds_loopback_by_default_and_lists_the_model(server, client):
    assert server.url.startswith("http://127.0.0.1:")
    assert [m.id for m in client.models.list()] == ["demo"]
    assert client.models.retrieve("demo").owned_by == "moeferry"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


@pytest.mark.slow
def test_chat_streamed_equals_whole_and_the_engine(client, reference):
    kw = {"model": "demo", "messages": chat_messages(), "temperature": 0.9, "top_p": 0.95, "seed": 11,
          "max_tokens": 40}
    whole = client.chat.completions.create(**kw)
    text, chunks = streamed_text(client.chat.completions.create(**kw, stream=True,
                                                                stream_options={"include_usage": True}))
    assert text == whole.choices[0].message.content == reference(chat_messages(), True, 40, 0.9, 0.95, 11)
    assert text
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    extra = whole.model_extra["moeferry"]
    assert extra["tokens_per_s"] > 0 and 0 <= extra["cache_hit_rate"] <= 1 and extra["bytes_h2d"] >= 0


@pytest.mark.slow
def test_completions_streamed_equals_whole_and_the_engine(client, reference):
    kw = {"model": "demo", "prompt": LONG_PROMPT, "temperature": 0.0, "max_tokens": 24}
    whole = client.completions.create(**kw)
    text, _ = streamed_text(client.completions.create(**kw, stream=True), chat=False)
    assert text == whole.choices[0].text == reference(LONG_PROMPT, False, 24)
    assert whole.object == "text_completion"
    assert (whole.choices[0].finish_reason, whole.usage.completion_tokens) == ("length", 24)


@pytest.mark.slow
def test_a_seed_reproduces_a_reply_and_another_seed_changes_it(client):
    def ask(seed):
        return client.completions.create(model="demo", prompt="A dictionary", temperature=1.0, seed=seed,
                                         max_tokens=30).choices[0].text
    first = ask(5)
    assert ask(5) == first
    assert ask(6) != first


@pytest.mark.slow
def test_stop_sequences_cut_the_reply_streamed_or_not(client):
    kw = {"model": "demo", "prompt": LONG_PROMPT, "temperature": 0.0, "max_tokens": 60}
    full = client.completions.create(**kw).choices[0].text
    stop = full[20:24]
    expected = full[:full.find(stop)]
    cut = client.completions.create(**kw, stop=[stop, "never there"])
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (expected, "stop")
    text, chunks = streamed_text(client.completions.create(**kw, stop=stop, stream=True), chat=False)
    assert text == expected and chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_a_conversation_that_goes_on_reuses_the_cached_prompt(client):
    first = client.chat.completions.create(model="demo", messages=chat_messages(), temperature=0, max_tokens=30)
    history = chat_messages() + [{"role": "assistant", "content": first.choices[0].message.content},
                                 {"role": "user", "content": "And a tuple?"}]
    second = client.chat.completions.create(model="demo", messages=history, temperature=0, max_tokens=10)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens  # at least the whole first prompt was not computed again
    assert second.model_extra["moeferry"]["reused_prompt_tokens"] == cached
    fresh = client.chat.completions.create(model="demo", messages=chat_messages("Explain sets."),
                                           temperature=0, max_tokens=5)
    assert fresh.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens // 2


@pytest.mark.slow
def test_a_client_leaving_mid_stream_stops_its_generation(server, client):
    stream = client.completions.create(model="demo", prompt=LONG_PROMPT, temperature=0, max_tokens=900, stream=True)
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    stream.close()
    t0 = time.monotonic()
    reply = client.chat.completions.create(model="demo", messages=chat_messages(), temperature=0, max_tokens=8)
    assert reply.choices[0].message.content
    assert time.monotonic() - t0 < 6  # 900 tokens take ~8 s on this machine; the cancelled run did not go on
    line = server.wait_for(r"completion: .* cancelled")
    assert int(re.search(r"(\d+) new", line).group(1)) < 100


@pytest.mark.slow
def test_a_client_leaving_before_a_whole_reply_stops_its_generation(server):
    before = len([ln for ln in server.lines if "cancelled" in ln])
    impatient = server.client(max_retries=0, timeout=0.6)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model="demo", prompt=LONG_PROMPT, temperature=0, max_tokens=900)
    end = time.monotonic() + 30  # a loaded 2-core CI box may take seconds to log it
    while len([ln for ln in server.lines if "cancelled" in ln]) == before and time.monotonic() < end:
        time.sleep(0.05)
    line = [ln for ln in server.lines if "cancelled" in ln][before:]  # this test's, not an earlier one's
    assert line and int(re.search(r"(\d+) new", line[0]).group(1)) < 300  # ~60 at 0.6 s; 900 if not stopped


@pytest.mark.slow
def test_two_clients_are_served_one_after_the_other_in_order(client, reference):
    times: dict[str, list[float]] = {"a": [], "b": []}
    first_chunk = threading.Event()
    results = {}

    def long_one():
        stream = client.completions.create(model="demo", prompt=LONG_PROMPT, temperature=0, max_tokens=120,
                                           stream=True)
        for _chunk in stream:
            times["a"].append(time.monotonic())
            first_chunk.set()

    def short_one():
        results["b"] = client.chat.completions.create(model="demo", messages=chat_messages(), temperature=0,
                                                      max_tokens=12).choices[0].message.content
        times["b"].append(time.monotonic())

    a = threading.Thread(target=long_one)
    a.start()
    assert first_chunk.wait(30)
    b = threading.Thread(target=short_one)
    b.start()
    a.join(60)
    b.join(60)
    assert len(times["a"]) > 100 and times["b"]
    assert times["b"][0] > times["a"][-1]  # b waited for all of a
    assert results["b"] == reference(chat_messages(), True, 12)


@pytest.mark.slow
def test_a_full_queue_answers_429_with_retry_after(server, client):
    stream = client.completions.create(model="demo", prompt=LONG_PROMPT, temperature=0, max_tokens=900, stream=True)
    next(iter(stream))  # the first request is running
    waiting = {}
    b = threading.Thread(target=lambda: waiting.update(
        r=client.completions.create(model="demo", prompt="A list", temperature=0, max_tokens=4)))
    b.start()
    time.sleep(1.0)  # the second one waits in the queue (size 1)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="demo", prompt="A set", max_tokens=4)
    assert int(e.value.response.headers["Retry-After"]) >= 1
    assert e.value.body["type"] == "rate_limit_error"
    stream.close()
    b.join(30)
    assert waiting["r"].choices[0].text  # the waiting one is served once the first has gone


@pytest.mark.slow
def test_bad_requests_get_openai_error_objects(server, client):
    base = f"http://127.0.0.1:{server.port}/v1"
    cases = [
        ("POST", "/chat/completions", b"{oops", 400, None),
        ("POST", "/chat/completions", json.dumps({"model": "demo", "messages": chat_messages(),
                                                  "temperature": "hot"}).encode(), 400, "temperature"),
        ("POST", "/completions", json.dumps({"model": "demo", "prompt": "x", "max_tokens": 5000}).encode(),
         400, "max_tokens"),
        ("POST", "/completions", json.dumps({"model": "demo", "prompt": "word " * 300,
                                             "max_tokens": 900}).encode(), 400, "prompt"),
        ("POST", "/chat/completions", json.dumps({"model": "demo", "messages": chat_messages(),
                                                  "pad": "x" * (2 << 20)}).encode(), 413, None),
        ("GET", "/nowhere", b"", 404, None),
        ("GET", "/chat/completions", b"", 405, None),
    ]
    for method, path, body, status, param in cases:
        got, answer = raw(method, base + path, body if method == "POST" else None)
        assert got == status, (path, answer)
        err = answer["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
        assert "Traceback" not in err["message"]
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:  # not even HTTP
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n")
        assert sock.makefile("rb").readline().split()[1] == b"400"
    server.wait_for(r"Error handling request from .*: Invalid character in Content-Length", 10)  # one line
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=chat_messages())
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt="word " * 300, max_tokens=900)
    assert e.value.code == "context_length_exceeded"
    assert all("Traceback" not in line for line in server.lines)


@pytest.mark.slow
def test_the_server_wrote_no_files(server, client):
    client.chat.completions.create(model="demo", messages=chat_messages(), max_tokens=4)
    assert list(server.home.rglob("*")) == []  # its HOME, TMPDIR and caches
    assert repo_files() == server.repo_before  # nor the repository it runs in (the demo store included)


# ---------------------------------------------------------------------------------------------
# Keys and addresses


@pytest.mark.slow
def test_an_api_key_is_required_when_set_and_never_logged(tmp_path):
    key = "sk-local-4f9c2b7e"
    s = Server(tmp_path / "home", env={"MOEFERRY_API_KEY": key})
    try:
        assert "key required" in s.lines[-1]
        for wrong in ("unused", key + "x", key[:-1]):
            with pytest.raises(openai.AuthenticationError) as e:
                s.client(wrong, max_retries=0).models.list()
            assert e.value.code == "invalid_api_key"
        status, answer = raw("POST", f"http://127.0.0.1:{s.port}/v1/completions",
                             json.dumps({"model": "demo", "prompt": "x"}).encode())
        assert status == 401 and answer["error"]["type"] == "authentication_error"
        with socket.create_connection(("127.0.0.1", s.port), timeout=30) as sock:  # a key that is not UTF-8
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
                         b"Connection: close\r\n\r\n")
            assert sock.makefile("rb").readline().split()[1] == b"401"
        reply = s.client(key).chat.completions.create(model="demo", messages=chat_messages(), max_tokens=4)
        assert reply.choices[0].message.content is not None
    finally:
        s.stop()
    assert s.lines and all(key not in line for line in s.lines)


def test_a_key_that_is_not_utf8_is_wrong_not_a_server_error():
    from moeferry.engine.api.serve import key_matches

    header = b"Bearer \xff\xfe".decode("utf-8", "surrogateescape")  # as aiohttp hands such a header over
    assert not key_matches(header, "sk-local")
    assert key_matches(header, header.removeprefix("Bearer "))
    assert key_matches("bearer  sk-local ", "sk-local") and not key_matches("Basic sk-local", "sk-local")


def run_serve(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    env.pop("MOEFERRY_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "moeferry.engine.cli", "serve", "demo", *args], cwd=str(ROOT), env=env,
                          capture_output=True, text=True, timeout=60, check=False)


def test_another_address_needs_a_key_or_no_auth():
    r = run_serve("--host", "0.0.0.0")
    assert r.returncode == 2
    assert "--api-key" in r.stderr and "--no-auth" in r.stderr and "Traceback" not in r.stderr
    r = run_serve("--api-key", "k", "--no-auth")
    assert r.returncode == 2 and "exclude each other" in r.stderr


@pytest.mark.slow
def test_no_auth_on_another_address_warns_and_serves(tmp_path):
    s = Server(tmp_path / "home", "--host", "0.0.0.0", "--no-auth")
    try:
        assert s.wait_for(r"warning: .*no key")
        assert [m.id for m in s.client().models.list()] == ["demo"]
    finally:
        s.stop()


@pytest.mark.gpu
def test_serves_from_the_gpu_with_experts_ferried(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    s = Server(tmp_path / "home", "--cache-experts", "2", device="cuda")
    try:
        api = s.client(max_retries=0)
        kw = {"model": "demo", "messages": chat_messages(), "temperature": 0.8, "seed": 3, "max_tokens": 40}
        whole = api.chat.completions.create(**kw)
        text, _ = streamed_text(api.chat.completions.create(**kw, stream=True))
        assert text == whole.choices[0].message.content and text
        extra = whole.model_extra["moeferry"]
        assert extra["bytes_h2d"] > 0 and extra["cache_hit_rate"] < 1  # 2 of 8 experts cached per layer
    finally:
        s.stop()
