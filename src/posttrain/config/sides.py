"""The keys of where an on-policy run's sampler side runs (``trainers/online/sides.py``):
inline, or ahead of the learner in a producer thread or process (docs/async.md)."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.errors import check


@dataclass
class SamplerSideFields:
    async_staleness: int = 0
    """Asynchronous rollouts (docs/async.md): a producer thread samples step s's batch with
    the policy of step s-1-K while the learner trains steps s-K..s-1, so sampling and
    training overlap; no sample is more than K versions old. The loss then takes the
    learner's own pass as the proximal policy and corrects for the behaviour policy
    (decoupled PPO; rollout_correction auto = token_truncate). 0 = the synchronous loop."""
    async_producer: str = "auto"
    """With async_staleness: where the producer runs. thread: beside the learner in this
    process (one interpreter lock between them); process: a process of its own with its
    own copy of the policy (its own interpreter: small models overlap there); auto =
    process for a single process sampling with hf or lean, thread under torchrun, with
    vllm or a 4-bit base (docs/async.md)."""
    async_cores: str = "split"
    """With a producer process: how it and the learner share the CPU cores. split: half
    each, fixed (reproducible, exact resume); adaptive: the learner takes every core while
    the producer waits for an environment or for weights (faster where the producer mostly
    waits; the learner's rounding then depends on timing, so a run is not bit-for-bit
    reproducible). docs/async.md."""
    partial_rollouts: bool = False
    """With async_staleness and episodes: an episode in flight when a newer policy is
    published continues its next turns under it (each token's behaviour log-prob and
    version from the weights that sampled it). Faster to pick up new weights; the run then
    depends on timing, so it is not reproducible (docs/async.md)."""

    def _check_async(self) -> None:
        check(self.async_staleness >= 0, f"async_staleness must be ≥ 0 (0 = synchronous), "
              f"got {self.async_staleness}")
        check(self.async_producer in ("auto", "thread", "process"),
              "async_producer must be auto, thread or process")
        from posttrain.trainers.online.cores import MODES

        check(self.async_cores in MODES,
              f"async_cores must be {' or '.join(MODES)}, got {self.async_cores!r}")
        if not self.async_process:
            self.refuse(("async_cores",), "a run without a producer process (async_cores "
                        "shares the cores between the learner and async_producer process)")
        if not self.async_staleness:
            self.refuse(("partial_rollouts",), "the synchronous loop (async_staleness 0): a "
                        "rollout there never sees the weights change")
            self.refuse(("async_producer",), "the synchronous loop (async_staleness 0)")
        elif self.async_producer == "process":
            from posttrain import dist

            check(not dist.launched(), "async_producer=process runs one producer for one "
                  "process; under torchrun use async_producer thread (or auto)")
            check(not self.vllm_engine and not self.load_in_4bit,
                  "async_producer=process samples with hf or lean from a full-precision "
                  "copy; with vllm or load_in_4bit use async_producer thread (or auto)")

    @property
    def async_process(self) -> bool:
        """The asynchronous producer runs in a process of its own (``async_producer``)."""
        if not self.async_staleness or self.async_producer == "thread":
            return False
        if self.async_producer == "process":
            return True
        from posttrain import dist

        return not dist.launched() and not self.vllm_engine and not self.load_in_4bit
