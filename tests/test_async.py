"""Asynchronous rollouts (``--async_staleness K``): the producer's schedule on a fake
engine (which weights sample which batch, how far ahead it runs, where evaluations and
checkpoints fall), a made batch through a checkpoint and back, and whole runs: reproducible,
exactly resumed, decoupled from the behaviour policy, on single turns and episodes."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.builtin import episodes as builtin_episodes
from posttrain.trainers.online.producer import Producer, need


# --- the schedule, on fakes ---------------------------------------------------------------
class FakeEngine:
    """Holds a version and the weights it was last given."""

    def __init__(self):
        self.version, self.weight = 0, 0.0
        self.loads: list[int] = []

    def sync(self, weights, version: int) -> None:
        ((_, t),) = list(weights)
        self.version, self.weight = version, float(t)
        self.loads.append(version)


@dataclass
class Made:
    step: int
    version: int
    weight: float


class FakeMaker:
    """``collect(step)``: a batch noting the engine's version; ``delay`` seconds each."""

    def __init__(self, engine: FakeEngine, delay: float = 0.0):
        self.engine, self.delay = engine, delay
        self.before_turn = None
        self.made: list[int] = []

    def evaluate(self, engine, rows):
        return engine.version, engine.weight

    def collect(self, step: int) -> Made:
        time.sleep(self.delay)
        self.made.append(step)
        return Made(step, self.engine.version, self.engine.weight)


def _learn(producer: Producer, steps: int, K: int, evaluate_at=(), publish_delay=0.0):
    """The learner's side: take batch s, check it, publish version s."""
    evals = {}
    if 0 in evaluate_at:
        evals[0] = producer.call([])
    for s in range(1, steps + 1):
        made, _ = producer.take(s)
        assert made.step == s
        assert made.version == need(s, K), (s, made.version)
        assert made.weight == float(made.version)  # the weights of that version, not others
        # never more than K batches beyond the one being trained (plus the one in hand)
        assert producer.next - 1 <= s + K
        time.sleep(publish_delay)
        producer.publish(s, [("w", torch.tensor(float(s)))])
        if s in evaluate_at:
            evals[s] = producer.call([])
    return evals


@pytest.mark.parametrize("K", [1, 2, 3])
def test_batch_s_is_sampled_by_version_s_minus_1_minus_k(K):
    """Batch s comes from the weights of version max(0, s-1-K), whatever the timing (a slow
    learner, a slow producer); an evaluation after step s sees version s."""
    for maker_delay, learner_delay in ((0.0, 0.01), (0.01, 0.0)):
        engine = FakeEngine()
        maker = FakeMaker(engine, maker_delay)
        producer = Producer(maker, engine, K, last=8)
        try:
            evals = _learn(producer, 8, K, evaluate_at=(0, 3, 8), publish_delay=learner_delay)
        finally:
            producer.close()
        assert evals == {0: (0, 0.0), 3: (3, 3.0), 8: (8, 8.0)}
        assert maker.made == list(range(1, 9))  # each batch once, in order, none past last
        assert engine.loads == sorted(engine.loads)  # weights only ever move forward


def test_the_producer_runs_ahead_while_the_learner_works():
    """With K=1 the producer makes batch s+1 while the learner is still on step s: the
    learner, before it publishes version s, sees batch s+1 finished (an event, not a timing:
    with K=0 batch s+1 would need version s, and the wait below would run out)."""
    engine = FakeEngine()
    made = {s: threading.Event() for s in range(1, 5)}

    class Marking(FakeMaker):
        def collect(self, step):
            out = super().collect(step)
            made[step].set()
            return out

    producer = Producer(Marking(engine), engine, 1, last=4)
    try:
        for s in range(1, 5):
            producer.take(s)
            if s < 4:  # the learner's update of step s: batch s+1 is made meanwhile
                assert made[s + 1].wait(60), f"batch {s + 1} was not made during step {s}"
            producer.publish(s, [("w", torch.tensor(float(s)))])
    finally:
        producer.close()


def test_pause_holds_the_producer_after_the_batches_of_older_versions():
    """At a checkpoint after step s the producer has made every batch that needs a version
    older than s (through s+K), and makes nothing more until resumed."""
    engine = FakeEngine()
    maker = FakeMaker(engine)
    K = 2
    producer = Producer(maker, engine, K, last=10)
    try:
        for s in range(1, 4):
            producer.take(s)
            producer.publish(s, [("w", torch.tensor(float(s)))])
        producer.pause(3)
        assert max(maker.made) >= 3 + K
        held = list(maker.made)
        with producer.cond:  # held: not on a task, and none it may start
            assert not producer.busy and producer._pick() is None
        assert maker.made == held
        assert sorted(producer.ready) == list(range(4, max(held) + 1))  # what state() keeps
        assert producer.next == max(held) + 1
        producer.resume()
        producer.take(4)
    finally:
        producer.close()


def test_an_error_in_the_producer_is_raised_in_the_learner():
    class Broken(FakeMaker):
        def collect(self, step):
            if step == 2:
                raise ValueError("env exploded")
            return super().collect(step)

    engine = FakeEngine()
    producer = Producer(Broken(engine), engine, 1, last=4)
    try:
        producer.take(1)
        producer.publish(1, [("w", torch.tensor(1.0))])
        with pytest.raises(ValueError, match="env exploded"):
            producer.take(2)
    finally:
        producer.close()


def test_close_stops_a_waiting_producer():
    engine = FakeEngine()
    producer = Producer(FakeMaker(engine), engine, 1, last=5)
    producer.take(1)
    producer.take(2)  # (both from version 0); batch 3 waits for version 1
    producer.close()
    assert not producer.thread.is_alive()


def test_partial_rollouts_take_newer_weights_between_turns():
    """Partial rollouts: before each later turn the engine takes the newest published
    version (each token keeps the version that sampled it)."""
    engine = FakeEngine()

    class Turns(FakeMaker):
        def collect(self, step):
            seen = [engine.version]
            if step == 2:  # the learner publishes version 1 during this batch's first turn
                with producer.cond:
                    assert producer.cond.wait_for(lambda: producer.published >= 1, 60)
                self.before_turn(1)
                seen.append(engine.version)
            return Made(step, min(seen), float(max(seen)))

    maker = Turns(engine)
    producer = Producer(maker, engine, 1, last=2, partial=True)
    try:
        first, _ = producer.take(1)
        producer.publish(1, [("w", torch.tensor(1.0))])
        second, _ = producer.take(2)
    finally:
        producer.close()
    assert (first.version, second.version, second.weight) == (0, 0, 1.0)


# --- a made batch through a checkpoint ----------------------------------------------------
def test_a_made_batch_round_trips_through_tensors_and_json():
    from posttrain.rollout import Rollout
    from posttrain.trainers.online.experience import Experience
    from posttrain.trainers.online.producer import experience_from_state, experience_state

    g = torch.Generator().manual_seed(0)
    N, T = 4, 5
    ro = Rollout(prompt_ids=[[1, 2], [1, 2], [3], [3]],
                 completion_ids=torch.randint(0, 9, (N, T), generator=g),
                 completion_mask=torch.ones(N, T, dtype=torch.long),
                 logprobs=-torch.rand(N, T, generator=g),
                 truncated=torch.tensor([0, 1, 0, 0]).bool(),
                 group_ids=torch.tensor([0, 0, 1, 1]), texts=["a", "b", "c", "d"],
                 policy_version=3, loss_mask=torch.randint(0, 2, (N, T), generator=g),
                 routing=torch.randint(-1, 4, (N, 2, 7, 2), generator=g),
                 versions=torch.randint(3, 5, (N, T), generator=g),
                 stats={"turns": torch.tensor([1.0, 2, 2, 1], dtype=torch.float64)})
    exp = Experience(ro, torch.rand(N), {"env": torch.rand(N, dtype=torch.float64)},
                     torch.tensor([True, True, False, True]), torch.tensor([1, 0, 0, 1]).bool(),
                     2, 1, 0.5, 0.25, 17, ro, torch.arange(N))
    meta, tensors = experience_state(exp)
    meta = json.loads(json.dumps(meta))  # as the checkpoint's JSON holds it
    back = experience_from_state(meta, tensors)
    for k in ("completion_ids", "completion_mask", "logprobs", "truncated", "group_ids",
              "loss_mask", "routing", "versions"):
        assert torch.equal(getattr(back.rollout, k), getattr(ro, k)), k
        assert getattr(back.rollout, k).dtype == getattr(ro, k).dtype, k
    assert back.rollout.prompt_ids == ro.prompt_ids and back.rollout.texts == ro.texts
    assert back.rollout.policy_version == 3
    assert torch.equal(back.rollout.stats["turns"], ro.stats["turns"])
    for k in ("scores", "valid", "correct", "own"):
        assert torch.equal(getattr(back, k), getattr(exp, k)), k
    assert torch.equal(back.terms["env"], exp.terms["env"])
    assert (back.rounds, back.dropped_groups, back.generate_s, back.reward_s,
            back.sampled_tokens) == (2, 1, 0.5, 0.25, 17)
    assert back.local is back.rollout
    # another rank's share: its rows of the whole batch
    part = experience_from_state(meta, tensors, torch.tensor([2, 3]))
    assert part.local.texts == ["c", "d"]


# --- whole runs ---------------------------------------------------------------------------
def _run(tmp_path: Path, name: str, *extra: str, model: str = "builtin") -> Path:
    from posttrain.cli import main

    out = tmp_path / name
    assert main(["grpo", "--model", model, "--output_dir", str(out), "--max_steps", "4",
                 "--prompts_per_step", "4", "--group_size", "4", "--builtin_train_size", "64",
                 "--builtin_eval_size", "8", "--eval_every", "2", "--log_every", "1",
                 "--device", "cpu", "--tensorboard", "false", "--seed", "3", *extra]) == 0
    return out


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def _same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_k1_is_reproducible_and_its_metrics_show_the_staleness(tmp_path):
    """Two K=1 runs end on the same weights and rows; each step's batch is min(s-1, 1)
    versions old; the loss is decoupled: the old pass (proximal policy) is computed and the
    correction (token_truncate by default) weighs the behaviour policy's tokens."""
    a = _run(tmp_path, "a", "--async_staleness", "1", "--async_producer", "thread")
    b = _run(tmp_path, "b", "--async_staleness", "1", "--async_producer", "thread")
    assert _same_weights(a / "final", b / "final")
    rows = _rows(a)
    assert rows == _rows(b)
    steps = {r["step"]: r for r in rows if "async/staleness" in r}
    assert [steps[s]["async/staleness"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    # step 1's batch is on-policy: the proximal and behaviour log-probs agree to rounding;
    # later batches are one version behind: visibly not
    assert steps[1]["sampling/logprob_gap_mean"] < 1e-4  # (float32 rounding: ~1e-6)
    assert min(steps[s]["sampling/logprob_gap_mean"] for s in (2, 3, 4)) > 1e-3
    assert steps[2]["train/rollout_corr/weight_max"] != 1.0


@pytest.mark.slow
@pytest.mark.parametrize("K", [1, 2])
def test_a_checkpoint_resumes_exactly(tmp_path, K):
    """Stopped at checkpoint-2 (its made batches inside) and resumed: the same final
    weights and rows as the run that was not interrupted."""
    whole = _run(tmp_path, "whole", "--async_staleness", str(K))
    cut = _run(tmp_path, "cut", "--async_staleness", str(K), "--save_every", "2")
    state = json.loads((cut / "checkpoint-2" / "trainer_state.json").read_text())
    made = state["job"]["async"]
    # every batch of a version older than 2 is inside (3..2+K; the producer may have made
    # one more, of version 2 itself)
    kept = sorted(int(s) for s in made["batches"])
    assert kept[:K] == list(range(3, 3 + K)) and len(kept) <= K + 1
    import shutil

    shutil.rmtree(cut / "final")
    _run(tmp_path, "cut", "--async_staleness", str(K), "--save_every", "2",
         "--resume_from", str(cut / "checkpoint-2"))
    assert _same_weights(whole / "final", cut / "final")
    assert _rows(cut) == _rows(whole)


@pytest.mark.kill
@pytest.mark.parametrize("producer", ["process", "thread"])
def test_sigkill_after_a_checkpoint_then_resume_is_bit_identical(tmp_path, producer):
    """K=1 killed (SIGKILL: no chance to write anything) once checkpoint-3 exists, with
    batches in flight, resumed from it: the final weights and rows of the run that was
    never interrupted. The killed run is given far more steps, so the kill lands mid-run;
    with a constant schedule nothing it computes depends on max_steps. The producer process
    of the killed run exits with it (its pipe closes)."""
    import os
    import signal
    import subprocess
    import sys

    common = ["--async_staleness", "1", "--async_producer", producer, "--save_every", "3",
              "--prompts_per_step", "4", "--group_size", "4", "--builtin_train_size", "64",
              "--builtin_eval_size", "8", "--eval_every", "2", "--log_every", "1",
              "--device", "cpu", "--tensorboard", "false", "--seed", "3", "--model",
              "builtin"]
    from posttrain.cli import main

    torch.set_num_threads(1)  # as the killed subprocess (OMP_NUM_THREADS=1) decodes
    whole = tmp_path / "whole"
    assert main(["grpo", *common, "--output_dir", str(whole), "--max_steps", "6"]) == 0
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "posttrain", "grpo", *common,
                             "--output_dir", str(killed), "--max_steps", "100000"],
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = killed / "checkpoint-3"
    deadline = time.monotonic() + 120
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert first.exists()
    assert main(["grpo", *common, "--output_dir", str(killed), "--max_steps", "6",
                 "--resume_from", str(first)]) == 0
    assert _same_weights(whole / "final", killed / "final")
    assert _rows(killed) == _rows(whole)


def test_a_checkpoint_of_another_schedule_is_refused(tmp_path, capsys):
    from posttrain.cli import main

    cut = _run(tmp_path, "cut", "--async_staleness", "1", "--save_every", "2", "--max_steps",
               "3", "--eval_every", "0")
    code = main(["grpo", "--model", "builtin", "--output_dir", str(cut), "--max_steps", "4",
                 "--prompts_per_step", "4", "--group_size", "4", "--builtin_train_size", "64",
                 "--builtin_eval_size", "8", "--eval_every", "2", "--log_every", "1",
                 "--device", "cpu", "--tensorboard", "false", "--seed", "3", "--save_every", "2",
                 "--async_staleness", "0", "--resume_from", str(cut / "checkpoint-2")])
    assert code == 2
    assert "async_staleness (1 -> 0)" in capsys.readouterr().err


@pytest.mark.slow
def test_episodes_run_asynchronously_with_a_slow_environment(tmp_path):
    """Multi-turn episodes with K=1, a slow environment and its calls on 8 threads: the same
    run twice is the same; with env_workers 1 too (the threads change nothing but time)."""
    common = ("--env", "builtin", "--env_kwargs", '{"latency_s": 0.002}',
              "--async_staleness", "1", "--max_new_tokens", "6")
    a = _run(tmp_path, "a", *common, "--env_workers", "8", model="builtin-episodes")
    b = _run(tmp_path, "b", *common, "--env_workers", "1", model="builtin-episodes")
    assert _same_weights(a / "final", b / "final")
    assert _rows(a) == _rows(b)
    steps = [r for r in _rows(a) if "async/staleness" in r]
    assert [r["async/staleness"] for r in steps] == [0, 1, 1, 1]
    assert all(r["episodes/turns_mean"] > 1 for r in steps)  # (they ask, then answer)


@pytest.mark.slow
def test_partial_rollouts_tag_tokens_with_their_versions(tmp_path, monkeypatch):
    """Partial rollouts on episodes: an episode's later turn takes the weights published
    while its first turn waited, and its tokens carry that version. The environment's
    first step waits (an event, not a timing) until the learner publishes a version newer
    than the one sampling the batch, wherever the learner can publish it without this
    batch (batch j sampled by version v < j - 1); so from step 2 on, the trained tokens'
    smallest staleness is below the batch's."""
    producers = []
    real_init, real_step = Producer.__init__, builtin_episodes.LookupEnv.step

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        producers.append(self)

    def step(self, text):
        if not self.asked:
            p = producers[-1]
            with p.cond:
                v = p.loaded
                if p.next > v + 1:  # (p.next: the batch in the making)
                    assert p.cond.wait_for(lambda: p.published > v, 60)
        return real_step(self, text)

    monkeypatch.setattr(Producer, "__init__", init)
    monkeypatch.setattr(builtin_episodes.LookupEnv, "step", step)
    out = _run(tmp_path, "p", "--env", "builtin", "--async_staleness", "1",
               "--async_producer", "thread", "--partial_rollouts", "true",
               "--max_new_tokens", "6", "--eval_every", "0", "--env_timeout", "120",
               model="builtin-episodes")
    steps = [r for r in _rows(out) if "async/staleness" in r]
    assert [r["async/staleness"] for r in steps] == [0, 1, 1, 1]
    assert "async/token_staleness_min" not in steps[0]  # (one version: nothing to tag)
    for r in steps[1:]:
        assert r["async/token_staleness_min"] < r["async/staleness"]
        assert r["async/token_staleness_min"] <= r["async/token_staleness_mean"] \
            <= r["async/staleness"]


def test_async_config_errors(tmp_path):
    from posttrain.config import ConfigError, RLConfig

    for kw, match in [({"async_staleness": -1}, "async_staleness must be ≥ 0"),
                      ({"partial_rollouts": True}, "unknown key 'partial_rollouts' for "
                       "single-turn"),
                      ({"env": "builtin", "partial_rollouts": True},
                       "unknown key 'partial_rollouts' for the synchronous loop"),
                      ({"env": "builtin", "env_workers": 0}, "env_workers must be ≥ 1")]:
        cfg = RLConfig(output_dir=str(tmp_path), **kw)
        cfg.given = set(kw)
        with pytest.raises(ConfigError, match=match):
            cfg.validate()
    cfg = RLConfig(output_dir=str(tmp_path), async_staleness=1)
    cfg.given = {"async_staleness"}
    cfg.validate()
    assert cfg.correction().mode == "token_truncate"  # decoupled: the behaviour weight


class _Gathered(builtin_episodes.LookupEnv):
    """The built-in environment whose first step waits at a barrier of 8: it returns only
    once eight first steps are in flight together."""

    barrier: threading.Barrier

    def step(self, text):
        if not self.asked:
            self.barrier.wait()  # BrokenBarrierError after its timeout
        return super().step(text)


def test_env_workers_run_a_turns_calls_at_once():
    """With 8 workers a turn's 8 environment calls are in flight at once: each first step
    waits at a barrier of 8 that only 8 concurrent calls pass (one at a time, the first
    would wait out the barrier's timeout and the episode fail). The episodes are those of
    one worker."""
    from posttrain.episodes import EnvSpec, EpisodeLimits, run_episodes
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.rollout import SamplingParams, make_engine

    tok = load_tokenizer("builtin-episodes")
    model = load_causal_lm("builtin-episodes", device="cpu").eval()
    engine = make_engine("hf", model, tok, False)
    rows = builtin_episodes.rows(8, "train", 0)
    params = SamplingParams(1.0, 1.0, 0, 6)
    limits = EpisodeLimits(2, 32)
    one = run_episodes(engine, tok, EnvSpec(builtin_episodes.LookupEnv, {}, 120.0, "Lookup"),
                       rows, 1, list(range(8)), params, limits, workers=1)
    _Gathered.barrier = threading.Barrier(8, timeout=60)
    eight = run_episodes(engine, tok, EnvSpec(_Gathered, {}, 120.0, "Gathered"), rows, 1,
                         list(range(8)), params, limits, workers=8)
    assert not _Gathered.barrier.broken
    assert one.rollout.texts == eight.rollout.texts
    assert torch.equal(one.returns, eight.returns)


@pytest.mark.slow
def test_the_process_producer_makes_the_threads_batches(tmp_path):
    """The producer in a process of its own (its own interpreter and copy of the policy,
    the batches and weights over a pipe and shared memory) runs the same schedule: the
    thread's samples (its behaviour log-probs differ by rounding only: the process decodes
    on fewer threads, another summation order), and it resumes exactly."""
    thread = _run(tmp_path, "thread", "--async_staleness", "1", "--async_producer", "thread")
    whole = _run(tmp_path, "whole", "--async_staleness", "1", "--async_producer", "process")
    sampled = ("reward/mean", "reward/task_accuracy", "samples/tokens_total")
    pick = lambda out: [{k: r[k] for k in sampled if k in r} for r in _rows(out)]  # noqa: E731
    assert pick(thread) == pick(whole)
    cut = _run(tmp_path, "cut", "--async_staleness", "1", "--async_producer", "process",
               "--save_every", "2")
    import shutil

    shutil.rmtree(cut / "final")
    _run(tmp_path, "cut", "--async_staleness", "1", "--async_producer", "process",
         "--save_every", "2", "--resume_from", str(cut / "checkpoint-2"))
    assert _same_weights(whole / "final", cut / "final")
    assert _rows(whole) == _rows(cut)


def test_an_environment_error_in_the_producer_process_stops_the_run_in_one_line(
        tmp_path, capsys):
    """The producer process's error is the learner's: the CLI's one line, exit 2."""
    from posttrain.cli import main

    (tmp_path / "bad.py").write_text(
        "class Bad:\n"
        "    def __init__(self, row):\n        pass\n"
        "    def reset(self):\n        return '1+?'\n"
        "    def step(self, text):\n        raise KeyError('boom')\n")
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"x": i}) + "\n" for i in range(4)))
    code = main(["grpo", "--model", "builtin", "--output_dir", str(tmp_path / "run"),
                 "--env", f"{tmp_path}/bad.py:Bad", "--data", str(tmp_path / "rows.jsonl"),
                 "--max_steps", "2", "--prompts_per_step", "2", "--group_size", "2",
                 "--device", "cpu", "--tensorboard", "false", "--eval_every", "0",
                 "--async_staleness", "1", "--async_producer", "process"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert "error: env Bad on row" in err[-1] and "KeyError: 'boom'" in err[-1], err[-1]


def test_threads_are_not_left_behind(tmp_path):
    before = {t.name for t in threading.enumerate()}
    _run(tmp_path, "a", "--async_staleness", "1", "--async_producer", "thread")
    assert "posttrain-producer" not in {t.name for t in threading.enumerate()} - before


def test_a_copy_of_a_prepared_model_switches_its_own_attention():
    """The sampler's copy of the policy (asynchronous rollouts, rollout_dtype) switches
    its own attention implementation per call, never the original's: a closure over the
    original in the copied hook made the producer's short forwards flip the learner's
    model to eager mid-pass (found as a 4.5-nat log-prob gap on episodes)."""
    import copy

    from posttrain import fast
    from posttrain.models import load_causal_lm

    model = fast.prepare_model(load_causal_lm("builtin", device="cpu"), True)
    if not getattr(model, "_posttrain_short_eager", False):
        pytest.skip("the short-input switch is not installed here")
    twin = copy.deepcopy(model)
    model.set_attn_implementation("sdpa")
    twin.set_attn_implementation("sdpa")
    with torch.no_grad():
        twin(input_ids=torch.tensor([[1, 2, 3]]))
    assert twin.config._attn_implementation == "eager"
    assert model.config._attn_implementation == "sdpa"
