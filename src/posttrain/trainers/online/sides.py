"""The sampler side of an RL run, and the one factory that places it.

An RL run is two sides joined by messages. The **sampler side** owns the rollout engine, the
prompt order and the reward terms; the **learner side** (:mod:`.trainer`) owns the models,
the optimisers, the score shaping and the advantages. Between them:

- ``take(step) -> (Experience, metrics)``: step ``step``'s batch, scored (the rollout with
  its behaviour log-probs and weight versions, the reward terms' raw scores);
- ``publish(step, policy, moved, keep) -> metrics``: after a step, the weights of version
  ``step`` (``moved``: the optimiser steps it took) and what the next rollouts keep for the
  update to reuse; the metrics are the weight-sync guard's, where it checked now;
- ``keep(extras)``: what the next rollouts keep, on its own (at the start, on resume);
- ``evaluate(rows)``: greedy decoding and scoring of held-out rows with the newest weights;
- ``state(step)`` / ``load_state(meta, tensors, step)``: what a checkpoint keeps of the side
  (its data order; ahead of the learner, the batches already made);
- ``close()``.

The learner never reads or writes the side's engine or batch maker. One factory,
:func:`sampler_side`, builds every placement:

- **inline** (``async_staleness 0``): the learner's process samples each batch when asked,
  with the weights the last step left (the synchronous loop);
- **thread** (``async_staleness K``): a producer thread makes batches up to K versions
  ahead (:mod:`.producer`, the fixed schedule);
- **process** (``async_producer process``): the same producer in a process of its own
  (:mod:`.remote`); this process then builds no engine at all.

A fleet of rollout servers (``rollout_backend vllm_server``) is an engine, so any of the
three placements can drive it.
"""

from __future__ import annotations

import torch

from posttrain import dist
from posttrain.models.weights import hf_weights
from posttrain.trainers.online.experience import Experience
from posttrain.trainers.online.inputs import experience_maker
from posttrain.trainers.online.producer import Producer
from posttrain.trainers.online.sampler import build_engine, make_guard, sampler_module


class EngineTraits:
    """What the learner may know of a side's engine, to plan what the update reuses
    (:func:`posttrain.fast.eligibility.plan`): a process side's engine is elsewhere, so it
    shares no weights and keeps nothing for the update."""

    def __init__(self, engine=None, name: str = "engine"):
        self.name = getattr(engine, "name", name)
        self.shares_weights = bool(getattr(engine, "shares_weights", False))
        self.extras = frozenset(getattr(engine, "extras", ()))


class InlineSide:
    """K = 0: each batch is sampled in the learner's process when the learner asks for it,
    with the weights the previous step left; after a step the engine follows the policy
    (streamed one tensor at a time; nothing is copied for an engine that decodes with the
    policy itself) and the guard checks it."""

    def __init__(self, experience, engine, guard):
        self.experience, self.engine, self.guard = experience, engine, guard
        self.traits = EngineTraits(engine)
        self.version = 0
        """The policy version the engine holds: the optimiser steps synced so far."""

    def take(self, step: int) -> tuple[Experience, dict[str, float]]:
        exp = self.experience.collect(step)
        self.engine.sleep()  # where it can, the engine frees its memory for the update
        return exp, {}

    def publish(self, step: int, policy, moved: int, keep: frozenset[str]
                ) -> dict[str, float]:
        checked: dict[str, float] = {}
        if moved or self.engine.needs_sync:  # (its sleep freed weights: bring them back)
            self.version += moved
            self.engine.sync(hf_weights(policy, changed_only=self.engine.partial_sync),
                             self.version)
            if self.guard is not None and moved:
                checked = self.guard.check(policy, step)
        self.keep(keep)
        return checked

    def keep(self, extras: frozenset[str]) -> None:
        self.experience.extras = extras

    def evaluate(self, rows: list[dict]) -> list[float]:
        return self.experience.evaluate(self.engine, rows)

    def state(self, step: int) -> tuple[dict, dict[str, torch.Tensor]]:
        return {"order": self.experience.order}, {}

    def load_state(self, meta: dict, tensors: dict[str, torch.Tensor], step: int) -> None:
        self.experience.order = [int(i) for i in meta["order"]]

    def close(self) -> None:
        self.experience.close()
        self.engine.close()


class AheadSide:
    """K > 0: a producer (:class:`~.producer.Producer`, or its handle in another process,
    :class:`~.remote.RemoteProducer`) makes batches ahead of the learner on the fixed
    schedule; each published version travels as a copy of the weights."""

    def __init__(self, cfg, producer, experience=None, engine=None, guard=None,
                 partial_sync: bool | None = None):
        self.cfg, self.producer, self.experience = cfg, producer, experience
        self.engine, self.guard = engine, guard
        self.staleness = cfg.async_staleness
        self.traits = EngineTraits(engine, cfg.rollout_backend)
        self.partial_sync = (engine.partial_sync if partial_sync is None else partial_sync)
        """Whether a published version carries only the tensors training changes."""

    def take(self, step: int) -> tuple[Experience, dict[str, float]]:
        exp, metrics = self.producer.take(step)
        metrics.update(staleness(exp, step, self.staleness))
        return exp, metrics

    def publish(self, step: int, policy, moved: int, keep: frozenset[str]
                ) -> dict[str, float]:
        """Version ``step``, whether the step moved the policy or not (the schedule counts
        steps); ``keep`` is what the producer was started with (the update reuses nothing
        of a batch sampled by older weights)."""
        weights = [(name, t.detach().clone())
                   for name, t in hf_weights(policy, changed_only=self.partial_sync)]
        expected = self.guard.expect(policy) if self.guard is not None else None
        self.producer.publish(step, weights, expected)
        return {}

    def keep(self, extras: frozenset[str]) -> None:
        """What the next batches keep (a process producer keeps what it was started with:
        its engine captures nothing the learner can reuse but routing)."""
        if self.experience is not None:
            with self.producer.cond:
                self.experience.extras = extras

    def evaluate(self, rows: list[dict]) -> list[float]:
        return self.producer.call(rows)

    def state(self, step: int) -> tuple[dict, dict[str, torch.Tensor]]:
        """The made batches, the producer's data order and generator; every rank calls it
        (torchrun: each rank's rows of each batch are gathered)."""
        (made, made_tensors), order, generator = self.producer.snapshot(step)
        meta = {"order": order,
                "async": {"staleness": self.staleness, "version": step, **made}}
        tensors = {f"async.{k}": v for k, v in made_tensors.items()}
        tensors["producer_generator"] = generator
        if dist.world_size() > 1:  # each rank's rows of each made batch (a thread there)
            owns = dist.gather_objects({s: e.own.tolist()
                                        for s, e in self.producer.ready.items()})
            for r, mine in enumerate(owns):
                tensors.update({f"async.own.{r}.{s}": torch.tensor(rows, dtype=torch.long)
                                for s, rows in mine.items()})
        return meta, tensors

    def load_state(self, meta: dict, tensors: dict[str, torch.Tensor], step: int) -> None:
        made = meta["async"]  # (a resume keeps the run's config: the same schedule)
        version = int(made["version"])
        own = None
        if dist.world_size() > 1:
            prefix = f"async.own.{dist.rank()}."
            own = {int(k[len(prefix):]): v for k, v in tensors.items()
                   if k.startswith(prefix)}
        batches = {k[6:]: v for k, v in tensors.items() if k.startswith("async.batch.")}
        self.producer.restore((made, batches), meta["order"], tensors["producer_generator"],
                              version, own)

    def close(self) -> None:
        self.producer.close()
        if self.engine is not None and not self.producer.stuck():
            self.engine.close()  # (a stuck thread still holds it; the exit reclaims both)
            if self.experience is not None:
                self.experience.close()


def staleness(exp: Experience, step: int, bound: int) -> dict[str, float]:
    """How many versions behind the learner's (``step - 1``) the batch's weights are: its
    oldest token's, and with partial rollouts the trained tokens' mean. Never more than
    ``bound`` (the schedule's, checked)."""
    lag = step - 1 - exp.rollout.policy_version
    if lag > bound:
        raise RuntimeError(f"step {step}: its batch was sampled by version "
                           f"{exp.rollout.policy_version}, {lag} versions old, beyond "
                           f"async_staleness={bound}")
    out = {"async/staleness": float(lag)}
    versions = exp.rollout.versions
    if versions is not None:
        m = exp.rollout.trained_mask.bool()
        lags = (step - 1 - versions)[m].double()
        if len(lags):
            out.update({"async/token_staleness_mean": float(lags.mean()),
                        "async/token_staleness_min": float(lags.min())})
    return out


def sampler_side(cfg, algo, policy, tok, rewards, train_rows, generator, keep, sharded: bool):
    """The sampler side this run's placement asks for (see the module docstring).
    ``generator``: the learner's (the synchronous loop's data order draws from it, as it
    always has; a producer draws from one of its own); ``keep``: what the rollouts keep
    before the learner knows more (routing; :meth:`keep` sends the rest)."""
    if cfg.async_process:
        from posttrain.trainers.online.remote import RemoteProducer

        weights = [(n, t.detach().clone()) for n, t in hf_weights(policy)]
        # (its engine decodes with a module of its own, hf or lean, so the first weights are
        # all of them and each later version the tensors training changes)
        return AheadSide(cfg, RemoteProducer(cfg, keep & {"routing"}, weights),
                         partial_sync=True)
    engine = build_engine(cfg, policy, sampler_module(cfg, policy, sharded), tok)
    try:
        experience = experience_maker(cfg, algo, engine, tok, rewards, train_rows, generator)
        guard = make_guard(cfg, engine, policy, [experience.first_prompt_ids(r)
                                                 for r in train_rows[:2]])
        experience.extras = keep
        if not cfg.async_staleness:
            return InlineSide(experience, engine, guard)
        experience.group = dist.side_group()  # (torchrun: the rounds' gathers of its own)
        return AheadSide(cfg, Producer(experience, engine, cfg.async_staleness,
                                       cfg.max_steps, 0, guard, cfg.partial_rollouts),
                         experience, engine, guard)
    except BaseException:
        engine.close()
        raise
