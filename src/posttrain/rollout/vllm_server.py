"""The ``vllm_server`` rollout engine: a client of one or more vLLM servers (the rollout
fleet), which sample on their own devices while the trainer holds only this client.

- **Requests** go to vLLM's token-in/token-out endpoint (``/inference/v1/generate``), one
  per sample: the prompt's token ids and the sample's own seed (``sample_seed(seed, j)``),
  so a sample is the same whichever server draws it. The answer carries the sampled token
  ids, their behaviour log-probs (the server runs ``--logprobs-mode processed_logprobs``),
  the finish reason and the versions of the weights that sampled each token; a version
  other than the one last pushed is an error (:class:`StaleWeights`), never a sample.
- **Affinity**: a request goes to the server its prompt hashes to, so a group's samples
  share one server's prefix cache; a request that extends a sequence the last call
  produced (an episode's next turn) goes where that sequence was made.
- **Weights** through vLLM's own RL API (:meth:`VLLMServerEngine.sync`): ``/pause``,
  ``/start_weight_update``, buckets of (Hugging Face name, tensor) through
  ``/update_weights`` (posttrain's transport, :mod:`posttrain.rollout.vllm_transfer`:
  a safetensors file in ``/dev/shm`` for a server on this host, inline otherwise),
  ``/finish_weight_update`` with the version, ``/resume``. The version names the run
  (``<run id>-<step>``), so a server restarted on other weights answers with another
  version and is refused.
- **No hangs**: every call has a timeout (``timeout`` s). A server that does not answer
  in time or refuses the connection is named in one line and dropped; its requests go to
  the servers left (the same samples: seeds are per request); with none left the run stops
  with :class:`RolloutServerError` (exit 2; the last checkpoint is intact).

Only the standard library speaks HTTP here; nothing imports vLLM."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from posttrain.models.weights import checkpoint_layout
from posttrain.rollout.engine import RolloutEngine
from posttrain.rollout.types import Request, Rollout, SamplingParams, cut_at_stop, sample_seed
from posttrain.rollout.vllm import _tied_names, _with_head


class RolloutServerError(ConnectionError):
    """The fleet cannot serve the run: every server is down (or one misbehaved)."""


class StaleWeights(RolloutServerError):
    """A server answered with weights other than the version last pushed."""


class ServerDown(ConnectionError):
    """One server did not answer (timeout, refused or reset connection)."""

    def __init__(self, why: str, timed_out: bool):
        super().__init__(why)
        self.timed_out = timed_out


@dataclass
class ServerOptions:
    urls: list[str]
    key: str | None = None
    """Sent as the bearer token (vLLM's ``--api-key``) and with every weight push."""
    timeout: float = 120.0
    """Seconds any one call to a server may take."""
    bucket_mb: int = 256
    """Largest weight bucket of a push, MiB."""
    dtype: str = "auto"
    startup_timeout: float = 600.0
    """Seconds to wait for a server's ``/health`` before the first push."""
    max_concurrency: int = 256
    """Requests in flight per server."""
    local: list[bool] = field(default_factory=list)
    """Per server: on this host (pushes go by file); default from the URL's host."""


_KEY = 16
"""Tokens of a sequence that index it for affinity (a later turn shares its start)."""


def _is_local(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    return host in ("127.0.0.1", "localhost", "::1")


class Server:
    def __init__(self, index: int, url: str, local: bool):
        self.index, self.url, self.local = index, url.rstrip("/"), local
        self.alive = True

    def __str__(self) -> str:
        return f"rollout server {self.index} ({self.url})"


class VLLMServerEngine(RolloutEngine):
    """Sample through a fleet of vLLM servers (see the module docstring)."""

    name = "vllm_server"

    def __init__(self, model, tokenizer, options: ServerOptions, fleet=None):
        self.tokenizer, self.options, self.fleet = tokenizer, options, fleet
        self.dtype = (next(model.parameters()).dtype if options.dtype == "auto"
                      else getattr(torch, options.dtype))
        local = options.local or [_is_local(u) for u in options.urls]
        self.servers = [Server(i, u, loc) for i, (u, loc) in
                        enumerate(zip(options.urls, local, strict=True))]
        if not self.servers:
            raise ValueError("rollout_backend=vllm_server needs rollout_servers or "
                             "launch_rollout_servers")
        self.run_id = secrets.token_hex(4)
        self._model, self._tied = model, _tied_names(model)
        self._made: dict[tuple[int, ...], list] = {}
        """The last call's sequences and their servers, by their first ``_KEY`` tokens."""
        self._dir = None
        self.push_seconds = 0.0
        self.last_servers: list[int] = []
        """The server that drew each sample of the last call."""
        try:
            for s in self.servers:
                self._wait_healthy(s)
            from posttrain.models.weights import hf_weights

            self.sync(hf_weights(model, self.dtype), 0)
        except BaseException:
            self.close()
            raise

    # --- HTTP ----------------------------------------------------------------------------
    def _call(self, server: Server, path: str, body: dict | None = None,
              method: str = "POST", timeout: float | None = None) -> dict:
        """One call; :class:`ServerDown` when the server does not answer in time or drops
        the connection, :class:`RolloutServerError` when it answers with an error."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(server.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.options.key:
            req.add_header("Authorization", f"Bearer {self.options.key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.options.timeout) as r:
                text = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode(errors="replace")
            raise RolloutServerError(f"{server}: {path} answered {e.code}: "
                                     f"{' '.join(detail.split())}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            timed_out = isinstance(reason, TimeoutError) or isinstance(e, TimeoutError)
            if timed_out:
                why = f"did not answer {path} within {timeout or self.options.timeout:g} s"
            else:
                why = f"dropped {path} ({type(reason).__name__}: {reason})"
            raise ServerDown(why, timed_out) from None
        return json.loads(text) if text else {}

    def _wait_healthy(self, server: Server) -> None:
        deadline = time.monotonic() + self.options.startup_timeout
        last = ""
        while time.monotonic() < deadline:
            if self.fleet is not None:
                self.fleet.check(server.index)  # a launched server that died: its log's tail
            try:
                self._call(server, "/health", method="GET", timeout=5.0)
                return
            except (ServerDown, RolloutServerError) as e:
                last = str(e)
            time.sleep(1.0)
        raise RolloutServerError(f"{server} was not healthy within "
                                 f"{self.options.startup_timeout:g} s ({last})")

    def _drop(self, server: Server, why: str) -> None:
        if server.alive:
            server.alive = False
            left = [s for s in self.servers if s.alive]
            then = (f"its requests go to {', '.join(f'server {s.index}' for s in left)}"
                    if left else "no server is left")
            print(f"warning: {server} {why}: {then}", file=sys.stderr, flush=True)
        if not any(s.alive for s in self.servers):
            raise RolloutServerError(
                f"every rollout server is down (the last: {server} {why}); the run's last "
                "checkpoint is intact: resume with --resume_from once they answer")

    def _live(self) -> list[Server]:
        return [s for s in self.servers if s.alive]

    @property
    def tag(self) -> str:
        return f"{self.run_id}-{self.version}"

    # --- sampling ------------------------------------------------------------------------
    def _params(self, p: SamplingParams, seed: int | None) -> dict:
        eos = self.tokenizer.eos_token_id
        return {"n": 1, "temperature": p.temperature, "top_p": p.top_p,
                "top_k": p.top_k or -1, "max_tokens": p.max_new_tokens, "seed": seed,
                "logprobs": 0, "stop": list(p.stop) or None,
                "stop_token_ids": [eos] if eos is not None else None,
                "detokenize": bool(p.stop)}

    def _home(self, prompt: tuple[int, ...]) -> int:
        """The index among live servers a prompt goes to: where the sequence it extends
        was made, else its hash."""
        live = self._live()
        for seq, server in self._made.get(prompt[:_KEY], ()):
            if server.alive and len(seq) <= len(prompt) and prompt[:len(seq)] == seq:
                return live.index(server)
        h = int.from_bytes(hashlib.sha256(repr(prompt).encode()).digest()[:8], "little")
        return h % len(live)

    def _sample(self, prompt: tuple[int, ...], params: dict) -> tuple[Server, dict]:
        """One sample, on its server or, when that one is down, the next live one."""
        while True:
            live = self._live()
            if not live:
                raise RolloutServerError("every rollout server is down")
            server = live[self._home(prompt) % len(live)]
            body = {"token_ids": list(prompt), "sampling_params": params}
            try:
                return server, self._call(server, "/inference/v1/generate", body)
            except ServerDown as e:
                if e.timed_out:
                    self._drop(server, str(e))
                    continue
            time.sleep(1.0)  # a dropped connection: once more (an overloaded accept queue)
            try:
                return server, self._call(server, "/inference/v1/generate", body)
            except ServerDown as e:
                self._drop(server, str(e))

    def generate(self, requests: list[Request], n: int = 1,
                 params: SamplingParams | None = None,
                 generator: torch.Generator | None = None,
                 extras: frozenset[str] = frozenset()) -> Rollout:
        """``n`` samples per request, each its own server request seeded
        ``sample_seed(request.seed, j)`` (``generator`` seeds requests without one)."""
        params = params or SamplingParams()
        params.validate()
        jobs = []
        for r in requests:
            for j in range(n):
                seed = (sample_seed(r.seed, j) if r.seed is not None else
                        None if generator is None else
                        int(torch.randint(2**62, (1,), generator=generator)))
                jobs.append((tuple(r.prompt_ids), self._params(params, seed)))
        if not jobs:
            return self._rollout(requests, n, params, [], [])
        workers = min(len(jobs), self.options.max_concurrency * len(self._live()))
        with ThreadPoolExecutor(workers, thread_name_prefix="rollout-server") as pool:
            answers = list(pool.map(lambda job: self._sample(*job), jobs))
        outs = [self._choice(server, out) for server, out in answers]
        self._made = {}
        for (prompt, _), (server, _), (ids, *_) in zip(jobs, answers, outs, strict=True):
            seq = prompt + tuple(ids)
            self._made.setdefault(seq[:_KEY], []).append((seq, server))
        return self._rollout(requests, n, params, outs, [s for s, _ in answers])

    def _choice(self, server: Server, out: dict) -> tuple[list[int], list[float], str]:
        choice = out["choices"][0]
        ids = list(choice.get("token_ids") or [])
        spans = choice.get("weight_versions")
        if not spans and ids:
            raise RolloutServerError(f"{server} does not report the weight version of what "
                                     "it sampled (vLLM ≥ 0.32 with its RL API, "
                                     "VLLM_SERVER_DEV_MODE=1)")
        stale = {s["version"] for s in spans or []} - {self.tag}
        if stale:
            raise StaleWeights(f"{server} sampled with weights {sorted(stale)}, not the "
                               f"version last pushed ({self.tag}): it was restarted or "
                               "updated by someone else; refusing its samples")
        content = (choice.get("logprobs") or {}).get("content") or []
        if content and [c["token_id"] for c in content] != ids:
            raise RolloutServerError(f"{server} returned log-probs that are not the "
                                     "sampled tokens'")
        lps = [float(c["logprob"]) for c in content] if content else [0.0] * len(ids)
        return ids, lps, choice.get("finish_reason") or "stop"

    def _rollout(self, requests, n, params, outs, servers) -> Rollout:
        pad = self.tokenizer.pad_token_id
        N, T = len(outs), max((len(o[0]) for o in outs), default=0)
        ids = torch.full((N, T), pad, dtype=torch.long)
        mask = torch.zeros(N, T, dtype=torch.long)
        lps = torch.zeros(N, T)
        for i, (row, lp, _) in enumerate(outs):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, :len(row)] = 1
            if params.temperature > 0:
                lps[i, :len(row)] = torch.tensor(lp, dtype=torch.float32)
        truncated = torch.tensor([o[2] == "length" for o in outs], dtype=torch.bool)
        texts = self.tokenizer.batch_decode([o[0] for o in outs], skip_special_tokens=True)
        if params.stop:
            texts = [cut_at_stop(x, params.stop) for x in texts]
        self.last_servers = [s.index for s in servers]
        return Rollout(prompt_ids=[list(r.prompt_ids) for r in requests for _ in range(n)],
                       completion_ids=ids, completion_mask=mask, logprobs=lps,
                       truncated=truncated,
                       group_ids=torch.arange(len(requests)).repeat_interleave(n),
                       texts=texts, policy_version=self.version)

    # --- the guard's probe -----------------------------------------------------------------
    def score_each(self, sequences: list[list[int]], prompt_lens: list[int]
                   ) -> dict[str, list[torch.Tensor]]:
        """Each live server's log-probs (temperature 1) of each sequence after its prompt."""
        got = {}
        for server in self._live():
            try:
                got[str(server)] = [self._score_one(server, s, k)
                                    for s, k in zip(sequences, prompt_lens, strict=True)]
            except ServerDown as e:
                self._drop(server, str(e))
        return got

    def score(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[torch.Tensor]:
        """The log-probs of the first live server (:meth:`score_each` for all)."""
        return next(iter(self.score_each(sequences, prompt_lens).values()))

    def _score_one(self, server: Server, seq: list[int], k: int) -> torch.Tensor:
        params = {"n": 1, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0,
                  "detokenize": False}
        out = self._call(server, "/inference/v1/generate",
                         {"token_ids": list(seq), "sampling_params": params})
        rows = out["prompt_logprobs"]
        return torch.tensor([float(rows[t][str(seq[t])]["logprob"]) for t in range(k, len(seq))])

    # --- weights ---------------------------------------------------------------------------
    def _buckets(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """The stream in the checkpoint layout vLLM's loaders read, as safetensors blobs of
        at most ``bucket_mb`` MiB (a larger tensor goes alone)."""
        from safetensors.torch import save

        limit, bucket, size = self.options.bucket_mb << 20, {}, 0
        for name, t in _with_head(checkpoint_layout(self._model, weights), self._tied):
            t = t.detach().to("cpu", self.dtype).contiguous()
            if bucket and size + t.numel() * t.element_size() > limit:
                yield save(bucket)
                bucket, size = {}, 0
            if any(t.data_ptr() == x.data_ptr() for x in bucket.values()):
                t = t.clone()  # (a tied head: safetensors stores no shared tensors)
            bucket[name] = t
            size += t.numel() * t.element_size()
        if bucket:
            yield save(bucket)

    def sync(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Push the stream to every live server through vLLM's RL API (see the module
        docstring); a server that stops answering is dropped. Under ``torchrun`` rank 0
        pushes (every rank reads the stream: a sharded run gathers it collectively) and the
        ranks meet after the push, so none samples before the servers hold the version."""
        from posttrain import dist

        t0 = time.perf_counter()
        if dist.world_size() > 1 and dist.rank() != 0:
            for _ in weights:
                pass
            dist.barrier()
            self.version, self._made = version, {}
            return
        tag, key = f"{self.run_id}-{version}", self.options.key or ""
        live = self._live()

        def each(path: str, body: dict | None = None) -> None:
            for s in list(live):
                if s.alive:
                    try:
                        self._call(s, path, body)
                    except ServerDown as e:
                        self._drop(s, str(e))

        each("/pause?mode=wait")
        each("/init_weight_transfer_engine", {"init_info": {"key": key}})
        each("/start_weight_update")
        for blob in self._buckets(weights):
            inline = {"key": key, "data": base64.b64encode(blob).decode()}
            path = None
            if any(s.local for s in live):
                if self._dir is None:
                    self._dir = tempfile.mkdtemp(prefix=f"posttrain-push-{self.run_id}-",
                                                 dir="/dev/shm" if os.path.isdir("/dev/shm")
                                                 else None)
                path = os.path.join(self._dir, "bucket.safetensors")
                with open(path, "wb") as f:
                    f.write(blob)
            for s in list(live):
                if s.alive:
                    info = {"key": key, "path": path} if s.local else inline
                    try:
                        self._call(s, "/update_weights", {"update_info": info})
                    except ServerDown as e:
                        self._drop(s, str(e))
        each("/finish_weight_update", {"weight_version": tag})
        each("/reset_prefix_cache")
        each("/resume")
        if dist.world_size() > 1:
            dist.barrier()
        self.version = version
        self._made = {}
        self.push_seconds = time.perf_counter() - t0

    def close(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        fleet, self.fleet = self.fleet, None
        if fleet is not None:
            fleet.close()
