"""Routing replay on mixture-of-experts families built here (Mixtral; Qwen2-MoE with its
shared expert and unnormalised top-k; Qwen3-MoE): a recording replays exactly — the update's
routing is the recorded one, whatever the router has become — the gate's weights still come
from the current router (it gets a gradient), a replay of the router's own choice is the
plain forward bit for bit, and without replay the disagreement is measured. Every family
also runs through the trainers (GRPO with r3, r2 and none, single-turn and episodes; SFT,
RM and DPO with the auxiliary loss) and both in-process engines (lean and hf), whose
recordings are checked against a plain forward's routing."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import test_families
from bounds import entropy_error, logsoftmax_error, unit_roundoff
from posttrain.models.routing import Routing, routers
from posttrain.rollout import SamplingParams

COMMON = test_families.COMMON
U32, U64 = unit_roundoff(torch.float32), unit_roundoff(torch.float64)


def _aux_rel_bound(router_logits, E: int, k: int, dtype=torch.float32) -> float:
    """Relative error of a Switch load-balancing loss E·Σ_e f_e·P_e computed in ``dtype``
    from these router logits, in any arrangement: every term is positive, so each step's
    error stays relative to the result: p within L + u (bounds.logsoftmax_error of the log,
    and the exp), a mean of p over the n logits' rows ((n − 1)·u and the division's u), f an
    exact count over another (u), the product (u), the sum over E·k terms (E·k·u) and × E
    (u)."""
    z = torch.cat([x.reshape(-1, E) for x in router_logits])
    return logsoftmax_error(z, dtype) + (len(z) + E * k + 5) * unit_roundoff(dtype)
EXPERTS = 6  # more than the families test's 4, so routing has room to move
FAMILIES = {  # the families test's MoE configs; Qwen2-MoE with its top-k unnormalised
    name: (cls, {**extra, "num_local_experts" if name == "mixtral" else "num_experts": EXPERTS,
                 **({"norm_topk_prob": False} if name == "qwen2_moe" else {})})
    for name, (cls, extra) in test_families.FAMILIES.items()
    if name in ("mixtral", "qwen2_moe", "qwen3_moe")}


@pytest.fixture(params=sorted(FAMILIES))
def moe(request):
    cls, extra = FAMILIES[request.param]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**{**COMMON, **extra})).eval()
    with torch.no_grad():  # routers large enough to route decisively
        for r in routers(model):
            r.weight.normal_(0, 1.0)
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    mask[2, 5:] = 0  # right padding
    return ids, mask


def forward(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask).logits


def test_routers_are_found_in_layer_order(moe):
    assert len(routers(moe)) == moe.config.num_hidden_layers


def test_replaying_the_routers_own_choice_is_the_plain_forward(moe):
    ids, mask = batch()
    rows = torch.arange(3)
    with torch.no_grad():
        plain = forward(moe, ids, mask)
        with Routing(moe, 3, 7) as routing:
            with routing.call(rows, mask, "record"):
                recorded = forward(moe, ids, mask)
            with routing.call(rows, mask, "replay"):
                replayed = forward(moe, ids, mask)
            assert routing.disagreement == 0.0
    assert torch.equal(plain, recorded) and torch.equal(plain, replayed)


def test_replay_routes_through_the_recorded_experts_and_the_router_learns(moe):
    """After the first router moves, the plain forward routes some real tokens elsewhere
    (the disagreement: exactly the count at that router, whose input replay does not
    change); under replay every real token goes to its recorded experts at every router,
    in micro-batches of rows other than the recording's, and the routers' weights get a
    gradient."""
    ids, mask = batch()
    routing = Routing(moe, 3, 7)
    with torch.no_grad(), routing.call(torch.arange(3), mask, "record"):
        forward(moe, ids, mask)
    recorded = routing.indices.clone()
    with torch.no_grad():
        first = routers(moe)[0]
        first.weight.add_(torch.randn_like(first.weight))
    seen = Routing(moe, 3, 7)  # what the routers choose now, without replay
    with torch.no_grad(), seen.call(torch.arange(3), mask, "record"):
        forward(moe, ids, mask)
    real = mask.bool()[None, :, :, None].expand_as(recorded)
    moved = (recorded[0].sort(-1).values != seen.indices[0].sort(-1).values).any(-1)
    n_moved = int((moved & mask.bool()).sum())
    assert n_moved > 0  # the perturbation changed some tokens' experts
    seen.close()
    # replay, one micro-batch of row 2 then one of rows 0 and 1
    for rows in (torch.tensor([2]), torch.tensor([0, 1])):
        check = Routing(moe, 3, 7)  # records what the replayed forward really routed to
        with routing.call(rows, mask[rows], "replay"), check.call(rows, mask[rows], "record"):
            out = forward(moe, ids[rows], mask[rows])
        got = check.indices[:, rows]
        want = recorded[:, rows]
        keep = real[:, rows]
        assert torch.equal(got[keep], want[keep])
        check.close()
        out[mask[rows].bool()].sum().backward()
    assert routing.differ[0] == n_moved and routing.counted[0] == int(mask.sum())
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0
               for r in routers(moe))
    metrics = routing.metrics()
    for key in ("router/load_max_over_mean", "router/entropy", "router/aux_loss",
                "router/disagreement"):
        assert key in metrics
    assert metrics["router/load_max_over_mean"] >= 1.0
    assert 0 < metrics["router/entropy"] <= float(torch.log(torch.tensor(6.0))) + 1e-6
    routing.close()


def test_router_metrics_against_a_direct_count(moe):
    """Load, entropy and the auxiliary loss over the real tokens only, computed here from
    the router's logits in float64."""
    ids, mask = batch()
    logits = []
    hooks = [r.register_forward_hook(lambda m, a, o: logits.append(o[0].detach()))
             for r in routers(moe)]
    with torch.no_grad(), Routing(moe, 3, 7) as routing:
        with routing.call(torch.arange(3), mask, "record"):
            forward(moe, ids, mask)
        got = routing.metrics()
    for h in hooks:
        h.remove()
    real = mask.bool().reshape(-1)
    k = moe.config.num_experts_per_tok
    for i, z in enumerate(logits):
        p = z.double()[real].softmax(-1)
        E = p.shape[-1]
        chosen = p.topk(k, -1).indices
        f = torch.bincount(chosen.reshape(-1), minlength=E).double() / chosen.numel()
        # Derived bounds, the metric in float32 (then Python floats) against float64 from
        # the same logits. Load: exact counts, a division and × E (2u each side). Entropy:
        # each token's within entropy_error of its logits, the float32 sum over the n tokens
        # ((n − 1)·u of Σ H, positive) and the division; the clamp at 1e-30 drops terms of
        # < 7e-29 each. Aux: _aux_rel_bound. A 1% error, or one token lost, is far beyond.
        n, zr = len(p), z[real]
        assert got[f"router/load_max_over_mean_{i}"] == pytest.approx(
            float(f.max() * E), rel=2 * (U32 + U64))
        ent = -(p * p.log()).sum(-1)
        bound = (entropy_error(zr) + entropy_error(zr, torch.float64) + E * 7e-29
                 + float(ent.mean()) * (n * U32 + n * U64))
        assert got[f"router/entropy_{i}"] == pytest.approx(float(ent.mean()), rel=0, abs=bound)
        rel = _aux_rel_bound([zr], E, k) + _aux_rel_bound([zr.double()], E, k, torch.float64)
        assert got[f"router/aux_loss_{i}"] == pytest.approx(
            float(E * (f * p.mean(0)).sum()), rel=rel)


def test_tokens_never_recorded_route_freely_and_are_not_counted(moe):
    ids, mask = batch()
    with torch.no_grad(), Routing(moe, 3, 7) as routing:
        plain = forward(moe, ids, mask)
        with routing.call(torch.arange(3), mask, "replay"):
            replayed = forward(moe, ids, mask)
        assert torch.equal(plain, replayed) and sum(routing.counted) == 0


def test_a_dense_model_has_no_router():
    from transformers import LlamaConfig

    dense = AutoModelForCausalLM.from_config(LlamaConfig(**COMMON))
    with pytest.raises(ValueError, match="no mixture-of-experts router"):
        Routing(dense, 1, 1)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def moe_dir(request, tmp_path_factory):
    """Each MoE family saved with the built-in tokenizer (top-2 routing, routers that route
    decisively), for the trainers and engines to load."""
    from posttrain.builtin.tokenizer import build_tokenizer

    cls, extra = FAMILIES[request.param]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**{**COMMON, **extra,
                                                    "num_experts_per_tok": 2}))
    with torch.no_grad():
        for r in routers(model):
            r.weight.normal_(0, 1.0)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def _length_task(tmp_path) -> tuple[str, str]:
    """Eight prompts and a reward of the completion's length: every group has signal."""
    import json

    reward = tmp_path / "r.py"
    reward.write_text("def by_len(prompts, completions, **_):\n"
                      "    return [float(len(c)) for c in completions]\n")
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}="}) + "\n" for i in range(8)))
    return str(data), f"{reward}:by_len"


def _assert_recorded_as_a_plain_forward_routes(model, ro, every_fed: bool) -> None:
    """The last token of each of ``ro``'s sequences (never fed) has no recording, every
    other one has (``every_fed``), and the recording holds the experts a plain forward of the whole
    sequence chooses wherever the router's k-th and (k+1)-th probabilities are apart by
    far more than float32 rounding of the two forwards can move them (> 1e-3); at least
    60% of the tokens are so decisive, so the check is not vacuous."""
    seqs, _ = ro.sequences()
    k = model.config.num_experts_per_tok
    checked = total = 0
    for i, seq in enumerate(seqs):
        logits = []
        hooks = [r.register_forward_hook(lambda m, a, o, got=logits: got.append(o[0]))
                 for r in routers(model)]
        with torch.no_grad(), Routing(model, 1, len(seq)) as plain, \
                plain.call(torch.tensor([0]), torch.ones(1, len(seq)), "record"):
            model(input_ids=torch.tensor([seq]))
        for h in hooks:
            h.remove()
        fed = len(seq) - 1
        assert (ro.routing[i, :, fed:] == -1).all()
        assert not every_fed or (ro.routing[i, :, :fed] >= 0).all()
        got = ro.routing[i, :, :fed].sort(-1).values
        want = plain.indices[:, 0, :fed].sort(-1).values
        p = torch.stack(logits).double().softmax(-1)[:, :fed].sort(-1, descending=True).values
        decisive = (p[..., k - 1] - p[..., k]) > 1e-3
        assert torch.equal(got[decisive], want[decisive])
        checked, total = checked + int(decisive.sum()), total + decisive.numel()
    assert checked >= 0.6 * total


@pytest.mark.parametrize(("replay", "engine"), [("r3", "lean"), ("r3", "hf"), ("r2", "auto"),
                                                ("none", "auto")])
def test_grpo_on_a_moe_policy_logs_its_routing(moe_dir, tmp_path, replay, engine):
    """GRPO with two epochs on a Mixtral policy: r3 replays the experts the engine (lean or
    hf) chose while sampling (old pass and update), r2 the old pass's in the update, none
    compares the old pass's with the engine's; all log router/* each step. The gradient
    still reaches the routers (their weights move)."""
    import json

    from safetensors.torch import load_file

    from posttrain.config import RLConfig
    from posttrain.trainers.online import run_rl

    data, reward = _length_task(tmp_path)
    cfg = RLConfig(model=moe_dir, output_dir=str(tmp_path / "run"), max_steps=2,
                   prompts_per_step=2, data=data, reward=reward,
                   group_size=4, minibatch_size=4, ppo_epochs=2, max_new_tokens=4,
                   builtin_train_size=16, builtin_eval_size=0, device="cpu",
                   tensorboard=False, temperature=1.5, routing_replay=replay, lr=1e-2,
                   log_every=1, rollout_backend=engine)
    cfg.validate()
    run_rl(cfg)
    rows = [json.loads(x) for x in
            (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    for r in steps:
        assert 0 <= r["router/disagreement"] <= 1
        assert r["router/load_max_over_mean"] >= 1 and r["router/entropy"] > 0
        assert "router/aux_loss_0" in r and "router/disagreement_1" in r
    if replay == "r2":  # the update's experts against the old pass's: after the first
        # optimizer step of a step the routers have moved, so some tokens' experts differ
        assert max(r["router/disagreement"] for r in steps) > 0
    else:  # the old pass's against the engine's, at the same weights in the same dtype:
        # they differ only where the router's top-k is a float tie (a few of hundreds)
        assert max(r["router/disagreement"] for r in steps) <= 0.02
    start = load_file(f"{moe_dir}/model.safetensors")
    end = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    gate = next(k for k in start if k.endswith("gate.weight"))
    assert not torch.equal(start[gate], end[gate])


def test_routing_replay_config_errors(tmp_path, tiny_model_dir):
    from posttrain.config import ConfigError, RLConfig
    from posttrain.trainers.online import RLTrainer

    with pytest.raises(ConfigError, match="vllm engine does not return here"):
        RLConfig(output_dir=str(tmp_path), routing_replay="r3",
                 rollout_backend="vllm").validate()
    cfg = RLConfig(model=tiny_model_dir, output_dir=str(tmp_path), routing_replay="r2",
                   device="cpu", tensorboard=False)
    cfg.validate()
    with pytest.raises(ConfigError, match="needs a mixture-of-experts policy"):
        RLTrainer(cfg)


def test_the_hf_engine_records_the_experts_it_sampled_with(moe_dir):
    """R3's recording: every token the hf engine fed (prompt and completion, the last
    sampled token excepted) has the experts a plain forward of the whole sequence chooses
    at it (the same weights: the routing agrees wherever the router's top-k is not a
    float tie), in sequence positions."""
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.rollout import make_engine

    model = load_causal_lm(moe_dir, device="cpu").eval()
    tok = load_tokenizer(moe_dir)
    engine = make_engine("hf", model, tok)
    from posttrain.rollout import Request

    ro = engine.generate([Request((5, 6, 7, 8), 1), Request((9, 10), 2)], 2,
                         SamplingParams(max_new_tokens=5, temperature=1.5),
                         extras=frozenset({"routing"}))
    assert ro.routing is not None and ro.routing.shape[:2] == (4, 2)
    _assert_recorded_as_a_plain_forward_routes(model, ro, every_fed=False)


def test_the_auxiliary_loss_is_the_familys_own(moe):
    """Routing.aux_loss is the family's load-balancing loss over the real tokens of the last
    call (what the model computes itself with output_router_logits), and it has a gradient
    to the routers."""
    import sys

    ids, mask = batch()
    with Routing(moe, 3, 7) as routing:
        routing.collect_logits = True
        with routing.call(torch.arange(3), mask, "observe"):
            out = moe(input_ids=ids, attention_mask=mask, output_router_logits=True)
        got = routing.aux_loss()
    fn = sys.modules[type(moe).__module__].load_balancing_loss_func
    E, k = len(routers(moe)[0].weight), routers(moe)[0].top_k
    want = fn(out.router_logits, E, k, mask)
    # two float32 computations of one positive loss, each within _aux_rel_bound (~1e-5)
    assert torch.allclose(got, want, rtol=2 * _aux_rel_bound(out.router_logits, E, k), atol=0)
    got.backward()
    assert routers(moe)[0].weight.grad.abs().sum() > 0


def test_the_auxiliary_loss_switch_trains_the_routers_toward_balance(moe_dir, tmp_path):
    """--router_aux_loss_coef: the update adds the family's auxiliary loss (logged as
    train/router_aux_loss), so the routers' weights end elsewhere than without it."""
    import json

    from safetensors.torch import load_file

    from posttrain.config import RLConfig
    from posttrain.trainers.online import run_rl

    data, reward = _length_task(tmp_path)
    gates = []
    for coef in (0.0, 1.0):
        out = tmp_path / f"run{coef}"
        cfg = RLConfig(model=moe_dir, output_dir=str(out), max_steps=2, prompts_per_step=2,
                       data=data, reward=reward, group_size=4,
                       max_new_tokens=4, device="cpu", tensorboard=False, temperature=1.5,
                       lr=1e-2, log_every=1, router_aux_loss_coef=coef, eval_every=0)
        cfg.validate()
        run_rl(cfg)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        trained = [r for r in rows if "train/loss" in r]
        assert trained and all(("train/router_aux_loss" in r) == (coef > 0) for r in trained)
        w = load_file(str(out / "final" / "model.safetensors"))
        gates.append(w[next(k for k in w if k.endswith("gate.weight"))])
    assert not torch.equal(gates[0], gates[1])


def _moe_trainer(moe_dir, tmp_path, **kw):

    from posttrain.config import RLConfig
    from posttrain.trainers.online import RLTrainer

    data, reward = _length_task(tmp_path)
    cfg = RLConfig(**{"model": moe_dir, "output_dir": str(tmp_path / "run"), "max_steps": 2,
                      "prompts_per_step": 2, "data": data,
                      "reward": reward, "group_size": 4, "max_new_tokens": 4,
                      "device": "cpu", "tensorboard": False, "temperature": 1.5, "lr": 1e-2,
                      "log_every": 1, "eval_every": 0, **kw})
    cfg.validate()
    return RLTrainer(cfg)


def test_a_bfloat16_sampler_is_a_copy_that_follows_the_policy(moe_dir, tmp_path):
    """--rollout_dtype bfloat16 with the hf engine: the engine samples from a bfloat16 copy
    (the policy stays float32), every sync leaves the copy equal to the policy cast to
    bfloat16, the default correction truncates the importance weight, and the rollout's
    routing (recorded by the copy) is compared with the trainer's."""
    t = _moe_trainer(moe_dir, tmp_path, rollout_backend="hf", rollout_dtype="bfloat16")
    assert t.engine.model is not t.policy and not t.engine.shares_weights
    assert next(t.engine.model.parameters()).dtype == torch.bfloat16
    assert next(t.policy.parameters()).dtype == torch.float32
    assert t.correction.mode == "token_truncate" and not t.reuse.projections
    for step in (1, 2):
        values = t.step(step).values
        assert values["optim/steps"] >= 1 and 0 <= values["router/disagreement"] <= 1
        own = dict(t.engine.model.named_parameters())
        for name, p in t.policy.named_parameters():
            assert torch.equal(own[name], p.detach().to(torch.bfloat16)), name
    t.close()


def test_without_replay_the_rollouts_routing_is_compared_with_the_trainers(moe_dir,
                                                                           tmp_path):
    """--routing_replay none, one update per batch (no old pass): the update routes freely
    and its experts are compared with those the engine sampled with. The hf engine holds
    the policy itself, so at step 1 (the update's forward at the sampling weights) the two
    differ only where the router's top-k is a float tie: at most a few tokens of the
    hundreds routed; the routers are drawn to route decisively."""
    t = _moe_trainer(moe_dir, tmp_path, rollout_backend="hf")
    assert t.engine.shares_weights and "routing" in t.experience.extras
    values = t.step(1).values
    assert 0 <= values["router/disagreement"] <= 0.02
    t.close()


def test_routing_moved_counts_the_tokens_routed_elsewhere(moe):
    """compare's routing_moved: 0 between a model and itself; against a copy whose routers
    are negated every real token moves at the first router (its top experts become its
    bottom ones; later routers see other inputs, so they may or may not agree)."""
    import copy

    from posttrain.compare.moe import routing_moved

    ids, mask = batch()
    b = {"input_ids": ids, "attention_mask": mask}
    assert routing_moved(moe, moe, b) == 0.0
    other = copy.deepcopy(moe)
    with torch.no_grad():
        for r in routers(other):
            r.weight.neg_()
    # with E ≥ 2k experts, the k largest of −z are none of the k largest of z
    assert 1 / len(routers(moe)) <= routing_moved(moe, other, b) <= 1


@pytest.mark.parametrize(("engine", "reuse"), [("hf", True), ("hf", False), ("lean", True)])
def test_an_episodes_recording_covers_every_fed_token_of_its_transcript(moe_dir, tmp_path,
                                                                        engine, reuse):
    """R3 for episodes: each turn's engine call records the tokens it runs (with reused
    keys and values, only the turn's new tokens: the last sampled token, the message, the
    generation prompt), and the episode's recording over the whole transcript has, at every
    token but the last, the experts a plain forward of the transcript chooses (where the
    router's top-k is decisive: the reused keys and values are the decode steps' own, so
    routing agrees only up to float rounding)."""
    from posttrain.episodes import EnvSpec, EpisodeLimits, run_episodes
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.rollout import make_engine

    env = tmp_path / "envs.py"
    env.write_text("class Three:\n"
                   "    def __init__(self, row):\n        self.t = 0\n"
                   "    def reset(self):\n        return '1+2='\n"
                   "    def step(self, text):\n        self.t += 1\n"
                   "        return ('and 3+4=', 0.0, False) if self.t < 3 else "
                   "(None, 1.0, True)\n")
    model = load_causal_lm(moe_dir, device="cpu").eval()
    tok = load_tokenizer(moe_dir)
    eps = run_episodes(make_engine(engine, model, tok), tok, EnvSpec.parse(f"{env}:Three"),
                       [{}], 3, [5], SamplingParams(max_new_tokens=4, temperature=1.5),
                       EpisodeLimits(max_turns=3, max_episode_tokens=48), reuse=reuse,
                       extras=frozenset({"routing"}))
    ro = eps.rollout
    assert ro.routing is not None and int(eps.turns.max()) > 1
    _assert_recorded_as_a_plain_forward_routes(model, ro, every_fed=True)


def test_grpo_with_r3_on_episodes(moe_dir, tmp_path):
    """An episodic GRPO run with r3: the update routes through the experts the engine chose
    over every turn; at the sampling weights the trainer's own choice differs from them
    only at float ties."""
    import json

    from posttrain.config import RLConfig
    from posttrain.trainers.online import run_rl

    env = tmp_path / "envs.py"
    env.write_text("class Two:\n"
                   "    def __init__(self, row):\n        self.row, self.t = row, 0\n"
                   "    def reset(self):\n        return self.row['q']\n"
                   "    def step(self, text):\n        self.t += 1\n"
                   "        return ('again', 0.0, False) if self.t < 2 else "
                   "(None, float(len(text)), True)\n")
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"q": f"{i}+{i}="}) + "\n" for i in range(8)))
    cfg = RLConfig(model=moe_dir, output_dir=str(tmp_path / "run"), max_steps=2,
                   prompts_per_step=2, data=str(data), env=f"{env}:Two", group_size=4,
                   max_new_tokens=4, max_turns=2, max_episode_tokens=64, device="cpu",
                   tensorboard=False, temperature=1.5, lr=1e-2, log_every=1, eval_every=0,
                   routing_replay="r3", ppo_epochs=2, minibatch_size=4)
    cfg.validate()
    run_rl(cfg)
    rows = [json.loads(x) for x in
            (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2 and all(r["episodes/turns_mean"] == 2 for r in steps)
    assert all(0 <= r["router/disagreement"] <= 0.02 for r in steps)


def test_the_weight_stream_in_checkpoint_layout_is_what_save_pretrained_writes(moe,
                                                                              tmp_path):
    """What a serving engine loads: ``checkpoint_layout`` of the module-layout stream has
    exactly the names and tensors of the model's own saved checkpoint (per-expert tensors
    where the modules hold fused ones)."""
    from safetensors.torch import load_file

    from posttrain.models.weights import checkpoint_layout, hf_weights

    moe.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    got = dict(checkpoint_layout(moe, hf_weights(moe)))
    tied = {"lm_head.weight"} - got.keys() if moe.config.tie_word_embeddings else set()
    assert got.keys() | tied == saved.keys()
    assert any(".experts.0." in k for k in got)  # the experts came apart
    for name, t in got.items():
        assert torch.equal(t, saved[name]), name


def test_router_losses_are_the_familys_own_over_the_forwards_with_gradients(moe):
    """RouterLosses (the offline trainers' auxiliary loss): over a padded forward it is the
    family's load-balancing loss as the model computes it with output_router_logits, with a
    gradient to the routers; a forward under no_grad (a reference pass) adds nothing."""
    import sys

    from posttrain.models.routing import RouterLosses

    ids, mask = batch()
    with RouterLosses(moe) as losses:
        with torch.no_grad():
            moe(input_ids=ids, attention_mask=mask)
        out = moe(input_ids=ids, attention_mask=mask, output_router_logits=True)
        got = losses.loss()
    fn = sys.modules[type(moe).__module__].load_balancing_loss_func
    E, k = len(routers(moe)[0].weight), routers(moe)[0].top_k
    want = fn(out.router_logits, E, k, mask)
    # two float32 computations of one positive loss, each within _aux_rel_bound (~1e-5)
    assert torch.allclose(got, want, rtol=2 * _aux_rel_bound(out.router_logits, E, k), atol=0)
    got.backward()
    assert routers(moe)[0].weight.grad.abs().sum() > 0
    with RouterLosses(moe) as losses, torch.no_grad():
        moe(input_ids=ids, attention_mask=mask)
        assert losses.loss() is None


@pytest.mark.parametrize("command", ["sft", "rm", "dpo"])
def test_offline_trainers_take_the_auxiliary_loss(moe_dir, tmp_path, command):
    """SFT, RM and DPO on a Mixtral: --router_aux_loss_coef adds the family's loss (logged as
    train/router_aux_loss), so the routers end elsewhere than without it; none (the
    config's own, here 0) logs nothing; a weight for a dense model is one line."""
    import json

    from safetensors.torch import load_file

    from posttrain.cli import main

    gates = []
    for coef in ("0", "1.0"):
        out = tmp_path / f"{command}{coef}"
        assert main([command, "--model", moe_dir, "--output_dir", str(out), "--max_steps",
                     "2", "--batch_size", "4", "--builtin_train_size", "16",
                     "--builtin_eval_size", "4", "--lr", "1e-2", "--log_every", "1",
                     "--tensorboard", "false", "--router_aux_loss_coef", coef]) == 0
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        trained = [r for r in rows if "train/loss" in r]
        assert trained and all(("train/router_aux_loss" in r) == (coef != "0")
                               for r in trained)
        w = load_file(str(out / "final" / "model.safetensors"))
        gates.append(w[next(k for k in w if k.endswith("gate.weight"))])
    assert not torch.equal(gates[0], gates[1])


def test_an_auxiliary_weight_for_a_dense_model_is_one_line(tiny_model_dir, tmp_path, capsys):
    from posttrain.cli import main

    assert main(["sft", "--model", tiny_model_dir, "--output_dir", str(tmp_path / "o"),
                 "--max_steps", "1", "--router_aux_loss_coef", "0.1",
                 "--tensorboard", "false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "needs a mixture-of-experts model" in err[-1]
