"""The input embedding trained by rows (``posttrain.fast.sparse_rows``): AdamW over sparse row
gradients, with states only for rows that have had one, gives dense AdamW's weights (float64:
to its rounding; float32: within the float32 bound of a float64 reference), across the switch
to dense states, with clipping, and through checkpoints written either way."""

from __future__ import annotations

import pytest
import torch

from bounds import (
    assert_within,
    grad_term_scales,
    model_inner,
    model_stages,
    pair_bound,
    unit_roundoff,
)
from posttrain.fast import sparse_rows
from posttrain.trainers.loop import Optim
from posttrain.trainers.loop import checkpoint as ckpt

V, H, STEPS = 40, 6, 10
BETAS = (0.9, 0.999)


def _batches(seed: int = 0) -> list[torch.Tensor]:
    """Token ids per step with duplicates; rows 0-2 appear in the first step only (their states
    must keep decaying and moving them afterwards), row 3 in every step."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.tensor([0, 1, 2, 2, 3])]
    for _ in range(STEPS - 1):
        out.append(torch.cat([torch.randint(5, V, (6,), generator=g), torch.tensor([3, 3])]))
    return out


def _run(optim_cls, sparse: bool, dtype, wd: float, steps: int = STEPS, state=None,
         start: int = 0, weights=None):
    """Train an embedding on ``sum(c_i * e[id_i])`` (coefficients spanning 1e-6..1e4: tiny
    and large gradients); returns the weights, the optimiser and the largest update ratio
    |m̂/(√v̂+ε)| seen (for the error bound)."""
    torch.manual_seed(1)
    emb = torch.nn.Embedding(V, H, sparse=sparse).to(dtype)
    if weights is not None:
        with torch.no_grad():
            emb.weight.copy_(weights)
    opt = optim_cls([emb.weight], lr=1e-2, betas=BETAS, weight_decay=wd,
                    **({"foreach": False} if optim_cls is torch.optim.AdamW else {}))
    if state is not None:
        opt.load_state_dict(state)
    g = torch.Generator().manual_seed(7)
    coefs = [(torch.logspace(-6, 4, 8, dtype=torch.float64)[
        torch.randint(0, 8, (len(b), H), generator=g)]
        * torch.randn(len(b), H, generator=g, dtype=torch.float64)).to(dtype) for b in _batches()]
    for t, (ids, c) in enumerate(zip(_batches(), coefs, strict=False)):
        if t < start or t >= steps:
            continue
        for group in opt.param_groups:
            group["lr"] = 1e-2 * (1 + t) / STEPS  # a schedule: the rate changes every step
        (emb(ids) * c).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return emb.weight.detach(), opt


def _bound(reference: torch.Tensor, steps: int) -> float:
    """Float32 against float64: each step rounds the weight (|p|·u per op, a few ops) and an
    update of at most lr·r, with r = |m̂|/(√v̂+ε) ≤ 1/√(1-β2) for Adam, computed in a
    few dependent ops whose relative errors add up over the steps' states."""
    u = unit_roundoff(torch.float32)
    r = 1 / (1 - BETAS[1]) ** 0.5
    return steps * 16 * u * (float(reference.abs().max()) + 1e-2 * r * steps)


@pytest.mark.parametrize("dense_from", [0.5, 2.0], ids=["turns-dense", "rows-only"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_row_adamw_equals_dense_adamw(dense_from, wd, monkeypatch):
    monkeypatch.setattr(sparse_rows, "DENSE_FROM", dense_from)
    ref64, _ = _run(torch.optim.AdamW, False, torch.float64, wd)
    rows64, opt = _run(sparse_rows.AdamW, True, torch.float64, wd)
    st = next(iter(opt.state.values()))
    assert ("rows" in st) == (dense_from > 1)  # the path the case is named after
    if "rows" in st:  # untouched rows hold no state
        assert len(st["rows"]) < V and st["exp_avg"].shape == (len(st["rows"]), H)
    assert torch.allclose(rows64, ref64, rtol=0, atol=64 * torch.finfo(torch.float64).eps
                          * float(ref64.abs().max()) * STEPS)
    rows32, _ = _run(sparse_rows.AdamW, True, torch.float32, wd)
    dense32, _ = _run(torch.optim.AdamW, False, torch.float32, wd)
    bound = _bound(ref64, STEPS)
    assert (rows32.double() - ref64).abs().max() <= bound
    assert (dense32.double() - ref64).abs().max() <= bound


def test_a_row_that_was_never_touched_never_moves():
    before = torch.nn.Embedding(V, H).to(torch.float64).weight.detach().clone()
    after, _opt = _run(sparse_rows.AdamW, True, torch.float64, 0.0, weights=before)
    seen = torch.unique(torch.cat(_batches()))
    unseen = torch.ones(V, dtype=torch.bool)
    unseen[seen] = False
    assert unseen.any() and torch.equal(after[unseen], before[unseen])
    assert not torch.equal(after[seen], before[seen])


@pytest.mark.parametrize("dense_from", [0.5, 2.0], ids=["turns-dense", "rows-only"])
def test_a_rows_checkpoint_resumes_exactly_and_loads_into_a_dense_optimiser(dense_from,
                                                                             monkeypatch,
                                                                             tmp_path):
    monkeypatch.setattr(sparse_rows, "DENSE_FROM", dense_from)
    whole, _ = _run(sparse_rows.AdamW, True, torch.float64, 0.1)
    half, opt = _run(sparse_rows.AdamW, True, torch.float64, 0.1, steps=5)
    ckpt.save_optimizer(opt.state_dict(), tmp_path / "opt")
    sd = ckpt.read_optimizer(tmp_path / "opt")
    again, _ = _run(sparse_rows.AdamW, True, torch.float64, 0.1, state=sd, start=5,
                    weights=half)
    assert torch.equal(again, whole)  # the same operations in the same order
    # the same checkpoint continued with dense gradients (fast turned off)
    dense, _ = _run(sparse_rows.AdamW, False, torch.float64, 0.1,
                    state=ckpt.read_optimizer(tmp_path / "opt"), start=5, weights=half)
    assert torch.allclose(dense, whole, rtol=0, atol=1e-12)
    # and a dense run's checkpoint continued with row gradients
    dhalf, dopt = _run(torch.optim.AdamW, False, torch.float64, 0.1, steps=5)
    ckpt.save_optimizer(dopt.state_dict(), tmp_path / "dense")
    rows, _ = _run(sparse_rows.AdamW, True, torch.float64, 0.1,
                   state=ckpt.read_optimizer(tmp_path / "dense"), start=5, weights=dhalf)
    assert torch.allclose(rows, whole, rtol=0, atol=1e-12)


def _tiny(tied: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied))


def test_only_an_untied_trainable_embedding_gets_row_gradients():
    assert sparse_rows.sparse_embedding_gradients(_tiny(tied=True)) is None
    frozen = _tiny(tied=False)
    frozen.get_input_embeddings().weight.requires_grad_(False)
    assert sparse_rows.sparse_embedding_gradients(frozen) is None
    model = _tiny(tied=False)
    w = sparse_rows.sparse_embedding_gradients(model)
    assert w is model.get_input_embeddings().weight
    dense = _tiny(tied=False)
    ids = torch.tensor([[5, 9, 5, 200, 7]])
    # the scale of the terms the dense gradient sums: one per predicted token of the mean loss
    logits = dense(input_ids=ids).logits[0, :-1]
    terms = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none") / 4
    (scale,) = grad_term_scales(terms, [dense.get_input_embeddings().weight])
    for m in (model, dense):
        m(input_ids=ids, labels=ids).loss.backward()
    g, want = w.grad, dense.get_input_embeddings().weight.grad
    # two float32 backwards of the same model (the rows' gradient summed per row rather than
    # scattered into the dense table): within pair_bound of the per-token terms; a row
    # missing one token's term (~1e-2 of the scale here) is far outside
    bound = pair_bound(model_stages(dense.config) + 1, model_inner(dense.config, ids.numel()))
    assert g.is_sparse
    assert_within(g.to_dense(), want, bound, scale, "embedding gradient")


@pytest.mark.parametrize("max_grad_norm", [0.0, 1e-3])
def test_the_optimiser_with_row_gradients_clips_and_steps_as_the_dense_one(max_grad_norm):
    models = [_tiny(tied=False).double() for _ in range(2)]
    opts = [Optim("model", m, 1e-2, 0.0, max_grad_norm, sparse_embedding=rows)
            for m, rows in zip(models, (True, False), strict=False)]
    assert opts[0].rows is not None and opts[1].rows is None
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 300, (2, 7), generator=g)
        norms = []
        for m, o in zip(models, opts, strict=False):
            m(input_ids=ids, labels=ids).loss.backward()
            norms.append(o._apply())
        assert norms[0] == pytest.approx(norms[1], rel=1e-12)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=False):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    assert "rows" in opts[0].opt.state[opts[0].rows]


def test_a_nonfinite_row_gradient_stops_the_step():
    from posttrain.trainers.loop.guards import NonFiniteError

    model = _tiny(tied=False)
    opt = Optim("model", model, 1e-2, 0.0, 1.0, sparse_embedding=True)
    ids = torch.tensor([[1, 2, 3]])
    (model(input_ids=ids, labels=ids).loss * float("inf")).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteError):
        opt._apply()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=False))


@pytest.fixture(scope="module")
def untied_model_dir(tmp_path_factory) -> str:
    from posttrain.builtin.build import init_model

    out = tmp_path_factory.mktemp("untied")
    init_model(out, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    return str(out)


@pytest.mark.parametrize("command", [
    ["dpo", "--batch_size", "4", "--builtin_train_size", "32", "--precompute_ref", "false"],
    ["grpo", "--prompts_per_step", "2", "--group_size", "4", "--max_new_tokens", "4",
     "--builtin_train_size", "16"]], ids=["dpo", "grpo"])
def test_a_run_trains_the_embedding_by_rows_and_resumes_exactly(command, untied_model_dir,
                                                                 tmp_path):
    from safetensors.torch import load_file

    from posttrain.cli import main

    args = [*command, "--model", untied_model_dir, "--max_steps", "4", "--save_every", "2",
            "--lr_schedule", "constant", "--warmup_ratio", "0", "--builtin_eval_size", "4",
            "--device", "cpu", "--tensorboard", "false"]
    whole, again = tmp_path / "whole", tmp_path / "again"
    assert main([*args, "--output_dir", str(whole)]) == 0
    state = load_file(str(next((whole / "checkpoint-2").glob("optimizer*.safetensors"))))
    rows = [k for k in state if k.endswith(".rows")]
    assert len(rows) == 1 and 0 < len(state[rows[0]]) < 300  # by rows, few of them
    assert main([*args, "--output_dir", str(again), "--resume_from",
                 str(whole / "checkpoint-2")]) == 0
    a = load_file(str(whole / "final" / "model.safetensors"))
    b = load_file(str(again / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_rows_state_written_out_dense_is_the_dense_optimisers(monkeypatch, tmp_path):
    """What a sharded model's loader gets from a one-process checkpoint."""
    monkeypatch.setattr(sparse_rows, "DENSE_FROM", 2.0)
    _, rows_opt = _run(sparse_rows.AdamW, True, torch.float64, 0.1, steps=5)
    _, dense_opt = _run(torch.optim.AdamW, False, torch.float64, 0.1, steps=5)
    ckpt.save_optimizer(rows_opt.state_dict(), tmp_path / "opt")
    params = [p for g in rows_opt.param_groups for p in g["params"]]
    sd = sparse_rows.dense_state_dict(ckpt.read_optimizer(tmp_path / "opt"), params)
    want = dense_opt.state_dict()["state"][0]
    got = sd["state"][0]
    assert "rows" not in got
    for k in ("exp_avg", "exp_avg_sq"):
        assert got[k].shape == want[k].shape
        assert torch.allclose(got[k], want[k], rtol=1e-12, atol=0)
