"""The learner's shaping of the scores the sampler side sends: the missing-EOS penalty, then
running normalisation, then clipping. It lives with the learner because its running moments
are learner state: they advance once per trained batch, in step order, whatever the
placement of the sampler side, and resume from the learner's checkpoint."""

from __future__ import annotations

import torch

from posttrain.core import RunningMoments
from posttrain.rollout import Rollout


class ScoreShaper:
    """``cfg``: anything with ``missing_eos_penalty``, ``reward_normalize`` and
    ``reward_clip`` (read at each call)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.moments = RunningMoments()

    def __call__(self, scores: torch.Tensor, ro: Rollout, valid: torch.Tensor
                 ) -> torch.Tensor:
        """The score the advantages see: minus the missing-EOS penalty, normalised by the
        running moments (updated with the valid samples' scores), clipped."""
        cfg = self.cfg
        scores = scores.float()
        if cfg.missing_eos_penalty:
            scores = scores - cfg.missing_eos_penalty * ro.truncated.float()
        if cfg.reward_normalize:
            self.moments.update(scores[valid])
            scores = self.moments.normalize(scores)
        if cfg.reward_clip:
            scores = scores.clamp(-cfg.reward_clip, cfg.reward_clip)
        return scores
