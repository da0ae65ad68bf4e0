"""``tiersync router`` against hostile clients and failing upstreams (no vLLM needed).

The upstreams are small HTTP servers that record what reaches them and answer as told (a
prefill server that returns KV params, or garbage; a decode server that echoes); the router is
the real one, in this process, over real sockets. The happy path against vLLM's OpenAI servers
is ``test_vllm_router.py``.
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from net._certs import make_pki
from net._peer import wait_until
from tiersync.errors import UsageError
from tiersync.integrations.router import Router, RouterConfig

PARAMS = {"tiersync_source": {"request_id": "p-1", "source": {"addresses": ["127.0.0.1:1"]}}}


class Upstream:
    """An HTTP server on loopback recording each (path, JSON body); ``answer`` makes the reply;
    ``tls``: (cert, key) of an HTTPS server."""

    def __init__(self, answer, tls: tuple[str, str] | None = None) -> None:
        self.seen: list[tuple[str, dict]] = []
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                upstream.seen.append((self.path, body))
                data = answer(body)
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.http.socket = _server_tls(tls).wrap_socket(self.http.socket, server_side=True)
        self.url = f"http{'s' if tls else ''}://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def _server_tls(tls: tuple[str, str]) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(*tls)
    return ctx


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"), "upstream")


@pytest.fixture
def stack():
    made = []

    def build(
        prefill_answer=lambda b: json.dumps({"kv_transfer_params": PARAMS}).encode(),
        decode_answer=lambda b: json.dumps(
            {"choices": [{"token_ids": [7]}], "got": b.get("kv_transfer_params")}
        ).encode(),
        **cfg,
    ):
        prefill = Upstream(prefill_answer)
        decode = Upstream(decode_answer)
        router = Router(RouterConfig((prefill.url,), (decode.url,), **cfg))
        threading.Thread(target=router.serve_forever, daemon=True).start()
        made.extend([router, prefill, decode])
        return router, prefill, decode

    yield build
    for thing in made:
        thing.close()


def _raw(address: str, request: bytes) -> bytes:
    """Send raw bytes to the router; everything it answers until it closes (or 10 s)."""
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _post(address: str, body: bytes, extra: bytes = b"", path: bytes = b"/v1/completions") -> bytes:
    return _raw(
        address,
        b"POST "
        + path
        + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
        + body
        + extra,
    )


def test_decode_gets_only_the_prefill_servers_kv_params(stack):
    router, prefill, decode = stack()
    forged = {"tiersync_source": {"request_id": "evil", "source": {"addresses": ["10.9.9.9:1"]}}}
    out = _post(
        router.address,
        json.dumps({"model": "m", "prompt": [1, 2], "max_tokens": 5, "kv_transfer_params": forged}).encode(),
    )
    assert b"200 OK" in out.split(b"\r\n")[0]
    assert prefill.seen[0][1]["max_tokens"] == 1 and prefill.seen[0][1]["kv_transfer_params"] == {
        "do_remote_decode": True
    }
    assert decode.seen[0][1]["kv_transfer_params"] == PARAMS and decode.seen[0][1]["max_tokens"] == 5


def test_chat_prefill_caps_min_tokens_at_its_one_token(stack):
    router, prefill, decode = stack()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "min_tokens": 4}
    out = _post(router.address, json.dumps(body).encode(), path=b"/v1/chat/completions")
    assert b"200 OK" in out.split(b"\r\n")[0]
    assert prefill.seen[0][0] == "/v1/chat/completions"
    assert prefill.seen[0][1]["max_tokens"] == 1 and prefill.seen[0][1]["min_tokens"] == 1
    assert decode.seen[0][1]["min_tokens"] == 4 and decode.seen[0][1]["max_tokens"] == 6


def test_prefill_without_params_sends_the_request_to_decode_without_any(stack):
    router, _, decode = stack(prefill_answer=lambda b: b'{"choices": []}')
    _post(router.address, json.dumps({"prompt": [1], "kv_transfer_params": {"forged": True}}).encode())
    assert "kv_transfer_params" not in decode.seen[0][1]


def _completion(text: str, ids: list[int], prompt: list[int], finish: str | None = "length") -> dict:
    choice = {"index": 0, "text": text, "token_ids": ids, "prompt_token_ids": prompt, "finish_reason": finish}
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
    return {
        "id": "cmpl-x",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [choice],
        "usage": usage,
    }


def _first_token_prefill(finish: str = "length"):
    return lambda b: json.dumps({**_completion(" A", [9], [1, 2], finish), "kv_transfer_params": PARAMS}).encode()


def _answer(raw: bytes) -> bytes:
    """The body of a chunked HTTP answer."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    if b"chunked" not in head:
        return rest
    body = b""
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        body, rest = body + rest[:n], rest[n + 2 :]
    return body


def test_a_completion_gets_the_prefill_token_first_and_decode_continues_from_it(stack):
    router, prefill, decode = stack(
        prefill_answer=_first_token_prefill(),
        decode_answer=lambda b: json.dumps(_completion(" B C", [10, 11], b["prompt"])).encode(),
    )
    out = json.loads(_answer(_post(router.address, json.dumps({"prompt": "hi", "max_tokens": 3}).encode())))
    assert prefill.seen[0][1]["return_token_ids"] is True and prefill.seen[0][1]["max_tokens"] == 1
    ask = decode.seen[0][1]
    assert ask["prompt"] == [1, 2, 9] and ask["max_tokens"] == 2 and ask["kv_transfer_params"] == PARAMS
    assert out["choices"][0]["text"] == " A B C" and out["choices"][0]["token_ids"] is None
    assert out["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


def test_a_streamed_completion_sends_the_first_token_then_the_decode_events(stack):
    def events(b):
        one = {"id": "d", "choices": [{"text": " B", "token_ids": [10], "prompt_token_ids": b["prompt"]}]}
        return b"data: " + json.dumps(one).encode() + b"\n\ndata: [DONE]\n\n"

    router, _, _ = stack(prefill_answer=_first_token_prefill(), decode_answer=events)
    body = {"prompt": [1, 2], "max_tokens": 2, "stream": True, "return_token_ids": True}
    lines = [ln for ln in _answer(_post(router.address, json.dumps(body).encode())).split(b"\n") if ln]
    first, second = (json.loads(ln[6:])["choices"][0] for ln in lines[:2])
    assert (first["text"], first["token_ids"], first["prompt_token_ids"]) == (" A", [9], [1, 2])
    assert (second["text"], second["token_ids"], second["prompt_token_ids"]) == (" B", [10], None)
    assert lines[2] == b"data: [DONE]"


def test_a_first_token_that_ends_the_answer_is_the_whole_answer(stack):
    router, prefill, decode = stack(prefill_answer=_first_token_prefill("stop"))
    out = json.loads(_answer(_post(router.address, json.dumps({"prompt": "hi", "max_tokens": 3}).encode())))
    assert out["choices"][0]["text"] == " A" and "kv_transfer_params" not in out and not decode.seen
    _post(router.address, json.dumps({"prompt": "hi", "max_tokens": 1}).encode())
    assert "kv_transfer_params" not in prefill.seen[1][1] and not decode.seen  # monolithic on the prefill server


def test_a_decode_answer_that_is_no_completion_is_a_502(stack):
    router, _, _ = stack(prefill_answer=_first_token_prefill(), decode_answer=lambda b: b'{"choices": ["x"]}')
    out = _post(router.address, json.dumps({"prompt": "hi", "max_tokens": 3}).encode())
    assert out.startswith(b"HTTP/1.1 502") and b"no completion choice" in out


def test_decode_unreachable_mid_stream_ends_the_stream_with_an_error_event(stack):
    router, _, decode = stack(prefill_answer=_first_token_prefill())
    decode.close()
    body = json.dumps({"prompt": "hi", "max_tokens": 3, "stream": True}).encode()
    lines = [ln for ln in _answer(_post(router.address, body)).split(b"\n") if ln]
    assert json.loads(lines[0][6:])["choices"][0]["text"] == " A"
    assert b"unreachable" in lines[1] and lines[2] == b"data: [DONE]"


def test_prefill_answering_garbage_is_a_502_naming_it(stack):
    router, prefill, decode = stack(prefill_answer=lambda b: b"<html>oops")
    out = _post(router.address, b'{"prompt": [1]}')
    assert out.startswith(b"HTTP/1.1 502") and prefill.url.encode() in out and not decode.seen


def test_unreachable_prefill_is_a_502(stack):
    router, prefill, _ = stack()
    prefill.close()
    out = _post(router.address, b'{"prompt": [1]}')
    assert out.startswith(b"HTTP/1.1 502") and b"unreachable" in out


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n", b"413"),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", b"411"),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n[1]", b"400"),
        (b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", b"404"),
    ],
)
def test_refused_requests_close_the_connection_so_a_smuggled_request_is_never_served(stack, request_bytes, status):
    router, prefill, decode = stack()
    smuggled = b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 13\r\n\r\n{"prompt":[1]}'
    out = _raw(router.address, request_bytes + smuggled)
    assert out.startswith(b"HTTP/1.1 " + status) and out.count(b"HTTP/1.1") == 1
    assert not prefill.seen and not decode.seen


def test_connections_over_the_cap_get_503_and_the_rest_are_served(stack):
    router, _, _ = stack(max_connections=1)
    host, port = router.address.split(":")
    with socket.create_connection((host, int(port)), timeout=10):  # holds the only slot
        assert _raw(router.address, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 503")
    for _ in range(50):  # the slot is free again once that connection's thread ended
        out = _post(router.address, b'{"prompt": [1]}')
        if out.startswith(b"HTTP/1.1 200"):
            break
    assert out.startswith(b"HTTP/1.1 200")


def test_silent_and_trickling_clients_lose_their_slot_after_the_request_deadline(stack):
    """A socket timeout bounds each recv: a client sending one byte every so often, or nothing
    on a kept-alive connection, held its slot for good and the router answered everyone else 503.
    Now the whole request must arrive within client_timeout_s (1 s here)."""
    import time

    router, _, _ = stack(max_connections=2, client_timeout_s=1.0)
    host, port = router.address.split(":")
    silent = socket.create_connection((host, int(port)), timeout=10)
    trickler = socket.create_connection((host, int(port)), timeout=10)
    held = {"trickled": 0}

    def trickle() -> None:  # one byte of a request line every 0.2 s, for at most 10 s
        try:
            for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40:
                trickler.sendall(bytes([byte]))
                held["trickled"] += 1
                time.sleep(0.2)
        except OSError:
            pass

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        assert silent.recv(1) == b""  # closed by the router, not by us
        thread.join(15)
        assert held["trickled"] < 40  # cut off long before its request line and headers ended
        assert wait_until(lambda: _post(router.address, b'{"prompt": [1]}').startswith(b"HTTP/1.1 200"))
    finally:
        silent.close()
        trickler.close()


def test_json_nested_past_the_parser_is_a_400_not_a_dropped_connection(stack):
    router, prefill, _ = stack()
    out = _post(router.address, b'{"a": ' + b"[" * 100_000)
    assert out.startswith(b"HTTP/1.1 400") and not prefill.seen


def test_request_bytes_held_at_once_are_bounded(stack):
    """Each body is held (parsed, some 20x its size) while its request runs: past max_bodies
    held at once, a new request is 503 until one ends."""
    release = threading.Event()

    def held_prefill(body):
        release.wait(10)
        return json.dumps({"kv_transfer_params": PARAMS}).encode()

    router, _, _ = stack(prefill_answer=held_prefill, max_bodies=1000, max_body=1000)
    body = json.dumps({"prompt": [1] * 200}).encode()  # 612 bytes: one fits, two do not
    first: list[bytes] = []
    held = threading.Thread(target=lambda: first.append(_post(router.address, body)))
    held.start()
    assert wait_until(lambda: router._held == len(body))
    assert _post(router.address, body).startswith(b"HTTP/1.1 503")
    release.set()
    held.join(10)
    assert first[0].startswith(b"HTTP/1.1 200") and _post(router.address, body).startswith(b"HTTP/1.1 200")


def test_an_upstream_that_answers_no_http_is_a_502_naming_it():
    """A decode URL whose server answers garbage (or TLS on an http:// URL): urllib raises
    http.client's BadStatusLine, which escaped as a traceback and no answer at all."""
    listener = socket.create_server(("127.0.0.1", 0))

    def garbage() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(b"garbage\r\n")

    threading.Thread(target=garbage, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    router = Router(RouterConfig((url,), (url,)))
    threading.Thread(target=router.serve_forever, daemon=True).start()
    try:
        out = _raw(router.address, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 502") and url.encode() in out
    finally:
        router.close()
        listener.close()


def test_an_http_1_0_client_gets_its_answer_unframed(stack):
    """HTTP/1.0 knows no chunked encoding: the relayed answer is the bytes, ended by close."""
    router, _, _ = stack(prefill_answer=lambda b: b'{"choices": [{"text": "x"}]}')
    body = json.dumps({"prompt": [1], "max_tokens": 1}).encode()
    out = _raw(
        router.address,
        b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(body) + body,
    )
    head, _, rest = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"chunked" not in head.lower()  # 1.1: its version, as RFC 9110 says
    assert rest == b'{"choices": [{"text": "x"}]}'


@pytest.mark.parametrize(
    ("path", "stream"), [("/v1/completions", True), ("/v1/completions", False), ("/v1/chat/completions", True)]
)
def test_a_client_gone_once_the_prefill_answered_still_has_decode_take_the_kv(stack, path, stream):
    """The prefill engine keeps a prompt's KV until a decode engine pulls it (or its timeout):
    a client gone before the router asked decode ended the request with no decode call, so the
    KV stayed pinned; clients doing that again and again fill the prefill's cache. Decode is
    still asked for one token (its answer dropped), so it pulls the KV. The client leaves (a
    reset) just as the prefill's answer is read: held there until the router saw it go."""
    import struct

    router, prefill, decode = stack(prefill_answer=_first_token_prefill())
    leave, real = threading.Event(), router.ask

    def ask(url, path, body, hangup=None):
        out = real(url, path, body, hangup)
        if url == prefill.url:  # the prefill answered: now the client leaves
            leave.set()
            assert wait_until(lambda: hangup.fired)
        return out

    router.ask = ask
    host, port = router.address.split(":")
    body = {"prompt": "hi", "messages": [], "max_tokens": 5, "min_tokens": 3, "stream": stream, "stream_options": {}}
    data = json.dumps(body).encode()
    client = socket.create_connection((host, int(port)), timeout=10)
    client.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (path.encode(), len(data)) + data)
    assert leave.wait(10)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()  # a reset
    assert wait_until(lambda: len(decode.seen) == 1)
    ask = decode.seen[0][1]
    assert ask["max_tokens"] == 1 and not {"stream", "stream_options", "min_tokens"} & set(ask)  # vLLM: min <= max
    assert ask["kv_transfer_params"] == PARAMS


def test_closing_the_router_does_not_wait_for_an_idle_client(stack):
    router, _, _ = stack()
    host, port = router.address.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as idle:
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # a request never finished
        closer = threading.Thread(target=router.close, daemon=True)
        closer.start()
        closer.join(10)
        assert not closer.is_alive()


def test_config_names_the_bad_argument():
    for kwargs, argument in (
        (dict(prefill=("localhost:1",), decode=("http://x",)), "prefill"),
        (dict(prefill="http://a", decode=("http://x",)), "prefill"),
        (dict(prefill=("http://a",), decode=()), "decode"),
        (dict(prefill=("http://a",), decode=("http://x",), timeout_s=float("inf")), "timeout_s"),
        (dict(prefill=("http://a",), decode=("http://x",), max_connections=0), "max_connections"),
        (dict(prefill=("http://a",), decode=("http://x",), client_timeout_s=0), "client_timeout_s"),
        (dict(prefill=("http://a",), decode=("http://x",), max_bodies=0), "max_bodies"),
        (dict(prefill=("http://a",), decode=("http://x",), max_body=2 << 20, max_bodies=1 << 20), "max_body"),
        (dict(prefill=("https://a",), decode=("http://x",), upstream_ca="/nonexistent/ca.pem"), "upstream_ca"),
        (dict(prefill=("https://a",), decode=("http://x",), upstream_ca=__file__), "upstream_ca"),  # no PEM
        (dict(prefill=("https://a",), decode=("http://x",), upstream_ca=""), "upstream_ca"),
    ):
        with pytest.raises(UsageError) as ei:
            RouterConfig(**kwargs)
        assert ei.value.argument == argument


class _Holding:
    """An upstream that reads a request and never answers; ``gone`` is set once the router
    closes or shuts down its connection (as vLLM's server sees its client leave); ``tls``:
    (cert, key) of an HTTPS server."""

    def __init__(self, tls: tuple[str, str] | None = None) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http{'s' if tls else ''}://127.0.0.1:{self.listener.getsockname()[1]}"
        self._tls = None if tls is None else _server_tls(tls)
        self.asked, self.gone = threading.Event(), threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(60)
        if self._tls is not None:
            conn = self._tls.wrap_socket(conn, server_side=True)
        with conn:
            try:
                while conn.recv(65536):
                    self.asked.set()
            except (ssl.SSLError, OSError):  # a TLS stream cut below TLS, as the router does
                pass
            self.gone.set()

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("scheme", ["http", "https"])
@pytest.mark.parametrize("how", ["close", "half-close"])
@pytest.mark.parametrize("path", [b"/v1/completions", b"/v1/chat/completions"])
def test_a_client_that_leaves_during_the_prefill_ends_that_call(how, path, scheme, pki):
    """Nothing is written to a client while the prefill server computes, so no write tells the
    router its client left: the client's hangup (a close, or a shutdown of its sending side,
    as nginx counts it) ends the prefill call itself (vLLM then aborts the request and frees
    its blocks), on the first-token path and the relayed one. Before, the call ran until the
    prefill answered or timeout_s (600 s) passed. Over HTTPS too (``upstream_ca``): the socket
    below TLS is cut."""
    tls = pki["upstream"] if scheme == "https" else None
    holding = _Holding(tls)
    answers = Upstream(
        lambda b: json.dumps({"choices": [{"token_ids": [7]}], "kv_transfer_params": PARAMS}).encode(), tls
    )
    router = Router(RouterConfig((holding.url,), (answers.url,), upstream_ca=pki["ca"]))
    threading.Thread(target=router.serve_forever, daemon=True).start()
    try:
        host, port = router.address.split(":")
        body = json.dumps({"prompt": [1, 2, 3], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
        client = socket.create_connection((host, int(port)), timeout=10)
        client.sendall(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (path, len(body), body.encode())
        )
        assert holding.asked.wait(10)  # the held upstream has the request
        client.shutdown(socket.SHUT_WR) if how == "half-close" else client.close()
        assert holding.gone.wait(10)
        assert not answers.seen  # decode was never asked
        client.close()
    finally:
        router.close()
        holding.close()
        answers.close()


def test_https_upstreams_are_verified_with_upstream_ca(pki):
    """``upstream_ca`` verifies https:// prefill and decode servers: the request goes through;
    without it (the system's CAs) the same servers are refused, a 502 naming the prefill."""
    prefill = Upstream(lambda b: json.dumps({"kv_transfer_params": PARAMS}).encode(), pki["upstream"])
    decode = Upstream(lambda b: json.dumps({"choices": [{"token_ids": [7]}]}).encode(), pki["upstream"])
    routers = [Router(RouterConfig((prefill.url,), (decode.url,), upstream_ca=ca)) for ca in (pki["ca"], None)]
    for router in routers:
        threading.Thread(target=router.serve_forever, daemon=True).start()
    try:
        out = _post(routers[0].address, b'{"prompt": [1, 2], "max_tokens": 3}')
        assert out.startswith(b"HTTP/1.1 200") and decode.seen[0][1]["kv_transfer_params"] == PARAMS
        out = _post(routers[1].address, b'{"prompt": [1, 2], "max_tokens": 3}')
        assert out.startswith(b"HTTP/1.1 502") and prefill.url.encode() in out and len(decode.seen) == 1
    finally:
        for thing in (*routers, prefill, decode):
            thing.close()
