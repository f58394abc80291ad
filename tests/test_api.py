"""Issue 34, `veil api`: the official `openai` client against Veil's OpenAI-compatible API on
the built-in model (streamed and not, token-identical to `veil generate` for the same greedy
request), bad requests and a wrong token as OpenAI-style error JSON, two clients at once, the
queue's order, and the `veil api` command itself."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from app.api.backend import JobQueue, RunnerBackend
from app.api.errors import ApiError
from app.api.server import ApiServer
from app.cmd_generate import default_decoder
from engine.loading import DEFAULT_MODEL
from engine.sampling import SamplingParams
from engine.session import RunnerOptions, open_runner

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")

pytestmark = pytest.mark.slow
TOKEN = "test-token-34"
PROMPT = "Write one sentence about a lease."


class Recording(RunnerBackend):
    """Remembers how each reply ended."""

    finished: list[str]

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        result = super().generate(*args, **kwargs)
        self.finished.append(result.finish_reason)
        return result


@pytest.fixture(scope="module")
def api() -> Iterator[ApiServer]:
    """The built-in model split as `veil generate` splits it (2 layers here, the trunk in this
    process), served on a free port."""
    runner = open_runner(RunnerOptions(model=DEFAULT_MODEL, local_layers=2))
    backend = Recording(runner, default_decoder(), SamplingParams(max_new_tokens=32))
    backend.finished = []
    server = ApiServer(backend, TOKEN, "127.0.0.1", 0).start()
    yield server
    server.stop()
    backend.close()


def client(server: ApiServer, token: str = TOKEN) -> Any:
    return openai.OpenAI(base_url=server.url, api_key=token, max_retries=0, timeout=300)


def veil_generate(prompt: str, n: int) -> dict[str, Any]:
    from app.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["generate", "--prompt", prompt, "--max-new-tokens", str(n), "--json"]) == 0
    return json.loads(out.getvalue())  # type: ignore[no-any-return]


def test_models_and_greedy_reply_equals_veil_generate(api: ApiServer) -> None:
    c = client(api)
    ids = [m.id for m in c.models.list().data]
    assert ids == [api.backend.model_id()] and ids[0].startswith("smollm2")
    ref = veil_generate(PROMPT, 24)
    msgs = [{"role": "user", "content": PROMPT}]
    r = c.chat.completions.create(model=ids[0], messages=msgs, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == ref["text"]
    assert r.usage.completion_tokens == ref["new_tokens"]
    assert r.usage.prompt_tokens == ref["prompt_tokens"]
    assert r.choices[0].finish_reason == ("length" if ref["finish_reason"] == "length" else "stop")
    # the same request streamed: the pieces add up to the same text, then usage
    pieces, usage, finish = [], None, None
    stream = c.chat.completions.create(
        model=ids[0],
        messages=msgs,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert len([p for p in pieces if p]) > 1  # really streamed, piece by piece
    assert "".join(pieces) == ref["text"]
    assert usage is not None and usage.completion_tokens == ref["new_tokens"]
    assert finish in ("length", "stop")


def test_completions_raw_prompt(api: ApiServer) -> None:
    c = client(api)
    model = api.backend.model_id()
    r = c.completions.create(model=model, prompt="The capital of France is", max_tokens=6)
    assert r.object == "text_completion" and r.usage.completion_tokens == 6
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model=model, prompt="The capital of France is", max_tokens=6, stream=True
        )
        if ch.choices
    )
    assert streamed == r.choices[0].text


def test_bad_requests_get_openai_errors(api: ApiServer) -> None:
    c = client(api)
    model = api.backend.model_id()
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as nf:
        c.chat.completions.create(model="gpt-4o", messages=msgs)
    assert nf.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as br:
        c.chat.completions.create(model=model, messages=msgs, temperature=7)
    assert br.value.body["param"] == "temperature"
    assert br.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="n=1"):
        c.chat.completions.create(model=model, messages=msgs, n=2)
    with pytest.raises(openai.BadRequestError) as ctx:  # longer than the model's context
        c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "lease " * 9000}]
        )
    assert ctx.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as room:
        c.chat.completions.create(model=model, messages=msgs, max_tokens=10**6)
    assert room.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as streamed:  # streamed: before the stream starts
        list(c.chat.completions.create(model=model, messages=msgs, stream=True, max_tokens=10**6))
    assert streamed.value.body["code"] == "context_length_exceeded"


def test_wrong_or_missing_token(api: ApiServer) -> None:
    with pytest.raises(openai.AuthenticationError) as err:
        client(api, "wrong").models.list()
    assert err.value.body["code"] == "invalid_api_key"
    status, body = raw(api, "GET", "/models", token=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def raw(
    server: ApiServer, method: str, path: str, data: bytes | None = None, token: str | None = TOKEN
) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(server.url + path, data=data, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize(
    ("method", "path", "data", "status"),
    [
        ("POST", "/chat/completions", b"{not json", 400),
        ("POST", "/chat/completions", b"[1, 2]", 400),
        ("POST", "/chat/completions", b'{"model": "x"}', 400),
        ("POST", "/completions", b'{"model": "x", "prompt": "a", "echo": true}', 400),
        ("GET", "/chat/completions", None, 405),
        ("GET", "/nothing", None, 404),
    ],
)
def test_malformed_requests(
    api: ApiServer, method: str, path: str, data: bytes | None, status: int
) -> None:
    got, body = raw(api, method, path, data)
    assert got == status
    assert set(body) == {"error"} and body["error"]["message"]
    assert "Traceback" not in json.dumps(body)


def test_two_clients_at_once(api: ApiServer) -> None:
    """Both get their own reply, each exactly what it gets alone; the engine ran one at a
    time."""
    model = api.backend.model_id()
    prompts = ["Name a fruit.", "Name a colour."]
    alone = [
        client(api)
        .chat.completions.create(
            model=model, messages=[{"role": "user", "content": p}], max_tokens=12, temperature=0
        )
        .choices[0]
        .message.content
        for p in prompts
    ]
    got: dict[int, str] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def ask(i: int) -> None:
        try:
            start.wait()
            stream = client(api).chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompts[i]}],
                max_tokens=12,
                temperature=0,
                stream=True,
            )
            got[i] = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        except BaseException as exc:
            errors.append(exc)

    before = api.jobs.started
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors
    assert [got[0], got[1]] == alone
    assert api.jobs.started == before + 2


def test_a_client_that_leaves_is_cancelled(api: ApiServer) -> None:
    backend = api.backend
    assert isinstance(backend, Recording)
    stream = client(api).chat.completions.create(
        model=backend.model_id(),
        messages=[{"role": "user", "content": "Tell me a very long story."}],
        max_tokens=2000,
        stream=True,
    )
    for n, _chunk in enumerate(stream):
        if n == 2:
            break
    stream.close()  # the client hangs up mid-reply
    deadline = time.monotonic() + 120
    while "cancelled" not in backend.finished and time.monotonic() < deadline:
        time.sleep(0.1)
    assert backend.finished[-1] == "cancelled"


def test_queue_runs_in_arrival_order_and_refuses_when_full() -> None:
    q = JobQueue(max_waiting=3)
    gate = threading.Event()
    order: list[int] = []
    running = [0, 0]  # now, most at once

    def job(i: int) -> int:
        running[0] += 1
        running[1] = max(running)
        if i == 0:
            gate.wait(10)
        order.append(i)
        running[0] -= 1
        return i

    futs = [q.submit(lambda: job(0))]
    while q.started == 0:  # job 0 is running (and holds the engine)
        time.sleep(0.01)
    futs += [q.submit(lambda i=i: job(i)) for i in (1, 2, 3)]
    with pytest.raises(ApiError) as full:
        q.submit(lambda: job(9))
    assert full.value.status == 429
    futs[2].cancel()  # a client that left while waiting is skipped
    gate.set()
    assert [f.result(10) for f in (futs[0], futs[1], futs[3])] == [0, 1, 3]
    assert order == [0, 1, 3] and running[1] == 1
    q.close()


def test_veil_api_command_streams(tmp_path: Path) -> None:
    """Acceptance: `veil api` on the built-in model, and the openai client streams from it."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "VEIL_API_TOKEN": "t0k"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "api", "--port", "0", "--max-tokens", "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("Veil API on http://127.0.0.1:"), line + proc.stderr.read()
        url = line.split()[3]
        assert "token:" not in proc.stdout.readline()  # given by the environment: not printed
        c = openai.OpenAI(base_url=url, api_key="t0k", max_retries=0, timeout=300)
        model = c.models.list().data[0].id
        text = "".join(
            ch.choices[0].delta.content or ""
            for ch in c.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Hello"}], stream=True
            )
            if ch.choices
        )
        assert text.strip()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_veil_api_port_in_use_is_one_line() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        from app.api.server import bind
        from engine.errors import VeilError

        with pytest.raises(VeilError, match=f"port {port} on 127.0.0.1 is already in use"):
            bind("127.0.0.1", port)
