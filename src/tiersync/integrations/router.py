"""``tiersync router``: prefill -> decode in front of vLLM's OpenAI servers.

Clients talk to the router as to one OpenAI server (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/health``). Each generation request goes to a
prefill server first (``max_tokens=1``, no streaming, ``kv_transfer_params={"do_remote_decode":
true}``); the prefill engine (``kv_role="kv_producer"``) computes the prompt and answers with
``kv_transfer_params`` naming where its KV is served. Then:

- ``/v1/completions`` with one prompt and one choice (no echo, logprobs or suffix): the
  prefill server's token is the answer's first (a streaming client gets it at once), and the
  decode server (``kv_role="kv_consumer"``) gets the prompt's ids followed by that token, with
  those params, for the rest: it pulls the KV of every prompt token and computes none of them
  (:mod:`tiersync.integrations.first_token`). A first token that ends the answer (EOS, a stop
  string, ``max_tokens`` 1) is the whole answer.
- anything else (chat, several prompts or choices, structured output...): the client's own
  request, with those params, goes to the decode server, which pulls the KV of all but the
  prompt's last token and computes that one; its answer is relayed (streamed as it comes
  when the client asked).

Several ``--prefill`` / ``--decode`` URLs are used in turn.

Failures: a prefill server that cannot be reached, refuses or answers what is not JSON is an
HTTP 502 naming it; a prefill answer without ``kv_transfer_params`` sends the request to decode
alone (it computes the prompt itself). Hostile clients: request bodies are capped
(``max_body`` each, ``max_bodies`` held at once: more get 503) and must be JSON objects (nested
past the parser: 400); a client's own ``kv_transfer_params`` are dropped (only what the prefill
server returned reaches decode: a client must not point decode at a KV server of its choosing);
a connection whose request was refused is closed; a client's whole request, and the wait for
its next one, must arrive within ``client_timeout_s`` (:mod:`~tiersync.integrations.client_reads`:
a per-recv timeout let one byte now and then hold a slot for good); writes to a client have the
upstream timeout; at most ``max_connections`` clients are served at once (more get 503). An
HTTP/1.0 client gets streamed answers unframed, ended by closing the connection. An upstream
that answers no HTTP at all is a 502 too. A client that hangs up (closes, or shuts down its
sending side, as nginx counts it too) while the prefill server computes ends that call
(:mod:`~tiersync.integrations.hangup`: vLLM aborts the request and frees its blocks); one gone
once the prefill answered still has decode take the prompt's KV (one token, dropped), or the
prefill engine would hold it until its timeout. Decode calls are never cut (one cut before it
pulled the KV would leave it pinned on the prefill engine): a non-streamed answer nobody waits
for any more is computed to its end, a streamed one ends at the first write that fails.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import itertools
import json
import logging
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tiersync.errors import UsageError
from tiersync.integrations import first_token
from tiersync.integrations.client_reads import DeadlineReader
from tiersync.integrations.hangup import Hangup, Hangups, opener
from tiersync.integrations.router_config import RouterConfig

__all__ = ["Router", "RouterConfig"]

log = logging.getLogger(__name__)
GENERATE = ("/v1/completions", "/v1/chat/completions")
_CHUNK = 64 << 10


class _Upstream(Exception):
    """An upstream server failed: the status and message the client gets."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Router:
    """The router's HTTP server on ``host:port`` (0 picks one: see :attr:`address`)."""

    def __init__(self, config: RouterConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        if not isinstance(config, RouterConfig):
            raise UsageError("must be a RouterConfig", argument="config", got=type(config).__name__)
        self.config = config
        self._prefill, self._decode = itertools.cycle(config.prefill), itertools.cycle(config.decode)
        self._turn = threading.Lock()
        self._held, self._held_lock = 0, threading.Lock()  # request body bytes being served
        self.hangups, self._opener = Hangups(), opener(config.upstream_context())
        self._http = _HTTPServer((host, port), _Handler)
        self._http.router = self
        self._http.slots = threading.BoundedSemaphore(config.max_connections)
        self.address = f"{host}:{self._http.server_address[1]}"

    def serve_forever(self) -> None:
        self._http.serve_forever(poll_interval=0.2)

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self.hangups.close()

    def hold(self, nbytes: int) -> bool:
        """Take ``nbytes`` of the ``max_bodies`` budget for a request's body; False when full."""
        with self._held_lock:
            if self._held + nbytes > self.config.max_bodies:
                return False
            self._held += nbytes
            return True

    def unhold(self, nbytes: int) -> None:
        with self._held_lock:
            self._held -= nbytes

    def next_pair(self) -> tuple[str, str]:
        with self._turn:
            return next(self._prefill), next(self._decode)

    def prefill(self, url: str, path: str, body: dict[str, Any], hangup: Hangup | None) -> dict[str, Any] | None:
        """Run the prompt on prefill server ``url``: the ``kv_transfer_params`` it returned."""
        params = self.ask(url, path, first_token.prefill_body(body), hangup).get("kv_transfer_params")
        return params if isinstance(params, dict) else None

    def ask(self, url: str, path: str, body: dict[str, Any], hangup: Hangup | None = None) -> dict[str, Any]:
        """POST ``body`` to ``url + path``: the JSON object it answered. _Upstream otherwise."""
        try:
            with self.call(url, path, body, hangup) as answer:
                raw = answer.read(self.config.max_body + 1)
        except (OSError, http.client.HTTPException) as exc:  # the answer broke off
            raise _Upstream(502, f"{url} failed mid-answer: {exc!r}") from None
        try:
            parsed = json.loads(raw) if len(raw) <= self.config.max_body else None
        except (ValueError, RecursionError):
            parsed = None
        if not isinstance(parsed, dict):
            raise _Upstream(502, f"{url} answered {path} with no JSON object")
        return parsed

    def call(self, url: str, path: str, body: dict[str, Any] | None = None, hangup: Hangup | None = None) -> Any:
        """POST ``body`` (GET without one) to ``url + path``; the open response. _Upstream on
        failure. ``hangup``: the client's, which ends the call when the client leaves."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
        request.hangup = hangup  # type: ignore[attr-defined]
        try:
            return self._opener.open(request, timeout=self.config.timeout_s)
        except urllib.error.HTTPError as exc:
            try:
                detail = exc.read(500).decode(errors="replace")
            except (OSError, http.client.HTTPException):
                detail = "(its body broke off)"
            raise _Upstream(exc.code, f"{url} answered {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise _Upstream(502, f"{url} unreachable: {getattr(exc, 'reason', exc)}") from None
        except http.client.HTTPException as exc:  # e.g. a status line that is not HTTP
            raise _Upstream(502, f"{url} answered no HTTP: {exc!r}") from None


class _HTTPServer(ThreadingHTTPServer):
    """Threads per connection, at most ``slots`` at once: one more gets 503 and is closed."""

    daemon_threads = True
    block_on_close = False  # closing does not wait for clients (one idle client held it up to timeout_s)
    router: Router
    slots: threading.BoundedSemaphore

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _Handler(BaseHTTPRequestHandler):
    """One client connection: GET /health and /v1/models go to a decode server, generation
    requests through prefill then decode (see the module docstring)."""

    protocol_version = "HTTP/1.1"
    server: _HTTPServer
    _hangup: Hangup | None = None  # a generation request's client's (hangup.py)

    def setup(self) -> None:
        self.timeout = self.server.router.config.timeout_s  # a client that stalls a write is dropped
        super().setup()
        self._reader = DeadlineReader(self.connection, self.timeout)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        self._reader.start(self.server.router.config.client_timeout_s)
        super().handle_one_request()

    def do_GET(self) -> None:
        router = self.server.router
        if self.path not in ("/health", "/v1/models"):
            return self._error(404, f"no route {self.path}")
        self._relay(lambda: router.call(router.next_pair()[1], self.path))

    def do_POST(self) -> None:
        router = self.server.router
        if self.path not in GENERATE:
            return self._error(404, f"no route {self.path}")
        n = self._length(router.config.max_body)
        if n is None:
            return None
        if not router.hold(n):
            return self._error(503, "the router holds as many request bytes as it takes: retry")
        try:
            body = self._body(n)
            if body is not None:
                with router.hangups.watch(self.connection) as self._hangup:
                    self._generate(body)
        finally:
            self._hangup = None
            router.unhold(n)

    def _generate(self, body: dict[str, Any]) -> None:
        """A generation request: prefill, then decode (module docstring)."""
        router = self.server.router
        prefill, decode = router.next_pair()

        body.pop("kv_transfer_params", None)  # only the prefill server's reach decode
        max_tokens = first_token.plan(self.path, body)
        if max_tokens == 1:  # the prefill server's token is the whole answer
            return self._relay(lambda: router.call(prefill, self.path, body, self._hangup))
        if max_tokens is not None:
            return self._first_token(prefill, decode, body, max_tokens)

        def run() -> Any:
            params = router.prefill(prefill, self.path, body, self._hangup)
            if params is not None and self._left():  # it answered as the client left
                self._release(decode, {**body, "kv_transfer_params": params})
                raise _Upstream(499, "the client left")
            if params is None:
                log.warning("prefill %s returned no kv_transfer_params: decode computes the prompt", prefill)
            ask = {**body, "kv_transfer_params": params} if params else body
            return router.call(decode, self.path, ask)  # never cut: it takes the prefill's KV

        self._relay(run)

    def _first_token(self, prefill: str, decode: str, body: dict[str, Any], max_tokens: int) -> None:
        """The first-token flow (module docstring)."""
        router = self.server.router
        try:
            answer = router.ask(prefill, self.path, first_token.prefill_body(body), self._hangup)
        except _Upstream as exc:
            return self._error(exc.status, str(exc))
        first, params = first_token.first_of(answer), answer.get("kv_transfer_params")
        want_ids, stream = body.get("return_token_ids") is True, body.get("stream") is True
        if first is None or not isinstance(params, dict):
            log.warning("prefill %s returned no first token or kv_transfer_params: decode computes the prompt", prefill)
            ask = {**body, "kv_transfer_params": params} if isinstance(params, dict) else body
            return self._relay(lambda: router.call(decode, self.path, ask))
        if first.finish_reason != "length":
            if stream:
                usage = isinstance(body.get("stream_options"), dict) and body["stream_options"].get("include_usage")
                return self._send(200, "text/event-stream", first_token.alone_events(first, want_ids, bool(usage)))
            return self._send(200, "application/json", json.dumps(first_token.alone(first, want_ids)).encode())
        ask = first_token.decode_body(body, first, max_tokens, params)
        if self._left():  # it answered as the client left
            return self._release(decode, ask)
        if stream:
            return self._stream(decode, ask, first_token.StreamFixer(first, want_ids))
        try:
            merged = first_token.merge(first, router.ask(decode, self.path, ask), want_ids)
        except _Upstream as exc:
            return self._error(exc.status, str(exc))
        except ValueError as exc:
            return self._error(502, f"{decode}: {exc}")
        self._send(200, "application/json", json.dumps(merged).encode())

    def _stream(self, decode: str, ask: dict[str, Any], fixer: first_token.StreamFixer) -> None:
        """Send the first token's event now, then the decode server's events, rewritten."""
        try:
            self._start(200, "text/event-stream")
            self._chunk(fixer.opening())
        except OSError as exc:
            log.info("router: %s left before its stream began: %s", self.client_address[0], exc)
            self.close_connection = True
            return self._release(decode, ask)
        try:
            try:
                upstream = self.server.router.call(decode, self.path, ask)
            except _Upstream as exc:  # the answer has begun: end it with an error event
                self._chunk(first_token.event({"error": {"message": str(exc), "code": exc.status}}))
                self._chunk(b"data: [DONE]\n\n")
            else:
                self._events(upstream, fixer)
            self._end_chunks()
        except OSError as exc:
            log.info("router: stream to %s ended: %s", self.client_address[0], exc)
            self.close_connection = True

    def _left(self) -> bool:
        """The client hung up (its upstream calls are ended: :mod:`~tiersync.integrations.hangup`)."""
        return self._hangup is not None and self._hangup.fired

    def _release(self, decode: str, ask: dict[str, Any]) -> None:
        """The client left before decode was asked: decode still takes the prompt's KV (one
        token, answer dropped), or the prefill engine would keep its blocks until its timeout
        (a client leaving at once, again and again, would fill the prefill's KV cache)."""
        dropped = ("stream", "stream_options", "min_tokens", "max_completion_tokens")  # vLLM: min <= max
        once = {k: v for k, v in ask.items() if k not in dropped} | {"max_tokens": 1}
        with contextlib.suppress(_Upstream):
            self.server.router.ask(decode, self.path, once)

    def _events(self, upstream: Any, fixer: first_token.StreamFixer) -> None:
        """Relay the decode server's events; one that breaks off ends with an error event."""
        with upstream:
            try:
                while line := upstream.readline(self.server.router.config.max_body):
                    self._chunk(fixer.line(line))
                return
            except (http.client.HTTPException, TimeoutError, ConnectionError) as exc:
                message = f"the decode server's answer broke off: {exc!r}"
        self._chunk(first_token.event({"error": {"message": message, "code": 502}}) + b"data: [DONE]\n\n")

    def _length(self, limit: int) -> int | None:
        """The request's Content-Length, at most ``limit`` (an error answered otherwise)."""
        try:
            n = int(self.headers.get("Content-Length") or -1)
        except ValueError:
            n = -1
        if not 0 < n <= limit:
            self._error(413 if n > limit else 411, "a JSON body with Content-Length is required")
            return None
        return n

    def _body(self, n: int) -> dict[str, Any] | None:
        try:
            body = json.loads(self.rfile.read(n))
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            body = None
        if not isinstance(body, dict):
            self._error(400, "the body must be a JSON object")
            return None
        return body

    def _relay(self, run: Any) -> None:
        try:
            upstream = run()
        except _Upstream as exc:
            return self._error(exc.status, str(exc))
        with upstream:
            try:
                self._start(upstream.status, upstream.headers.get("Content-Type", "application/json"))
                while chunk := upstream.read1(_CHUNK):
                    self._chunk(chunk)
                self._end_chunks()
            except (OSError, http.client.HTTPException) as exc:  # a side went away mid-answer: end this connection
                log.info("router: relay to %s ended: %s", self.client_address[0], exc)
                self.close_connection = True

    def _start(self, status: int, content_type: str) -> None:
        """Begin an answer of unknown length: chunked, or for an HTTP/1.0 client (which knows
        no chunks) unframed and ended by closing the connection."""
        self._chunked = self.request_version != "HTTP/1.0"
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if self._chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.close_connection = True
            self.send_header("Connection", "close")
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        if data:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)
            self.wfile.flush()

    def _end_chunks(self) -> None:
        if self._chunked:
            self.wfile.write(b"0\r\n\r\n")

    def _send(self, status: int, content_type: str, data: bytes) -> None:
        try:
            if self._left():  # nobody to answer: its calls were ended
                raise ConnectionAbortedError("the client hung up")
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError as exc:
            log.info("router: %s left before its answer: %s", self.client_address[0], exc)
            self.close_connection = True

    def _error(self, status: int, message: str) -> None:
        self.close_connection = True  # the request body may be unread: never parse it as a request
        self._send(status, "application/json", json.dumps({"error": {"message": message, "code": status}}).encode())

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("router: " + fmt, *args)
