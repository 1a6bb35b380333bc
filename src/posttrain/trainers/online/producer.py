"""Asynchronous rollouts (``--async_staleness K``, docs/async.md): a producer thread samples
and scores the learner's batches ahead of it, so sampling (and the environments' waits)
overlap the update.

**The schedule.** Version ``v`` is the policy after learner step ``v`` (0: the start).
Step ``s`` trains on batch ``s``, and batch ``s`` is sampled by version

    need(s) = max(0, s − 1 − K)

— the synchronous loop is K = 0 (batch ``s`` by the weights step ``s − 1`` left). The
producer may start batch ``j`` as soon as version ``need(j)`` is published, that is while
the learner trains steps ``need(j) + 1 … j − 1``; so at most K + 1 batches are ahead of the
learner, and no sample is older than K versions when it is trained on. The bound holds by
construction, so nothing is ever dropped as stale: a stream that drops stragglers keeps
the episodes that finish fast, which biases the data toward short episodes; this one
trains every sampled episode.

The schedule is fixed, not raced: which weights sample which batch does not depend on
timing, the sampling seeds are the synchronous loop's (``request_seed(seed, step, ...)``),
and the producer draws its data order from a generator of its own. So a run is reproducible
and resumes exactly. ``partial_rollouts`` gives that up for freshness: an episode's later
turns take the newest published weights (each token tagged with its version).

**What runs where.** The producer thread owns the rollout engine: every batch, every weight
load and every evaluation goes through it, in the schedule's order (an evaluation of
version ``v`` runs once no batch needs an older one). The learner publishes each version as
a copy of its weights (one tensor at a time, gathered from shards on the learner's thread;
copies are kept until the producer has loaded them or passed them by). Under torchrun each
rank runs its own producer, whose gathers use a process group of their own.

**Checkpoints.** :meth:`Producer.pause` lets the producer finish every batch that needs a
version older than the checkpoint's, and holds it there; the checkpoint stores those
batches (:func:`experience_state`) and the producer's data order. A resumed run starts its
producer at the next batch with the checkpoint's weights, which are the version that batch
needs: the same batches, the same weights, the same final model as the run that was not
interrupted.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, fields

import torch

from posttrain.rollout import Rollout, record, select
from posttrain.trainers.online.experience import Experience

CLOSE_WAIT_S = 30.0
"""How long :meth:`Producer.close` waits for the task in progress: a producer stuck past it
(an environment without a timeout, say) is left behind, a daemon thread that cannot keep
the process alive."""


def need(step: int, staleness: int) -> int:
    """The policy version that samples batch ``step`` (see the module docstring)."""
    return max(0, step - 1 - staleness)


@dataclass
class _Job:
    """An evaluation (or any call on the engine) waiting for the weights of ``version``."""

    fn: object
    version: int
    done: bool = False
    result: object = None


class Producer:
    """The producer thread and the learner's handle on it (see the module docstring).

    ``experience``: the :class:`~posttrain.trainers.online.experience.ExperienceMaker`
    whose ``collect`` makes a batch (its engine is ``engine``); ``last``: the last batch to
    make; ``version``: the version the engine holds now; ``guard``: the weight-sync guard
    of an engine with weights of its own, checked after every load against what
    :meth:`publish` was given."""

    def __init__(self, experience, engine, staleness: int, last: int, version: int = 0,
                 guard=None, partial: bool = False):
        self.x, self.engine, self.K = experience, engine, staleness
        self.last, self.guard, self.partial = last, guard, partial
        self.next = version + 1
        """The next batch to make."""
        self.loaded = self.published = version
        self.weights: dict[int, tuple[list, object]] = {}
        """Published versions not yet loaded: (named tensors, the guard's expectation)."""
        self.ready: dict[int, Experience] = {}
        self.jobs: list[_Job] = []
        self.hold_after: int | None = None
        self.busy = self.closing = False
        self.error: BaseException | None = None
        self.idle_s = 0.0
        """Seconds the producer waited for weights since the learner last took a batch."""
        self.waiting = contextlib.nullcontext
        """What the producer waits for work under (a process's mark: :mod:`.cores`)."""
        self.guard_metrics: dict[str, float] = {}
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None
        if partial:
            experience.before_turn = self._refresh

    # --- the producer's thread ------------------------------------------------------------
    def _start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="posttrain-producer",
                                           daemon=True)
            self.thread.start()

    def _pick(self):
        """The next task, under the lock: ``("eval", job, version)``, ``("batch", step,
        version)``, ``("close",)``, or None (nothing can run yet)."""
        if self.closing:
            return ("close",)
        j = self.next
        can_batch = j <= self.last and (self.hold_after is None or j <= self.hold_after)
        version = need(j, self.K)
        if self.jobs:
            job = self.jobs[0]
            if job.version == self.loaded or not can_batch or version >= job.version:
                return ("eval", self.jobs.pop(0), job.version)
        if can_batch and version <= self.published:
            return ("batch", j, self.published if self.partial else version)
        return None

    def _weights_for(self, version: int):
        """The published weights of ``version`` (older copies dropped: nothing needs them)."""
        for v in [v for v in self.weights if v < version]:
            del self.weights[v]
        return self.weights.pop(version)

    def _load(self, version: int, published) -> None:
        weights, expected = published
        self.engine.sync(iter(weights), version)
        if self.guard is not None and expected is not None:
            self.guard_metrics = self.guard.check(None, version, expected)
        with self.cond:
            self.loaded = version

    def _refresh(self, turn: int) -> None:
        """Partial rollouts, before an episode's next turn: the newest published weights."""
        with self.cond:
            if self.published <= self.loaded:
                return
            version = self.published
            published = self._weights_for(version)
        self._load(version, published)

    def _run(self) -> None:
        # A new thread's OpenMP count is OMP_NUM_THREADS until torch's first parallel call
        # on it sets torch's count; a C++ kernel that asks OpenMP first (vLLM's CPU
        # attention plans with one count and checks with the other) would see both.
        torch.get_num_threads()
        try:
            while True:
                with self.cond:
                    task = self._pick()
                    while task is None:
                        t0 = time.perf_counter()
                        with self.waiting():
                            self.cond.wait()
                        self.idle_s += time.perf_counter() - t0
                        task = self._pick()
                    if task[0] == "close":
                        return
                    kind, what, version = task
                    self.busy = True
                    published = (self._weights_for(version) if version != self.loaded
                                 else None)
                if published is not None:
                    self._load(version, published)
                if kind == "eval":
                    what.result = what.fn(self.engine)
                else:
                    exp = self.x.collect(what)
                with self.cond:
                    if kind == "eval":
                        what.done = True
                    else:
                        self.ready[what] = exp
                        self.next = what + 1
                    self.busy = False
                    self.cond.notify_all()
        except BaseException as e:
            with self.cond:
                self.error, self.busy = e, False
                self.cond.notify_all()

    # --- the learner's side ---------------------------------------------------------------
    def _wait(self, done) -> None:
        """Wait (under the lock) until ``done()``; the producer's error is raised here."""
        self._start()
        while not done():
            if self.error is not None:
                raise self.error
            self.cond.wait()

    def take(self, step: int) -> tuple[Experience, dict[str, float]]:
        """Batch ``step`` (waiting for it), and the producer's metrics since the last one."""
        t0 = time.perf_counter()
        with self.cond:
            self._wait(lambda: step in self.ready)
            exp = self.ready.pop(step)
            idle, self.idle_s = self.idle_s, 0.0
            ahead = len(self.ready)
            self.cond.notify_all()
        # (timings: under time/, as they differ between runs)
        return exp, {"time/learner_wait_s": time.perf_counter() - t0,
                     "time/producer_idle_s": idle, "time/ready_batches": ahead,
                     **self.guard_metrics}

    def publish(self, version: int, weights: list[tuple[str, torch.Tensor]],
                expected=None) -> None:
        """Version ``version``'s weights (copies the learner no longer writes to), and the
        guard's expectation of them (:meth:`SyncGuard.expect`)."""
        with self.cond:
            self.weights[version] = (weights, expected)
            self.published = version
            self.cond.notify_all()

    def call(self, rows: list[dict]):
        """The evaluation of ``rows`` (the maker's ``evaluate(engine, rows)``) on the
        producer's thread with the newest published weights, in the schedule's order;
        returns its result."""
        with self.cond:
            job = _Job(lambda engine: self.x.evaluate(engine, rows), self.published)
            self.jobs.append(job)
            self.cond.notify_all()
            self._wait(lambda: job.done)
        return job.result

    def pause(self, version: int) -> None:
        """Hold the producer once it has made every batch that needs a version older than
        ``version`` (it makes none beyond those until :meth:`resume`)."""
        through = min(self.last, version + self.K)
        with self.cond:
            self.hold_after = through
            self.cond.notify_all()
            self._wait(lambda: not self.busy and (self.next > through))
            self.hold_after = max(through, self.next - 1)

    def resume(self) -> None:
        with self.cond:
            self.hold_after = None
            self.cond.notify_all()

    def close(self) -> None:
        """Stop the thread (after the task it is on, waiting at most :data:`CLOSE_WAIT_S`)."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(CLOSE_WAIT_S)

    def stuck(self) -> bool:
        """Whether the thread is still on a task after :meth:`close` (then its engine must not
        be closed under it)."""
        return self.thread is not None and self.thread.is_alive()

    # --- checkpoints ----------------------------------------------------------------------
    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """The made batches and the next one's number (call between :meth:`pause` and
        :meth:`resume`)."""
        meta: dict = {"next": self.next, "batches": {}}
        tensors: dict[str, torch.Tensor] = {}
        for step, exp in sorted(self.ready.items()):
            m, t = experience_state(exp)
            meta["batches"][str(step)] = m
            tensors.update({f"batch.{step}.{k}": v for k, v in t.items()})
        return meta, tensors

    def snapshot(self, version: int):
        """What a checkpoint after step ``version`` keeps: ``((meta, tensors) of the made
        batches, the data order, the data generator's state)``, taken while paused."""
        self.pause(version)
        try:
            return self.state(), list(self.x.order), self.x.gen.get_state()
        finally:
            self.resume()

    def restore(self, made, order: list[int], generator: torch.Tensor, version: int,
                own: dict[int, torch.Tensor] | None = None) -> None:
        """Restore :meth:`snapshot` at ``version`` (the weights the engine holds)."""
        self.load_state(*made, version, own)
        self.x.order = [int(i) for i in order]
        self.x.gen.set_state(generator)
        self.engine.version = version

    def load_state(self, meta: dict, tensors: dict[str, torch.Tensor], version: int,
                   own: dict[int, torch.Tensor] | None = None) -> None:
        """Restore :meth:`state` at ``version`` (the weights the engine was built from);
        ``own``: this rank's rows of each batch (torchrun; None for a world of one)."""
        self.next = int(meta["next"])
        self.loaded = self.published = version
        for key, m in meta["batches"].items():
            step = int(key)
            prefix = f"batch.{step}."
            part = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            self.ready[step] = experience_from_state(m, part, None if own is None
                                                     else own[step])


# --- a batch as JSON and tensors ------------------------------------------------------------
_EXPERIENCE_META = ("rounds", "dropped_groups", "generate_s", "reward_s", "sampled_tokens")


def experience_state(exp: Experience) -> tuple[dict, dict[str, torch.Tensor]]:
    """A made batch as JSON-able values and tensors (no pickle): its rollout's fields as
    their declaration says (:func:`~posttrain.rollout.record.to_state`, tensors under
    ``rollout.``), its scores and counts. Its sampler cache is not kept (asynchronous
    rollouts keep none: the engine's weights are not the learner's)."""
    ro_meta, ro_tensors = record.to_state(exp.rollout)
    tensors = {f"rollout.{k}": v for k, v in ro_tensors.items()}
    tensors.update({"scores": exp.scores, "valid": exp.valid, "correct": exp.correct,
                    "own": exp.own})
    tensors.update({f"terms.{k}": v for k, v in exp.terms.items()})
    batch = {"terms": list(exp.terms), **{f.name: getattr(exp, f.name) for f in fields(Experience)
                                          if f.name in _EXPERIENCE_META}}
    if clash := sorted(set(ro_meta) & set(batch)):
        raise TypeError(f"the rollout's keys {clash} are the batch's own")
    return {**ro_meta, **batch}, {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


def experience_from_state(meta: dict, tensors: dict[str, torch.Tensor],
                          own: torch.Tensor | None = None,
                          rollout_type: type[Rollout] = Rollout) -> Experience:
    """The batch :func:`experience_state` wrote; ``own``: this rank's rows of it (torchrun),
    None: all of them (a world of one); ``rollout_type``: the class of its rollout (a
    subclass with fields of its own)."""
    ro = record.from_state(rollout_type, meta, {k[len("rollout."):]: v for k, v in tensors.items()
                                                if k.startswith("rollout.")})
    own = tensors["own"] if own is None else own
    local = ro if own is None or (len(own) == len(ro.texts) and bool(
        (own == torch.arange(len(ro.texts))).all())) else select(ro, own)
    return Experience(ro, tensors["scores"], {k: tensors[f"terms.{k}"] for k in meta["terms"]},
                      tensors["valid"], tensors["correct"], int(meta["rounds"]),
                      int(meta["dropped_groups"]), float(meta["generate_s"]),
                      float(meta["reward_s"]), int(meta["sampled_tokens"]), local, own)
