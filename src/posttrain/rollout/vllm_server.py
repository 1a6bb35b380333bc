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
  a safetensors file in ``/dev/shm`` for a server on this host, inline otherwise; or
  vLLM's NCCL transport, GPU to GPU: :mod:`posttrain.rollout.nccl_push`),
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
  with :class:`RolloutServerError` (exit 2; the last checkpoint is intact). A dropped
  server that answers again is re-admitted at the next push (:meth:`~VLLMServerEngine.sync`).

Only the standard library speaks HTTP here; only the NCCL transport imports vLLM."""

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

from posttrain.rollout import nccl_push
from posttrain.rollout.engine import RolloutEngine
from posttrain.rollout.nccl_push import NcclGroups
from posttrain.rollout.push_files import PushFiles, buckets, inline
from posttrain.rollout.server_calls import (
    RolloutServerError,
    Server,
    ServerDown,
    StaleWeights,  # noqa: F401  (re-exported: the run's callers catch it from here)
    call,
    choice,
    is_local,
    readmitted,
    returning,
    shared_value,
    wait_healthy,
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
    transfer: str = "posttrain"
    """How a push moves the weights: ``posttrain`` (safetensors buckets by file or inline,
    any device) or ``nccl`` (vLLM's NCCL transport, GPU to GPU: rollout/nccl_push.py)."""
    address: str = "127.0.0.1"
    """``nccl``: the address at which the servers reach this process."""


_KEY = 16
"""Tokens of a sequence that index it for affinity (a later turn shares its start)."""
_PROBE = 5.0
"""Seconds a dropped server has, at each push, to answer ``/health`` and be re-admitted."""
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
        self._nccl = None
        if options.transfer == "nccl":
            nccl_push.check()
            self._nccl = NcclGroups(options.address, options.timeout, self._call)
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
                wait_healthy(s, self.options.key, self.options.startup_timeout, self.fleet)
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

    def _drop(self, server: Server, why: str, last_stops: bool = True) -> None:
        """Name ``server`` and stop sending to it; with none left, stop the run (unless
        ``last_stops`` is False: a push, whose ranks decide that together)."""
        with self._lock:
            first, server.alive = server.alive, False
            left = [s for s in self.servers if s.alive]
        if first:
            then = (f"its requests go to {', '.join(f'server {s.index}' for s in left)}"
                    if left else "no server is left")
            print(f"warning: {server} {why}: {then}", file=sys.stderr, flush=True)
        if last_stops and not any(s.alive for s in self.servers):
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
        outs = [choice(server, out, self.tag) for server, out in answers]
        self._made = {}
        for (prompt, _), (server, _), (ids, *_) in zip(jobs, answers, outs, strict=True):
            seq = prompt + tuple(ids)
            self._made.setdefault(seq[:min(_KEY, len(seq))], []).append((seq, server))
        return self._rollout(requests, n, params, outs, [s for s, _ in answers])

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
        docstring); a server that stops answering is dropped, one that answers again is
        re-admitted (:func:`~posttrain.rollout.server_calls.returning`). Under ``torchrun``
        rank 0 pushes (every rank reads the stream: a sharded run gathers it collectively)
        and every rank then takes rank 0's view of the fleet, so none samples before the
        servers hold the version."""
        from posttrain import dist
        from posttrain.models.weights import hf_weights

        t0 = time.perf_counter()
        back = returning(self.servers, self.options.key, min(_PROBE, self.options.timeout),
                         lambda s: self.fleet is None or self.fleet.running(s.index))
        adapter_only = self.adapter is not None and self._pushed
        if adapter_only and back:  # (a returning server holds no base weights: they go first)
            weights = hf_weights(self._model, self.dtype, merged=False)
        full = [s for s in self._live() if s in back or not adapter_only]
        """The servers that take the stream (an adapter push reads none of it)."""
        if dist.world_size() > 1 and dist.rank() != 0:
            if back or not adapter_only:
                for _ in weights:
                    pass
        else:
            self._push(weights, version, full, back)
        if dist.world_size() > 1:  # (rank 0 pushed: a server it dropped lacks the version)
            flags = shared_value("".join("1" if s.alive else "0" for s in self.servers))
            for s, flag in zip(self.servers, flags, strict=True):
                s.alive = flag == "1"
        if not any(s.alive for s in self.servers):
            raise RolloutServerError(f"every rollout server is down after the push; {_RESUME}")
        readmitted(back, version)
        if adapter_only and version != self.version:
            self._files.drop(self._adapter_name(self.version))
        self.version = version
        self._made = {}
        self._pushed = True
        self.push_seconds = time.perf_counter() - t0

    def _push(self, weights, version: int, full: list[Server], back: list[Server]) -> None:
        """Rank 0's push (:meth:`sync`): the stream to ``full``, then the adapter (LoRA
        runs) to every live server. A returning server (``back``) first finishes an update
        it may have been left in (dropped mid-push) and, on NCCL, closes its old group."""
        tag, key = f"{self.run_id}-{version}", self.options.key or ""
        live, paused = self._live(), []
        adapter = None
        name = self._adapter_name(version)

        def attempt(server: Server, fn, *args, error_ok: bool = False):
            """``fn(*args)`` for ``server``; a server that fails it (no answer, or an error
            unless ``error_ok``) is dropped: it does not hold the weights the run samples."""
            if not server.alive:
                return None
            try:
                return fn(*args)
            except (ServerDown, RolloutServerError) as e:
                if not (error_ok and isinstance(e, RolloutServerError)):
                    self._drop(server, str(e).removeprefix(f"{server}: "), last_stops=False)
                return None

        def call(server: Server, path: str, body: dict | None = None, error_ok=False):
            return attempt(server, self._call, server, path, body, error_ok=error_ok)

        try:
            for server in live:
                if call(server, "/pause?mode=wait") is not None:
                    paused.append(server)
                if server in back:  # (errors answered: there was nothing to finish or close)
                    call(server, "/finish_weight_update", None, error_ok=True)
                    if self._nccl is not None:
                        self._nccl.close(server)
                        call(server, "/shutdown_weight_transfer_engine", None, error_ok=True)
                if server in full and self._nccl is None:
                    call(server, "/init_weight_transfer_engine", {"init_info": {
                        "key": key, "reserve": self.adapter is None}})
                elif server in full and server.index not in self._nccl.groups:
                    attempt(server, self._nccl.open, server)
                if server in full:
                    call(server, "/start_weight_update")
            for index, bucket in enumerate(buckets(
                    self._model, self._tied, weights, self.dtype, self.options.bucket_mb)
                    if full else ()):
                blob = path = None
                for server in full:
                    if not server.alive:
                        continue
                    if self._nccl is not None:
                        attempt(server, self._nccl.send, server, bucket)
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
                if server in full:
                    call(server, "/finish_weight_update", {"weight_version": tag})
                if adapter is not None and call(server, "/v1/load_lora_adapter", {
                        "lora_name": name, "lora_path": adapter}) is not None:
                    call(server, "/update_weight_version", {"new_version": tag})
                    old, server.adapter = server.adapter, name
                    if old not in (None, name):  # (a restarted server has none: not an error)
                        call(server, "/v1/unload_lora_adapter", {"lora_name": old}, True)
                done = call(server, "/reset_prefix_cache")
                if done is not None and done.get("success") is False:
                    self._drop(server, "could not reset its prefix cache after the push (it "
                               "would reuse the old weights' keys and values)", last_stops=False)
        finally:  # every server paused resumes, whatever became of the push (a server
            # dropped on the way too: it may serve another run)
            for server in paused:
                with contextlib.suppress(ServerDown, RolloutServerError):
                    self._call(server, "/resume")

    def close(self) -> None:
        if self._nccl is not None:
            self._nccl.close_all()
        self._files.close()
        fleet, self.fleet = self.fleet, None
        if fleet is not None:
            fleet.close()
