"""The ``vllm_server`` engine's client against fake servers that speak vLLM's HTTP
(tests/fake_vllm_server.py): samples independent of which server draws them, affinity,
weight pushes, failover on a server that stops answering, the version check, the guard on
a broken push, the key, and a whole run. The real servers are tested in the vLLM tier
(tests/test_vllm_servers.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import procs
from bounds import logprob_tolerance
from fake_vllm_server import FakeServer
from posttrain.cli import main
from posttrain.models import load_causal_lm, load_tokenizer
from posttrain.models.loading import builtin_model_dir
from posttrain.models.weights import hf_weights
from posttrain.rollout import Request, SamplingParams
from posttrain.rollout.guard import SyncGuard, SyncMismatch
from posttrain.rollout.vllm_server import (
    RolloutServerError,
    ServerOptions,
    StaleWeights,
    VLLMServerEngine,
)

PROMPTS = ["12+3=", "40+41=", "7+45=", "30+5="]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6)
STOPPED = 10.0
"""The client's timeout where a fake server is stopped: the stopped one costs that long. A
live fake answers a call's samples one after another (about 50 ms each here, so the last of
8 queued ones in under half a second): ten seconds leaves a margin of 20× for a busy
machine."""


QUIET = ["--eval_every", "0", "--builtin_eval_size", "16", "--tensorboard", "false"]
"""A whole run's quiet keys: no periodic evaluation, and the start's and the end's on 16
held-out problems (the fakes sample one request after another, ~50 ms each: 500 problems
took ~30 s of a two-step run)."""


@pytest.fixture(scope="module")
def model_tok():
    model = load_causal_lm(str(builtin_model_dir()), device="cpu").eval()
    return model, load_tokenizer(str(builtin_model_dir()))


@pytest.fixture
def fakes(model_tok):
    servers = [FakeServer(*model_tok, key="k") for _ in range(2)]
    yield servers
    for s in servers:
        s.close()


def _engine(model_tok, servers, timeout=30.0, key="k"):
    model, tok = model_tok
    return VLLMServerEngine(model, tok, ServerOptions([s.url for s in servers], key, timeout,
                                                      startup_timeout=30.0))


def _requests(tok):
    return [Request(tuple(tok(p)["input_ids"]), 100 + i) for i, p in enumerate(PROMPTS)]


def _same(a, b) -> None:
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.logprobs, b.logprobs)
    assert torch.equal(a.truncated, b.truncated)
    assert a.texts == b.texts


def test_samples_do_not_depend_on_the_server_and_groups_stay_together(model_tok, fakes):
    model, tok = model_tok
    reqs = _requests(tok)
    two = _engine(model_tok, fakes)
    a = two.generate(reqs, 3, PARAMS)
    where = list(two.last_servers)
    b = _engine(model_tok, fakes[:1]).generate(reqs, 3, PARAMS)  # (a push of its own)
    _same(a, b)
    assert set(where) == {0, 1}  # both servers drew some (the hash of these 4 prompts)
    for g in range(len(reqs)):  # a group's samples on one server (its prefix cache)
        assert len({where[i] for i in range(3 * g, 3 * g + 3)}) == 1
    assert a.policy_version == 0 and a.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2,
                                                              3, 3, 3]
    # the behaviour log-probs are the sampled tokens' under the model (temperature 1):
    # the trainer's full forward of the same tokens, within two float32 forwards' rounding
    for i, (seq, k) in enumerate(zip(*a.sequences(), strict=True)):
        with torch.no_grad():
            z = model(input_ids=torch.tensor([seq])).logits[0, k - 1:-1].double()
        want = z.log_softmax(-1).gather(-1, torch.tensor(seq[k:])[:, None]).squeeze(-1)
        got = a.logprobs[i, :len(want)].double()
        assert float((got - want).abs().max()) <= logprob_tolerance(model, z)


def test_an_episodes_next_turn_goes_where_its_sequence_was_made(model_tok, fakes):
    _, tok = model_tok
    eng = _engine(model_tok, fakes)
    reqs = _requests(tok)  # (short: fewer tokens than the affinity index's key)
    first = eng.generate(reqs, 1, PARAMS)
    where = list(eng.last_servers)
    seqs, _ = first.sequences()
    nxt = [Request(tuple(s) + tuple(tok(" ok")["input_ids"]), 7) for s in seqs]
    eng.generate(nxt, 1, PARAMS)
    assert eng.last_servers == where
    eng._made = {}  # the hash alone would have placed some elsewhere (else this test is blind)
    assert [eng._home(r.prompt_ids, eng.servers).index for r in nxt] != where


def test_a_push_reaches_every_server_and_versions_follow(model_tok, fakes):
    model, tok = model_tok
    eng = _engine(model_tok, fakes)
    moved = {n: p.detach() + 0.01 * torch.randn_like(p) for n, p in model.named_parameters()}
    trained = load_causal_lm(str(builtin_model_dir()), device="cpu")
    trained.load_state_dict(moved, strict=False)
    eng.sync(hf_weights(trained, torch.float32), 3)
    for f in fakes:
        got = dict(f.model.named_parameters())
        for n, p in trained.named_parameters():
            assert torch.equal(got[n], p), n
        assert f.version == eng.tag == f"{eng.run_id}-3"
    assert eng.generate(_requests(tok), 1, PARAMS).policy_version == 3
    for f in fakes:  # the RL API's order (the built-in model is one bucket)
        push = [c for c in f.calls if c not in ("/health", "/inference/v1/generate")]
        assert push[-7:] == ["/pause", "/init_weight_transfer_engine", "/start_weight_update",
                             "/update_weights", "/finish_weight_update",
                             "/reset_prefix_cache", "/resume"]


@pytest.fixture
def nccl_fakes(model_tok, monkeypatch):
    """Servers standing in for vLLM's ``nccl`` weight transfer engine, their groups queues
    (tests/fake_vllm_server.py): the trainer's side of ``rollout_transfer nccl`` without a
    GPU."""
    import posttrain.rollout.nccl_push as nccl_push
    from fake_vllm_server import FakeGroup

    monkeypatch.setattr(nccl_push, "open_group", FakeGroup)
    monkeypatch.setattr(nccl_push, "check", lambda: None)  # (no CUDA here: the fakes need none)
    servers = [FakeServer(*model_tok, key="k", transfer="nccl") for _ in range(2)]
    yield servers
    for s in servers:
        s.close()


def _nccl_engine(model, tok, servers, timeout=30.0):
    return VLLMServerEngine(model, tok, ServerOptions(
        [s.url for s in servers], "k", timeout, bucket_mb=1, startup_timeout=30.0,
        transfer="nccl"))


def _moved(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    trained = load_causal_lm(str(builtin_model_dir()), device="cpu")
    trained.load_state_dict({n: p.detach() + 0.01 * torch.randn(p.shape, generator=g)
                             for n, p in model.named_parameters()}, strict=False)
    return trained


def test_nccl_pushes_reach_every_server_bucket_by_bucket(model_tok, nccl_fakes):
    """rollout_transfer nccl: each server joins a group of its own at the first push and
    keeps it; every bucket's tensors go in the order its ``/update_weights`` lists them,
    so the servers hold exactly the weights pushed, sample under the version pushed, and
    draw what the servers of posttrain's transport draw."""
    model, tok = model_tok
    eng = _nccl_engine(model, tok, nccl_fakes)
    for version in (1, 2):
        trained = _moved(model, version)
        eng.sync(hf_weights(trained, torch.float32), version)
        for f in nccl_fakes:
            got = dict(f.model.named_parameters())
            assert all(torch.equal(got[n], p) for n, p in trained.named_parameters())
            assert f.version == eng.tag == f"{eng.run_id}-{version}"
    for f in nccl_fakes:  # (one group each, many buckets a push: 1 MiB of a 3.6 MB model)
        assert f.calls.count("/init_weight_transfer_engine") == 1
        assert f.calls.count("/update_weights") >= 3 * 4
    got = eng.generate(_requests(tok), 2, PARAMS)
    assert got.policy_version == 2 and set(eng.last_servers) == {0, 1}
    plain = [FakeServer(trained, tok, key="k") for _ in range(2)]
    try:
        _same(got, _engine((trained, tok), plain).generate(_requests(tok), 2, PARAMS))
    finally:
        for f in plain:
            f.close()


def test_a_server_on_the_other_transport_refuses_its_nccl_group_and_is_dropped(
        model_tok, nccl_fakes, capsys):
    """A server started for posttrain's transport refuses the NCCL init at once: dropped
    then, naming its answer, not after the rendezvous's timeout."""
    model, tok = model_tok
    other = FakeServer(model, tok, key="k")
    try:
        eng = _nccl_engine(model, tok, [nccl_fakes[0], other])
        assert [s.alive for s in eng.servers] == [True, False]
        assert (f"rollout server 1 ({other.url}) did not join its NCCL group "
                "(RolloutServerError") in capsys.readouterr().err
    finally:
        other.close()


@pytest.mark.parametrize("stuck", ["open", "broadcast"])
def test_an_nccl_call_that_blocks_its_thread_costs_the_timeout_and_the_server(
        model_tok, nccl_fakes, monkeypatch, capsys, stuck):
    """A call into NCCL may block the thread that makes it (a rendezvous no one joins, a
    broadcast queued behind one no one takes): each runs on a thread of its own, waited
    for at most the timeout, and the server is dropped."""
    import threading

    import posttrain.rollout.nccl_push as nccl_push
    from fake_vllm_server import FakeGroup

    model, tok = model_tok
    never, made = threading.Event(), []

    class Stuck(FakeGroup):  # (the second group opened: server 1's)
        def __init__(self, *args):
            made.append(self)
            if stuck == "open" and len(made) == 2:
                never.wait()
            super().__init__(*args)

        def stage(self, tensors):
            self.left = len(tensors)
            return super().stage(tensors)

        def broadcast(self, tensor):  # (the server takes the bucket and answers; the last
            super().broadcast(tensor)  # call into NCCL never returns)
            self.left -= 1
            if stuck == "broadcast" and self is made[1] and not self.left:
                never.wait()

    monkeypatch.setattr(nccl_push, "open_group", Stuck)
    try:
        eng = _nccl_engine(model, tok, nccl_fakes, timeout=3.0)
        assert [s.alive for s in eng.servers] == [True, False]
        assert nccl_fakes[0].version == eng.tag
        err = capsys.readouterr().err  # (a stuck open: the server's join call may time out first)
        assert f"rollout server 1 ({nccl_fakes[1].url}) did not " in err and "within 3 s" in err
        if stuck == "broadcast":
            assert "did not take a weight bucket over NCCL within 3 s" in err
    finally:
        never.set()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for a machine without CUDA")
def test_the_nccl_transport_without_cuda_is_a_one_line_error(fakes, tmp_path, monkeypatch,
                                                            capsys):
    monkeypatch.setenv("POSTTRAIN_ROLLOUT_KEY", "k")
    assert main(["grpo", "--rollout_backend", "vllm_server", "--rollout_servers",
                 fakes[0].url, "--rollout_transfer", "nccl", "--max_steps", "1", *QUIET,
                 "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: rollout_transfer nccl needs CUDA on the run's rank 0 (use "
                       "rollout_transfer posttrain)")


def test_the_nccl_address_is_the_loopback_for_local_servers_else_the_users(monkeypatch):
    from posttrain.trainers.online.sampler import _nccl_address

    monkeypatch.setenv("POSTTRAIN_NCCL_ADDRESS", "10.0.0.7")
    assert _nccl_address(["http://127.0.0.1:1", "http://localhost:2"]) == "127.0.0.1"
    assert _nccl_address(["http://127.0.0.1:1", "http://10.0.0.9:2"]) == "10.0.0.7"


@pytest.mark.slow
def test_an_nccl_server_that_never_takes_its_bucket_is_dropped_then_readmitted(
        model_tok, nccl_fakes, capsys):
    """A server that does not take a bucket's broadcasts within the timeout has its group
    aborted and is dropped in one line, the push goes on to the other; once it answers
    again, the next push opens it a new group and it holds the weights."""
    model, tok = model_tok
    eng = _nccl_engine(model, tok, nccl_fakes, STOPPED)
    nccl_fakes[1].hold_buckets.set()
    eng.sync(hf_weights(_moved(model, 1), torch.float32), 1)
    err = capsys.readouterr().err
    assert (f"rollout server 1 ({nccl_fakes[1].url}) did not take a weight bucket over NCCL "
            f"within {STOPPED:g} s: its requests go to server 0") in err
    assert not eng.servers[1].alive and nccl_fakes[0].version == eng.tag
    nccl_fakes[1].hold_buckets.clear()
    trained = _moved(model, 2)
    eng.sync(hf_weights(trained, torch.float32), 2)
    assert eng.servers[1].alive and nccl_fakes[1].version == eng.tag
    assert nccl_fakes[1].calls.count("/init_weight_transfer_engine") == 2
    got = dict(nccl_fakes[1].model.named_parameters())
    assert all(torch.equal(got[n], p) for n, p in trained.named_parameters())


@pytest.mark.slow
def test_a_stopped_server_is_named_and_its_requests_go_to_the_other(model_tok, fakes, capsys):
    _, tok = model_tok
    reqs = _requests(tok)
    want = _engine(model_tok, fakes).generate(reqs, 2, PARAMS)
    eng = _engine(model_tok, fakes, timeout=STOPPED)
    fakes[1].stall.set()
    got = eng.generate(reqs, 2, PARAMS)
    _same(got, want)
    assert set(eng.last_servers) == {0}
    err = capsys.readouterr().err
    assert f"rollout server 1 ({fakes[1].url}) did not answer" in err
    assert "its requests go to server 0" in err


@pytest.mark.slow
@pytest.mark.parametrize("push", ["merged", "adapter"])
def test_a_server_that_answers_again_is_readmitted_at_the_next_push(model_tok, fakes, capsys,
                                                                     push):
    """A stopped server is dropped; a push while it still answers nothing goes on without
    it; the first push after it answers again re-admits it: it takes the whole push (an
    adapter run's base weights, then the adapter) and draws its share of the samples again,
    the samples of a fleet that never lost it."""
    import copy
    from types import SimpleNamespace

    model, tok = model_tok
    policy = copy.deepcopy(model)
    adapter = None
    if push == "adapter":
        pytest.importorskip("peft")
        from posttrain.models import lora

        policy = lora.add(policy, SimpleNamespace(lora_rank=4, lora_alpha=8, lora_dropout=0.0,
                                                  lora_targets="all-linear"))
        adapter = "policy"

    def moved() -> None:
        with torch.no_grad():
            for p in policy.parameters():
                if p.requires_grad:
                    p.add_(0.05 * torch.randn_like(p))

    def engine(servers, timeout=30.0):
        return VLLMServerEngine(policy, tok, ServerOptions(
            [f.url for f in servers], "k", timeout, startup_timeout=30.0, adapter=adapter))

    reqs = _requests(tok)
    eng = engine(fakes, STOPPED)
    fakes[1].stall.set()
    eng.generate(reqs, 2, PARAMS)
    assert not eng.servers[1].alive
    moved()
    eng.sync(hf_weights(policy, torch.float32), 1)  # still stopped: it stays out
    assert not eng.servers[1].alive and fakes[0].version == eng.tag != fakes[1].version
    fakes[1].stall.clear()
    moved()
    eng.sync(hf_weights(policy, torch.float32), 2)
    assert eng.servers[1].alive and fakes[1].version == eng.tag == f"{eng.run_id}-2"
    assert f"rollout server 1 ({fakes[1].url}) answers again: re-admitted with version 2" \
        in capsys.readouterr().err
    got = eng.generate(reqs, 2, PARAMS)
    assert set(eng.last_servers) == {0, 1} and got.policy_version == 2
    if adapter is not None:  # (the adapter it held when it stopped: unloaded)
        assert fakes[1].calls.count("/update_weights") == 2
        assert list(fakes[1].adapters) == [f"{adapter}-2"]
    _same(got, engine(fakes[:1]).generate(reqs, 2, PARAMS))


def test_a_returning_server_left_mid_update_is_finished_first_and_failures_back_off(
        model_tok, fakes, capsys):
    """A server dropped between a push's start and finish is still in that update (vLLM
    refuses a second start): re-admitted, it is told to finish first, and takes the push.
    A re-admission that fails (here: the push refused) is tried again after 1, then 3
    pushes, not at every one."""
    model, _ = model_tok
    eng = _engine(model_tok, fakes)
    eng.servers[1].alive, fakes[1].updating = False, True
    eng.sync(hf_weights(_moved(model, 1), torch.float32), 1)
    assert eng.servers[1].alive and fakes[1].version == eng.tag and not fakes[1].updating
    eng.servers[1].alive, fakes[1].key = False, "another run's"
    asked = []
    for version in range(2, 9):
        before = fakes[1].calls.count("/is_paused")
        eng.sync(hf_weights(model, torch.float32), version)
        asked.append(fakes[1].calls.count("/is_paused") - before)
    assert asked == [1, 0, 1, 0, 0, 0, 1] and not eng.servers[1].alive
    assert "weight push refused" in capsys.readouterr().err


@pytest.mark.parametrize("down", ["dead", pytest.param("stopped", marks=pytest.mark.slow)])
def test_every_server_down_stops_the_run_in_one_line(model_tok, fakes, down):
    """Killed servers (connections dropped: named at once) in the fast tier; stopped ones,
    each costing the client's timeout, in the heavy tier (one stopped server is the fast
    tier's, above)."""
    _, tok = model_tok
    eng = _engine(model_tok, fakes, timeout=STOPPED)
    for f in fakes:
        if down == "dead":
            f.dead = True
        else:
            f.stall.set()
    with pytest.raises(RolloutServerError, match=r"every rollout server is down.*resume"):
        eng.generate(_requests(tok), 1, PARAMS)


def test_a_server_on_other_weights_is_refused(model_tok, fakes):
    _, tok = model_tok
    eng = _engine(model_tok, fakes)
    fakes[0].version = "default"  # restarted: it answers with its own weights
    with pytest.raises(StaleWeights, match="rollout server 0 .*sampled with weights "
                       r"\['default'\]"):
        eng.generate(_requests(tok), 2, PARAMS)


def test_the_guard_catches_a_push_that_loaded_nothing(model_tok, fakes):
    model, tok = model_tok
    eng = _engine(model_tok, fakes)
    ro = eng.generate(_requests(tok)[:2], 1, SamplingParams(temperature=0.0,
                                                            max_new_tokens=6))
    guard = SyncGuard(eng, model, *ro.sequences(), torch.float32, torch.float32)
    trained = load_causal_lm(str(builtin_model_dir()), device="cpu")
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.05 * torch.randn_like(p))
    fakes[1].ignore_pushes = True
    eng.sync(hf_weights(trained, torch.float32), 1)
    with pytest.raises(SyncMismatch, match=f"rollout server 1 \\({fakes[1].url}\\)'s"):
        guard.check(trained, 1)
    fakes[1].ignore_pushes = False
    eng.sync(hf_weights(trained, torch.float32), 2)
    assert guard.check(trained, 2)["sync/gap_mean"] <= guard.tolerance * 4


def test_a_wrong_key_is_refused(model_tok, fakes, capsys):
    with pytest.raises(RolloutServerError, match="every rollout server is down"):
        _engine(model_tok, fakes, key="wrong")
    err = capsys.readouterr().err
    assert err.count("answered 500: ") == 2 and "weight push refused" in err
    for f in fakes:  # paused by the push, resumed when it failed
        assert f.calls[-1] == "/resume"


def test_a_grpo_run_samples_through_the_servers(model_tok, fakes, tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_ROLLOUT_KEY", "k")
    out = tmp_path / "run"
    assert main(["grpo", "--rollout_backend", "vllm_server", "--rollout_servers",
                 ",".join(f.url for f in fakes), "--max_steps", "2", "--prompts_per_step", "4",
                 "--group_size", "2", *QUIET, "--output_dir", str(out)]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r][-1] == 2
    assert all(f.version.endswith("-2") for f in fakes)  # both hold the final weights
    assert all("/inference/v1/generate" in f.calls for f in fakes)


# (whole LoRA runs through the fakes, like the adapter push's guard below: in the heavy tier,
# which keeps the fast one under 4 minutes on a slow 2-core machine)
@pytest.mark.slow
@pytest.mark.parametrize("push", ["adapter", "merged"])
def test_a_lora_run_pushes_the_adapter_alone_or_merged_weights(model_tok, fakes, tmp_path,
                                                                monkeypatch, push):
    """adapter: the base weights go once (the first push), then each version is the adapter
    alone, loaded under a name of its own (the last one unloaded) and named by every
    request; merged: the RL API's push every time, no adapter. The guard probes every
    server after every push either way, so a server sampling with other weights stops the
    run."""
    pytest.importorskip("peft")
    monkeypatch.setenv("POSTTRAIN_ROLLOUT_KEY", "k")
    out = tmp_path / "run"
    assert main(["grpo", "--rollout_backend", "vllm_server", "--rollout_servers",
                 ",".join(f.url for f in fakes), "--lora_rank", "4", "--lr", "1e-2",
                 "--rollout_lora_push", push, "--max_steps", "3", "--prompts_per_step", "4",
                 "--group_size", "2", *QUIET, "--log_every", "1", "--output_dir", str(out)]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "sync/gap_mean" in r]) == 3  # the guard, every step
    for f in fakes:
        pushes = f.calls.count("/reset_prefix_cache")
        assert pushes == 4 and f.version.endswith("-3")  # the start and three steps
        if push == "adapter":
            assert f.calls.count("/update_weights") == 1
            assert f.calls.count("/v1/load_lora_adapter") == pushes
            assert list(f.adapters) == ["posttrain-policy-3"]
        else:
            assert f.calls.count("/update_weights") == pushes and not f.adapters


@pytest.mark.slow
def test_the_guard_catches_an_adapter_push_that_loaded_nothing(fakes, tmp_path, monkeypatch,
                                                               capsys):
    pytest.importorskip("peft")
    monkeypatch.setenv("POSTTRAIN_ROLLOUT_KEY", "k")
    fakes[1].ignore_pushes = True  # (a new name over the old adapter)
    assert main(["grpo", "--rollout_backend", "vllm_server", "--rollout_servers",
                 ",".join(f.url for f in fakes), "--lora_rank", "4", "--lr", "1e-1",
                 "--rollout_lora_push", "adapter", "--max_steps", "2", "--prompts_per_step",
                 "4", "--group_size", "2", *QUIET, "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"rollout server 1 ({fakes[1].url})'s" in err


@pytest.mark.parametrize("args, message", [
    (["--launch_rollout_servers", "2"], "launch_rollout_servers.*rollout_backend=auto"),
    (["--rollout_backend", "vllm_server"], "needs either rollout_servers"),
    (["--rollout_backend", "vllm_server", "--rollout_servers", "http://a:1",
      "--launch_rollout_servers", "1"], "needs either rollout_servers"),
    (["--rollout_backend", "vllm_server", "--rollout_servers", "a:1"], "not an http"),
    (["--rollout_backend", "vllm_server", "--launch_rollout_servers", "2",
      "--rollout_server_devices", "0"], "names 1 device sets for 2 servers"),
    (["--rollout_backend", "vllm_server", "--launch_rollout_servers", "1",
      "--rollout_lora_push", "adapter"], "rollout_lora_push.*without LoRA"),
    (["--rollout_backend", "vllm_server", "--launch_rollout_servers", "1", "--lora_rank",
      "4", "--rollout_lora_push", "both"], "rollout_lora_push must be auto, adapter or"),
    (["--rollout_backend", "vllm_server", "--launch_rollout_servers", "1",
      "--rollout_transfer", "ipc"], "rollout_transfer must be posttrain or nccl"),
    (["--rollout_transfer", "nccl"], "rollout_transfer.*rollout_backend=auto"),
])
def test_server_keys_are_checked(args, message, capsys, tmp_path):
    assert main(["grpo", *args, "--output_dir", str(tmp_path / "r")]) == 2
    assert __import__("re").search(message, capsys.readouterr().err)


@pytest.mark.slow
@pytest.mark.parametrize("command", [["ppo"], ["grpo", "--async_staleness", "1"],
                                     ["distill", "--teacher", "builtin"]])
def test_ppo_async_and_distill_sample_through_the_servers(command, fakes, tmp_path,
                                                         monkeypatch):
    monkeypatch.setenv("POSTTRAIN_ROLLOUT_KEY", "k")
    out = tmp_path / "run"
    assert main([*command, "--rollout_backend", "vllm_server", "--rollout_servers",
                 ",".join(f.url for f in fakes), "--max_steps", "2", "--prompts_per_step",
                 "4", *QUIET, "--output_dir", str(out)]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows if "train/loss" in r) == 2
    versions = {f.version for f in fakes}  # (the optimiser steps: ppo makes several a step)
    assert len(versions) == 1 and not versions.pop().endswith("-0")
    assert all("/inference/v1/generate" in f.calls for f in fakes)


@pytest.mark.slow
def test_a_run_whose_servers_all_stop_resumes_to_the_uninterrupted_weights(
        fakes, tmp_path, monkeypatch, capsys):
    """Every server dies after the push that follows step 2 (the guard's probe is the first
    call it drops): the run stops with exit 2 in one line and its step-1 checkpoint intact;
    resumed once they answer, it ends with the weights of the run never interrupted. (Dead,
    not stopped: a dropped connection is named at once, whatever the machine's load, where
    a timeout short enough for a test could also catch a slow answer.)"""
    from safetensors.torch import load_file

    monkeypatch.setenv("POSTTRAIN_ROLLOUT_KEY", "k")
    args = ["grpo", "--rollout_backend", "vllm_server", "--rollout_servers",
            ",".join(f.url for f in fakes), "--max_steps", "4", "--prompts_per_step", "4",
            *QUIET, "--save_every", "1"]
    assert main([*args, "--output_dir", str(tmp_path / "whole")]) == 0
    for f in fakes:
        f.die_after, f.pushes = 3, 0  # the start's push, then steps 1 and 2
    cut = tmp_path / "cut"
    assert main([*args, "--output_dir", str(cut)]) == 2
    err = capsys.readouterr().err
    assert "error: every rollout server is down" in err and "--resume_from" in err
    assert (cut / "checkpoint-1").exists() and not (cut / "checkpoint-2").exists()
    assert not (cut / "final").exists()
    for f in fakes:
        f.die_after, f.dead = None, False
    assert main([*args, "--output_dir", str(cut), "--resume_from",
                 str(cut / "checkpoint-1")]) == 0
    a = load_file(str(tmp_path / "whole" / "final" / "model.safetensors"))
    b = load_file(str(cut / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.multiprocess
def test_two_ranks_sampling_from_the_servers_compute_the_update_of_one(fakes, tmp_path):
    """torchrun, 2 ranks on gloo: each rank sends its share of the requests, rank 0 pushes
    and the ranks share its run id (else every other rank refuses every answer as stale);
    the same per-request seeds draw the same samples, so the final weights are one
    process's to float32 rounding of the gradient's sum (1e-5, as tests/test_distributed.py
    derives for these runs)."""
    import os
    import sys

    from safetensors.torch import load_file

    env = {**os.environ, "OMP_NUM_THREADS": "1", "POSTTRAIN_ROLLOUT_KEY": "k"}
    args = ["-m", "posttrain", "grpo", "--rollout_backend", "vllm_server",
            "--rollout_servers", ",".join(f.url for f in fakes), "--max_steps", "3",
            "--prompts_per_step", "4", *QUIET, "--lr", "1e-5"]
    finals = []
    for ranks in (1, 2):
        out = tmp_path / f"ranks-{ranks}"
        launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                   "--standalone"] if ranks == 2 else [sys.executable])
        cmd = [*launch, *args, "--output_dir", str(out)]
        proc = procs.run(cmd, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        finals.append(load_file(str(out / "final" / "model.safetensors")))
    a, b = finals
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)


def test_agents_sample_through_the_servers_token_exactly(tmp_path, monkeypatch):
    """``--agent builtin`` with ``--rollout_backend vllm_server``: the endpoint's batches go
    to the servers (an episode's later requests extend its first, so its server's prefix
    cache serves them), and the trainer's log-probs at the captured tokens equal the
    servers' behaviour log-probs to float32 rounding."""
    pytest.importorskip("openai")
    from posttrain.config import RLConfig
    from posttrain.trainers.online import RLTrainer
    from rl_steps import check_trainer_reads_behaviour

    path = str(builtin_model_dir("builtin-episodes"))
    model, tok = load_causal_lm(path, device="cpu").eval(), load_tokenizer(path)
    servers = [FakeServer(model, tok, key="k") for _ in range(2)]
    monkeypatch.setenv("POSTTRAIN_ROLLOUT_KEY", "k")
    try:
        cfg = RLConfig(output_dir=str(tmp_path), agent="builtin",
                       rollout_backend="vllm_server",
                       rollout_servers=",".join(s.url for s in servers), max_steps=1,
                       prompts_per_step=4, group_size=2, builtin_train_size=16,
                       builtin_eval_size=0, device="cpu", tensorboard=False, kl_coef=0.0)
        cfg.validate()
        trainer = RLTrainer(cfg)
        try:
            ro = trainer.experience.collect(1).rollout
            assert ro.stats["requests"].sum() > len(ro.prompt_ids)  # (some asked first)
            check_trainer_reads_behaviour(trainer, ro)
        finally:
            trainer.close()
    finally:
        for s in servers:
            s.close()
    assert all("/inference/v1/generate" in s.calls for s in servers)


@pytest.mark.parametrize(("bind", "engine_process"), [(None, "0"), ("0-1", None)])
def test_a_cpu_server_runs_its_model_in_the_engine_process_unless_threads_are_bound(
        bind, engine_process, model_tok, tmp_path, monkeypatch):
    """Launched on CPU with its threads unbound (the default), a server runs its model in
    vLLM's engine-core process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no worker process
    busy-polling a core the trainer needs); a binding the user set keeps vLLM's worker
    processes, the only place vLLM binds threads. The servers' environments are read at
    ``Popen``, which starts an idle process in their place."""
    import subprocess
    import sys

    from posttrain.rollout import fleet

    for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING",
                 "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    if bind:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    envs, popen = [], subprocess.Popen

    def start(cmd, env, **kw):
        envs.append(env)
        return popen([sys.executable, "-c", "import time; time.sleep(60)"],
                     start_new_session=True)

    monkeypatch.setattr(fleet.subprocess, "Popen", start)
    monkeypatch.setattr(fleet, "_cuda", lambda: False)
    f = fleet.Fleet(*model_tok, 1, "k", tmp_path, dtype=torch.float32, max_model_len=64)
    f.close(grace=5.0)
    (env,) = envs
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == (bind or "nobind")
    assert env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == engine_process
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"


@pytest.mark.parametrize(("user", "server"), [
    ("glibc.malloc.arena_max=2", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
    ("glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=0")])
def test_a_cpu_servers_huge_pages_keep_the_users_malloc_tunables(user, server):
    """Huge pages for a CPU server's malloc are added to the tunables the user set, and a
    ``glibc.malloc.hugetlb`` the user chose stays theirs."""
    from posttrain.rollout.fleet import _huge_pages

    env = {"GLIBC_TUNABLES": user}
    _huge_pages(env)
    assert env["GLIBC_TUNABLES"] == server


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="bucket files are kept in /dev/shm")
def test_push_files_rewrite_a_bucket_in_place_while_its_layout_holds(monkeypatch):
    """Kept, a push's bucket ``i`` goes to the same file at every push: safetensors writes
    it once per layout, later pushes copy into it where its tensors lie (the same inode),
    and safetensors reads back exactly what was pushed each time, whatever the dtypes'
    order and alignment; ``release`` leaves it in place."""
    import shutil

    import safetensors.torch
    from safetensors.torch import load_file

    from posttrain.rollout.push_files import PushFiles

    writes, save_file = [], safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file",
                        lambda t, path, **kw: (writes.append(path), save_file(t, path, **kw)))
    g = torch.Generator().manual_seed(0)

    def bucket():
        return {"w": torch.randn(3, 5, generator=g),
                "h": torch.randn(7, generator=g).to(torch.bfloat16),
                "ids": torch.randint(1 << 40, (3,), generator=g)}

    files = PushFiles("test", keep_bytes=1 << 10)
    try:
        path = files.bucket(0, bucket())
        inode = os.stat(path).st_ino
        for _ in range(2):
            files.release(0)
            pushed = bucket()
            assert files.bucket(0, pushed) == path and os.stat(path).st_ino == inode
            got = load_file(path)
            assert got.keys() == pushed.keys()
            assert all(torch.equal(got[k], pushed[k]) for k in pushed)
        assert writes == [path] and files.keep
        other = {"w": torch.randn(2, 2, generator=g)}  # (another layout: written afresh)
        assert files.bucket(0, other) == path and len(writes) == 2
        assert torch.equal(load_file(path)["w"], other["w"])
        for remove in (lambda: os.unlink(path), lambda: shutil.rmtree(files.dir)):
            remove()  # (by someone else, under the run: written afresh, not into the mapping)
            other = {"w": torch.randn(2, 2, generator=g)}
            assert files.bucket(0, other) == path
            assert torch.equal(load_file(path)["w"], other["w"])
        assert len(writes) == 4
    finally:
        files.close()


@pytest.mark.parametrize("why", ["adapter", "no room"])
def test_push_files_not_kept_are_written_afresh_and_removed(why, monkeypatch):
    """Bucket files are not kept where a run pushes its weights once (a LoRA run's base:
    no ``keep_bytes``) or where ``/dev/shm`` has not twice the push free: each bucket is
    written afresh and ``release`` removes it."""
    import shutil

    from safetensors.torch import load_file

    from posttrain.rollout.push_files import PushFiles

    if why == "no room":
        usage = shutil.disk_usage("/")
        monkeypatch.setattr(shutil, "disk_usage",
                            lambda p: usage._replace(free=(1 << 20) - 1))
    files = PushFiles("test", keep_bytes=0 if why == "adapter" else 1 << 19)
    try:
        for n in (5, 6):
            path = files.bucket(0, {"w": torch.full((n,), float(n))})
            assert torch.equal(load_file(path)["w"], torch.full((n,), float(n)))
            files.release(0)
            assert not os.path.exists(path)
        assert files.keep is False
    finally:
        files.close()


@pytest.mark.slow
def test_push_files_are_removed_when_a_run_exits_without_closing_them():
    """A process that exits without closing its push files (as a run that ends on an
    error may) leaves nothing in ``/dev/shm``: kept bucket files are a model's size."""
    import subprocess
    import sys

    code = ("import torch\nfrom posttrain.rollout.push_files import PushFiles\n"
            "f = PushFiles('exit', keep_bytes=1 << 10)\n"
            "f.bucket(0, {'w': torch.ones(4)})\nprint(f.dir, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out and not os.path.exists(out[-1])
