"""Configs of the on-policy commands: ``posttrain grpo`` (the critic-free algorithms) and
``posttrain ppo`` (per-token KL rewards, with a critic for PPO). Keys that set fields of the
algorithm's record (clip range, β, γ, λ, ...) are overrides of the table's defaults; keys of
a critic are refused for an algorithm without one."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from posttrain.config.agents import AgentFields
from posttrain.config.base import RunConfig
from posttrain.config.errors import ConfigError, check
from posttrain.config.packing import PackingFields
from posttrain.config.rewards import RewardFields
from posttrain.config.servers import RolloutServerFields
from posttrain.config.sides import SamplerSideFields
from posttrain.core.algorithms import Algorithm, algorithm_names, get_algorithm

ALGORITHM_KEYS = tuple(f.name for f in fields(Algorithm) if f.name not in ("name", "critic"))
"""The record's fields a config key of the same name overrides (``critic`` decides the
command, so it is not one)."""


@dataclass
class RLConfig(AgentFields, PackingFields, SamplerSideFields, RewardFields,
               RolloutServerFields, RunConfig):
    """On-policy RL with verifiable rewards (the critic-free algorithms of the table)."""

    COMMAND: ClassVar[str] = "grpo"
    ALGOS: ClassVar[list[str]] = algorithm_names(critic=False)
    algo: str = "grpo"
    """One of the table's algorithms without a critic: see `posttrain grpo --help`."""
    env: str | None = None
    """Multi-turn episodes: an environment class, file.py:Name or module:Name, made once per
    sampled trajectory as Name(row, **env_kwargs) (docs/environments.md); builtin = the
    built-in multi-turn task (its start: --model builtin-episodes, taken when --model is
    left at builtin). None: single-turn completions of the rows' prompts."""
    tools: str | None = None
    """Tool calls as the environment: file.py:fn1,fn2 or module:fn1,fn2; each row's prompt
    is the first message, the model's calls (its template's <tool_call> JSON, else lines
    'call: name(args)') run the functions and return as tool messages, a turn without a
    call is the answer the reward terms score (docs/environments.md)."""
    tool_error_reward: float = 0.0
    """tools: the reward of a turn with a malformed or failing call."""
    env_kwargs: str | None = None
    """env: keyword arguments of the environment class, as a JSON object."""
    env_timeout: float = 30.0
    """env: seconds an environment's reset or step may take; 0 = no limit."""
    env_workers: int = 1
    """env: environment calls of one turn run on this many threads at once (an environment
    that waits on a sandbox, a tool or a remote service); 1 = one after another. Results
    are taken in episode order, so the run does not depend on it, provided the
    environment's instances share no state."""
    max_turns: int = 4
    """env: most assistant turns per episode (an episode still running then is truncated)."""
    max_episode_tokens: int = 256
    """env: most tokens after the first message, every turn's and every message's (an
    episode reaching it is truncated, its last turn's reward kept); max_new_tokens bounds
    each turn."""
    missing_eos_penalty: float = 0.0
    """Subtracted from the score of completions that hit max_new_tokens without eos or a
    stop string (episodes: of episodes cut at max_turns or max_episode_tokens)."""
    reward_normalize: bool = False
    """Normalise scores by the running mean and std of every score seen so far."""
    reward_clip: float = 0.0
    """Clip scores (after normalisation) to [-c, c]; 0 = no clipping."""
    lr: float = 1e-4
    max_steps: int = 60
    prompts_per_step: int = 16
    """Prompts (groups) per step."""
    group_size: int = 8
    """Completions per prompt (G)."""
    minibatch_size: int = 128
    """Samples per optimiser step (several steps per batch when smaller than the batch)."""
    micro_batch_size: int = 128
    """Samples per forward/backward pass; the gradient does not depend on it."""
    ppo_epochs: int = 1
    """Passes over each batch of samples (μ). Old log-probs are recorded before the first
    update whenever a batch gives more than one optimiser step (μ > 1 or minibatch_size
    below the batch) or the reward carries a KL penalty; otherwise the ratio is 1 and the
    loss uses the detached current log-probs."""
    max_new_tokens: int = 8
    max_length: int = 512
    """Longest prompt + max_new_tokens allowed, in tokens; a longer prompt stops the run with
    an error naming its file and row."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: str | None = None
    """Stop strings, comma-separated (eos always stops)."""
    advantage: str | None = None
    """Override the algorithm's advantage estimator: group, group_no_std, rloo,
    reinforce_pp, reinforce_pp_baseline (gae needs a critic: posttrain ppo)."""
    policy_loss: str | None = None
    """Override the algorithm's policy loss: ppo_clip, gspo, gspo_token."""
    aggregation: str | None = None
    """Override how per-token losses become the step's loss: token_mean, seq_mean,
    seq_sum_const, ..."""
    kl_coef: float | None = None
    """Override the algorithm's β (KL to the reference in the loss)."""
    kl_estimator: str | None = None
    """Override the estimator of the loss KL term: k3 (default), k1 or k2."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 (ppo_clip): bounds a negative-advantage token's loss at −c·A;
    none = off."""
    dynamic_sampling: bool | None = None
    """Override whether groups whose rewards are all equal are dropped and more sampled."""
    overlong_shaping: bool | None = None
    """Override whether DAPO's soft overlong penalty is added to the reward."""
    reward_kl_coef: float | None = None
    """Override k, the coefficient of the per-token KL penalty in the reward (ppo,
    reinforce_pp*); with kl_target set, its starting value."""
    reward_kl_estimator: str | None = None
    """Override the estimator of that penalty: k1 (default), k2 or k3."""
    kl_target: float = 0.0
    """Adaptive KL (Ziegler et al.): move k so the mean per-sequence KL to the reference
    tracks this many nats; 0 = fixed k."""
    kl_horizon: float = 10000.0
    """Samples over which the adaptive controller may move k by up to ±20%."""
    gamma: float | None = None
    """Override the discount γ of token-level returns (ppo, reinforce_pp*)."""
    lam: float | None = None
    """Override GAE's λ (ppo)."""
    clip_low: float | None = None
    """Override the algorithm's ε_low."""
    clip_high: float | None = None
    """Override the algorithm's ε_high."""
    overlong_cache: int = 2
    """DAPO's soft overlong buffer L_cache, in tokens below max_new_tokens."""
    dynamic_sampling_rounds: int = 4
    """Most generation rounds per step when dynamic sampling refills the batch."""
    share_prompt: bool | None = None
    """Run each group's prompt once for its G completions in the update, old, reference and
    critic passes; none = automatic (on when group_size > 1, else from 2M parameters)."""
    rollout_backend: str = "auto"
    """The rollout engine: hf (the model's own forward with a KV cache, any model), lean
    (posttrain.fast's decoder for plain Llama-family models), vllm (a vLLM engine in this
    process: docs/engines.md), vllm_server (vLLM servers on their own devices:
    rollout_servers or launch_rollout_servers), auto = lean where it applies and fast is
    on, else hf.
    Evaluation decodes through the same engine."""
    rollout_correction: str = "auto"
    """Mismatch correction by the importance weight π_old/π_behaviour of the sampled tokens:
    none, token_truncate, token_mask, sequence_truncate, sequence_mask, icepop; auto = none
    for the exact engines (lean, hf in the trainer's dtype), token_truncate for vllm, a
    rollout_dtype of its own or async_staleness > 0 (docs/engines.md)."""
    rollout_correction_low: float | None = None
    """Lower bound of the masks (token_mask, sequence_mask, icepop); none = the mode's
    default."""
    rollout_correction_high: float | None = None
    """Upper bound: the truncation cap, or the masks' upper bound; none = the mode's
    default."""
    routing_replay: str = "none"
    """Mixture-of-experts policies: r3 records each token's experts while sampling (the
    lean and hf engines, single turns and episodes) and the old-policy and update passes
    route through them; r2 records them in the old-policy pass and the update routes
    through them (the gate's weights always from the current router); none routes
    freely. Either way the step logs router/* (load, entropy, auxiliary loss, and the
    share of tokens whose experts differ from the recorded ones)."""
    sync_guard: bool = True
    """After each weight sync of an engine with weights of its own (vllm), score a small
    probe and stop the run when the engine's log-probs differ from the trainer's beyond
    the bound of the two dtypes (docs/engines.md)."""
    rollout_dtype: str = "auto"
    """The dtype the engine samples in (float32, bfloat16, float16); auto = the policy's.
    Another than the policy's gives hf and lean a copy of the policy in that dtype, which
    every weight sync refreshes (vllm holds its own copy anyway); the trainer still computes
    in ``dtype``, so this is the rollout/trainer mismatch of a bfloat16 sampler."""
    vllm_kv_cache_gb: int = 1
    """vllm on the CPU (and the servers launch_rollout_servers starts there): GiB of KV cache
    (whole GiB: vLLM's ``VLLM_CPU_KVCACHE_SPACE``)."""
    vllm_gpu_memory_utilization: float = 0.3
    """vllm on CUDA: the share of the GPU's memory the engine may take."""
    vllm_sleep: bool = True
    """vllm on CUDA: free the engine's weights and KV cache while the trainer updates."""
    vllm_tensor_parallel_size: int = 1
    """vllm: ranks per engine (tensor parallel across k consecutive torchrun ranks; k must
    divide the ranks); 1 = an engine per rank."""
    replay_projections: bool = True
    """With fast: the lean sampler keeps each projection's output, and the policy's passes
    before its first optimizer step (the update of a one-update step, the old log-probs)
    take them instead of running those matmuls again (2·N FLOPs per completion token).
    Applies where the batch's passes take two calls (prompts, then completions over their
    KV cache), with the lean engine, no dropout, no compile, unsharded; false = recompute."""
    reuse_sampler_head: bool = True
    """With fast: the sampler's log-sum-exp and entropy at each token stand in for the
    forward of a fused head (large vocabularies, float32) in those passes, one of its four
    vocabulary-sized matmuls; unsharded, no dropout; false = recompute."""
    log_samples_every: int = 0
    """Every this many steps, a table of ``log_samples`` samples (prompt, completion or whole
    episode, each reward term, advantage, length, finish reason) into samples.jsonl and each
    tracker (``posttrain samples RUN_DIR`` prints them); 0 = none."""
    log_samples: int = 8
    """Samples per table (the step's first ones: whole groups together)."""
    eval_every: int = 20
    warmup_ratio: float = 0.0
    lr_schedule: str = "constant"

    @property
    def run_name(self) -> str:
        return self.algo

    @property
    def episodic(self) -> bool:
        """Multi-turn episodes (``env``, ``tools`` or ``agent``) rather than single
        completions."""
        return bool(self.env or self.tools or self.agent)

    def validate(self) -> None:
        super().validate()
        check(self.algo in self.ALGOS, f"algo must be one of {', '.join(self.ALGOS)}")
        check(self.max_steps >= 1, "max_steps must be ≥ 1")
        check(self.log_samples_every >= 0 and self.log_samples >= 1,
              "log_samples_every must be ≥ 0 and log_samples ≥ 1")
        check(self.rollout_backend in ("auto", "hf", "lean", "vllm", "vllm_server"),
               "rollout_backend must be auto, hf, lean, vllm or vllm_server")
        self._check_engine()
        self._check_servers()
        self._check_rewards()
        self._check_env()
        self._check_agent()
        self._check_packing()
        check(not (self.packing and self.routing_replay != "none"), "routing_replay records "
              "and replays padded sequences; it does not take --packing yet")
        self._check_async()
        check(self.routing_replay in ("none", "r2", "r3"),
              "routing_replay must be none, r2 or r3")
        if self.routing_replay == "r3":
            check(not self.vllm_engine, "routing_replay=r3 reads the experts the "
                  "engine chose while sampling, which the vllm engine does not return here "
                  "(vLLM 0.32 returns them only from its model runner V2, which needs "
                  "Triton, so not on CPU; posttrain does not read them yet); use "
                  "rollout_backend hf or lean, or routing_replay r2")
        if self.data is not None and not self.reward and not self.env and not self.agent:
            if self.tools:
                raise ConfigError("--tools needs --reward: the terms that score each "
                                  "episode's answer")
            raise ConfigError("--data needs --reward (math, code, format, length, "
                              "module:function, file.py:function or rm:DIR)")
        check(self.fast or self.rollout_backend != "lean",
              "rollout_backend=lean is part of the speed machinery that fast=false turns off")
        algo = self.algorithm()
        check(self.group_size >= 1, f"group_size must be ≥ 1, got {self.group_size}")
        check(self.group_size >= 2 or not algo.needs_groups,
               f"group_size must be ≥ 2 for {self.algo}")
        check(self.reward_clip >= 0 and self.missing_eos_penalty >= 0 and self.kl_target >= 0
               and self.kl_horizon > 0, "reward_clip, missing_eos_penalty and kl_target must "
               "be ≥ 0 and kl_horizon > 0")
        for key in ("reward_kl_coef", "reward_kl_estimator", "gamma", "lam", "kl_target"):
            if getattr(self, key) and not algo.token_rewards:
                raise ConfigError(f"{key} applies to algorithms with per-token rewards "
                                  f"({', '.join(algorithm_names(token_rewards=True))}), "
                                  f"not to {self.algo}")
        check(0 <= algo.gamma <= 1 and 0 <= algo.lam <= 1, "gamma and lam must be in [0, 1]")
        check(self.kl_target == 0 or algo.reward_kl_coef > 0,
               "kl_target needs a reward KL coefficient > 0 to adapt")
        check(min(self.prompts_per_step, self.minibatch_size, self.micro_batch_size,
                   self.ppo_epochs, self.dynamic_sampling_rounds, self.max_new_tokens) >= 1,
               "prompts_per_step, minibatch_size, micro_batch_size, ppo_epochs, "
               "dynamic_sampling_rounds and max_new_tokens must be ≥ 1")
        check(self.temperature > 0, f"temperature must be > 0 for RL sampling, got "
              f"{self.temperature}")
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        check(self.top_k >= 0, f"top_k must be ≥ 0 (0 = off), got {self.top_k}")
        check(self.max_length >= 2, f"max_length must be ≥ 2, got {self.max_length}")
        for key in ("kl_coef", "reward_kl_coef", "clip_low", "clip_high"):
            value = getattr(self, key)
            check(value is None or value >= 0, f"{key} must be ≥ 0, got {value}")
        if "dual_clip" not in algo.loss.reads:
            self.refuse(("dual_clip",), f"{self.algo}'s policy loss {algo.policy_loss}, "
                        "which has no dual clip")
        if algo.kl_coef == 0:
            self.refuse(("kl_estimator",), f"{self.algo} without a KL term in the loss "
                        "(kl_coef 0)")
        if not algo.dynamic_sampling:
            self.refuse(("dynamic_sampling_rounds",),
                        f"{self.algo}, which has no dynamic sampling")
        if not algo.overlong_shaping:
            self.refuse(("overlong_cache",), f"{self.algo}, which has no overlong shaping")
        if self.kl_target == 0:
            self.refuse(("kl_horizon",), "a fixed KL coefficient (kl_horizon needs kl_target)")

    def _check_env(self) -> None:
        if not self.env and not self.tools:
            if not self.agent:
                self.refuse(("env_kwargs", "env_timeout", "env_workers", "max_turns",
                             "max_episode_tokens", "tool_error_reward", "partial_rollouts"),
                            "single-turn runs (they set the episodes of --env or --tools)")
            return
        check(not (self.env and self.tools), "--env and --tools are two environments; "
              "choose one (a tool-calling environment of your own can call the functions)")
        if self.env:
            self.refuse(("tool_error_reward",), "--env (it sets --tools' environment)")
        else:
            self.refuse(("env_kwargs",), "--tools (its environment takes the functions "
                        "alone; env_kwargs are --env's class's)")
        check(self.env == "builtin" or self.data is not None,
              f"--{'env' if self.env else 'tools'} {self.env or self.tools} needs --data: "
              "the rows its episodes are made from")
        check(self.max_turns >= 1 and self.max_episode_tokens >= 1 and self.env_timeout >= 0
              and self.env_workers >= 1, "max_turns, max_episode_tokens and env_workers must "
              "be ≥ 1 and env_timeout ≥ 0")
        from posttrain.episodes.env import parse_kwargs

        try:
            parse_kwargs(self.env_kwargs)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.env == "builtin" and self.model == "builtin":
            self.model = "builtin-episodes"  # the built-in model SFT'd on the task's protocol

    @property
    def vllm_engine(self) -> bool:
        """The engine is vLLM's, in this process or served (its own copy of the weights)."""
        return self.rollout_backend in ("vllm", "vllm_server")

    def _check_engine(self) -> None:
        from posttrain.core.correction import CORRECTIONS

        check(self.rollout_correction in ("auto", *CORRECTIONS),
              f"rollout_correction must be auto or one of {', '.join(CORRECTIONS)}")
        try:
            self.correction().validate()
        except ValueError as e:
            raise ConfigError(f"rollout_correction: {e}") from None
        if self.rollout_backend == "vllm_server":
            self.refuse(("vllm_gpu_memory_utilization", "vllm_sleep",
                         "vllm_tensor_parallel_size"), "rollout_backend=vllm_server (pass "
                        "the servers' own flags in rollout_server_args)")
        elif self.rollout_backend != "vllm":
            self.refuse(("vllm_kv_cache_gb", "vllm_gpu_memory_utilization",
                         "vllm_sleep", "vllm_tensor_parallel_size"),
                        f"rollout_backend={self.rollout_backend} (they set the vllm engine)")
        check(self.rollout_dtype in ("auto", "float32", "bfloat16", "float16"),
              "rollout_dtype must be auto, float32, bfloat16 or float16")
        check(self.vllm_kv_cache_gb >= 1 and 0 < self.vllm_gpu_memory_utilization <= 1
              and self.vllm_tensor_parallel_size >= 1, "vllm_kv_cache_gb must be ≥ 1, "
              "vllm_gpu_memory_utilization in (0, 1] and vllm_tensor_parallel_size ≥ 1")

    @property
    def samples_in_own_dtype(self) -> bool:
        """The engine samples in another dtype than the trainer computes in."""
        return self.rollout_dtype not in ("auto", self.dtype)

    def correction(self):
        """The mismatch correction this run applies (``auto`` resolved by the backend)."""
        from posttrain.core.correction import Correction

        mode = self.rollout_correction
        if mode == "auto":
            exact = (not self.vllm_engine and not self.samples_in_own_dtype
                     and not self.async_staleness)
            mode = "none" if exact else "token_truncate"
        bounds = {k: v for k, v in (("low", self.rollout_correction_low),
                                    ("high", self.rollout_correction_high)) if v is not None}
        return Correction(mode, **bounds)

    def _overrides(self) -> dict:
        """Fields of the algorithm's record that this config sets: every key named like a
        field of :class:`Algorithm` and not None."""
        return {k: getattr(self, k) for k in ALGORITHM_KEYS
                if getattr(self, k, None) is not None}

    def algorithm(self) -> Algorithm:
        try:
            return get_algorithm(self.algo, **self._overrides())
        except ValueError as e:
            raise ConfigError(str(e)) from None

@dataclass
class PPOConfig(RLConfig):
    """RLHF with a per-token KL penalty in the reward: PPO with a critic (actor, critic,
    frozen reference, reward model or function), or REINFORCE++ without one."""

    COMMAND: ClassVar[str] = "ppo"
    ALGOS: ClassVar[list[str]] = algorithm_names(token_rewards=True)
    CRITIC_KEYS: ClassVar[tuple[str, ...]] = ("critic_model", "critic_lr",
                                              "critic_warmup_steps", "value_clip", "value_coef",
                                              "critic_lora")
    algo: str = "ppo"
    """ppo (actor + critic, GAE), reinforce_pp or reinforce_pp_baseline (no critic)."""
    critic_model: str | None = None
    """Where the critic starts: a reward-model (posttrain rm) or causal-LM directory; none =
    the reward model when the reward is a single rm:DIR term, else the policy's weights with
    a fresh value head."""
    critic_lr: float = 1e-4
    """Learning rate of the critic (its own AdamW)."""
    critic_lora: bool = False
    """With lora_rank: the critic trains LoRA adapters too (same rank, alpha, targets) and
    its value head in full; false = the critic is fully trained."""
    critic_warmup_steps: int = 0
    """First steps that train the critic only, leaving the actor as it is."""
    value_clip: float | None = None
    """Override ε_v of the clipped value loss (0.2); 0 = unclipped."""
    value_coef: float | None = None
    """Override c_v, the weight of the value loss (0.5). The critic has its own AdamW, which
    is nearly blind to a loss scale, so c_v acts mainly through gradient clipping;
    critic_lr is the knob that matters."""
    prompts_per_step: int = 32
    group_size: int = 4
    minibatch_size: int = 64
    micro_batch_size: int = 64
    ppo_epochs: int = 2
    lr: float = 5e-5

    def validate(self) -> None:
        super().validate()
        if not self.algorithm().critic:
            self.refuse(self.CRITIC_KEYS, f"{self.algo}, which has no critic")
        check(not self.critic_lora or self.lora_rank > 0,
              "critic_lora needs lora_rank > 0 (the rank the critic's adapters take)")
        check(self.critic_lr > 0 and self.critic_warmup_steps >= 0,
               "critic_lr must be > 0 and critic_warmup_steps ≥ 0")
        check(self.critic_warmup_steps == 0 or self.algorithm().critic,
               f"critic_warmup_steps needs a critic; {self.algo} has none")
        check((self.value_clip is None or self.value_clip >= 0)
               and (self.value_coef is None or self.value_coef > 0),
               "value_clip must be ≥ 0 and value_coef > 0")

    def _overrides(self) -> dict:
        out = super()._overrides()
        if self.value_clip is not None:
            out["value_clip"] = self.value_clip or None  # 0: the plain ½(V - R)²
        return out
