"""The on-policy loop on a tiny random model: every critic-free algorithm of the table runs
end to end through the same loop, and writes its metrics and final model."""

import json

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.core import ALGORITHMS
from posttrain.trainers.online import RLConfig, run_rl

CRITIC_FREE = [name for name, a in ALGORITHMS.items() if not a.critic]


def _cfg(model_dir, out, algo, **kw):
    cfg = RLConfig(model=model_dir, output_dir=str(out), algo=algo, max_steps=2,
                   prompts_per_step=2, group_size=4, minibatch_size=4, max_new_tokens=4,
                   builtin_train_size=16, builtin_eval_size=4, log_every=1, eval_every=0,
                   device="cpu", tensorboard=False, **kw)
    cfg.validate()
    return cfg


@pytest.mark.parametrize("algo", CRITIC_FREE)
def test_every_critic_free_algorithm_runs(tiny_model_dir, tmp_path, algo):
    """Two steps per algorithm; metrics carry rewards, lengths, timing; final/ is saved."""
    run_rl(_cfg(tiny_model_dir, tmp_path, algo, ppo_epochs=2))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for key in ("reward/std", "completion/length_mean", "completion/truncated_frac",
                "groups/zero_signal_frac", "time/generate_s", "time/train_s"):
        assert key in steps[0]
    assert (tmp_path / "final" / "model.safetensors").exists()


def test_policy_moves_when_there_is_signal(tiny_model_dir, tmp_path):
    """With a reward that varies within groups (completion length), the loop changes the
    weights; with a constant reward every advantage is 0 and nothing is updated."""
    from transformers import AutoModelForCausalLM

    reward = tmp_path / "r.py"
    reward.write_text("def by_len(prompts, completions, **_):\n"
                      "    return [float(len(c)) for c in completions]\n"
                      "def const(prompts, completions, **_):\n"
                      "    return [1.0] * len(completions)\n")
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}="}) + "\n" for i in range(8)))
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    for fn, should_move in (("by_len", True), ("const", False)):
        out = tmp_path / fn
        cfg = _cfg(tiny_model_dir, out, "dapo", data=str(data), reward=f"{reward}:{fn}",
                   temperature=1.5)
        run_rl(cfg)
        after = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
        moved = any(not torch.equal(before[k], after[k]) for k in before)
        assert moved == should_move, fn


def test_rl_config_rejects_critic_algorithms():
    with pytest.raises(ConfigError):
        RLConfig(algo="ppo").validate()
    with pytest.raises(ConfigError):
        RLConfig(group_size=1).validate()
