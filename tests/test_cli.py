"""The posttrain command line, called in-process through ``posttrain.cli.main``."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from posttrain import __version__
from posttrain.cli import main
from posttrain.trainers.offline import DPOConfig, SFTConfig

SMALL = ["--builtin_train_size", "16", "--builtin_eval_size", "4", "--batch_size", "2",
         "--device", "cpu", "--tensorboard", "false", "--log_every", "1"]


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"posttrain {__version__}"


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for command in ("sft", "rm", "dpo", "eval", "demo"):
        assert command in out


def test_no_command_prints_help(capsys):
    assert main([]) == 0
    assert "usage: posttrain" in capsys.readouterr().out


@pytest.mark.parametrize("command,cls", [("sft", SFTConfig), ("dpo", DPOConfig)])
def test_command_help_lists_config_keys(capsys, command, cls):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for f in dataclasses.fields(cls):
        assert f"--{f.name} (default {f.default!r})" in out
    assert "Peak learning rate (AdamW)." in out


def test_sft_runs_and_prints_json(tiny_model_dir, tmp_path, capsys):
    out_dir = tmp_path / "sft"
    rc = main(["sft", "--model", tiny_model_dir, "--max_steps", "1", "--output_dir",
               str(out_dir), *SMALL])
    assert rc == 0
    result = last_json(capsys.readouterr().out)
    assert result["output_dir"] == str(out_dir)
    assert math.isfinite(result["eval/loss"])
    assert (out_dir / "final" / "model.safetensors").exists()
    assert json.loads((out_dir / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1


def test_yaml_config_and_override(tiny_model_dir, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {tiny_model_dir}\nmax_steps: 5\nbeta: 0.3\n"
                   f"output_dir: {tmp_path / 'dpo'}\n")
    rc = main(["dpo", "--config", str(cfg), "--max_steps", "1", *SMALL])
    assert rc == 0
    saved = (tmp_path / "dpo" / "config.yaml").read_text()
    assert "max_steps: 1\n" in saved and "beta: 0.3\n" in saved
    assert last_json(capsys.readouterr().out)["output_dir"] == str(tmp_path / "dpo")


def test_unknown_key_exits_2_with_suggestion(capsys):
    assert main(["dpo", "--betta", "0.2"]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'betta'" in err and "did you mean 'beta'" in err


def test_bad_value_exits_2(capsys):
    assert main(["sft", "--overlong", "x"]) == 2
    assert "overlong must be" in capsys.readouterr().err


def test_data_error_exits_2(tiny_model_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+2="}\n')
    rc = main(["sft", "--model", tiny_model_dir, "--data", str(bad), "--output_dir",
               str(tmp_path / "out"), *SMALL])
    assert rc == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "row 2" in err and "field 'completion'" in err
    assert not (tmp_path / "out" / "final").exists()


def test_eval_builtin_task(tiny_model_dir, capsys):
    rc = main(["eval", "--model", tiny_model_dir, "--n", "8", "--max_new_tokens", "4",
               "--device", "cpu"])
    assert rc == 0
    result = last_json(capsys.readouterr().out)
    assert result["n"] == 8
    assert result["model"] == tiny_model_dir
    assert 0.0 <= result["accuracy"] <= 1.0
    # the built-in reward is 0/1, so the share reaching 1 is the mean
    assert result["accuracy"] == pytest.approx(result["mean_reward"])


REWARD_FILE = '''
import json
from pathlib import Path


def score(prompts, completions, target, **columns):
    Path(__file__).with_name("seen.json").write_text(json.dumps(
        {"prompts": prompts, "n_completions": len(completions), "columns": sorted(columns)}))
    return [float(t) for t in target]
'''


def test_eval_data_with_reward_file(tiny_model_dir, tmp_path, capsys):
    rows = [{"prompt": "1+1=", "target": 0, "note": "a"},
            {"prompt": "2+2=", "target": 1, "note": "b"},
            {"prompt": "3+3=", "target": 2, "note": "c"},
            {"prompt": "4+4=", "target": 0.5, "note": "d"}]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_reward.py").write_text(REWARD_FILE)
    rc = main(["eval", "--model", tiny_model_dir, "--data", str(data), "--reward",
               f"{tmp_path / 'my_reward.py'}:score", "--max_new_tokens", "3",
               "--device", "cpu", "--batch_size", "3"])
    assert rc == 0
    result = last_json(capsys.readouterr().out)
    assert result["n"] == 4
    assert result["mean_reward"] == pytest.approx((0 + 1 + 2 + 0.5) / 4)
    assert result["accuracy"] == pytest.approx(2 / 4)  # rewards ≥ 1.0
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {"prompts": [r["prompt"] for r in rows], "n_completions": 4,
                    "columns": ["note"]}


def test_eval_data_needs_reward(tmp_path, capsys):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "a"}\n')
    assert main(["eval", "--data", str(data)]) == 2
    assert "--reward" in capsys.readouterr().err


def test_eval_missing_reward_file_exits_2(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "a"}\n')
    rc = main(["eval", "--model", tiny_model_dir, "--data", str(data), "--reward",
               f"{tmp_path / 'nope.py'}:f", "--device", "cpu"])
    assert rc == 2
    assert "nope.py" in capsys.readouterr().err


def test_eval_rejects_training_keys(capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "--lr", "1"])
    assert e.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def _bert_dir(path, cls_name: str):
    """A tiny random BERT (built from a local config) with a WordPiece tokenizer that, like
    BERT's, has a pad token and no eos token."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.BertConfig(vocab_size=48, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32,
                                     max_position_embeddings=64)
    getattr(transformers, cls_name)(config).save_pretrained(path)
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(special + list("0123456789+=abcdefghijklmnopqrstuvwxyz"))}
    wordpiece = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    transformers.BertTokenizerFast(tokenizer_object=wordpiece, unk_token="[UNK]",
                                   pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                                   mask_token="[MASK]").save_pretrained(path)
    return path


@pytest.mark.parametrize("command, cls_name", [("eval", "BertForMaskedLM"),
                                                ("eval", "BertModel"),
                                                ("sft", "BertForMaskedLM")])
def test_a_model_that_is_not_a_causal_lm_is_named(tmp_path, capsys, command, cls_name):
    """An encoder given as the model is refused at load, naming the directory and its
    architecture (it used to sample and fail on its missing eos token)."""
    bert = str(_bert_dir(tmp_path / "bert", cls_name))
    args = (["eval", "--model", bert, "--n", "2", "--device", "cpu"] if command == "eval"
            else ["sft", "--model", bert, "--output_dir", str(tmp_path / "out"), *SMALL])
    capsys.readouterr()
    assert main(args) == 2
    err = [x for x in capsys.readouterr().err.strip().splitlines() if x.startswith("error: ")]
    assert len(err) == 1, err
    assert f"model {bert}: not a causal language model ({cls_name})" in err[0]
