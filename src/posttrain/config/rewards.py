"""The keys of the reward terms and of how they are called, shared by every on-policy
command (docs/rewards.md)."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.errors import check


@dataclass
class RewardFields:
    reward: str | None = None
    """Reward terms, comma-separated: builtin, math, code, format, length, module:function,
    file.py:function, rm:DIR; none = builtin (the built-in task's exact-answer reward)."""
    reward_weights: str | None = None
    """Weights of the reward terms, comma-separated (default 1 each)."""
    on_reward_error: str = "raise"
    """A reward term that fails, times out or returns NaN on a sample: raise = stop; skip =
    leave the sample out and count it (reward/skipped); zero = score it 0 on that term and
    count it (reward/<term>_failed)."""
    reward_workers: int = 1
    """Each term scores a batch in this many parts at once, on threads (terms that wait: a
    sandbox, a remote service); 1 = the whole batch in one call."""
    reward_timeout: float = 300.0
    """Seconds a term may take on a batch; past it the call is abandoned and its samples
    fail (on_reward_error); 0 = no limit (the call then runs on the caller's thread)."""
    sandbox: str = "auto"
    """reward code: where the programs run: auto (the strongest level this machine offers),
    bwrap, namespaces, or rlimits (resource limits only: the code reward takes it only when
    named here). docs/rewards.md says what each level stops."""
    code_reward_mode: str = "all"
    """reward code: all = 1 when every test passes, else 0; share = the share passed."""
    code_timeout: float = 10.0
    """reward code: wall-clock seconds one program may run (then it and every process it
    started are killed, and it scores 0)."""
    format_pattern: str | None = None
    """reward format: the regular expression a whole completion must match (re.DOTALL);
    none = a <think>...</think> block, then the answer."""
    length_target: int = 1024
    """reward length: characters a completion may have without penalty."""
    length_span: int = 1024
    """reward length: characters past length_target where the penalty reaches -1."""

    def _check_rewards(self) -> None:
        from posttrain.rewards.terms import BUILTIN_NAMES

        check(self.on_reward_error in ("raise", "skip", "zero"),
              "on_reward_error must be raise, skip or zero")
        check(self.reward_workers >= 1 and self.reward_timeout >= 0,
              "reward_workers must be ≥ 1 and reward_timeout ≥ 0")
        named = {s.strip() for s in (self.reward or "").split(",")} & set(BUILTIN_NAMES)
        if "code" not in named:
            self.refuse(("sandbox", "code_reward_mode", "code_timeout"),
                        "runs without --reward code")
        if "format" not in named:
            self.refuse(("format_pattern",), "runs without --reward format")
        if "length" not in named:
            self.refuse(("length_target", "length_span"), "runs without --reward length")
        check(self.sandbox in ("auto", "bwrap", "namespaces", "rlimits"),
              "sandbox must be auto, bwrap, namespaces or rlimits")
        check(self.code_reward_mode in ("all", "share"), "code_reward_mode must be all or share")
        check(self.code_timeout > 0, "code_timeout must be > 0")
        check(self.length_target >= 0 and self.length_span >= 1,
              "length_target must be ≥ 0 and length_span ≥ 1")
        if self.format_pattern is not None:
            import re

            try:
                re.compile(self.format_pattern)
            except re.error as e:
                check(False, f"format_pattern {self.format_pattern!r} is not a regular "
                      f"expression: {e}")

    def reward_options(self):
        """The settings the reward terms are made with."""
        from posttrain.rewards.terms import RewardOptions

        return RewardOptions(workers=self.reward_workers, timeout=self.reward_timeout,
                             format_pattern=self.format_pattern,
                             length_target=self.length_target, length_span=self.length_span,
                             code_mode=self.code_reward_mode, sandbox=self.sandbox,
                             code_timeout=self.code_timeout)
