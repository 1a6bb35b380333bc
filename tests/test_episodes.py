"""Multi-turn episodes: token-exact trajectories (the tokens trained are the tokens
sampled, observations appended and never re-tokenised), the environment protocol's checks,
the limits, multi-turn SFT in the same layout, and every trainer on episodes."""

import json

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from posttrain import data as data_mod
from posttrain.episodes import (
    EnvError,
    EnvSpec,
    EpisodeLimits,
    Renderer,
    TemplateError,
    run_episodes,
)
from posttrain.rollout import Rollout, RolloutEngine, SamplingParams

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
            "{% if m['role'] == 'assistant' %}</s>{% endif %}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")

ENVS = '''
class Chatty:
    """Answers every turn with a tool message; never done."""
    def __init__(self, row, reply="ok"):
        self.row, self.reply = row, reply
    def reset(self):
        return self.row["q"]
    def step(self, text):
        return {"role": "tool", "content": self.reply}, 0.25, False

class TwoTurns:
    def __init__(self, row):
        self.turn = 0
    def reset(self):
        return "go"
    def step(self, text):
        self.turn += 1
        if self.turn == 1:
            return "ab?", 0.5, False
        return None, 1.0, True

class Bad:
    def __init__(self, row, mode="raise"):
        self.mode = mode
    def reset(self):
        return "go"
    def step(self, text):
        import time
        if self.mode == "raise":
            raise KeyError("boom")
        if self.mode == "pair":
            return "x", 1.0
        if self.mode == "nan":
            return None, float("nan"), True
        if self.mode == "done":
            return None, 1.0, "yes"
        if self.mode == "role":
            return {"content": "x"}, 1.0, False
        if self.mode == "slow":
            time.sleep(2)
        return None, 1.0, True
'''


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "envs.py"
    path.write_text(ENVS)
    return path


def merging_tokenizer(template: str | None = TEMPLATE) -> PreTrainedTokenizerFast:
    """Characters plus one merge, ``a b -> ab``: a transcript with the sampled tokens
    ``a``, ``b`` re-tokenises to ``ab``."""
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789+?=<>|/:. \n")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    vocab["ab"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [("a", "b")]))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<pad>", "<s>", "</s>")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = template
    return fast


class Scripted(RolloutEngine):
    """Turn ``t`` of every request samples ``turns[t]``, log-prob -0.5 - 0.01·position;
    records each call's requests."""

    def __init__(self, tokenizer, turns: list[list[int]]):
        self.tokenizer, self.turns, self.calls = tokenizer, turns, []

    def generate(self, requests, n=1, params=None, generator=None, extras=frozenset()):
        assert n == 1
        self.calls.append(requests)
        ids = self.turns[len(self.calls) - 1][:params.max_new_tokens]
        eos = self.tokenizer.eos_token_id
        N, T = len(requests), len(ids)
        return Rollout(prompt_ids=[list(r.prompt_ids) for r in requests],
                       completion_ids=torch.tensor([ids] * N),
                       completion_mask=torch.ones(N, T, dtype=torch.long),
                       logprobs=-0.5 - 0.01 * torch.arange(T).float().expand(N, T),
                       truncated=torch.tensor([ids[-1] != eos] * N),
                       group_ids=torch.arange(N),
                       texts=[self.tokenizer.decode(ids, skip_special_tokens=True)] * N)


def test_tokens_trained_are_the_tokens_sampled(env_file):
    """The assistant's sampled ``a``, ``b`` stay two tokens (re-tokenising the transcript
    merges them into ``ab``); the tool message and the next generation prompt are appended
    with loss mask 0; each turn's request is the previous one plus exactly what was
    appended."""
    tok = merging_tokenizer()
    a, b, eos, ab = (tok.convert_tokens_to_ids(t) for t in ("a", "b", "</s>", "ab"))
    engine = Scripted(tok, [[a, b, eos], [b, a, eos]])
    spec = EnvSpec.parse(f"{env_file}:TwoTurns")
    eps = run_episodes(engine, tok, spec, [{"_row": 7}], 2, [11], SamplingParams(
        max_new_tokens=8), EpisodeLimits(max_turns=4, max_episode_tokens=64))
    ro = eps.rollout
    between = tok("\n<|user|>ab?\n<|assistant|>", add_special_tokens=False)["input_ids"]
    want = [a, b, eos, *between, b, a, eos]
    n = len(want)
    assert ro.completion_ids[0, :n].tolist() == want
    assert ro.completion_mask[0].tolist() == [1] * n
    assert ro.loss_mask[0].tolist() == [1, 1, 1] + [0] * len(between) + [1, 1, 1]
    assert ro.logprobs[0, :3].tolist() == pytest.approx([-0.5, -0.51, -0.52])
    assert (ro.logprobs[0, 3:3 + len(between)] == 0).all()
    prompt = tok("<|user|>go\n<|assistant|>")["input_ids"]
    assert ro.prompt_ids[0] == prompt
    assert list(engine.calls[1][0].prompt_ids) == prompt + [a, b, eos] + between
    # what re-tokenising the transcript gives: other tokens (the merge), so the loop must not
    transcript = tok.decode(prompt + want)
    retok = tok(transcript, add_special_tokens=False)["input_ids"]
    assert retok[len(prompt)] == ab and retok != prompt + want
    assert eps.returns.tolist() == [1.5, 1.5] and eps.turns.tolist() == [2, 2]
    assert eps.messages[0] == [{"role": "user", "content": "go"},
                               {"role": "assistant", "content": "ab"},
                               {"role": "user", "content": "ab?"},
                               {"role": "assistant", "content": "ba"}]
    assert not ro.truncated.any() and ro.group_ids.tolist() == [0, 0]
    # two episodes of the row, each its own seed per turn
    assert engine.calls[0][0].seed != engine.calls[0][1].seed
    assert engine.calls[0][0].seed != engine.calls[1][0].seed


def test_plain_layout_without_a_chat_template(env_file):
    tok = merging_tokenizer(template=None)
    a, eos = tok.convert_tokens_to_ids("a"), tok.eos_token_id
    engine = Scripted(tok, [[a, eos], [a, eos]])
    eps = run_episodes(engine, tok, EnvSpec.parse(f"{env_file}:TwoTurns"), [{}], 1, [1],
                       SamplingParams(max_new_tokens=4), EpisodeLimits(4, 64))
    assert eps.rollout.prompt_ids[0] == tok("user: go\nassistant: ")["input_ids"]
    between = tok("\nuser: ab?\nassistant: ", add_special_tokens=False)["input_ids"]
    assert eps.rollout.completion_ids[0, :len(between) + 4].tolist() == [a, eos, *between,
                                                                         a, eos]


def test_a_turn_without_eos_is_closed_by_the_template(env_file):
    """A turn cut by max_new_tokens did not sample eos: the closing appended carries it
    (untrained)."""
    tok = merging_tokenizer()
    a, eos = tok.convert_tokens_to_ids("a"), tok.eos_token_id
    engine = Scripted(tok, [[a, a, a], [a, eos]])
    eps = run_episodes(engine, tok, EnvSpec.parse(f"{env_file}:TwoTurns"), [{}], 1, [1],
                       SamplingParams(max_new_tokens=3), EpisodeLimits(4, 64))
    ids, loss = eps.rollout.completion_ids[0].tolist(), eps.rollout.loss_mask[0].tolist()
    assert ids[:4] == [a, a, a, eos] and loss[:4] == [1, 1, 1, 0]


def test_limits_truncate_and_keep_the_last_reward(env_file):
    tok = merging_tokenizer()
    a, eos = tok.convert_tokens_to_ids("a"), tok.eos_token_id
    spec = EnvSpec.parse(f"{env_file}:Chatty")
    eps = run_episodes(Scripted(tok, [[a, eos]] * 5), tok, spec, [{"q": "hi"}], 1, [1],
                       SamplingParams(max_new_tokens=4), EpisodeLimits(3, 256))
    assert eps.turns.tolist() == [3] and eps.rollout.truncated.tolist() == [True]
    assert eps.returns.tolist() == [0.75]  # three turns' rewards, the last one kept
    # the token budget: 2 sampled + 1 closing + ... stops before a turn would not fit
    eps = run_episodes(Scripted(tok, [[a, a, a, eos]] * 5), tok, spec, [{"q": "hi"}], 1, [1],
                       SamplingParams(max_new_tokens=8), EpisodeLimits(10, 6))
    assert eps.rollout.truncated.tolist() == [True]
    assert int(eps.rollout.completion_mask.sum()) <= 6 and eps.turns.tolist() == [1]
    assert eps.returns.tolist() == [0.25]


@pytest.mark.parametrize("mode,match", [
    ("raise", "step\\(\\) raised KeyError"), ("pair", "expected a tuple"),
    ("nan", "not a finite number"), ("done", "done is str"), ("role", "'role' and 'content'"),
    ("slow", "within 0.2 s")])
def test_environment_errors_name_class_row_and_turn(env_file, mode, match):
    tok = merging_tokenizer()
    a, eos = tok.convert_tokens_to_ids("a"), tok.eos_token_id
    spec = EnvSpec.parse(f"{env_file}:Bad", json.dumps({"mode": mode}), timeout=0.2)
    with pytest.raises(EnvError, match=match) as e:
        run_episodes(Scripted(tok, [[a, eos]]), tok, spec, [{"_row": 3}], 1, [1],
                     SamplingParams(max_new_tokens=4), EpisodeLimits(2, 64))
    assert str(e.value).startswith("env Bad on row 3, turn 1: ")
    # skip: the episode is dropped and counted; the others go on
    eps = run_episodes(Scripted(tok, [[a, eos]]), tok, spec, [{"_row": 3}], 2, [1],
                       SamplingParams(max_new_tokens=4), EpisodeLimits(2, 64), on_error="skip")
    assert eps.valid.tolist() == [False, False] and len(eps.errors) == 2


def test_env_spec_errors(env_file, tmp_path):
    with pytest.raises(ValueError, match="expected module:Name"):
        EnvSpec.parse("nocolon")
    with pytest.raises(FileNotFoundError, match="no file"):
        EnvSpec.parse(f"{tmp_path}/none.py:X")
    with pytest.raises(ValueError, match="has no 'Nope'"):
        EnvSpec.parse(f"{env_file}:Nope")
    with pytest.raises(ValueError, match="env_kwargs: expected a JSON object"):
        EnvSpec.parse(f"{env_file}:Chatty", "[1]")
    with pytest.raises(ValueError, match="not JSON"):
        EnvSpec.parse(f"{env_file}:Chatty", "{oops")


def test_a_template_that_rewrites_earlier_turns_is_refused():
    tok = merging_tokenizer(template=(
        "{% for m in messages %}{% if loop.last %}<|{{ m['role'] }}|>{{ m['content'] }}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"))
    with pytest.raises(TemplateError, match="cannot be appended"):
        Renderer(tok).between(True, [{"role": "user", "content": "x"}])


def test_multi_turn_sft_trains_every_assistant_turn_in_the_episode_layout(env_file):
    """A messages row trains its assistant turns (content and eos) and nothing else, and
    its ids are exactly those of the same conversation sampled as an episode."""
    tok = merging_tokenizer()
    a, b, eos = (tok.convert_tokens_to_ids(t) for t in ("a", "b", "</s>"))
    row = {"messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ab"},
                        {"role": "user", "content": "ab?"},
                        {"role": "assistant", "content": "ba"}]}
    (enc,) = data_mod.encode_sft(tok, "src", data_mod.validate("src", [row], "sft"), 64, "error")
    eps = run_episodes(Scripted(tok, [[a, b, eos], [b, a, eos]]), tok,
                       EnvSpec.parse(f"{env_file}:TwoTurns"), [{}], 1, [1],
                       SamplingParams(max_new_tokens=8), EpisodeLimits(4, 64))
    n = int(eps.rollout.completion_mask.sum())
    assert enc.prompt == eps.rollout.prompt_ids[0]
    # SFT tokenises "ab" as one token; the episode sampled two: the layout around them is
    # the same, and the trained tokens are the contents and eos
    trained = [t for t, m in zip(enc.completions[0], enc.trained[0], strict=True) if m]
    assert tok.decode(trained) == "ab</s>ba</s>"
    untrained = [t for t, m in zip(enc.completions[0], enc.trained[0], strict=True) if not m]
    ep_untrained = eps.rollout.completion_ids[0, :n][eps.rollout.loss_mask[0, :n] == 0]
    assert untrained == ep_untrained.tolist()
    batch = data_mod.pad_sequences([enc.prompt], enc.completions, 0, enc.trained)
    assert batch["loss_mask"][0, len(enc.prompt):].tolist() == enc.trained[0]
    # over max_length: error names the field; truncate keeps the trained part that fits
    with pytest.raises(data_mod.DataError, match="messages"):
        data_mod.encode_sft(tok, "src", data_mod.validate("src", [row], "sft"), 12, "error")
