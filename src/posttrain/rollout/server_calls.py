"""The HTTP side of the ``vllm_server`` engine: one call to one server, with a timeout, no
proxy, and the failures named (:class:`ServerDown`: no answer in time or a dropped
connection; :class:`RolloutServerError`: an error answer, or a fleet that cannot serve the
run). Standard library only."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request


class RolloutServerError(ConnectionError):
    """The fleet cannot serve the run: every server is down (or one misbehaved)."""


class StaleWeights(RolloutServerError):
    """A server answered with weights other than the version last pushed."""


class ServerDown(ConnectionError):
    """One server did not answer (timeout, refused or reset connection)."""

    def __init__(self, why: str, timed_out: bool):
        super().__init__(why)
        self.timed_out = timed_out


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""No proxy: samples, weights and keys go to the servers themselves, whatever
``http_proxy`` says."""

def is_local(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    return host in ("127.0.0.1", "localhost", "::1")


def shared_value(value: str) -> str:
    """``value`` as rank 0 has it (every rank's, in one process)."""
    from posttrain import dist

    if dist.world_size() == 1:
        return value
    import torch.distributed as td

    box = [value]
    td.broadcast_object_list(box, src=0)
    return box[0]


class Server:
    def __init__(self, index: int, url: str, local: bool):
        self.index, self.url, self.local = index, url.rstrip("/"), local
        self.alive = True

    def __str__(self) -> str:
        return f"rollout server {self.index} ({self.url})"



def call(server: Server, path: str, body: dict | None, key: str | None, timeout: float,
         method: str = "POST", text_ok: bool = False) -> dict:
    """One call to ``server``; :class:`ServerDown` when it does not answer within
    ``timeout`` s or drops the connection, :class:`RolloutServerError` when it answers with
    an error. ``key``: the bearer token (vLLM's ``--api-key``); ``text_ok``: an answer that
    is not JSON comes back as ``{"text": ...}`` (some of vLLM's routes answer in words)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            text = r.read()
    except urllib.error.HTTPError as e:
        try:
            detail = e.read()[:300].decode(errors="replace")
        except (OSError, http.client.HTTPException):
            detail = ""
        raise RolloutServerError(f"{server}: {path} answered {e.code}: "
                                 f"{' '.join(detail.split())}") from None
    except http.client.HTTPException as e:  # (a server that died mid-answer)
        raise ServerDown(f"dropped {path} ({type(e).__name__})", False) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        timed_out = isinstance(reason, TimeoutError) or isinstance(e, TimeoutError)
        why = (f"did not answer {path} within {timeout:g} s" if timed_out else
               f"dropped {path} ({type(reason).__name__}: {reason})")
        raise ServerDown(why, timed_out) from None
    try:
        return json.loads(text) if text else {}
    except ValueError:
        if text_ok:
            return {"text": text.decode(errors="replace")}
        raise RolloutServerError(f"{server}: {path} answered with something other than "
                                 f"JSON: {text[:100]!r}") from None
