"""Hostile input against a real keyed server (tiny core): invalid text and numbers on every POST
route are 400s in the route's shape, grammars that cannot generate are 400s at admission,
undecodable auth bytes are 401s, compressed bodies cost linear work and bounded memory, stalled
connections are cut, and nothing leaves a slot or page behind."""

from __future__ import annotations

import gzip
import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from helios.launcher import HeliosProcess
from tests.unit.live import ANTHROPIC, USER, sse, wait_idle

KEY = "reliability-key"
BODY_LIMIT = 16 << 20  # large enough that fixed allocator overhead does not dominate the 4x bound
TIMEOUT_S = 2  # header and body read deadlines of this server
HEADERS = {"Authorization": f"Bearer {KEY}", **ANTHROPIC}

SYSTEMONE = {
    "model": "local",
    "state": {"message": "Charged twice"},
    "questions": {
        "refund": {"type": "noul", "instructions": "Is a refund requested?"},
        "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["Routine", "Urgent"]},
    },
}
DECISIONS = {
    "model": "local",
    "input": "Charged twice",
    "safety_identifier": "user-1",
    "questions": [{"type": "predicate", "name": "refund", "instructions": "Refund requested?"}],
}
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
# Every POST route: a valid body and the shape its errors take.
ROUTES = {
    "/v1/chat/completions": (
        {"messages": USER, "max_tokens": 2, "stop": ["x"], "tools": [TOOL], "temperature": 0.5},
        "openai",
    ),
    "/v1/completions": ({"prompt": ["Hello", "Hi"], "max_tokens": 2, "stop": "x"}, "openai"),
    "/v1/messages": ({"messages": USER, "max_tokens": 2, "system": "Be brief.", "stop_sequences": ["x"]}, "messages"),
    "/v1/messages/count_tokens": ({"messages": USER, "system": "Be brief."}, "messages"),
    "/v1/responses": (
        {"input": "Hi", "max_output_tokens": 2, "metadata": {"k": "v"}, "user": "u1", "text": {"verbosity": "low"}},
        "openai",
    ),
    "/v1/systemone": (SYSTEMONE, "systemone"),
    "/v1/decisions": (DECISIONS, "openai"),
    "/api/show": ({"model": "qwen2.5-coder"}, "ollama"),
}


@pytest.fixture(scope="module")
def server(tiny_core, tmp_path_factory):
    folder = tmp_path_factory.mktemp("reliability")
    (folder / "key").write_text(KEY)
    (folder / "helios.toml").write_text(
        f"[server]\nmax_body_bytes = {BODY_LIMIT}\nheader_timeout_s = {TIMEOUT_S}\nbody_timeout_s = {TIMEOUT_S}\n"
    )
    server = HeliosProcess(tiny_core, "--api-key-file", str(folder / "key"), "--config", str(folder / "helios.toml"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=60) as client:
        yield client


def check_shape(response: httpx.Response, shape: str) -> str:
    """The error's message, after checking the route's error shape."""
    body = response.json()
    if shape == "messages":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return body["error"]["message"]
    if shape == "ollama":
        assert set(body) == {"error"} and isinstance(body["error"], str), body
        return body["error"]
    if shape == "systemone" and response.status_code == 422:
        assert isinstance(body["detail"], list) and body["detail"], body
        return json.dumps(body["detail"])
    assert set(body["error"]) == {"type", "message", "param", "code"}, body
    return body["error"]["message"]


def string_paths(value, path=()):
    """Every string leaf (and object key) of a body, as a path."""
    if isinstance(value, str):
        yield path
    elif isinstance(value, dict):
        for key, child in value.items():
            yield (*path, ("key", key))
            yield from string_paths(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from string_paths(child, (*path, index))


def replaced(body, path, make):
    """A copy of body whose leaf (or key) at path is make(old)."""
    body = json.loads(json.dumps(body))
    parent = body
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    if isinstance(last, tuple):  # rename a key
        parent[make(last[1])] = parent.pop(last[1])
    else:
        parent[last] = make(parent[last])
    return body


def post_raw(http: httpx.Client, path: str, text: str) -> httpx.Response:
    return http.post(path, content=text.encode("utf-8", "surrogatepass"), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_lone_surrogates_anywhere_are_400s(http, path):
    body, shape = ROUTES[path]
    assert http.post(path, json=body).status_code == 200
    for leaf in string_paths(body):
        for spelling in ("escaped", "raw"):
            mutated = replaced(body, leaf, lambda old: old + "\ud800")
            text = json.dumps(mutated, ensure_ascii=spelling == "escaped")
            response = post_raw(http, path, text)
            assert response.status_code == 400, (leaf, spelling, response.text)
            message = check_shape(response, shape)
            assert "surrogate" in message or "UTF-8" in message, message
    wait_idle(http)


NON_FINITE = ["1e999", "-1e999", "1" + "0" * 400 + ".5"]


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_non_finite_numbers_anywhere_are_400s(http, path):
    body, shape = ROUTES[path]
    marker = "NONFINITE_MARKER"
    for leaf in [*string_paths(body)][:6]:
        if isinstance(leaf[-1], tuple):
            continue
        for literal in NON_FINITE:
            text = json.dumps(replaced(body, leaf, lambda old: marker)).replace(f'"{marker}"', literal)
            response = post_raw(http, path, text)
            assert response.status_code == 400, (leaf, literal, response.text)
            assert "finite" in check_shape(response, shape)
    # Fields read after generation ran (metadata, user, text.verbosity): a non-finite number in each is still a 400.
    for extra in ('"metadata": {"x": 1e999}', '"user": 1e999', '"text": {"verbosity": 1e999}'):
        response = post_raw(http, "/v1/responses", '{"input": "Hi", "max_output_tokens": 2, ' + extra + "}")
        assert response.status_code == 400 and "finite" in check_shape(response, "openai")


@pytest.mark.parametrize(
    "field,value",
    [
        ("guided_regex", "a{1000000}"),
        ("guided_regex", "(a{1000}){1000}"),
        ("guided_choice", [f"choice {i}" for i in range(5000)]),
        ("guided_grammar", "start: a\na: a"),
    ],
)
def test_grammars_that_cannot_generate_are_400s_at_admission(http, field, value):
    path, base = "/v1/chat/completions", {"messages": USER}
    for stream in (False, True):
        response = http.post(path, json={**base, "max_tokens": 4, field: value, "stream": stream})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == field and "grammar cannot generate" in error["message"], error
        assert "<state>" not in error["message"]  # no llguidance internals
    ok = http.post(path, json={**base, "max_tokens": 4, "guided_regex": "[a-z]{1,3}"})
    assert ok.status_code == 200, ok.text


def raw_request(server: HeliosProcess, head: bytes, body: bytes = b"", timeout: float = 20) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as conn:
        conn.sendall(head + body)
        chunks = []
        while True:
            try:
                data = conn.recv(65536)
            except TimeoutError:
                break
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks)


@pytest.mark.parametrize(
    "method,path,header",
    [
        ("GET", "/v1/models", b"Authorization: Bearer \xff\xfe" + KEY.encode()),
        ("POST", "/v1/messages/count_tokens", b"Authorization: Bearer \xff\xfe" + KEY.encode()),
        ("POST", "/v1/messages/count_tokens", b"x-api-key: \xff" + KEY.encode()),
        ("POST", "/v1/chat/completions", b"Authorization: Bearer " + KEY.encode() + b"\xc3"),
    ],
)
def test_undecodable_auth_bytes_are_401s(server, method, path, header):
    body = json.dumps({"messages": USER}).encode()
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body) if method == 'POST' else 0}\r\nConnection: close\r\n"
    ).encode()
    reply = raw_request(server, head + header + b"\r\n\r\n", body if method == "POST" else b"")
    status = reply.split(b"\r\n", 1)[0]
    assert status.startswith(b"HTTP/1.1 401"), reply[:300]
    payload = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert payload["error"]["type"] == "authentication_error"  # OpenAI and Messages shapes alike


def rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


def test_compressed_bodies_cost_linear_work_and_bounded_memory(server, http):
    member = gzip.compress(b"")
    many = http.post(
        "/v1/chat/completions",
        content=member * 150_000,  # 3 MB of empty members
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
    )
    assert many.status_code == 400 and "members" in check_shape(many, "openai")
    empties = gzip.compress(b"[" + b"[]," * ((BODY_LIMIT - 2) // 3 - 1) + b"[]]")
    pid = server.process.pid
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset the peak RSS (VmHWM) to now
    except OSError:
        pytest.skip("cannot reset the server's peak RSS here")
    idle = rss_kib(pid, "VmRSS")
    for _ in range(4):
        bomb = http.post(
            "/v1/chat/completions",
            content=empties,
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )
        assert bomb.status_code == 400 and "elements" in check_shape(bomb, "openai")
    # A body-limit prompt string (one word): parsed, then refused before whole tokenization.
    text = gzip.compress(b'{"prompt": "' + b"a" * (BODY_LIMIT - 64) + b'", "max_tokens": 1}')
    long = http.post("/v1/completions", content=text, headers={"Content-Encoding": "gzip"})
    assert long.status_code == 400 and "context" in check_shape(long, "openai")
    # The most elements the parser takes (a list of token ids, refused afterwards as over-context).
    most = json.dumps({"prompt": list(range(200, 200 + 131_000)), "max_tokens": 1}).encode()  # 4 x context
    over = http.post("/v1/completions", content=gzip.compress(most), headers={"Content-Encoding": "gzip"})
    assert over.status_code == 400 and "context" in check_shape(over, "openai")
    increase = (rss_kib(pid, "VmHWM") - idle) * 1024
    assert increase < 4 * BODY_LIMIT, f"peak RSS rose {increase >> 20} MiB while parsing"  # within 4x the limit
    largest = json.dumps({"model": "local", "prompt": list(range(200, 200 + 32760)), "max_tokens": 1}).encode()
    big = http.post("/v1/completions", content=gzip.compress(largest), headers={"Content-Encoding": "gzip"})
    assert big.status_code == 200, big.text  # a full-context token-ID prompt is accepted


def test_stalled_headers_and_bodies_are_cut(server, http):
    started = time.monotonic()
    # Headers that never finish: the connection is closed after the header deadline.
    assert raw_request(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n") == b""
    # A body that stops short of its Content-Length: 408 in the route's shape, then close.
    head = (
        f"POST /v1/messages HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        "anthropic-version: 2023-06-01\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    ).encode()
    reply = raw_request(server, head, b'{"messages": ')
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert body["type"] == "error" and "did not arrive" in body["error"]["message"]
    assert time.monotonic() - started < 4 * TIMEOUT_S + 10  # both cut near their deadlines, not held
    assert http.get("/health").json() == {"status": "ok"}


def test_many_stalled_connections_do_not_block_service(server, http):
    conns = []
    try:
        for _ in range(40):
            conn = socket.create_connection(("127.0.0.1", server.port))
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
            conns.append(conn)
        response = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
        assert response.status_code == 200
        time.sleep(TIMEOUT_S + 1.5)
        for conn in conns:  # each got its 401 (no key) or 408 and was closed
            conn.settimeout(5)
            data = conn.recv(4096)
            assert data.startswith(b"HTTP/1.1 4"), data[:100]
    finally:
        for conn in conns:
            conn.close()
    assert wait_idle(http)["flare_http_inflight_requests"] == 0


def test_errors_stream_in_shape_and_nothing_is_held(http):
    # A streamed request with invalid text is refused before the stream starts.
    response = post_raw(
        http, "/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udc00"}], "stream": true}'
    )
    assert response.status_code == 400 and response.headers["content-type"].startswith("application/json")
    ok = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "stream": True})
    assert ok.status_code == 200 and sse(ok.text)[-1][1] == "[DONE]"
    after = wait_idle(http)
    assert after["flare_http_admission_slots_used"] == 0 and after["flare_active_requests"] == 0
    assert after["flare_free_kv_pages"] + after["flare_cached_kv_pages"] == after["flare_total_kv_pages"]


def test_text_past_the_context_is_refused_before_it_is_tokenized_whole(http, tiny_core):
    from tokenizers import Tokenizer as HFTokenizer

    words = "hello world, " * 40_000  # ~120k tokens: counted in pieces, refused part way
    for path, body in (
        ("/v1/completions", {"prompt": words, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": words}], "max_tokens": 1}),
        ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": words}]}),
    ):
        response = http.post(path, json=body)
        assert response.status_code == 400, response.text
        assert "more tokens than this model's 32768-token context" in check_shape(response, ROUTES[path][1])
    # Under the context, a long prompt is still tokenized exactly, in one call.
    fits = "hello world, " * 6_000
    exact = len(HFTokenizer.from_file(str(tiny_core / "tokenizer.json")).encode(fits, add_special_tokens=False).ids)
    response = http.post("/v1/completions", json={"prompt": fits, "max_tokens": 1})
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == exact
