"""The HTTP side of the ``vllm_server`` engine: one call to one server, with a timeout, no
proxy, and the failures named (:class:`ServerDown`: no answer in time or a dropped
connection; :class:`RolloutServerError`: an error answer, or a fleet that cannot serve the
run). Standard library only."""

from __future__ import annotations

import http.client
import json
import time
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
        self.adapter: str | None = None
        """The LoRA adapter it was last given (adapter pushes)."""
        self.failures = 0
        """Re-admissions in a row that failed (:func:`returning`)."""
        self.wait = 0
        """Pushes before it is asked again."""

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


def answers(server: Server, key: str | None, timeout: float) -> bool:
    """Whether ``server``'s engine answers within ``timeout`` s (``/is_paused`` reaches the
    engine, where ``/health`` is answered by the front end alone)."""
    try:
        call(server, "/is_paused", None, key, timeout, "GET")
        return True
    except (ServerDown, RolloutServerError):
        return False


def returning(servers: list[Server], key: str | None, timeout: float,
              asked=lambda s: True) -> list[Server]:
    """The dropped servers (of those ``asked`` says to ask) that answer again within
    ``timeout`` s, all asked at once, marked alive: they take the coming push. Rank 0
    asks and every rank learns its answer. A server whose re-admission failed is asked
    again only after 1, 3, 7, … pushes (at most 63)."""
    from concurrent.futures import ThreadPoolExecutor

    from posttrain import dist

    gone = []
    for s in servers:
        if not s.alive and s.wait:
            s.wait -= 1  # (a push it sits out)
        elif not s.alive and asked(s):
            gone.append(s)
    back: list[Server] = []
    if gone and dist.rank() == 0:
        with ThreadPoolExecutor(len(gone)) as pool:
            ok = list(pool.map(lambda s: answers(s, key, timeout), gone))
        back = [s for s, k in zip(gone, ok, strict=True) if k]
    if dist.world_size() > 1:
        indices = shared_value(",".join(str(s.index) for s in back))
        back = [servers[int(i)] for i in indices.split(",") if i]
    for s in back:
        s.alive = True
    return back


def readmitted(back: list[Server], version: int) -> None:
    """After the push: name the servers of ``back`` that took it; the others wait longer
    before they are asked again (:func:`returning`)."""
    import sys

    for s in back:
        if s.alive:
            s.failures = 0
            print(f"{s} answers again: re-admitted with version {version}", file=sys.stderr,
                  flush=True)
        else:
            s.failures += 1
            s.wait = 2 ** min(s.failures, 6) - 1  # (pushes it sits out)


def choice(server: Server, out: dict, tag: str) -> tuple[list[int], list[float], str]:
    """A ``/inference/v1/generate`` answer's sample: its token ids, behaviour log-probs and
    finish reason, checked: every token sampled by the weights ``tag`` names (else
    :class:`StaleWeights`), log-probs of those tokens, a finish reason of stop or length."""
    first = out["choices"][0]
    ids = list(first.get("token_ids") or [])
    spans = first.get("weight_versions")
    if not spans and ids:
        raise RolloutServerError(f"{server} does not report the weight version of what "
                                 "it sampled (vLLM ≥ 0.32 with its RL API, "
                                 "VLLM_SERVER_DEV_MODE=1)")
    stale = {s["version"] for s in spans or []} - {tag}
    covered = sum(int(s["end"]) - int(s["start"]) for s in spans or [])
    if not stale and covered != len(ids):
        raise RolloutServerError(f"{server}'s weight versions cover {covered} of the "
                                 f"{len(ids)} tokens it sampled")
    if stale:
        raise StaleWeights(f"{server} sampled with weights {sorted(stale)}, not the "
                           f"version last pushed ({tag}): it was restarted or "
                           "updated by someone else; refusing its samples")
    content = (first.get("logprobs") or {}).get("content") or []
    if content and [c["token_id"] for c in content] != ids:
        raise RolloutServerError(f"{server} returned log-probs that are not the "
                                 "sampled tokens'")
    lps = [float(c["logprob"]) for c in content] if content else [0.0] * len(ids)
    reason = first.get("finish_reason")
    if reason not in ("stop", "length"):  # (aborted: someone paused the server)
        raise RolloutServerError(f"{server} ended a sample with finish reason "
                                 f"{reason!r}, not stop or length")
    return ids, lps, reason


def wait_healthy(server: Server, key: str | None, timeout: float, fleet=None) -> None:
    """Wait up to ``timeout`` s for ``server`` to answer ``/health`` (a launched server
    whose process exits meanwhile: an error with its log's tail, from ``fleet``)."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if fleet is not None:
            fleet.check(server.index)
        try:
            call(server, "/health", None, key, 5.0, "GET")
            return
        except (ServerDown, RolloutServerError) as e:
            last = str(e)
        time.sleep(1.0)
    raise RolloutServerError(f"{server} was not healthy within {timeout:g} s ({last})")
