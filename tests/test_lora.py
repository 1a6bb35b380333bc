"""LoRA through peft (``--lora_rank``): the adapter-off reference is the base, the sampler's
merged copy computes what the adapted policy computes, only adapters (and heads) train,
checkpoints hold the adapter and resume exactly, ``posttrain merge`` writes a plain model
with the adapter model's logits, and LoRA GRPO learns the built-in task."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bounds import model_inner, model_stages, rel_bound
from posttrain.cli import main
from posttrain.config import RLConfig
from posttrain.models import completion_logprobs, load_causal_lm, lora

pytest.importorskip("peft")

FAST = ["--device", "cpu", "--tensorboard", "false", "--log_every", "1",
        "--builtin_train_size", "32", "--builtin_eval_size", "8"]


def _adapted(rank: int = 4):
    """The built-in model with adapters whose B is random (a fresh adapter computes the
    base exactly, which would make these comparisons vacuous)."""
    cfg = RLConfig(lora_rank=rank)
    torch.manual_seed(0)  # peft draws A from the global generator
    model = lora.add(load_causal_lm("builtin", device="cpu"), cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _batch():
    from posttrain.data import pad_sequences
    from posttrain.models import load_tokenizer

    tok = load_tokenizer("builtin")
    prompts = [tok(p)["input_ids"] for p in ("58+67=", "7+8=", "40+41=")]
    completions = [tok(c)["input_ids"] for c in ("125", "15", "81")]
    return pad_sequences(prompts, completions, tok.pad_token_id)


def _logprobs(model, b):
    with torch.no_grad():
        return completion_logprobs(model, b["input_ids"], b["attention_mask"], b["loss_mask"])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _bound(model, length: int) -> float:
    """Two float32 computations of the same forward (another summation order: the adapter
    as its own products or merged into W) each within the forward's bound."""
    return 2 * rel_bound(model_stages(model.config, backward=False),
                         model_inner(model.config, length))


def test_the_adapter_off_reference_is_the_base_model():
    model, base, b = _adapted(), load_causal_lm("builtin", device="cpu"), _batch()
    adapted = _logprobs(model, b)
    with lora.adapter_off(model):
        off = _logprobs(model, b)
    reference = _logprobs(base, b)
    bound = _bound(base, b["input_ids"].shape[1])
    assert _rel(off, reference) <= bound
    assert _rel(adapted, reference) > 100 * bound  # the adapter does change it


def test_the_merged_sampler_copy_computes_the_adapted_policy():
    model, b = _adapted(), _batch()
    plain = lora.plain_copy(model)
    assert not lora.is_adapted(plain)
    assert all(type(m) is torch.nn.Linear for m in plain.modules()
               if isinstance(m, torch.nn.Linear))  # plain layers: the lean decoder runs it
    bound = _bound(plain, b["input_ids"].shape[1])
    assert _rel(_logprobs(plain, b), _logprobs(model, b)) <= bound
    with torch.no_grad():  # an update of the adapters reaches the copy on merge_into
        for name, p in model.named_parameters():
            if "lora_B" in name:  # the adapter's change doubled
                p.mul_(2.0)
    assert _rel(_logprobs(plain, b), _logprobs(model, b)) > 100 * bound
    lora.merge_into(plain, model)
    assert _rel(_logprobs(plain, b), _logprobs(model, b)) <= bound


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj"])
def test_the_sampler_copy_owns_only_the_adapted_layers(targets):
    """The merged copy costs the adapted layers' weights, nothing more: every frozen weight
    (embeddings, norms, LM head, layers left unadapted) is the base's tensor, and merging
    leaves the base's own weights as they were."""
    cfg = RLConfig(lora_rank=4, lora_targets=targets)
    model = lora.add(load_causal_lm("builtin", device="cpu"), cfg)
    before = {n: p.detach().clone() for n, p in model.get_base_model().named_parameters()
              if "lora_" not in n}
    plain = lora.plain_copy(model)
    base = {n.replace(".base_layer", ""): p for n, p in model.get_base_model().named_parameters()
            if "lora_" not in n}
    adapted = {n for n, m in model.get_base_model().named_modules() if hasattr(m, "lora_A")}
    owned = 0
    for name, p in plain.named_parameters():
        shared = p.data_ptr() == base[name].data_ptr()
        assert shared != (name.rpartition(".")[0] in adapted), name
        owned += 0 if shared else p.numel()
    wanted = sum(m.base_layer.weight.numel() for m in model.get_base_model().modules()
                 if hasattr(m, "lora_A"))
    assert 0 < owned == wanted
    for n, p in model.get_base_model().named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, before[n]), n


def test_targets_are_every_linear_layer_of_the_blocks_or_named_ones():
    base = load_causal_lm("builtin", device="cpu")
    assert lora.linear_targets(base) == ["down_proj", "gate_proj", "k_proj", "o_proj",
                                         "q_proj", "up_proj", "v_proj"]
    assert lora.linear_targets(base, "q_proj, v_proj") == ["q_proj", "v_proj"]
    with pytest.raises(lora.LoRAError, match="lm_head is not a linear layer"):
        lora.linear_targets(base, "q_proj,lm_head")


def test_only_the_adapters_train_and_final_holds_the_adapter(tmp_path):
    out = tmp_path / "sft"
    assert main(["sft", "--lora_rank", "4", "--max_steps", "2", "--output_dir", str(out),
                 *FAST]) == 0
    final = out / "final"
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    saved = load_file(str(final / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved)
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8


def test_merge_writes_a_plain_model_with_the_adapter_models_logits(tmp_path):
    out, merged = tmp_path / "sft", tmp_path / "merged"
    assert main(["sft", "--lora_rank", "4", "--max_steps", "3", "--lr", "1e-2",
                 "--output_dir", str(out), *FAST]) == 0
    assert main(["merge", str(out / "final"), "--output", str(merged)]) == 0
    plain = load_causal_lm(str(merged), device="cpu")
    adapted = lora.load(load_causal_lm("builtin", device="cpu"), out / "final", trainable=False)
    base = load_causal_lm("builtin", device="cpu")
    ids = torch.tensor([[5, 60, 61, 62, 63, 64, 65, 66]])
    with torch.no_grad():
        a, p, b = adapted(ids).logits, plain(ids).logits, base(ids).logits
    assert _rel(b, a) > 10 * _bound(plain, ids.shape[1])  # training moved it past the bound
    # W + (α/r)·B·A in one matrix or as two products: float32 rounding of a forward whose
    # logits reach ~10 (the 1e-5, relative: about 1e-6 here)
    assert _rel(p, a) <= _bound(plain, ids.shape[1])
    assert main(["merge", str(out / "final"), "--output", str(merged)]) == 2  # not emptied


def test_every_command_trains_adapters(tmp_path):
    """sft, rm (the scalar head trains and is saved with the adapter), dpo (the reference
    is the policy with its adapter off), grpo and ppo (actor adapted, critic full)."""
    runs = {"sft": [], "rm": [], "dpo": ["--precompute_ref", "false"],
            "grpo": ["--prompts_per_step", "2", "--group_size", "4", "--max_new_tokens", "4"],
            "ppo": ["--prompts_per_step", "2", "--group_size", "2", "--max_new_tokens", "4"]}
    for command, extra in runs.items():
        out = tmp_path / command
        assert main([command, "--lora_rank", "4", "--max_steps", "2", "--output_dir",
                     str(out), *FAST, *extra]) == 0, command
        saved = load_file(str(out / "final" / "adapter_model.safetensors"))
        assert any("lora_" in k for k in saved), command
        if command == "rm":
            assert any("score" in k for k in saved)
    assert (tmp_path / "ppo" / "final" / "critic" / "model.safetensors").is_file()


def test_a_ppo_critic_with_adapters_resumes_exactly(tmp_path):
    """--critic_lora: the critic trains adapters and its value head in full; its checkpoint
    holds them, and a resume ends on the uninterrupted run's actor and critic."""
    args = ["ppo", "--lora_rank", "4", "--critic_lora", "true", "--max_steps", "4",
            "--save_every", "2", "--lr_schedule", "constant", "--warmup_ratio", "0",
            "--prompts_per_step", "2", "--group_size", "2", "--max_new_tokens", "4", *FAST]
    whole, again = tmp_path / "whole", tmp_path / "again"
    assert main([*args, "--output_dir", str(whole)]) == 0
    assert main([*args, "--output_dir", str(again), "--resume_from",
                 str(whole / "checkpoint-2")]) == 0
    for part in ("", "critic"):
        a = load_file(str(whole / "final" / part / "adapter_model.safetensors"))
        b = load_file(str(again / "final" / part / "adapter_model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    critic = load_file(str(whole / "final" / "critic" / "adapter_model.safetensors"))
    assert any("lora_" in k for k in critic) and any("score" in k for k in critic)


def test_a_lora_run_resumes_exactly(tmp_path):
    args = ["grpo", "--lora_rank", "4", "--max_steps", "4", "--save_every", "2",
            "--lr_schedule", "constant", "--warmup_ratio", "0", "--prompts_per_step", "2",
            "--group_size", "4", "--max_new_tokens", "4", *FAST]
    whole, again = tmp_path / "whole", tmp_path / "again"
    assert main([*args, "--output_dir", str(whole)]) == 0
    assert main([*args, "--output_dir", str(again), "--resume_from",
                 str(whole / "checkpoint-2")]) == 0
    a = load_file(str(whole / "final" / "adapter_model.safetensors"))
    b = load_file(str(again / "final" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_qlora_on_the_cpu_is_one_clear_error(tmp_path, capsys):
    code = main(["sft", "--lora_rank", "4", "--load_in_4bit", "true", "--output_dir",
                 str(tmp_path / "q"), *FAST])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "needs a CUDA device" in err[0]
    assert main(["sft", "--load_in_4bit", "true", "--output_dir", str(tmp_path / "r"),
                 *FAST]) == 2


def test_qlora_under_fsdp_is_refused():
    with pytest.raises(ValueError, match="load_in_4bit and parallel=fsdp"):
        RLConfig(lora_rank=4, load_in_4bit=True, parallel="fsdp").validate()


@pytest.mark.slow
def test_lora_grpo_learns_the_builtin_task(tmp_path):
    """The quick start with --lora_rank 16 (60 steps, ~10 s on 2 cores): held-out greedy
    accuracy from 28% to ≥ 85% (the issue's bar; +25 points is the RL target)."""
    out = tmp_path / "grpo"
    assert main(["grpo", "--lora_rank", "16", "--output_dir", str(out), "--device", "cpu",
                 "--tensorboard", "false"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    start = rows[0]["eval/accuracy"]
    final = [r for r in rows if "eval/accuracy" in r][-1]["eval/accuracy"]
    assert start < 0.35 and final >= 0.85, (start, final)
    assert all(r.get("sampling/logprob_gap_max", 0) < 1e-3 for r in rows)  # merged sampler


@pytest.mark.slow
def test_lora_dpo_lifts_greedy_accuracy(tmp_path, capsys):
    """DPO with rank-16 adapters, one epoch of the built-in pairs at lr 5e-4 (adapters want
    a larger rate than full fine-tuning's 2e-5; ~8 s on 2 cores), merged, then evaluated:
    held-out greedy accuracy from 28% up by ≥ 10 points (measured: 68%)."""
    out, merged = tmp_path / "dpo", tmp_path / "merged"
    assert main(["dpo", "--lora_rank", "16", "--lr", "5e-4", "--epochs", "1", "--device",
                 "cpu", "--tensorboard", "false", "--output_dir", str(out)]) == 0
    assert main(["merge", str(out / "final"), "--output", str(merged)]) == 0
    capsys.readouterr()
    assert main(["eval", "--model", "builtin", "--device", "cpu"]) == 0
    start = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["accuracy"]
    assert main(["eval", "--model", str(merged), "--device", "cpu"]) == 0
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["accuracy"]
    assert final >= start + 0.10, (start, final)


# --- an adapter directory where a model is asked for --------------------------------------

@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory):
    """A LoRA SFT run on the built-in model (3 steps at lr 1e-2, so the adapter moves the
    model) and ``posttrain merge`` of its final/: (RUN/final, merged directory)."""
    root = tmp_path_factory.mktemp("adapter")
    out, merged = root / "sft", root / "merged"
    assert main(["sft", "--lora_rank", "4", "--max_steps", "3", "--lr", "1e-2",
                 "--output_dir", str(out), *FAST]) == 0
    assert main(["merge", str(out / "final"), "--output", str(merged)]) == 0
    return out / "final", merged


def _start(final) -> torch.nn.Module:
    """Base + adapter by peft's own merge, independent of posttrain's adapter loading."""
    return lora.load(load_causal_lm("builtin", device="cpu"), final,
                     trainable=False).merge_and_unload()


def _weights_equal(model, expected) -> None:
    """``model``'s frozen weights (an adapted model's base layers) equal ``expected``'s."""
    inner = model.get_base_model() if lora.is_adapted(model) else model
    got = {k.replace(".base_layer", ""): v for k, v in inner.state_dict().items()
           if "lora_" not in k}
    want = expected.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_an_adapter_dir_loads_as_its_base_with_the_adapter_merged(adapter_run):
    final, _ = adapter_run
    model, start = load_causal_lm(str(final), device="cpu"), _start(final)
    assert not lora.is_adapted(model)
    _weights_equal(model, start)
    unmerged = lora.load(load_causal_lm("builtin", device="cpu"), final, trainable=False)
    base = load_causal_lm("builtin", device="cpu")
    ids = torch.tensor([[5, 60, 61, 62, 63, 64, 65, 66]])
    with torch.no_grad():
        m, u, b = model(ids).logits, unmerged(ids).logits, base(ids).logits
    bound = _bound(model, ids.shape[1])
    assert _rel(m, u) <= bound
    assert _rel(m, b) > 10 * bound  # the adapter is in it
    from posttrain.models import load_tokenizer

    assert load_tokenizer(str(final)).get_vocab() == load_tokenizer("builtin").get_vocab()


def test_eval_of_an_adapter_dir_is_eval_of_its_merged_model(adapter_run, capsys):
    final, merged = adapter_run
    results = []
    for model in (final, merged):
        capsys.readouterr()
        assert main(["eval", "--model", str(model), "--n", "40", "--device", "cpu"]) == 0
        results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert results[0]["model"] == str(final)
    assert {**results[0], "model": None} == {**results[1], "model": None}
    assert results[0]["n"] == 40


@pytest.mark.parametrize("rank", [0, 2])
def test_sft_from_an_adapter_dir_starts_at_base_plus_adapter(adapter_run, tmp_path, rank):
    """Without lora_rank the merged start trains in full; with it a fresh adapter of that
    rank sits on the merged start (its adapter-off model is the start) and its saved
    adapter names the starting adapter as its base, so it loads as the chain."""
    from posttrain.config import SFTConfig
    from posttrain.trainers import trained

    final, _ = adapter_run
    cfg = SFTConfig(model=str(final), lora_rank=rank, device="cpu")
    model = trained.load_trained(cfg, None, lambda n: trained.load_policy(cfg, n, True))
    _weights_equal(model, _start(final))
    assert lora.is_adapted(model) == (rank > 0)
    if rank:
        assert model.peft_config["default"].r == rank
    out = tmp_path / "again"
    lora_args = ["--lora_rank", str(rank)] if rank else []
    assert main(["sft", "--model", str(final), *lora_args, "--max_steps", "1",
                 "--output_dir", str(out), *FAST]) == 0
    if rank:
        config = json.loads((out / "final" / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(final.resolve())
    assert not lora.is_adapted(load_causal_lm(str(out / "final"), device="cpu"))


@pytest.mark.parametrize("rank", [0, 2])
def test_grpo_from_an_adapter_dir_has_the_start_as_its_reference(adapter_run, tmp_path, rank):
    """The KL reference is base + adapter: a loaded copy of it in full fine-tuning, the
    policy with its fresh adapter off under LoRA (not the first adapter's base)."""
    from posttrain.models import completion_logprobs as logprobs
    from posttrain.trainers.online import RLTrainer
    from rl_steps import rl_step

    final, _ = adapter_run
    cfg = RLConfig(model=str(final), lora_rank=rank, kl_coef=0.04, output_dir=str(tmp_path),
                   max_steps=1, prompts_per_step=2, group_size=4, max_new_tokens=4,
                   builtin_train_size=32, builtin_eval_size=8, eval_every=0, device="cpu",
                   tensorboard=False)
    cfg.validate()
    trainer, start = RLTrainer(cfg), _start(final)
    ref = trainer.policy if rank else trainer.ref
    assert (trainer.ref is None) == (rank > 0)
    _weights_equal(ref, start)
    b = _batch()
    with torch.no_grad(), lora.adapter_off(ref):
        got = logprobs(ref, b["input_ids"], b["attention_mask"], b["loss_mask"])
    assert _rel(got, _logprobs(start, b)) <= _bound(start, b["input_ids"].shape[1])
    record = rl_step(trainer)
    assert math.isfinite(record["train/loss"])


def test_an_adapters_base_resolves_or_is_one_clear_line(adapter_run, tmp_path, capsys,
                                                         monkeypatch):
    """The base as written, else relative to the adapter's directory, ``builtin`` as the
    built-in model; a missing base and a missing peft are one line (exit 2); an adapter
    saved without a tokenizer takes its base's."""
    import shutil
    import sys

    from posttrain.models import adapter_base, builtin_model_dir, load_tokenizer

    final, _ = adapter_run
    monkeypatch.chdir(tmp_path)

    def copy_with_base(where, base):
        shutil.copytree(final, where)
        config = json.loads((where / "adapter_config.json").read_text())
        (where / "adapter_config.json").write_text(json.dumps(
            {**config, "base_model_name_or_path": base}))
        return where

    moved = copy_with_base(tmp_path / "m" / "run" / "final", "../../base")
    shutil.copytree(builtin_model_dir(), tmp_path / "m" / "base")
    assert Path(adapter_base(moved)).resolve() == (tmp_path / "m" / "base").resolve()
    named = copy_with_base(tmp_path / "named", "builtin")
    assert adapter_base(named) == "builtin"
    _weights_equal(load_causal_lm(str(named), device="cpu"), _start(final))
    for f in named.glob("tokenizer*"):
        f.unlink()
    assert load_tokenizer(str(named)).get_vocab() == load_tokenizer("builtin").get_vocab()

    def one_line(args, *needles):
        capsys.readouterr()
        assert main(args) == 2
        err = [x for x in capsys.readouterr().err.strip().splitlines()
               if x.startswith("error: ")]
        assert len(err) == 1 and all(n in err[0] for n in needles), err

    lost = copy_with_base(tmp_path / "lost", str(tmp_path / "no-such-base"))
    one_line(["eval", "--model", str(lost), "--device", "cpu"], str(lost), "no-such-base",
             "does not exist")
    one_line(["sft", "--model", str(lost), "--output_dir", str(tmp_path / "o"), *FAST],
             str(lost), "does not exist")
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    one_line(["eval", "--model", str(final), "--device", "cpu"], str(final), "needs peft",
             "pip install")
