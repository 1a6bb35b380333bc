"""The run's OpenAI-compatible endpoint: ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/models`` over HTTP, on 127.0.0.1 and a free port, for the agents of one run.

Every request must carry the run's key with the episode's name after it as its bearer
token (``Authorization: Bearer KEY.EPISODE``; the ``openai`` client sends its ``api_key``
so): a request without the run's key is refused (401) before anything else is read. What a
request asks is the :class:`~posttrain.agents.runner.Hub`'s to answer; this module speaks
HTTP, and answers the clients the run hands to its agents in process (an ``httpx``
transport: the same checks and answers, no socket).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hmac
import importlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_BODY = 16 << 20
"""The largest request body read (bytes); a longer one is refused (413)."""


class Endpoint:
    """An HTTP server on a thread of its own; ``hub.answer(path, episode, body)`` returns
    ``(status, json)``; ``hub.models()`` the model list. :meth:`transport` answers the
    run's own ``openai`` clients in process, through the same checks."""

    def __init__(self, hub, key: str, host: str = "127.0.0.1"):
        self.hub, self.key = hub, key
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
                episode = endpoint.episode_of(self.headers.get("Authorization", ""))
                if episode is None:  # (its body unread: the connection cannot go on)
                    self._reply(*UNAUTHORISED)
                    self.close_connection = True
                return episode

            def do_GET(self):
                if self._episode() is not None:
                    self._reply(*endpoint.respond("GET", self.path, "", b""))

            def do_POST(self):
                episode = self._episode()
                if episode is None:
                    return
                try:
                    n = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    n = -1
                if n < 0 or n > MAX_BODY:
                    self._reply(*((413, _error(f"the body is over {MAX_BODY} bytes", 413))
                                  if n > MAX_BODY else
                                  (400, _error("a bad Content-Length", 400))))
                    self.close_connection = True
                    return
                self._reply(*endpoint.respond("POST", self.path, episode, self.rfile.read(n)))

        self.server = _Server((host, 0), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        name="posttrain-agent-endpoint", daemon=True)
        self._thread.start()

    def episode_of(self, authorization: str) -> str | None:
        """The episode named by a bearer token (``KEY.EPISODE``), or None when it lacks the
        run's key (refused before anything else is read)."""
        token = authorization.removeprefix("Bearer ").strip()
        key, _, episode = token.partition(".")
        if not hmac.compare_digest(key.encode(), self.key.encode()):
            return None
        return episode

    def respond(self, method: str, path: str, episode: str, raw: bytes,
                wait: float | None = None) -> tuple[int, dict]:
        """A request of an episode whose key was checked: ``(status, json)``; a failure of
        the run's own is a 500 that names it. ``wait``: the longest to wait for the sample
        (the in-process client's read timeout; TimeoutError past it)."""
        route = path.split("?", 1)[0].rstrip("/")
        if method == "GET" and route == "/v1/models":
            return 200, self.hub.models()
        if method != "POST" or route not in ("/v1/chat/completions", "/v1/completions"):
            return 404, _error(f"no route {path}", 404)
        if len(raw) > MAX_BODY:
            return 413, _error(f"the body is over {MAX_BODY} bytes", 413)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:  # (bad JSON, bytes, numbers or nesting)
            body = ValueError(f"the body is not JSON we read ({type(e).__name__}: {e})"[:300])
        try:
            return self.hub.answer(route, episode, body, wait)
        except AnswerTimeout:
            raise
        except Exception as e:
            return 500, _error(f"the endpoint failed: {type(e).__name__}: {e}", 500)

    def transport(self, httpx, asynchronous: bool = False):
        """An ``httpx`` transport (of the module ``httpx``: the one the ``openai`` client is
        built on) that answers in process what this endpoint would answer over HTTP — the
        same key check, routes and answers, the client's read timeout kept; mounted for the
        endpoint's address alone (:func:`client_for`). The run's own clients skip the
        sockets and both sides' HTTP parsing (~0.5 ms of CPU a request). Any other client
        (the plain ``base_url``) speaks HTTP."""
        endpoint = self

        def answer(request, raw: bytes):
            episode = endpoint.episode_of(request.headers.get("Authorization", ""))
            if episode is None:
                code, body = UNAUTHORISED
            else:
                wait = (request.extensions.get("timeout") or {}).get("read")
                try:
                    code, body = endpoint.respond(request.method, request.url.path, episode,
                                                  raw, wait)
                except AnswerTimeout as e:
                    raise httpx.ReadTimeout(str(e), request=request) from None
            return httpx.Response(code, headers={"Content-Type": "application/json"},
                                  content=json.dumps(body).encode())

        if not asynchronous:
            class Local(httpx.BaseTransport):
                def handle_request(self, request):
                    return answer(request, request.read())

            return Local()

        class LocalAsync(httpx.AsyncBaseTransport):
            async def handle_async_request(self, request):
                raw = await request.aread()
                # (the answer waits for the engine: on a daemon thread, off the agent's event
                # loop, so that nothing left waiting holds the interpreter open at exit;
                # asyncio hands the result over, or drops it for a closed loop or a
                # cancelled request)
                done: concurrent.futures.Future = concurrent.futures.Future()

                def work():
                    if not done.set_running_or_notify_cancel():  # (cancelled before it ran)
                        return
                    try:
                        done.set_result(answer(request, raw))
                    except BaseException as e:
                        done.set_exception(e)

                threading.Thread(target=work, name="posttrain-agent-answer",
                                 daemon=True).start()
                return await asyncio.wrap_future(done)

        return LocalAsync()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def client_for(url: str, key: str, timeout: float, asynchronous: bool = False,
               endpoint: Endpoint | None = None):
    """An ``openai`` client of the endpoint for one episode (no retries: a refused request is
    the agent's to see); given the ``endpoint`` itself, one answered in process by it."""
    try:
        import openai
    except ImportError:
        raise RuntimeError("--agent needs the openai package: pip install "
                           "'posttrain[agents]'") from None
    make = openai.DefaultAsyncHttpxClient if asynchronous else openai.DefaultHttpxClient
    local = {}
    if endpoint is not None:  # (the httpx the client is built on: httpx, or httpx2 of late;
        # mounted for the endpoint's address alone: any other goes out as the SDK sends it)
        httpx = importlib.import_module(make.__mro__[1].__module__.split(".")[0])
        local = {"mounts": {url.split("/v1")[0]: endpoint.transport(httpx, asynchronous)}}
    # (made with the run's one TLS context, a client takes ~0.5 ms, not the ~25 ms of
    # building a context — the endpoint speaks plain HTTP, but httpx builds one anyway)
    http = make(verify=_tls(), **local)
    kind = openai.AsyncOpenAI if asynchronous else openai.OpenAI
    return kind(base_url=url, api_key=key, max_retries=0, timeout=timeout, http_client=http)


@functools.lru_cache(maxsize=1)
def _tls():
    import ssl

    return ssl.create_default_context()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # (every agent in flight may connect at once)


def _error(message: str, code: int) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "code": code}}


class AnswerTimeout(TimeoutError):
    """A request of the run's own client not answered within the client's read timeout."""


UNAUTHORISED = (401, _error("the run's key is missing or wrong", 401))


error = _error
