"""The weight-sync guard: after each sync, the engine scores a small fixed probe (a few
sequences) and its log-probs must agree with the trainer's forward of the same tokens;
otherwise the run stops, naming the step and the size of the gap. An engine that samples
from silently stale weights (a sync that loaded nothing, half the tensors, an old copy)
shows as a gap of the size one optimiser step moves the log-probs, far above rounding.

The statistic is the mean absolute log-prob gap over the probe's tokens. Its bound:

    tol = max((8L + 2)·√n·2u·(1 + max|z|),  32·gap₀·(1 + max|z|) / (1 + max|z₀|))

``u`` is the unit roundoff of the more precise of the two dtypes (2⁻²⁴ float32, 2⁻¹¹
float16, 2⁻⁸ bfloat16); a decoder forward is a chain of about 8L + 2 dependent reductions
(L layers) of length at most n (the hidden, intermediate or vocabulary size), each adding a
rounding error of relative size √n·u (tests/bounds.py derives the same bound for the
tests); a log-prob ``z_y − lse(z)`` carries it in absolute terms scaled by the logits' size
``max|z|``, the trainer's on the probe now (``z₀`` at the start). ``gap₀`` is the gap
measured at the start, when the engine was built from the very weights the trainer holds:
the part of the mismatch that comes from the two forwards' kernels and from a less precise
side (a bfloat16 engine against a float32 trainer, say), scaled like the rounding term as
the logits grow. The less precise dtype's worst case is not used: for bfloat16 it is tens of
nats per token, far above any stale sync, where the measured ``gap₀`` is about 0.003.
The factor 32 leaves room for a gap that grows as training moves the policy away from
the probe's tokens (the less likely a token, the larger its log-prob's rounding error):
with a bfloat16 engine on the built-in task it grew 2.7× over the first step, then held."""

from __future__ import annotations

import math
import time

import torch

UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8,
                 torch.float16: 2.0 ** -11, torch.float64: 2.0 ** -53}


class SyncMismatch(RuntimeError):
    """The engine's log-probs disagree with the trainer's after a sync."""


def dtype_bound(engine_dtype: torch.dtype, trainer_dtype: torch.dtype, config,
                logit_scale: float) -> float:
    """The rounding term of the bound (see the module docstring) for a model ``config``."""
    u = UNIT_ROUNDOFF.get(engine_dtype, 2.0 ** -8) + UNIT_ROUNDOFF.get(trainer_dtype, 2.0 ** -8)
    layers = int(getattr(config, "num_hidden_layers", 32))
    inner = max(int(getattr(config, k, 0) or 0) for k in
                ("hidden_size", "intermediate_size", "vocab_size"))
    return (8 * layers + 2) * math.sqrt(max(inner, 1)) * u * (1.0 + logit_scale)


@torch.no_grad()
def trainer_logprobs(model, sequences: list[list[int]], prompt_lens: list[int],
                     scale: list | None = None) -> list[torch.Tensor]:
    """The trainer's log-probs (temperature 1, float32) of each sequence after its prompt;
    ``scale``: a list that gets the largest |logit| seen."""
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    out = []
    for seq, k in zip(sequences, prompt_lens, strict=True):
        ids = torch.tensor([seq], device=device)
        logits = model(input_ids=ids).logits[0, k - 1:-1].float()
        if scale is not None:
            scale.append(float(logits.abs().max()))
        out.append(logits.log_softmax(-1).gather(-1, ids[0, k:, None]).squeeze(-1).cpu())
    model.train(was)
    return out


def gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    """Mean and max |a − b| over all tokens (non-finite counts as an infinite gap)."""
    d = torch.cat([(x.double() - y.double()).abs() for x, y in zip(a, b, strict=True)])
    d = torch.where(torch.isfinite(d), d, torch.full_like(d, math.inf))
    return (float(d.mean()), float(d.max())) if len(d) else (0.0, 0.0)


class SyncGuard:
    """Checks an engine against the trainer on a fixed probe (see the module docstring)."""

    def __init__(self, engine, model, sequences: list[list[int]], prompt_lens: list[int],
                 engine_dtype: torch.dtype, trainer_dtype: torch.dtype):
        self.engine, self.sequences, self.prompt_lens = engine, sequences, prompt_lens
        from posttrain.models.weights import text_config

        config = text_config(model)
        scale: list[float] = []
        ours = trainer_logprobs(model, sequences, prompt_lens, scale)
        self.scale0 = max(scale, default=0.0)
        best = min((engine_dtype, trainer_dtype), key=lambda d: UNIT_ROUNDOFF.get(d, 2.0 ** -8))
        self.floor = dtype_bound(best, best, config, self.scale0)
        self.baseline = max(gap(got, ours)[0] for got in self._scores().values())
        self.tolerance = max(self.floor, 32.0 * self.baseline)
        """The bound at the start's logits; :meth:`check` scales it with the logits now."""

    def _scores(self) -> dict[str, list[torch.Tensor]]:
        """The engine's log-probs of the probe, per replica where it has several (every
        server of a fleet: ``score_each``), else its one."""
        each = getattr(self.engine, "score_each", None)
        if each is not None:
            return each(self.sequences, self.prompt_lens)
        return {f"{self.engine.name} engine": self.engine.score(self.sequences,
                                                                self.prompt_lens)}

    def expect(self, model) -> tuple[list[torch.Tensor], float]:
        """``model``'s log-probs of the probe and its largest |logit|: what :meth:`check`
        compares the engine with (taken apart when the engine loads those weights later, on
        another thread: asynchronous rollouts)."""
        scale: list[float] = []
        ours = trainer_logprobs(model, self.sequences, self.prompt_lens, scale)
        return ours, max(scale, default=0.0)

    def check(self, model, step: int, expected: tuple | None = None) -> dict[str, float]:
        """Raise :class:`SyncMismatch` when the engine disagrees with ``model`` (or with
        ``expected``, :meth:`expect` of the weights the engine was given); else the
        metrics ``sync/gap_mean``, ``sync/gap_max``, ``sync/tolerance``, ``time/guard_s``."""
        t0 = time.perf_counter()
        ours, scale = expected if expected is not None else self.expect(model)
        gaps = {who: gap(got, ours) for who, got in self._scores().items()}
        who = max(gaps, key=lambda k: (not gaps[k][0] <= math.inf, gaps[k][0]))
        mean, worst = gaps[who]
        tol = self.tolerance * (1.0 + scale) / (1.0 + self.scale0)
        if not mean <= tol:
            raise SyncMismatch(
                f"step {step}: after the weight sync the {who}'s "
                f"log-probs differ from the trainer's by {mean:.3g} nats per token on the "
                f"probe (max {worst:.3g}; bound {tol:.3g}): the engine is not sampling "
                "from the weights being trained")
        return {"sync/gap_mean": mean, "sync/gap_max": worst, "sync/tolerance": tol,
                "time/guard_s": time.perf_counter() - t0}
