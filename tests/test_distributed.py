"""torchrun on the CPU (gloo, 2 processes of one thread): every trainer computes on 2 ranks
the update it computes in one process, and a 2-rank run killed after a checkpoint resumes
to the end of the uninterrupted 2-rank run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import procs

pytestmark = pytest.mark.multiprocess

ARGS = ["--batch_size", "8", "--grad_accum", "2", "--max_steps", "4", "--builtin_train_size",
        "64", "--builtin_eval_size", "8", "--device", "cpu", "--tensorboard", "false",
        "--lr", "1e-3", "--log_every", "1", "--warmup_ratio", "0"]


# on-policy runs at an RL learning rate (1e-5): AdamW moves each weight by about lr per step
# whatever its gradient's size, so a component the group baseline cancels to rounding noise
# moves by up to lr either way in either run, and the weights can agree only to ~lr·steps
# there (at 1e-4 one weight in 16k differed by 1.4e-5). AdamW's scale invariance also hides
# a gradient off by a constant factor, which the gradient norms compared at every step catch.
# The built-in SFT'd start (a random model's groups are all wrong, which
# leaves DAPO's dynamic sampling nothing to keep); 3 prompts on 2 ranks, an uneven share
RL = {
    "grpo": ["--prompts_per_step", "3", "--group_size", "4", "--max_new_tokens", "8",
             "--kl_coef", "0.04", "--minibatch_size", "6"],
    "dapo": ["--prompts_per_step", "3", "--group_size", "4", "--max_new_tokens", "8",
             "--dynamic_sampling_rounds", "3"],
    "ppo": ["--prompts_per_step", "3", "--group_size", "2", "--max_new_tokens", "8",
            "--ppo_epochs", "2", "--minibatch_size", "4", "--critic_lr", "1e-5"],
    # GRPO with LoRA adapters: the reference is the base (the adapter off), the sampler a
    # merged copy; only the adapters' gradients are summed (lr 1e-3: adapters move slowly)
    "lora": ["--prompts_per_step", "3", "--group_size", "4", "--max_new_tokens", "8",
             "--kl_coef", "0.04", "--lora_rank", "4", "--lr", "1e-3"],
    # GRPO on the built-in multi-turn task's episodes (its start: builtin-episodes)
    "episodes": ["--env", "builtin", "--prompts_per_step", "3", "--group_size", "4",
                 "--max_new_tokens", "6", "--kl_coef", "0.04", "--minibatch_size", "6"],
    # asynchronous rollouts (K=1): each rank's producer thread samples its groups by the
    # schedule's version, gathering on a process group of its own
    "async": ["--prompts_per_step", "3", "--group_size", "4", "--max_new_tokens", "8",
              "--kl_coef", "0.04", "--async_staleness", "1", "--async_producer", "thread"],
    # the built-in task played by its openai-SDK agent through each rank's endpoint
    "agents": ["--agent", "builtin", "--prompts_per_step", "3", "--group_size", "4",
               "--max_new_tokens", "6", "--kl_coef", "0.04", "--minibatch_size", "6"],
    "async_episodes": ["--env", "builtin", "--prompts_per_step", "3", "--group_size", "4",
                       "--max_new_tokens", "6", "--async_staleness", "1",
                       "--async_producer", "thread", "--algo", "dapo"],
    # full sequences packed into forwards of at most 40 tokens: some minibatches cut into 1
    # forward on one rank and 2 on the other (seen when written), so under fsdp the first
    # runs a zero-weight extra
    "budget": ["--prompts_per_step", "3", "--group_size", "4", "--max_new_tokens", "8",
               "--kl_coef", "0.04", "--minibatch_size", "6", "--share_prompt", "false",
               "--packing", "true", "--max_tokens_per_micro_batch", "40"],
    # on-policy distillation from the built-in episodes model (context parallel only)
    "distill": ["--teacher", "builtin-episodes", "--prompts_per_step", "3", "--group_size", "2",
                "--max_new_tokens", "8"],
}
RL_ARGS = ["--lr", "1e-5", "--max_steps", "4", "--builtin_train_size", "32",
           "--builtin_eval_size", "5", "--eval_every", "2", "--log_every", "1", "--device",
           "cpu", "--tensorboard", "false", "--seed", "3"]


def _launch(ranks: int) -> list[str]:
    return ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
             "--standalone"] if ranks > 1 else [sys.executable])


def _rl_args(name: str, out: Path, *extra: str) -> list[str]:
    command = name if name in ("ppo", "distill") else "grpo"
    algo = [] if name == "ppo" else ["--algo", "grpo" if name in ("lora", "episodes",
                                                                  "async", "agents", "budget")
                                          else name]
    if name in ("async_episodes", "distill"):
        algo = []  # (its own: dapo, whose dynamic sampling gathers on the producer's group)
    return [command, "--model", "builtin", *algo, *RL_ARGS, *RL[name], "--output_dir",
            str(out), *extra]


# offline runs with LoRA adapters: DPO's reference is the policy with its adapter off
OFFLINE = {"sft": ("sft", []), "rm": ("rm", []), "dpo": ("dpo", []),
           "dpo_lora": ("dpo", ["--lora_rank", "4"]),
           # packed rows, each rank's share of a micro-batch balanced by tokens
           "sft_packed": ("sft", ["--packing", "true"]),
           "dpo_packed": ("dpo", ["--packing", "true", "--max_tokens_per_micro_batch", "64"]),
           # forwards of at most 28 tokens from the whole step: at step 3 one rank has 3, the
           # other 4 (seen when written), so under fsdp the first runs one zero-weight extra
           "sft_budget": ("sft", ["--packing", "true", "--max_tokens_per_micro_batch", "28"])}


def _run(command: str, model: str, out: Path, ranks: int, *extra: str) -> None:
    if command in OFFLINE:
        command, more = OFFLINE[command]
        args = [command, "--model", model, *ARGS, *more, "--output_dir", str(out), *extra]
    else:
        args = _rl_args(command, out, *extra)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = procs.run([*_launch(ranks), "-m", "posttrain", *args], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    final = out / "final"
    adapter = final / "adapter_model.safetensors"  # a LoRA run's final/ holds its adapter
    weights = load_file(str(adapter if adapter.exists() else final / "model.safetensors"))
    if (final / "critic").exists():
        weights.update({f"critic.{k}": v for k, v in
                        load_file(str(final / "critic" / "model.safetensors")).items()})
    return weights


def _sequence_logprob_sum_bound(out: Path) -> float:
    """How far two float32 computations of a sum of per-token log-prob differences over
    one completion may differ (a KL metric): the completion's tokens, each log-prob within
    ``pair_bound`` of the forward's reductions, relative to the log-probs' scale
    (2·log V: a log-softmax's terms lie within the vocabulary's log-sum-exp). A worst case,
    loose against a KL of ~1e-2 (7e-3 for the builtin model; seen: 1.3e-6): the weights
    (1e-5) and the other metrics carry the comparison's precision."""
    import math

    from transformers import AutoConfig

    from bounds import model_inner, model_stages, pair_bound
    from posttrain.models.loading import builtin_model_dir

    run = dict(x.split(": ", 1) for x in (out / "config.yaml").read_text().splitlines()
               if x.startswith(("model: ", "max_new_tokens: ")))
    model = run["model"].strip()  # (the base model: a LoRA run's final is its adapter)
    config = AutoConfig.from_pretrained(builtin_model_dir(model)
                                        if model.startswith("builtin") else model)
    tokens = int(run["max_new_tokens"])
    inner = model_inner(config, config.max_position_embeddings)  # (the longest sequence)
    return (tokens * pair_bound(model_stages(config, backward=False), inner)
            * 2 * math.log(config.vocab_size))


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """Each (command, ranks, parallel) run once per module: the single-process baselines
    serve the DDP and the FSDP comparisons."""
    done: dict[tuple, Path] = {}

    def get(name: str, ranks: int, parallel: str = "ddp", *extra: str) -> Path:
        key = (name, ranks, parallel, *extra)
        if key not in done:
            out = tmp_path_factory.mktemp(f"{name}-{ranks}-{parallel}")
            _run(name, tiny_model_dir, out, ranks, "--parallel", parallel, *extra)
            done[key] = out
        return done[key]

    return get


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
@pytest.mark.parametrize("command", sorted(OFFLINE))
def test_two_ranks_compute_the_update_of_one(command, parallel, runs):
    """Final weights within 1e-5 of the single process (the target), losses and gradient
    norms at every step to float32 rounding (the ranks sum in another order), whether each
    rank holds the whole model (ddp) or a shard of it (fsdp, FSDP2 on gloo). Only rank 0
    writes: one metrics.jsonl, one final/ that loads as a plain Hugging Face model."""
    one, two = runs(command, 1), runs(command, 2, parallel)
    _assert_offline_runs_agree(one, two)
    config = "adapter_config.json" if command.endswith("lora") else "config.json"
    assert (json.loads((two / "final" / config).read_text()).get("architectures")
            == json.loads((one / "final" / config).read_text()).get("architectures"))


@pytest.mark.parametrize(("command", "parallel"), [
    ("sft", "ddp"), ("rm", "ddp"), ("dpo_lora", "ddp"), ("sft_packed", "fsdp"), ("dpo", "fsdp")])
def test_two_ranks_splitting_each_sequence_compute_the_update_of_one(command, parallel, runs):
    """--context_parallel 2 on 2 ranks: one data replica whose every sequence (padded,
    packed, a preference pair's two) is split over both ranks computes the single process's
    update: final weights within 1e-5, losses and gradient norms to float32 rounding at every
    step, with the whole model on each rank or FSDP2's shards, and with LoRA."""
    _assert_offline_runs_agree(runs(command, 1),
                               runs(command, 2, parallel, "--context_parallel", "2"))


def _assert_offline_runs_agree(one: Path, two: Path) -> None:
    """Final weights within 1e-5; losses and gradient norms to float32 rounding at every
    logged step."""
    a, b = _weights(one), _weights(two)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)
    rows_a, rows_b = _rows(one), _rows(two)
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]
    for x, y in zip(rows_a, rows_b, strict=True):
        for key in ("train/loss", "train/grad_norm", "eval/loss"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-5), key


def _assert_adapters_agree(a: dict, b: dict, lr: float = 1e-3, steps: int = 4) -> None:
    """LoRA's adapters at lr 1e-3 (they learn nothing at 1e-5): AdamW moves a weight by
    about lr per step whatever its gradient's size, so the few whose gradient is rounding
    noise (in the q and k adapters' B, whose gradient starts near zero) can end up to
    lr·steps apart. One process with another micro-batch size (another summation order)
    shows it as well: 5 of 40,960 weights off by > 1e-5, the largest 4e-5. So: at most
    0.1% of the weights beyond 1e-5 and none beyond lr·steps; a gradient summed wrongly
    (a missing rank, a shard left out) moves nearly all of them."""
    total = off = 0
    for k in a:
        d = (a[k] - b[k]).abs()
        assert float(d.max()) <= lr * steps, k
        total, off = total + d.numel(), off + int((d > 1e-5).sum())
    assert off <= 1e-3 * total, (off, total)


@pytest.mark.parametrize(("name", "parallel"), [
    (name, parallel) for name in sorted(RL) if name != "distill" for parallel in ("ddp", "fsdp")])
def test_two_ranks_compute_the_on_policy_update_of_one(name, parallel, runs):
    """Each rank samples its own prompt groups (3 prompts on 2 ranks: 2 and 1); with the
    sampling draws fixed by (seed, step, slot), the same completions are drawn, so every
    reward, dynamic-sampling decision and count agrees exactly with the single process,
    the final weights (and PPO's critic) within 1e-5, and the float metrics to rounding.
    Under fsdp the sampler is a plain copy refreshed from the shards after every step."""
    _assert_on_policy_runs_agree(name, runs(name, 1), runs(name, 2, parallel))


@pytest.mark.parametrize(("name", "extra"), [("ppo", ("--share_prompt", "false")),
                                           ("distill", ())])
def test_two_ranks_dealing_full_sequences_by_tokens_compute_the_update_of_one(name, extra,
                                                                              runs):
    """ddp on full sequences (PPO with ``--share_prompt false``: its critic, 2 epochs of
    minibatches; distill, which runs whole sequences): the step's rows are dealt to the
    ranks by tokens, not kept where they were sampled (tests/test_context_parallel.py
    checks the deal), and the update is one process's."""
    _assert_on_policy_runs_agree(name, runs(name, 1, "ddp", *extra),
                                 runs(name, 2, "ddp", *extra))


@pytest.mark.parametrize(("name", "parallel", "extra"), [
    ("grpo", "ddp", ("--packing", "true")), ("ppo", "ddp", ()), ("lora", "ddp", ()),
    ("episodes", "fsdp", ()), ("distill", "ddp", ())])
def test_two_ranks_splitting_each_sequence_compute_the_on_policy_update_of_one(
        name, parallel, extra, runs):
    """--context_parallel 2: both ranks sample (3 prompts: 2 and 1), then train the whole
    step's rows together, each sequence's columns split between them (the log-probs,
    values and divergences gathered): the single process's update and metrics, as above,
    with packed rows, PPO's critic, LoRA, FSDP2 and on-policy distillation."""
    _assert_on_policy_runs_agree(name, runs(name, 1, "ddp", *extra),
                                 runs(name, 2, parallel, "--context_parallel", "2", *extra))


def _assert_on_policy_runs_agree(name: str, one: Path, two: Path) -> None:
    a, b = _weights(one), _weights(two)
    assert a.keys() == b.keys()
    if name == "lora":
        _assert_adapters_agree(a, b)
    else:
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)
    rows_a, rows_b = _rows(one), _rows(two)
    kl_tol = _sequence_logprob_sum_bound(one)
    assert len(rows_a) == len(rows_b) == 6  # the start, 4 steps, the final evaluation
    exact = ("reward/", "groups/", "sampling/rounds", "completion/", "optim/", "eval/",
             "start/", "samples/", "step")
    for x, y in zip(rows_a, rows_b, strict=True):
        assert x.keys() == y.keys()
        for k, v in x.items():
            if k.startswith(exact):
                assert y[k] == v, k
            elif not k.startswith(("time/", "sampling/logprob_gap", "train/rollout_corr/gap",
                                   "train/rollout_corr/prob_error")):
                # (the sampler/trainer gaps are rounding itself: ~1e-6, any order changes them)
                # float32 sums in another order; a KL is a sum of log-prob differences over a
                # sequence, whose rounding is the log-probs' (not relative to the small KL)
                tol = kl_tol if k.startswith("kl/") else 1e-6
                assert y[k] == pytest.approx(v, rel=1e-4, abs=tol), k
    if name == "dapo":  # dynamic sampling took part: groups were dropped and refilled
        assert sum(r.get("groups/dropped", 0) for r in rows_a) > 0


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds torchrun's workers in /proc")
@pytest.mark.parametrize(("name", "parallel"), [("sft", "ddp"), ("dapo", "ddp"),
                                              ("ppo", "fsdp"), ("lora", "fsdp"),
                                              ("episodes", "ddp"), ("async", "ddp"),
                                              ("agents", "ddp")])
def test_a_two_rank_run_killed_after_a_checkpoint_resumes_exactly(name, parallel,
                                                                  tiny_model_dir, tmp_path):
    """torchrun and both ranks SIGKILLed once checkpoint-2 exists (the killed run is given
    far more steps, so the kill lands mid-run; with a constant schedule nothing depends on
    max_steps), resumed on 2 ranks from that checkpoint: the weights equal the
    uninterrupted 2-rank run's bit for bit (fsdp: the optimiser states gathered into the
    checkpoint and sharded again on resume; LoRA: the adapter in peft's format, its
    optimiser states, the merged sampler rebuilt from them)."""
    constant = ("--lr_schedule", "constant", "--warmup_ratio", "0", "--save_every", "2",
                "--parallel", parallel)
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    _run(name, tiny_model_dir, whole, 2, *constant)
    args = ([name, "--model", tiny_model_dir, *ARGS, "--output_dir", str(killed)]
            if name == "sft" else _rl_args(name, killed))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([*_launch(2), "-m", "posttrain", *args, *constant, "--max_steps",
                             "100000"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    first = killed / "checkpoint-2"
    deadline = time.monotonic() + 120
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    for pid in [*_descendants(proc.pid), proc.pid]:  # both ranks, then the launcher
        os.kill(pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL  # killed mid-run, not finished
    assert first.exists() and not (killed / "final").exists()
    _run(name, tiny_model_dir, killed, 2, *constant, "--resume_from", str(first))
    a, b = _weights(whole), _weights(killed)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in _rows(killed)] == [r["step"] for r in _rows(whole)]


def test_a_sharded_checkpoint_resumes_in_one_process(tiny_model_dir, tmp_path):
    """Checkpoints hold gathered (whole) model and optimiser states, so a 2-rank FSDP run's
    checkpoint resumes in one process (ddp): the same samples, and weights within 1e-5 of
    the uninterrupted 2-rank run (the sums now run in another order)."""
    constant = ("--lr_schedule", "constant", "--warmup_ratio", "0", "--save_every", "2")
    whole, again = tmp_path / "whole", tmp_path / "again"
    _run("dapo", tiny_model_dir, whole, 2, *constant, "--parallel", "fsdp")
    _run("dapo", tiny_model_dir, again, 1, *constant, "--resume_from",
         str(whole / "checkpoint-2"))
    a, b = _weights(whole), _weights(again)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)
    tail = [r for r in _rows(whole) if r["step"] > 2]
    assert [r.get("reward/mean") for r in _rows(again)[-len(tail):]] == [
        r.get("reward/mean") for r in tail]


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (torchrun's workers run in sessions of their own, so a
    process-group kill misses them), from /proc."""
    parent = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        found += kids
        frontier = kids
    return found


def test_too_few_prompts_for_the_ranks_is_refused(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*_launch(2), "-m", "posttrain", "grpo", "--model", "builtin",
                           "--prompts_per_step", "1", "--output_dir", str(tmp_path / "o"),
                           "--device", "cpu"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "at least one prompt per rank" in proc.stderr
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """A tiny Mixtral (routers drawn to route decisively) and a prompt file with a length
    reward, so groups have signal from the first step; ``moe_run(ranks, parallel, replay)``
    runs GRPO with two minibatches per step (an old pass, ratios off 1) once per key."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    from posttrain.builtin.tokenizer import build_tokenizer
    from posttrain.models.routing import routers

    root = tmp_path_factory.mktemp("moe-dist")
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MixtralConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, num_local_experts=6, num_experts_per_tok=2,
        tie_word_embeddings=False))
    with torch.no_grad():
        for r in routers(model):
            r.weight.normal_(0, 1.0)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    (root / "r.py").write_text("def by_len(prompts, completions, **_):\n"
                               "    return [float(len(c)) for c in completions]\n")
    (root / "p.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+{i}="}) + "\n"
                                          for i in range(32)))
    done: dict[tuple, Path] = {}

    def get(ranks: int, parallel: str, replay: str) -> Path:
        key = (ranks, parallel, replay)
        if key not in done:
            out = root / "-".join(map(str, key))
            args = ["grpo", "--model", str(root / "model"), "--data", str(root / "p.jsonl"),
                    "--reward", f"{root / 'r.py'}:by_len", "--routing_replay", replay,
                    "--parallel", parallel, "--prompts_per_step", "3", "--group_size", "4",
                    "--max_new_tokens", "6", "--minibatch_size", "6", "--temperature", "1.5",
                    "--max_steps", "3", "--eval_every", "0", "--lr", "1e-3", "--device",
                    "cpu", "--tensorboard", "false", "--log_every", "1", "--seed", "3",
                    "--output_dir", str(out)]
            proc = subprocess.run([*_launch(ranks), "-m", "posttrain", *args],
                                  env={**os.environ, "OMP_NUM_THREADS": "1"},
                                  capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[key] = out
        return done[key]

    return get


@pytest.mark.parametrize(("parallel", "replay"), [("ddp", "r3"), ("fsdp", "r3"),
                                                  ("fsdp", "r2")])
def test_two_ranks_replay_the_routing_of_one(moe_run, parallel, replay):
    """Routing replay on 2 ranks (each its own prompt groups; under fsdp the sampler a plain
    copy that records the experts): the final weights are the single process's within
    1e-5, and the router metrics, summed over the ranks, are its own. Without replay the
    weights end elsewhere by far more than that, so the agreement is replay's."""
    one, two = moe_run(1, "ddp", replay), moe_run(2, parallel, replay)
    a, b = _weights(one), _weights(two)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)
    free = _weights(moe_run(2, parallel, "none"))
    assert max(float((free[k] - a[k]).abs().max()) for k in a) > 1e-4
    for x, y in zip(_rows(one), _rows(two), strict=True):
        for k, v in x.items():
            if k.startswith("router/"):
                assert y[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k


def test_two_ranks_train_split_agent_episodes_as_one(tiny_model_dir, tmp_path):
    """An agent whose every episode is two trajectories (it rewrites its history): each
    rank plays its own rows' episodes; gathered, the groups (of varying rows) are in the
    order one process makes them, so rewards, counts and weights agree with one process."""
    pytest.importorskip("openai")
    from test_agents import SUMMARISER

    (tmp_path / "agent.py").write_text(SUMMARISER)
    (tmp_path / "rows.jsonl").write_text("".join(
        json.dumps({"prompt": p}) + "\n" for p in ("ab", "cd", "ef")))
    outs = []
    for ranks in (1, 2):
        out = tmp_path / f"run{ranks}"
        args = ["grpo", "--model", tiny_model_dir, "--agent", f"{tmp_path}/agent.py:summarise",
                "--data", str(tmp_path / "rows.jsonl"), "--prompts_per_step", "3",
                "--group_size", "2", "--max_new_tokens", "4", "--max_steps", "2",
                "--log_every", "1", "--eval_every", "0", "--device", "cpu", "--tensorboard",
                "false", "--seed", "3", "--output_dir", str(out)]
        proc = subprocess.run([*_launch(ranks), "-m", "posttrain", *args],
                              env={**os.environ, "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(out)
    rows = [[r for r in _rows(o) if "agent/requests" in r] for o in outs]
    assert len(rows[0]) == len(rows[1]) == 2
    for x, y in zip(*rows, strict=True):
        assert x["agent/trajectory_splits"] == y["agent/trajectory_splits"] == 6
        for k in ("reward/mean", "agent/requests", "completion/length_mean"):
            assert x[k] == y[k], k
    a, b = _weights(outs[0]), _weights(outs[1])
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)
