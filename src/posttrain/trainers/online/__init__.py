"""The on-policy trainer, split by idea: :mod:`.experience` (sample, score, dynamic sampling,
score shaping), :mod:`.batch` (the token layout), :mod:`.update` (micro-batch accumulation
against the step's normaliser), :mod:`.metrics`, and :mod:`.trainer`, which orders them."""

from posttrain.config import PPOConfig, RLConfig
from posttrain.trainers.online.batch import TokenBatch
from posttrain.trainers.online.trainer import RLTrainer, run_rl

__all__ = ["PPOConfig", "RLConfig", "RLTrainer", "TokenBatch", "run_rl"]
