"""Run under the vLLM venv's python (weight_trainer imports vLLM): how the trainer side resets
vLLM's prefix cache after an update, through clients that answer as vLLM does (``LLM`` returns
False while blocks are held; the server route answers ``{"success": false}``). Prints one
JSON object."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tiersync.errors import RemoteError
from tiersync.integrations.vllm.weight_trainer import _reset_prefix_cache


class Engine:
    """``LLM.reset_prefix_cache``'s contract: False while blocks are held."""

    def __init__(self, answers: list[bool]) -> None:
        self.answers, self.calls = answers, []

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.calls.append((reset_running_requests, reset_connector))
        return self.answers.pop(0)


def _server(success: bool) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            data = json.dumps({"success": success}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    return http


def outcome(client: object) -> str:
    try:
        _reset_prefix_cache(client)
    except RemoteError:
        return "raised"
    return "reset"


def main() -> dict:
    busy_then_free, always_busy = Engine([False, True]), Engine([False, False, False])
    out = {
        "busy_then_free": [outcome(busy_then_free), busy_then_free.calls],
        "always_busy": [outcome(always_busy), len(always_busy.calls)],
    }
    for success in (True, False):
        http = _server(success)
        client = type("Http", (), {"base_url": f"http://127.0.0.1:{http.server_address[1]}", "timeout": 10})()
        out[f"http_success_{str(success).lower()}"] = outcome(client)
        http.shutdown()
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
