"""Typed configs: defaults, YAML + --key value overrides, conversion, validation, docs."""

from __future__ import annotations

import dataclasses

import pytest

from posttrain import config
from posttrain.config import ConfigError, OfflineConfig
from posttrain.trainers.offline import DPOConfig, RMConfig, SFTConfig

CLASSES = [OfflineConfig, SFTConfig, RMConfig, DPOConfig]


@pytest.mark.parametrize("cls", CLASSES)
def test_defaults_validate(cls):
    cfg = config.load(cls)
    expected = cls(output_dir=f"runs/{cls.COMMAND}")  # decided at validation
    assert cfg == expected


def test_subclass_defaults_differ_from_base():
    assert SFTConfig().batch_size == 32
    assert DPOConfig().lr == 2e-5
    assert RMConfig().epochs == 6.0
    assert DPOConfig().beta == 0.5


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 0.003\nbatch_size: 8\nbeta: 0.5\nloss_type: ipo\n")
    cfg = config.load(DPOConfig, str(path), ["--batch_size", "2", "--beta=0.25"])
    assert cfg.lr == 0.003  # from the file
    assert cfg.loss_type == "ipo"  # from the file
    assert cfg.batch_size == 2  # the override wins
    assert cfg.beta == 0.25
    assert cfg.seed == 0  # default untouched


def test_type_conversion():
    cfg = config.load(DPOConfig, None, [
        "--lr", "1e-5", "--max_steps", "7", "--warmup_ratio", "0", "--trust_remote_code",
        "yes", "--precompute_ref", "False", "--tensorboard", "0", "--ref_model", "none",
        "--data", "x.jsonl", "--epochs", "3"])
    assert cfg.lr == 1e-5 and isinstance(cfg.lr, float)
    assert cfg.max_steps == 7 and isinstance(cfg.max_steps, int)
    assert cfg.warmup_ratio == 0.0 and isinstance(cfg.warmup_ratio, float)
    assert cfg.trust_remote_code is True
    assert cfg.precompute_ref is False
    assert cfg.tensorboard is False
    assert cfg.ref_model is None
    assert cfg.data == "x.jsonl"
    assert cfg.epochs == 3.0 and isinstance(cfg.epochs, float)


def test_yaml_types(tmp_path):
    # PyYAML reads 1e-5 (no dot) as a string; the field type makes it a float.
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1e-5\nmax_steps: 4\ntensorboard: false\ndata: null\nseed: 3.0\n")
    cfg = config.load(SFTConfig, str(path))
    assert cfg.lr == 1e-5 and cfg.max_steps == 4 and cfg.tensorboard is False
    assert cfg.data is None and cfg.seed == 3 and isinstance(cfg.seed, int)


@pytest.mark.parametrize("args", [
    ["--max_steps", "2.5"], ["--batch_size", "four"], ["--tensorboard", "maybe"],
    ["--lr", "fast"],
])
def test_unconvertible_values(args):
    with pytest.raises(ConfigError, match=args[0][2:]):
        config.load(SFTConfig, None, args)


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError) as e:
        config.load(DPOConfig, None, ["--betta", "0.2"])
    assert "'betta'" in str(e.value)
    assert "did you mean 'beta'" in str(e.value)


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("batch_sise: 4\n")
    with pytest.raises(ConfigError) as e:
        config.load(SFTConfig, str(path))
    assert str(path) in str(e.value) and "'batch_size'" in str(e.value)


def test_unknown_key_without_close_match():
    with pytest.raises(ConfigError) as e:
        config.load(SFTConfig, None, ["--zzzzqqq", "1"])
    assert "did you mean" not in str(e.value)


def test_dashes_map_to_underscores():
    assert config.load(SFTConfig, None, ["--max-steps", "5"]).max_steps == 5


@pytest.mark.parametrize("cls,args,what", [
    (SFTConfig, ["--lr", "-1e-4"], "lr"),
    (SFTConfig, ["--lr", "0"], "lr"),
    (SFTConfig, ["--overlong", "x"], "overlong"),
    (SFTConfig, ["--lr_schedule", "step"], "lr_schedule"),
    (SFTConfig, ["--warmup_ratio", "1"], "warmup_ratio"),
    (SFTConfig, ["--batch_size", "0"], "batch_size"),
    (SFTConfig, ["--max_length", "1"], "max_length"),
    (SFTConfig, ["--dtype", "int8"], "dtype"),
    (SFTConfig, ["--max_grad_norm", "-1"], "max_grad_norm"),
    (SFTConfig, ["--epochs", "0"], "epochs"),
    (DPOConfig, ["--loss_type", "bogus"], "loss_type"),
    (DPOConfig, ["--beta", "0"], "beta"),
    (DPOConfig, ["--label_smoothing", "0.5"], "label_smoothing"),
    (RMConfig, ["--center_coef", "-0.1"], "center_coef"),
    (RMConfig, ["--head_init", "fan_in"], "head_init"),
])
def test_bad_values(cls, args, what):
    with pytest.raises(ConfigError, match=what):
        config.load(cls, None, args)


def test_epochs_zero_ok_with_max_steps():
    assert config.load(SFTConfig, None, ["--epochs", "0", "--max_steps", "3"]).max_steps == 3


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "3\n"])
def test_yaml_not_a_mapping(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="mapping"):
        config.load(SFTConfig, str(path))


def test_empty_yaml_is_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("")
    assert config.load(SFTConfig, str(path)) == SFTConfig(output_dir="runs/sft")


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(SFTConfig, str(tmp_path / "nope.yaml"))


@pytest.mark.parametrize("args", [["lr", "1"], ["--lr"], ["--lr", "--seed", "1"], ["--"]])
def test_malformed_overrides(args):
    with pytest.raises(ConfigError):
        config.parse_overrides(args)


def test_parse_overrides():
    assert config.parse_overrides(["--lr", "1e-5", "--beta=0.1", "--data=a=b"]) == {
        "lr": "1e-5", "beta": "0.1", "data": "a=b"}


@pytest.mark.parametrize("cls", CLASSES)
def test_field_docs_cover_every_field(cls):
    docs = config.field_docs(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    assert set(names) <= set(docs)
    assert all(docs[n].strip() for n in names)


def test_field_docs_text():
    docs = config.field_docs(DPOConfig)
    assert docs["beta"] == "β: strength of the implicit KL constraint."
    assert docs["lr"] == "Peak learning rate (AdamW)."  # inherited from RunConfig


@pytest.mark.parametrize("cls", CLASSES)
def test_dump_load_round_trip(tmp_path, cls):
    cfg = cls(lr=3e-5, data="d.jsonl", seed=7, tensorboard=False, max_steps=11,
              warmup_ratio=0.0)
    if cls is DPOConfig:
        cfg.ref_model, cfg.loss_type, cfg.precompute_ref = "ref", "hinge", False
    cfg.validate()
    path = tmp_path / "c.yaml"
    config.dump(cfg, path)
    assert config.load(cls, str(path)) == cfg


@pytest.mark.parametrize("command, args, match", [
    ("grpo", ["--grad_accum", "7"], "unknown key 'grad_accum'"),
    ("grpo", ["--batch_size", "4"], "unknown key 'batch_size'"),
    ("sft", ["--group_size", "4"], "unknown key 'group_size'"),
    ("grpo", ["--critic_lr", "1e-4"], "unknown key 'critic_lr'"),
    ("ppo", ["--algo", "reinforce_pp", "--critic_lr", "3e-4"], "critic_lr.*no critic"),
    ("grpo", ["--algo", "grpo", "--overlong_cache", "4"], "overlong_cache.*no overlong"),
    ("grpo", ["--dynamic_sampling_rounds", "2"], "dynamic_sampling_rounds"),
    ("grpo", ["--fast", "false", "--rollout_backend", "lean"], "fast=false"),
    ("ppo", ["--algo", "reinforce_pp_baseline", "--value_clip", "0.1"], "value_clip.*no critic"),
    ("grpo", ["--data", "x.jsonl"], "--data needs --reward"),
    ("grpo", ["--rollout_backend", "sglang"], "rollout_backend"),
    ("grpo", ["--vllm_kv_cache_gb", "2"], "vllm_kv_cache_gb.*rollout_backend=auto"),
    ("grpo", ["--rollout_backend", "vllm", "--vllm_kv_cache_gb", "0.5"], "vllm_kv_cache_gb"),
    ("grpo", ["--rollout_backend", "vllm", "--vllm_kv_cache_gb", "0"], "vllm_kv_cache_gb"),
    ("grpo", ["--rollout_correction", "tis"], "rollout_correction must be"),
    ("grpo", ["--rollout_correction", "token_mask", "--rollout_correction_low", "2"],
     "rollout_correction: token_mask"),
    ("grpo", ["--log_every", "0"], "log_every"),
])
def test_a_key_a_command_does_not_read_is_refused(command, args, match):
    """Each command accepts only the keys it reads: offline batching keys are not RL keys,
    critic keys need an algorithm with a critic; derived requirements fail at validation."""
    from posttrain.cli import _commands, _config_class

    cls = _config_class(_commands()[command][1])
    with pytest.raises(ConfigError, match=match):
        config.load(cls, None, args)


def test_critic_keys_accepted_where_there_is_a_critic_and_derived_values_decided_once():
    from posttrain.config import PPOConfig, RLConfig

    cfg = config.load(PPOConfig, None, ["--critic_lr", "3e-4", "--value_clip", "0"])
    assert cfg.critic_lr == 3e-4 and cfg.output_dir == "runs/ppo"
    assert config.load(RLConfig, None, ["--algo", "dapo"]).output_dir == "runs/dapo"
    assert config.load(RLConfig, None, ["--output_dir", "x"]).output_dir == "x"


def test_command_help_and_choices_read_the_algorithm_table():
    from posttrain.cli import _commands
    from posttrain.config import PPOConfig, RLConfig
    from posttrain.core.algorithms import ALGORITHMS

    assert set(RLConfig.ALGOS) == {n for n, a in ALGORITHMS.items() if not a.critic}
    assert set(PPOConfig.ALGOS) == {n for n, a in ALGORITHMS.items() if a.token_rewards}
    help_grpo = _commands()["grpo"][0]
    assert all(name in help_grpo for name in RLConfig.ALGOS)


@pytest.mark.parametrize("command, args", [
    ("ppo", ["--algo", "reinforce_pp"]), ("ppo", []), ("grpo", ["--algo", "dapo"]),
    ("dpo", []), ("rm", []),
])
def test_a_runs_own_config_yaml_loads_again(tmp_path, command, args):
    """config.yaml lists every key at its value, defaults included (critic keys of an
    algorithm without a critic too): loading it with --config gives the same config."""
    from posttrain.cli import _commands, _config_class

    cls = _config_class(_commands()[command][1])
    cfg = config.load(cls, None, args)
    config.dump(cfg, tmp_path / "config.yaml")
    assert config.load(cls, str(tmp_path / "config.yaml")) == cfg


def test_every_field_of_the_algorithm_record_is_a_key():
    """The record's fields are keys of the same name (dual_clip and the loss KL estimator
    included), read into the algorithm and validated by it in one line."""
    from posttrain import config
    from posttrain.config.rl import ALGORITHM_KEYS, PPOConfig, RLConfig
    from posttrain.core.algorithms import Algorithm

    fields = {f.name for f in dataclasses.fields(Algorithm)} - {"name", "critic"}
    assert set(ALGORITHM_KEYS) == fields
    assert fields <= {f.name for f in dataclasses.fields(PPOConfig)}
    cfg = config.load(RLConfig, None, ["--algo", "gspo", "--policy_loss", "ppo_clip",
                                       "--dual_clip", "3", "--kl_coef", "0.1",
                                       "--kl_estimator", "k1", "--aggregation", "token_mean",
                                       "--dynamic_sampling", "true"])
    cfg.validate()
    algo = cfg.algorithm()
    assert (algo.dual_clip, algo.kl_estimator, algo.aggregation, algo.policy_loss,
            algo.dynamic_sampling) == (3.0, "k1", "token_mean", "ppo_clip", True)
    for bad, needle in ((["--dual_clip", "1"], "dual_clip must be > 1"),
                        (["--kl_estimator", "k9"], "unknown KL estimator"),
                        (["--advantage", "gae"], "GAE needs a critic"),
                        (["--algo", "gspo", "--dual_clip", "3"], "unknown key 'dual_clip'"),
                        (["--algo", "dapo", "--kl_estimator", "k1"],
                         "unknown key 'kl_estimator'")):
        with pytest.raises(ConfigError, match=needle):
            config.load(RLConfig, None, bad).validate()
