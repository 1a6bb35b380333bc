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
- **LoRA** (``adapter``): the servers hold the base weights (pushed once, at the start)
  and each later push is the adapter alone, written as a peft directory in ``/dev/shm``
  and loaded in place through ``/v1/load_lora_adapter``; the version is set with
  ``/update_weight_version``. Servers on this host only (they read the directory).
- **No hangs**: every call has a timeout (``timeout`` s). A server that does not answer
  in time or refuses the connection is named in one line and dropped; its requests go to
  the servers left (the same samples: seeds are per request); with none left the run stops
  with :class:`RolloutServerError` (exit 2; the last checkpoint is intact).

Only the standard library speaks HTTP here; nothing imports vLLM."""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from posttrain.rollout.engine import RolloutEngine
from posttrain.rollout.push_files import PushFiles, buckets, inline
from posttrain.rollout.server_calls import (
    RolloutServerError,
    Server,
    ServerDown,
    StaleWeights,
    call,
    is_local,
    shared_value,
)
from posttrain.rollout.types import Request, Rollout, SamplingParams, cut_at_stop, sample_seed
from posttrain.rollout.vllm import _tied_names


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
    """Requests in flight per live server (the pool is this times the live servers)."""
    local: list[bool] = field(default_factory=list)
    """Per server: on this host (pushes go by file); default from the URL's host."""
    adapter: str | None = None
    """A LoRA policy's push: None = merged weights through the RL API; a name = the
    servers hold the base weights and load the adapter alone under this name (vLLM's
    ``/v1/load_lora_adapter``, servers started with ``--enable-lora``), and every request
    names it."""


_KEY = 16
"""Tokens of a sequence that index it for affinity (a later turn shares its start)."""
_RESUME = ("the run's last checkpoint is intact: resume with --resume_from once they "
           "answer")
"""How every 'every rollout server is down' error ends, whichever path found it."""


class VLLMServerEngine(RolloutEngine):
    """Sample through a fleet of vLLM servers (see the module docstring)."""

    name = "vllm_server"

    def __init__(self, model, tokenizer, options: ServerOptions, fleet=None):
        self.tokenizer, self.options, self.fleet = tokenizer, options, fleet
        self.dtype = (next(model.parameters()).dtype if options.dtype == "auto"
                      else getattr(torch, options.dtype))
        local = options.local or [is_local(u) for u in options.urls]
        self.servers = [Server(i, u, loc) for i, (u, loc) in
                        enumerate(zip(options.urls, local, strict=True))]
        if not self.servers:
            raise ValueError("rollout_backend=vllm_server needs rollout_servers or "
                             "launch_rollout_servers")
        self.run_id = shared_value(secrets.token_hex(4))  # (rank 0's: its pushes name it)
        self._lock = threading.Lock()
        self._model, self._tied = model, _tied_names(model)
        self._made: dict[tuple[int, ...], list] = {}
        """The last call's sequences and their servers, by their first ``_KEY`` tokens."""
        self.adapter = options.adapter
        self._files = PushFiles(self.run_id, keep_bytes=0 if self.adapter is not None else (
            sum(p.numel() for p in model.parameters()) * self.dtype.itemsize))
        """(With an adapter the bucket files carry the base weights once: not kept.)"""
        if self.adapter is not None and not all(s.local for s in self.servers):
            raise ValueError("rollout_lora_push=adapter needs every rollout server on this "
                             "host (a server reads the adapter from a path); use "
                             "rollout_lora_push merged")
        self._pushed = False
        """Whether the first push (the base weights, with an adapter) is done."""
        self.push_seconds = 0.0
        self.last_servers: list[int] = []
        """The server that drew each sample of the last call."""
        try:
            for s in self.servers:
                self._wait_healthy(s)
            from posttrain.models.weights import hf_weights

            self.sync(hf_weights(model, self.dtype, merged=self.adapter is None), 0)
        except BaseException:
            self.close()
            raise

    # --- HTTP ----------------------------------------------------------------------------
    def _call(self, server: Server, path: str, body: dict | None = None,
              method: str = "POST", timeout: float | None = None) -> dict:
        return call(server, path, body, self.options.key, timeout or self.options.timeout,
                    method, text_ok=path.startswith("/v1/"))

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
        with self._lock:
            first, server.alive = server.alive, False
            left = [s for s in self.servers if s.alive]
        if first:
            then = (f"its requests go to {', '.join(f'server {s.index}' for s in left)}"
                    if left else "no server is left")
            print(f"warning: {server} {why}: {then}", file=sys.stderr, flush=True)
        if not any(s.alive for s in self.servers):
            raise RolloutServerError(f"every rollout server is down (the last: {server} "
                                     f"{why}); {_RESUME}")

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

    def _body(self, ids, params: dict) -> dict:
        body = {"token_ids": list(ids), "sampling_params": params}
        if self.adapter is not None:
            body["model"] = self._adapter_name(self.version)
        return body

    def _adapter_name(self, version: int) -> str:
        """What the servers call the adapter of ``version`` (a name a version: vLLM reloads
        an adapter loaded "in place" at every batch that uses it)."""
        return f"{self.adapter}-{version}"

    def _home(self, prompt: tuple[int, ...], live: list[Server]) -> Server:
        """The live server a prompt goes to: where the sequence it extends was made, else
        the one its hash picks."""
        for k in range(1, min(_KEY, len(prompt)) + 1):
            for seq, server in self._made.get(prompt[:k], ()):
                if server in live and len(seq) <= len(prompt) and prompt[:len(seq)] == seq:
                    return server
        h = int.from_bytes(hashlib.sha256(repr(prompt).encode()).digest()[:8], "little")
        return live[h % len(live)]

    def _sample(self, prompt: tuple[int, ...], params: dict) -> tuple[Server, dict]:
        """One sample, on its server or, when that one is down, the next live one."""
        while True:
            live = self._live()
            if not live:
                raise RolloutServerError(f"every rollout server is down; {_RESUME}")
            server = self._home(prompt, live)
            body = self._body(prompt, params)
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
            self._made.setdefault(seq[:min(_KEY, len(seq))], []).append((seq, server))
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
        covered = sum(int(s["end"]) - int(s["start"]) for s in spans or [])
        if not stale and covered != len(ids):
            raise RolloutServerError(f"{server}'s weight versions cover {covered} of the "
                                     f"{len(ids)} tokens it sampled")
        if stale:
            raise StaleWeights(f"{server} sampled with weights {sorted(stale)}, not the "
                               f"version last pushed ({self.tag}): it was restarted or "
                               "updated by someone else; refusing its samples")
        content = (choice.get("logprobs") or {}).get("content") or []
        if content and [c["token_id"] for c in content] != ids:
            raise RolloutServerError(f"{server} returned log-probs that are not the "
                                     "sampled tokens'")
        lps = [float(c["logprob"]) for c in content] if content else [0.0] * len(ids)
        reason = choice.get("finish_reason")
        if reason not in ("stop", "length"):  # (aborted: someone paused the server)
            raise RolloutServerError(f"{server} ended a sample with finish reason "
                                     f"{reason!r}, not stop or length")
        return ids, lps, reason

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
        out = self._call(server, "/inference/v1/generate", self._body(seq, params))
        rows = out["prompt_logprobs"]
        return torch.tensor([float(rows[t][str(seq[t])]["logprob"]) for t in range(k, len(seq))])

    # --- weights ---------------------------------------------------------------------------
    def sync(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Push the stream to every live server through vLLM's RL API (see the module
        docstring); a server that stops answering is dropped. Under ``torchrun`` rank 0
        pushes (every rank reads the stream: a sharded run gathers it collectively) and the
        ranks meet after the push, so none samples before the servers hold the version."""
        from posttrain import dist

        t0 = time.perf_counter()
        adapter_only = self.adapter is not None and self._pushed
        if dist.world_size() > 1 and dist.rank() != 0:
            if not adapter_only:  # (an adapter push reads nothing of the stream)
                for _ in weights:
                    pass
            dist.barrier()
            self.version, self._made, self._pushed = version, {}, True
            return
        tag, key = f"{self.run_id}-{version}", self.options.key or ""
        live, paused = self._live(), []
        adapter = None
        name, old = self._adapter_name(version), self._adapter_name(self.version)

        def call(server: Server, path: str, body: dict | None = None) -> dict | None:
            """``path`` on ``server``; a server that fails it (no answer, or an error) is
            dropped: it no longer holds the weights the run samples from."""
            if not server.alive:
                return None
            try:
                return self._call(server, path, body)
            except (ServerDown, RolloutServerError) as e:
                self._drop(server, str(e).removeprefix(f"{server}: "))
                return None

        try:
            for server in live:
                if call(server, "/pause?mode=wait") is not None:
                    paused.append(server)
                if not adapter_only:
                    call(server, "/init_weight_transfer_engine", {"init_info": {
                        "key": key, "reserve": self.adapter is None}})
                    call(server, "/start_weight_update")
            for index, bucket in enumerate(() if adapter_only else buckets(
                    self._model, self._tied, weights, self.dtype, self.options.bucket_mb)):
                blob = path = None
                for server in live:
                    if not server.alive:
                        continue
                    if server.local and path is None:
                        path = self._files.bucket(index, bucket)
                    elif not server.local and blob is None:
                        blob = inline(bucket)
                    info = ({"key": key, "path": path} if server.local else
                            {"key": key, "data": blob})
                    call(server, "/update_weights", {"update_info": info})
                if path is not None:
                    self._files.release(index)
            if self.adapter is not None:
                adapter = self._files.adapter(self._model, name)
            for server in live:
                if not adapter_only:
                    call(server, "/finish_weight_update", {"weight_version": tag})
                if adapter is not None:
                    if call(server, "/v1/load_lora_adapter", {
                            "lora_name": name, "lora_path": adapter}) is not None:
                        call(server, "/update_weight_version", {"new_version": tag})
                    if adapter_only and old != name:
                        call(server, "/v1/unload_lora_adapter", {"lora_name": old})
                done = call(server, "/reset_prefix_cache")
                if done is not None and done.get("success") is False:
                    self._drop(server, "could not reset its prefix cache after the push "
                               "(it would reuse the old weights' keys and values)")
        finally:  # every server paused resumes, whatever became of the push (a server
            # dropped on the way too: it may serve another run)
            for server in paused:
                with contextlib.suppress(ServerDown, RolloutServerError):
                    self._call(server, "/resume")
        if not any(s.alive for s in self.servers):
            raise RolloutServerError(f"every rollout server is down after the push; {_RESUME}")
        if dist.world_size() > 1:
            dist.barrier()
        if adapter_only and old != name:
            self._files.drop(old)
        self.version = version
        self._made = {}
        self._pushed = True
        self.push_seconds = time.perf_counter() - t0

    def close(self) -> None:
        self._files.close()
        fleet, self.fleet = self.fleet, None
        if fleet is not None:
            fleet.close()
