"""The run's OpenAI-compatible endpoint: ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/models`` over HTTP, on 127.0.0.1 and a free port, for the agents of one run.

Every request must carry the run's key with the episode's name after it as its bearer
token (``Authorization: Bearer KEY.EPISODE``; the ``openai`` client sends its ``api_key``
so): a request without the run's key is refused (401) before anything else is read. What a
request asks is the :class:`~posttrain.agents.runner.Hub`'s to answer; this module only
speaks HTTP.
"""

from __future__ import annotations

import hmac
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_BODY = 16 << 20
"""The largest request body read (bytes); a longer one is refused (413)."""


class Endpoint:
    """An HTTP server on a thread of its own; ``hub.answer(path, episode, body)`` returns
    ``(status, json)``; ``hub.models()`` the model list."""

    def __init__(self, hub, key: str, host: str = "127.0.0.1"):
        self.key = key
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # (an answer's headers and body go as two
            # writes: with Nagle the body waited on the client's delayed acknowledgement)

            def log_message(self, *a):
                pass

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _episode(self) -> str | None:
                """The episode named by the bearer token, or None when it lacks the run's
                key (refused)."""
                token = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
                key, _, episode = token.partition(".")
                if not hmac.compare_digest(key.encode(), endpoint.key.encode()):
                    self._reply(401, _error("the run's key is missing or wrong", 401))
                    return None
                return episode

            def do_GET(self):
                if self._episode() is None:
                    return
                if self.path.rstrip("/") == "/v1/models":
                    self._reply(200, hub.models())
                else:
                    self._reply(404, _error(f"no route {self.path}", 404))

            def do_POST(self):
                episode = self._episode()
                if episode is None:
                    return
                n = int(self.headers.get("Content-Length") or 0)
                if n > MAX_BODY:
                    self._reply(413, _error(f"the body is over {MAX_BODY} bytes", 413))
                    self.close_connection = True
                    return
                raw = self.rfile.read(n)
                route = self.path.rstrip("/")
                if route not in ("/v1/chat/completions", "/v1/completions"):
                    self._reply(404, _error(f"no route {self.path}", 404))
                    return
                try:
                    body = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    body = ValueError(f"the body is not JSON ({e})")
                code, out = hub.answer(route, episode, body)
                self._reply(code, out)

        self.server = _Server((host, 0), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        name="posttrain-agent-endpoint", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # (every agent in flight may connect at once)


def _error(message: str, code: int) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "code": code}}


error = _error
