"""The producer of asynchronous rollouts in a process of its own (``async_producer=process``).

A producer thread shares the interpreter lock with the learner: on a small model, whose
steps are mostly Python between short kernels, the two threads take turns rather than run
side by side (measured in docs/async.md). A second process has its own interpreter. It
runs the same :class:`~posttrain.trainers.online.producer.Producer` — the same schedule,
seeds, data order and checkpoint state — over an engine of its own (its own copy of the
policy, loaded from ``cfg.model`` and overwritten by the first weights it is sent), and
the learner talks to it through :class:`RemoteProducer`, which has the thread's methods.

Between the two: a pipe of in-memory messages (the batches, the evaluation rows and
results, the checkpoint state) and the published weights, whose tensors travel in shared
memory (``torch.multiprocessing``); nothing is written to disk. The process is started
with ``spawn`` (a fresh interpreter: no forked threads or locks), so its first batch waits
for its imports and model load, a few seconds. An error in it (an environment's, say)
is raised in the learner as the same exception.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.multiprocessing as mp

from posttrain.trainers.online.cores import Adaptive, Waiting, shares
from posttrain.trainers.online.producer import CLOSE_WAIT_S


def _serve(conn, cfg, extras, version: int, threads: int, flag) -> None:
    """The producer process: build the engine and the batch maker, then answer the
    learner's messages until ``close``. ``flag``: the shared flag it raises while it waits
    (``async_cores adaptive``), or None."""
    try:
        torch.set_num_threads(threads)
        from posttrain import fast
        from posttrain.models import load_tokenizer
        from posttrain.rewards import parse_rewards
        from posttrain.trainers import trained
        from posttrain.trainers.online.inputs import experience_maker, rl_rows
        from posttrain.trainers.online.producer import Producer
        from posttrain.trainers.online.sampler import build_engine

        fast.prepare_process(cfg)  # (the process settings a run applies first)
        tok = load_tokenizer(cfg.model, cfg.trust_remote_code)
        own = copy.copy(cfg)
        own.dtype = cfg.rollout_dtype if cfg.samples_in_own_dtype else cfg.dtype
        model = trained.load_policy(own, cfg.model).eval()
        model.requires_grad_(False)
        engine = build_engine(cfg, None, model, tok)
        train_rows, _ = rl_rows(cfg, tok)
        rewards = parse_rewards(cfg.reward or ("" if cfg.episodic else "builtin"),
                                cfg.reward_weights, cfg.device, cfg.reward_options())
        x = experience_maker(cfg, cfg.algorithm(), engine, tok, rewards, train_rows)
        x.extras = extras
        producer = Producer(x, engine, cfg.async_staleness, cfg.max_steps, version,
                            partial=cfg.partial_rollouts)
        if flag is not None:
            from posttrain.episodes import env

            producer.waiting = env.waiting = Waiting(flag)
    except BaseException as e:
        conn.send(("error", e))
        return
    conn.send(("ok", None))
    while True:
        try:
            kind, *args = conn.recv()
        except EOFError:  # the learner is gone (killed): so is this process
            return
        try:
            if kind == "weights":  # (the first: the engine's weights; then publications)
                v, weights = args
                if v == producer.loaded:
                    engine.sync(iter(weights), v)
                else:
                    producer.publish(v, weights)
                continue
            if kind == "take":
                conn.send(("ok", producer.take(*args)))
            elif kind == "call":
                conn.send(("ok", producer.call(*args)))
            elif kind == "snapshot":
                conn.send(("ok", producer.snapshot(*args)))
            elif kind == "restore":
                producer.restore(*args)
                conn.send(("ok", None))
            elif kind == "close":
                producer.close()
                if not producer.stuck():  # (else the process's exit reclaims the engine)
                    engine.close()
                conn.send(("ok", None))
                return
        except BaseException as e:
            conn.send(("error", e))
            if kind == "close":
                return


class RemoteProducer:
    """The learner's handle on a producer process: :class:`Producer`'s methods over the
    pipe. ``weights``: the policy's weights now (version ``version``), the engine's
    start."""

    def __init__(self, cfg, extras: frozenset[str], weights, version: int = 0):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        cores = int(os.environ.get("OMP_NUM_THREADS", 0)) or torch.get_num_threads()
        # half the cores each: two teams of threads on the same cores slow each other far
        # more than their sum (cores.py, docs/async.md)
        producer, self.threads = shares(cores)
        self.before = torch.get_num_threads()  # (put back at close)
        torch.set_num_threads(self.threads)
        flag = ctx.RawValue("b", 0) if cfg.async_cores == "adaptive" else None
        self.process = ctx.Process(target=_serve, name="posttrain-producer", daemon=True,
                                   args=(child, cfg, extras, version, producer, flag))
        self.adaptive = None if flag is None else Adaptive(flag, self.threads, cores)
        self.process.start()
        child.close()
        self._reply()
        self.conn.send(("weights", version, weights))
        self.loaded = version

    def _reply(self):
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the producer process exited (code "
                               f"{self.process.exitcode}) without a reply") from None
        if status == "error":
            raise value
        return value

    def take(self, step: int):
        self.conn.send(("take", step))
        exp, metrics = self._reply()
        if self.adaptive is not None:
            metrics["time/learner_all_cores_s"] = self.adaptive.take_time()
        return exp, metrics

    def publish(self, version: int, weights, expected=None) -> None:
        self.conn.send(("weights", version, weights))

    def call(self, rows: list[dict]):
        self.conn.send(("call", rows))
        return self._reply()

    def snapshot(self, version: int):
        """:meth:`Producer.snapshot`, from the process."""
        self.conn.send(("snapshot", version))
        return self._reply()

    def restore(self, made, order, generator: torch.Tensor, version: int,
                own=None) -> None:
        self.conn.send(("restore", made, order, generator, version))
        self._reply()

    def stuck(self) -> bool:
        """Never after :meth:`close`: a process that did not exit was killed."""
        return False

    def close(self) -> None:
        """Stop the process: it closes its producer (waiting up to ``CLOSE_WAIT_S`` for the
        task in progress) and exits; one that has not answered and exited by then (stuck in
        a call, say) is killed."""
        if self.adaptive is not None:
            self.adaptive.close()
            self.adaptive = None
        torch.set_num_threads(self.before)
        if self.process.is_alive():
            try:
                self.conn.send(("close",))
                if self.conn.poll(CLOSE_WAIT_S + 10):
                    self._reply()
            except (BrokenPipeError, EOFError, RuntimeError):
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
