"""The study's mixture-of-experts part: on a MoE policy sampled in bfloat16 and trained in
float32, does routing replay (R3) or GSPO's sequence-level ratio make training steadier?

The built-in model is upcycled into a Mixtral-style model (each MLP copied into 8 experts,
2 routed per token, a fresh router; :func:`upcycle`) and SFT'd briefly so the experts part
(:func:`build_moe_start`). Four arms train it (:data:`ARMS`): GRPO and GSPO, each with
``--routing_replay none`` and ``r3``, off-policy (2 epochs over 2 minibatches) and sampled
by the hf engine from a bfloat16 copy of the float32 policy, the mismatch a user meets
with a bfloat16 serving engine: a token whose router's top scores are close goes to other
experts in the sampler than in the trainer. :func:`run_moe_study` gathers, per seed,
accuracy, clip fractions, the spread of the update's ratios and of the mismatch weights,
the rollout/trainer routing disagreement, the trainer/sampler log-prob gap, KL, and how far
training moved the routing from the start's (:func:`routing_moved`).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from posttrain.compare.runner import Scorer, spawn, train

MOE = dict(num_local_experts=8, num_experts_per_tok=2)
MOE_SFT_STEPS = 150
MOE_RL = ["--ppo_epochs", "2", "--minibatch_size", "64", "--rollout_backend", "hf",
          "--rollout_dtype", "bfloat16"]
"""Off-policy updates for the MoE study (2 epochs over 2 minibatches of a step's 128
samples, so every update after the first sees ratios ≠ 1), sampled from a bfloat16 copy
of the float32 policy (the mismatch is corrected by the default truncated importance
weight, as for any engine of another dtype)."""
ARMS = (("grpo", "none"), ("grpo", "r3"), ("gspo", "none"), ("gspo", "r3"))
"""(algorithm, routing replay) of the study's arms."""


def upcycle(dense, noise: float = 0.01, seed: int = 0):
    """A Mixtral-style mixture of experts made from the Llama-family ``dense`` model
    (sparse upcycling): attention, norms and embeddings copied, each MLP copied into every
    expert (times ``1 + noise·N(0, 1)`` elementwise, so the experts can part), a router
    drawn small. With ``noise = 0`` it computes what ``dense`` computes whatever the
    routing: the top-k weights sum to 1 over identical experts."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    c = dense.config
    cfg = MixtralConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                        intermediate_size=c.intermediate_size,
                        num_hidden_layers=c.num_hidden_layers,
                        num_attention_heads=c.num_attention_heads,
                        num_key_value_heads=c.num_key_value_heads,
                        head_dim=c.hidden_size // c.num_attention_heads,
                        max_position_embeddings=c.max_position_embeddings,
                        rms_norm_eps=c.rms_norm_eps,
                        rope_parameters=getattr(c, "rope_parameters", None),
                        tie_word_embeddings=c.tie_word_embeddings, sliding_window=None,
                        pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id,
                        eos_token_id=c.eos_token_id, router_aux_loss_coef=0.0, **MOE)
    torch.manual_seed(seed)
    moe = MixtralForCausalLM(cfg).to(next(dense.parameters()).dtype)
    missing, unexpected = moe.load_state_dict(
        {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}, strict=False)
    left = [k for k in missing if ".mlp." not in k]
    if left or unexpected:
        raise RuntimeError(f"upcycling: {(left + unexpected)[:3]} did not carry over")
    g = torch.Generator().manual_seed(seed)

    def jitter(w):
        return w * (1 + noise * torch.randn(w.shape, generator=g)) if noise else w

    with torch.no_grad():
        for layer, source in zip(moe.model.layers, dense.model.layers, strict=True):
            mlp = source.mlp
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            for e in range(cfg.num_local_experts):
                layer.mlp.experts.gate_up_proj[e].copy_(jitter(gate_up))
                layer.mlp.experts.down_proj[e].copy_(jitter(mlp.down_proj.weight))
            layer.mlp.gate.weight.normal_(0, 0.02, generator=g)
    return moe


def build_moe_start(out: Path, device: str, seed: int = 0, sft_steps: int | None = None
                    ) -> Path:
    """The built-in model upcycled (:func:`upcycle`) into ``out/upcycled`` and SFT'd on the
    built-in task for ``sft_steps`` steps so the experts part; returns that run's
    ``final/``, the study's start."""
    from posttrain.models import load_causal_lm, load_tokenizer

    sft_steps = sft_steps or MOE_SFT_STEPS
    upcycled = out / "upcycled"
    upcycle(load_causal_lm("builtin", device="cpu"), seed=seed).save_pretrained(upcycled)
    load_tokenizer("builtin").save_pretrained(upcycled)
    sft = out / "sft"
    code, _, _ = spawn(["sft", "--model", str(upcycled), "--output_dir", str(sft),
                        "--overwrite", "true", "--max_steps", str(sft_steps), "--lr", "1e-3",
                        "--batch_size", "128", "--builtin_train_size", "20000",
                        "--max_length", "32", "--warmup_ratio", "0.05", "--device", device,
                        "--tensorboard", "false", "--log_every", "50",
                        "--builtin_eval_size", "20", "--seed", str(seed)],
                       out / "sft.log")
    if code != 0:
        raise RuntimeError(f"compare: the MoE start's SFT failed (log: {out / 'sft.log'})")
    return sft / "final"


def setup() -> dict:
    """The MoE study as the report describes it: its experts, SFT steps and sampling, read
    when called so that the report names what :func:`build_moe_start` and the arms ran."""
    return {**MOE, "sft_steps": MOE_SFT_STEPS, "rl": " ".join(MOE_RL)}


def arm_name(algo: str, replay: str) -> str:
    return algo if replay == "none" else f"{algo}+{replay}"


def run_moe_study(out: Path, device: str, seeds: int, limit: list[str], log) -> dict:
    """The MoE start built under ``out/moe`` and scored, then every arm of :data:`ARMS`
    trained from it under ``limit`` for ``seeds`` seeds each: per run, the final model's
    scores, :func:`_moe_metrics` over its steps, :func:`routing_moved` and its wall time."""
    start = build_moe_start(out / "moe", device)
    scorer = Scorer(str(start), device)
    probe = _probe(scorer)
    study = {"start": scorer(start), "runs": {}}
    log(f"[compare] MoE start (upcycled, SFT'd): accuracy {study['start']['accuracy']:.1%}")
    for algo, replay in ARMS:
        name = arm_name(algo, replay)
        study["runs"][name] = []
        for seed in range(seeds):
            d = out / "runs" / f"moe-{algo}-{replay}-seed{seed}"
            got = train(algo, str(start), d, seed, limit, device,
                        [*MOE_RL, "--routing_replay", replay])
            rows = [r for r in got["rows"] if "train/ratio_max" in r]
            model = scorer.load(d / "final")
            final, moved = scorer(model), routing_moved(scorer.start, model, probe)
            study["runs"][name].append({**final, **_moe_metrics(rows),
                                        "routing_moved": moved, "wall_s": got["wall_s"]})
            r = study["runs"][name][-1]
            log(f"[compare] MoE {name} seed {seed}: accuracy {final['accuracy']:.1%}, "
                f"disagreement {r['disagreement']:.2%}, log-prob gap max "
                f"{r['gap_max']:.3f}")
    return study


def _probe(scorer: Scorer) -> dict:
    """The held-out prompts with the start's greedy completions: the tokens
    :func:`routing_moved` routes (the same for every run)."""
    return scorer.samples(scorer.start, 0.0, engine="hf")


def routing_moved(start, final, batch: dict) -> float:
    """The share of the real tokens of ``batch`` (every router) whose expert set in
    ``final`` differs from the one in ``start``: how far training moved the routing."""
    import torch

    from posttrain.models import routing

    ids, mask = batch["input_ids"], batch["attention_mask"]
    rows = torch.arange(len(ids))
    with routing.Routing(start, len(ids), ids.shape[1]) as before, \
            routing.Routing(final, len(ids), ids.shape[1]) as after, torch.no_grad():
        with before.call(rows, mask, "record"):
            start(input_ids=ids, attention_mask=mask)
        after.load(before.indices.permute(1, 0, 2, 3))
        with after.call(rows, mask, "compare"):
            final(input_ids=ids, attention_mask=mask)
        return after.disagreement


def _moe_metrics(rows: list[dict]) -> dict[str, float]:
    """Means over a run's training rows of what says how far the update strayed and how
    far the sampler was from the trainer; ``gap_max`` and ``kl_max`` are the worst step's."""
    keys = {"clip_low": "train/clip_frac_low", "clip_high": "train/clip_frac_high",
            "ratio_max": "train/ratio_max", "ratio_min": "train/ratio_min",
            "weight_max": "train/rollout_corr/weight_max",
            "weight_min": "train/rollout_corr/weight_min",
            "disagreement": "router/disagreement", "gap_mean": "sampling/logprob_gap_mean",
            "train_kl": "train/kl"}
    out = {}
    for name, key in keys.items():
        out[name] = statistics.fmean(xs) if (xs := _finite(rows, key)) else float("nan")
    for name, key in (("gap_max", "sampling/logprob_gap_max"), ("kl_max", "train/kl")):
        out[name] = max(xs) if (xs := _finite(rows, key)) else float("nan")
    out["clip"] = out["clip_low"] + out["clip_high"]
    out["ratio_spread"] = out["ratio_max"] - out["ratio_min"]
    out["weight_spread"] = out["weight_max"] - out["weight_min"]
    return out


def _finite(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if isinstance(r.get(key), (int, float))
            and math.isfinite(r[key])]
