"""Bradley–Terry and DPO-family losses against naive float64 formulas (ALGORITHMS.md §1, §2)."""

from __future__ import annotations

import math

import pytest
import torch

from bounds import assert_within, rel_bound, unit_roundoff
from posttrain.core.preference import bradley_terry_loss, dpo_loss

BATCHES = [1, 5, 16]


def _neg_log_sigmoid(z: float) -> float:
    """The textbook -log σ(z) = -log(1/(1+exp(-z))); only used where it is finite (|z| < 20)."""
    assert abs(z) < 20
    return -math.log(1.0 / (1.0 + math.exp(-z)))


def _sigmoid(z: float) -> float:
    """σ(z) in float64, written so neither branch overflows for |z| ≤ 700."""
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


# Tolerances: every loss here is a short chain of elementwise operations (no reduction), so
# its float error is u times the size of what each operation rounds, carried to the output by
# the chain's derivatives: the subtractions and β·(…) on |Δ| and |z|, softplus's exp and log1p
# (an ulp, 2u, each: 2u + 2u·loss), the square (2|q|·err q + u·q²). The float64 references
# add their own (u64 times the same, and 4u64·(1 + loss) for the naive −log(1/(1 + e^{−z}))).
# A 1% error, or a wrong sign or term, is ~10^4 times beyond these bounds.
U64 = unit_roundoff(torch.float64)


def _softplus_err(x, u):
    """softplus(x) = log1p(exp(x)) computed with error ≤ u·(2 + 2·softplus(x))."""
    return u * (2 + 2 * torch.nn.functional.softplus(x))


def _bt_bound(rc, rr, margin, center, dtype=torch.float32):
    """bradley_terry_loss and its gradient d/d r_c against the float64 formula, per pair."""
    u = unit_roundoff(dtype)
    c, r = rc.detach().double(), rr.detach().double()
    m = torch.zeros_like(c) if margin is None else torch.as_tensor(margin, dtype=torch.float64)
    diff, z = c - r, c - r - m
    err_z = u * (diff.abs() + z.abs() + m.abs())  # diff, − margin, the margin's own rounding
    sq = (c + r).square()
    loss = torch.nn.functional.softplus(-z) + center * sq
    err_loss = err_z + _softplus_err(-z, u) + center * 3 * u * sq + u * loss.abs()
    sig = torch.sigmoid(-z)
    grad = -sig + 2 * center * (c + r)
    err_grad = err_z / 4 + 3 * u * sig + 6 * u * center * (c + r).abs() + u * grad.abs()
    ref = U64 * (4 + loss.abs()) + U64 * (diff.abs() + z.abs() + 3 * center * sq + 4)
    return err_loss + ref, err_grad + 4 * U64 * (1 + grad.abs())


def _rewards(batch, seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, generator=g) * scale, torch.randn(batch, generator=g) * scale)


# --------------------------------------------------------------------------- Bradley–Terry


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("margin_kind", ["none", "scalar", "tensor"])
@pytest.mark.parametrize("center", [0.0, 0.05])
def test_bradley_terry_matches_formula(batch, margin_kind, center):
    """loss_i = -log σ(r_c - r_r - margin_i) + c (r_c + r_r)², per pair."""
    rc, rr = _rewards(batch, batch)
    margins = {"none": None, "scalar": 0.7,
               "tensor": torch.rand(batch, generator=torch.Generator().manual_seed(9))}
    margin = margins[margin_kind]
    loss, _ = bradley_terry_loss(rc, rr, margin=margin, center_coef=center)
    assert loss.shape == (batch,)
    expect = []
    for i in range(batch):
        m = 0.0 if margin is None else (margin if isinstance(margin, float) else float(margin[i]))
        c, r = float(rc[i]), float(rr[i])
        expect.append(_neg_log_sigmoid(c - r - m) + center * (c + r) ** 2)
    assert_within(loss, torch.tensor(expect, dtype=torch.float64), 1.0,
                  _bt_bound(rc, rr, margin, center)[0], "loss")


@pytest.mark.parametrize("batch", BATCHES)
def test_bradley_terry_metrics(batch):
    """accuracy = fraction of pairs with r_c > r_r; margin = mean(r_c - r_r), margin-free."""
    rc, rr = _rewards(batch, 100 + batch)
    _, metrics = bradley_terry_loss(rc, rr, margin=0.5)
    diffs = [float(c) - float(r) for c, r in zip(rc, rr, strict=True)]
    # k/B of a count: the float32 division rounds once
    assert float(metrics["accuracy"]) == pytest.approx(sum(d > 0 for d in diffs) / batch,
                                                       rel=unit_roundoff(), abs=0)
    # a float32 mean of B values: the sum within rel_bound(1, B) of Σ|x|, the division and
    # (for the margin) each subtraction one rounding more
    for key, values, extra in (("margin", diffs, 1), ("chosen_reward", rc.tolist(), 0),
                               ("rejected_reward", rr.tolist(), 0)):
        size = sum(map(abs, values)) / batch
        tol = (rel_bound(1, batch) + (1 + extra) * unit_roundoff()) * size
        assert float(metrics[key]) == pytest.approx(sum(values) / batch, abs=tol), key


def test_bradley_terry_metrics_by_hand():
    """Three pairs with margins 2, -1, 0: accuracy 1/3 (ties are not wins), mean margin 1/3.
    (Integers exact in float32; only the division by 3 rounds: pytest.approx's 1e-6 is ~17u.)"""
    rc = torch.tensor([3.0, 0.0, 1.0])
    rr = torch.tensor([1.0, 1.0, 1.0])
    _, metrics = bradley_terry_loss(rc, rr)
    assert float(metrics["accuracy"]) == pytest.approx(1 / 3)
    assert float(metrics["margin"]) == pytest.approx(1 / 3)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("center", [0.0, 0.1])
def test_bradley_terry_gradient(batch, center):
    """d loss/d r_c = -σ(-z) + 2c(r_c + r_r), d loss/d r_r = σ(-z) + 2c(r_c + r_r)."""
    rc, rr = _rewards(batch, 7 * batch)
    rc.requires_grad_(True)
    rr.requires_grad_(True)
    bradley_terry_loss(rc, rr, margin=0.3, center_coef=center)[0].sum().backward()
    gc, gr = [], []
    for c, r in zip(rc.tolist(), rr.tolist(), strict=True):
        s = _sigmoid(-(c - r - 0.3))
        gc.append(-s + 2 * center * (c + r))
        gr.append(s + 2 * center * (c + r))
    # d/d r_r = σ(−z) + 2c·s has the same error terms as d/d r_c = −σ(−z) + 2c·s, but its own
    # size in the last rounding: the bound at the larger of the two
    _, err = _bt_bound(rc, rr, 0.3, center)
    err = err + unit_roundoff() * torch.tensor(gr, dtype=torch.float64).abs()
    assert_within(rc.grad, torch.tensor(gc, dtype=torch.float64), 1.0, err, "d/d r_c")
    assert_within(rr.grad, torch.tensor(gr, dtype=torch.float64), 1.0, err, "d/d r_r")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_bradley_terry_extreme_margins(dtype):
    """Reward gaps ±200: loss ≈ 0 / 200, gradient σ(-z) ∈ {≈0, 1}, all finite."""
    rc = torch.tensor([100.0, -100.0, 0.0, 150.0], dtype=dtype, requires_grad=True)
    rr = torch.tensor([-100.0, 100.0, 0.0, -50.0], dtype=dtype, requires_grad=True)
    margin = torch.tensor([0.0, 0.0, 200.0, 0.0], dtype=dtype)  # z = 200, -200, -200, 200
    loss, _ = bradley_terry_loss(rc, rr, margin=margin)
    loss.sum().backward()
    z = [200.0, -200.0, -200.0, 200.0]
    expect = [max(-v, 0.0) + math.log1p(math.exp(-abs(v))) for v in z]  # stable -log σ(z)
    assert torch.isfinite(loss).all() and torch.isfinite(rc.grad).all()
    # computed in ``dtype`` (bf16 rounds every operation at 2^-8)
    err_loss, err_grad = _bt_bound(rc, rr, margin, 0.0, dtype)
    assert_within(loss, torch.tensor(expect, dtype=torch.float64), 1.0, err_loss, "loss")
    assert_within(rc.grad, torch.tensor([-_sigmoid(-v) for v in z], dtype=torch.float64), 1.0,
                  err_grad, "gradient")
    torch.testing.assert_close(rr.grad.double(), -rc.grad.double())


# --------------------------------------------------------------------------- DPO


def _dpo_inputs(batch, seed, spread=10.0):
    g = torch.Generator().manual_seed(seed)
    logps = [-torch.rand(batch, generator=g, dtype=torch.float64) * spread for _ in range(4)]
    lengths = [torch.randint(1, 40, (batch,), generator=g) for _ in range(2)]
    return [x.float() for x in logps], lengths


def _naive_dpo(logps, beta, loss_type, eps=0.0, lengths=None):
    """Per pair, in float64, straight from ALGORITHMS.md §2."""
    pc, pr, rc, rr = (x.double().tolist() for x in logps)
    out = []
    for i in range(len(pc)):
        if loss_type == "ipo":
            lc, lr = float(lengths[0][i]), float(lengths[1][i])
            dw, dl = (pc[i] - rc[i]) / lc, (pr[i] - rr[i]) / lr
        else:
            dw, dl = pc[i] - rc[i], pr[i] - rr[i]
        z = beta * (dw - dl)
        if loss_type == "sigmoid":
            out.append(_neg_log_sigmoid(z))
        elif loss_type == "robust":
            out.append((1 - eps) * _neg_log_sigmoid(z) + eps * _neg_log_sigmoid(-z))
        elif loss_type == "ipo":
            out.append((z / beta - 1 / (2 * beta)) ** 2)
        else:
            out.append(max(0.0, 1.0 - z))
    return torch.tensor(out, dtype=torch.float64)


def _dpo_bound(logps, beta, loss_type, eps=0.0, lengths=None, dtype=torch.float32):
    """dpo_loss and its gradient d/d log π(y_w) against the float64 formula, per pair."""
    u = unit_roundoff(dtype)
    pc, pr, rc, rr = (x.detach().double() for x in logps)
    dw, dl = pc - rc, pr - rr
    k = 1
    if loss_type == "ipo":
        lc, lr = (x.double().clamp_min(1) for x in lengths)
        dw, dl, k = dw / lc, dl / lr, 2  # the division rounds once more
    z = beta * (dw - dl)
    # Δ's rounding(s), their difference, β's own rounding and the product
    err_z = u * (beta * (k * (dw.abs() + dl.abs()) + (dw - dl).abs()) + 2 * z.abs())
    sig = torch.sigmoid(-z)
    sp = torch.nn.functional.softplus
    if loss_type == "sigmoid":
        loss, dz = sp(-z), -sig
        err_loss, err_dz = err_z + _softplus_err(-z, u), err_z / 4 + 3 * u * sig
    elif loss_type == "robust":
        loss = (1 - eps) * sp(-z) + eps * sp(z)
        dz = -(1 - eps) * sig + eps * (1 - sig)
        err_loss = err_z + _softplus_err(-z, u) + _softplus_err(z, u) + 3 * u * loss.abs()
        err_dz = err_z / 4 + 6 * u
    elif loss_type == "ipo":
        q = z / beta - 1 / (2 * beta)
        err_q = err_z / beta + u * (3 * (z / beta).abs() + 1 / (2 * beta) + q.abs())
        loss, dz = q.square(), 2 * q / beta
        err_loss = 2 * q.abs() * err_q + u * loss
        err_dz = (2 * err_q + 3 * u * 2 * q.abs()) / beta
    else:
        loss, dz = torch.relu(1 - z), -(z < 1).double()
        err_loss, err_dz = (err_z + u * (1 - z).abs()) * (z < 1), torch.zeros_like(z)
    ref = 4 * U64 * (1 + loss.abs()) + U64 / u * err_loss
    grad = beta * dz
    err_grad = beta * err_dz + 2 * u * grad.abs()  # times β, and β's rounding
    return err_loss + ref, err_grad + U64 / u * err_grad + 4 * U64 * grad.abs()


CASES = [("sigmoid", 0.0), ("robust", 0.1), ("robust", 0.3), ("ipo", 0.0), ("hinge", 0.0)]


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("loss_type, eps", CASES)
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_matches_formula(batch, loss_type, eps, beta):
    """Each loss type equals its naive formula on random sequence log-likelihoods."""
    logps, lengths = _dpo_inputs(batch, batch + int(beta * 10))
    loss, _ = dpo_loss(*logps, beta=beta, loss_type=loss_type, label_smoothing=eps,
                       chosen_lengths=lengths[0], rejected_lengths=lengths[1])
    assert loss.shape == (batch,)
    expect = _naive_dpo(logps, beta, loss_type, eps, lengths)
    assert_within(loss, expect, 1.0, _dpo_bound(logps, beta, loss_type, eps, lengths)[0],
                  loss_type)


def test_dpo_robust_without_smoothing_is_sigmoid():
    """robust with label_smoothing = 0 is plain DPO."""
    logps, _ = _dpo_inputs(8, 1)
    robust, _ = dpo_loss(*logps, beta=0.2, loss_type="robust", label_smoothing=0.0)
    sigmoid, _ = dpo_loss(*logps, beta=0.2, loss_type="sigmoid")
    torch.testing.assert_close(robust, sigmoid, rtol=0, atol=0)


def test_dpo_ipo_uses_length_average():
    """IPO with every length 1 equals (Δw - Δl - 1/(2β))² on the raw sums; lengths 2 halve Δ."""
    pc, pr = torch.tensor([-4.0]), torch.tensor([-10.0])
    rc, rr = torch.tensor([-6.0]), torch.tensor([-9.0])  # Δw = 2, Δl = -1
    one, two = torch.tensor([1]), torch.tensor([2])
    loss1, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="ipo",
                        chosen_lengths=one, rejected_lengths=one)
    # small integers and halves, exact in float32 (β = 0.5, 1/(2β) = 1): pytest.approx's
    # 1e-6 only covers the one rounding of a division by 2
    assert float(loss1) == pytest.approx((3.0 - 1.0) ** 2)
    loss2, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="ipo",
                        chosen_lengths=two, rejected_lengths=one)
    assert float(loss2) == pytest.approx((1.0 + 1.0 - 1.0) ** 2)


@pytest.mark.parametrize("missing", ["both", "chosen", "rejected"])
def test_dpo_ipo_without_lengths_raises(missing):
    """IPO needs both length tensors."""
    logps, (lc, lr) = _dpo_inputs(3, 0)
    kwargs = {"both": {}, "chosen": {"rejected_lengths": lr}, "rejected": {"chosen_lengths": lc}}
    with pytest.raises(ValueError, match="length"):
        dpo_loss(*logps, loss_type="ipo", **kwargs[missing])


def test_dpo_unknown_loss_type_raises():
    """An unknown loss type is an error, not a silent fallback."""
    logps, _ = _dpo_inputs(3, 0)
    with pytest.raises(ValueError, match="kto"):
        dpo_loss(*logps, loss_type="kto")


def _naive_dpo_torch(pc, pr, rc, rr, beta, loss_type, eps, lc, lr):
    """The §2 formulas written plainly with torch ops (float64), for autograd comparison."""
    if loss_type == "ipo":
        dw, dl = (pc - rc) / lc, (pr - rr) / lr
    else:
        dw, dl = pc - rc, pr - rr
    z = beta * (dw - dl)

    def nls(v):
        return -torch.log(1 / (1 + torch.exp(-v)))

    if loss_type == "sigmoid":
        return nls(z)
    if loss_type == "robust":
        return (1 - eps) * nls(z) + eps * nls(-z)
    if loss_type == "ipo":
        return (z / beta - 1 / (2 * beta)) ** 2
    return torch.clamp(1 - z, min=0)


@pytest.mark.parametrize("loss_type, eps", CASES)
def test_dpo_gradients(loss_type, eps):
    """Policy gradients equal autograd of the naive formula; references get no gradient."""
    logps, (lc, lr) = _dpo_inputs(6, 3)
    pc, pr, rc, rr = (x.double().requires_grad_(True) for x in logps)
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=0.3, loss_type=loss_type, label_smoothing=eps,
                       chosen_lengths=lc, rejected_lengths=lr)
    w = torch.rand(6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (loss * w).sum().backward()
    assert rc.grad is None and rr.grad is None
    qc, qr = (x.detach().clone().requires_grad_(True) for x in (pc, pr))
    naive = _naive_dpo_torch(qc, qr, rc.detach(), rr.detach(), 0.3, loss_type, eps,
                             lc.double(), lr.double())
    (naive * w).sum().backward()
    # two float64 paths, twice the float64 bound of each (times the weights ≤ 1); the naive
    # −log(1/(1 + e^{−z})) differentiates through 4 more roundings of size ≤ 1 each
    logps64 = [x.double() for x in logps]
    _, err = _dpo_bound(logps64, 0.3, loss_type, eps, (lc, lr), torch.float64)
    err = 2 * err + 8 * U64 * 0.3
    assert_within(pc.grad, qc.grad, 1.0, err, "d/d log π(y_w)")
    assert_within(pr.grad, qr.grad, 1.0, err + 2 * U64 * qr.grad.abs(), "d/d log π(y_l)")


def test_dpo_sigmoid_gradient_analytic():
    """d/d log π(y_w) = -β σ(-z), d/d log π(y_l) = +β σ(-z), for plain DPO in float32."""
    logps, _ = _dpo_inputs(5, 4)
    pc, pr = (x.clone().requires_grad_(True) for x in logps[:2])
    beta = 0.1
    dpo_loss(pc, pr, logps[2], logps[3], beta=beta)[0].sum().backward()
    rows = zip(*(x.tolist() for x in logps), strict=True)
    z = [beta * ((a - c) - (b - d)) for a, b, c, d in rows]
    s = torch.tensor([beta * _sigmoid(-v) for v in z], dtype=torch.float64)
    _, err = _dpo_bound(logps, beta, "sigmoid")
    assert_within(pc.grad, -s, 1.0, err, "d/d log π(y_w)")
    assert_within(pr.grad, s, 1.0, err, "d/d log π(y_l)")


@pytest.mark.parametrize("loss_type, eps", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dpo_extreme_margins_are_finite(loss_type, eps, dtype):
    """z = ±200 (β = 0.1, log-ratio gap ±2000): correct finite losses and gradients."""
    beta = 0.1
    pc = torch.tensor([0.0, -2000.0], dtype=dtype, requires_grad=True)
    pr = torch.tensor([-2000.0, 0.0], dtype=dtype, requires_grad=True)
    ref = torch.zeros(2, dtype=dtype, requires_grad=True)
    one = torch.ones(2, dtype=torch.long)
    loss, _ = dpo_loss(pc, pr, ref, ref, beta=beta, loss_type=loss_type,
                       label_smoothing=eps, chosen_lengths=one, rejected_lengths=one)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(pc.grad).all()
    assert torch.isfinite(pr.grad).all() and ref.grad is None
    z = [200.0, -200.0]

    def stable_nls(v):
        return max(-v, 0.0) + math.log1p(math.exp(-abs(v)))

    if loss_type == "sigmoid":
        expect = [stable_nls(v) for v in z]                       # ≈ [0, 200]
        dz = [-_sigmoid(-v) for v in z]                           # ≈ [0, -1]
    elif loss_type == "robust":
        expect = [(1 - eps) * stable_nls(v) + eps * stable_nls(-v) for v in z]
        dz = [-(1 - eps) * _sigmoid(-v) + eps * _sigmoid(v) for v in z]
    elif loss_type == "ipo":
        expect = [(v / beta - 1 / (2 * beta)) ** 2 for v in z]   # (±2000 - 5)²
        dz = [2 * (v / beta - 1 / (2 * beta)) / beta for v in z]
    else:
        expect = [max(0.0, 1 - v) for v in z]                     # [0, 201]
        dz = [-1.0 if v < 1 else 0.0 for v in z]
    # every operation rounds in ``dtype`` (bf16: 2^-8, β = 0.1 itself among them)
    err_loss, err_grad = _dpo_bound([pc, pr, ref, ref], beta, loss_type, eps, (one, one),
                                    dtype)
    assert_within(loss, torch.tensor(expect, dtype=torch.float64), 1.0, err_loss, "loss")
    assert_within(pc.grad, torch.tensor([beta * d for d in dz], dtype=torch.float64), 1.0,
                  err_grad, "gradient")
    torch.testing.assert_close(pr.grad.double(), -pc.grad.double())


def test_dpo_metrics_by_hand():
    """Δw = [1, 0, 0], Δl = [-1, 1, 0], β = 0.5: rewards [0.5, 0, 0] and [-0.5, 0.5, 0];
    the tie in the third pair is not a win."""
    pc, pr = torch.tensor([-1.0, -2.0, -2.0]), torch.tensor([-3.0, -1.0, -2.0])
    rc, rr = torch.tensor([-2.0, -2.0, -2.0]), torch.tensor([-2.0, -2.0, -2.0])
    _, m = dpo_loss(pc, pr, rc, rr, beta=0.5)
    # halves and integers exact in float32; the mean's division by 3 rounds once (approx: 1e-6)
    assert float(m["chosen_reward"]) == pytest.approx(0.5 / 3)
    assert float(m["rejected_reward"]) == pytest.approx(0.0)
    assert float(m["reward_accuracy"]) == pytest.approx(1 / 3)
    assert float(m["reward_margin"]) == pytest.approx(0.5 / 3)  # mean of [1.0, -0.5, 0.0]


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge"])
def test_dpo_metrics_random(batch, loss_type):
    """Implicit-reward metrics equal loops over β Δ, whatever the loss type."""
    logps, _ = _dpo_inputs(batch, 50 + batch)
    beta = 0.2
    policy = [x.clone().requires_grad_(True) for x in logps[:2]]
    _, m = dpo_loss(*policy, *logps[2:], beta=beta, loss_type=loss_type)
    pc, pr, rc, rr = (x.double().tolist() for x in logps)
    cw = [beta * (a - b) for a, b in zip(pc, rc, strict=True)]
    cl = [beta * (a - b) for a, b in zip(pr, rr, strict=True)]
    # per pair Δ and β·Δ round (with β itself) on ≤ 3|βΔ|; the float32 mean of B of them within
    # rel_bound(1, B) of Σ|βΔ|, its division once more, the margin's difference once more
    u = unit_roundoff()

    def tol(values, roundings):
        size = sum(map(abs, values)) / batch
        return (rel_bound(1, batch) + (roundings + 1) * u) * size

    assert float(m["chosen_reward"]) == pytest.approx(sum(cw) / batch, abs=tol(cw, 3))
    assert float(m["rejected_reward"]) == pytest.approx(sum(cl) / batch, abs=tol(cl, 3))
    assert float(m["reward_accuracy"]) == pytest.approx(
        sum(a > b for a, b in zip(cw, cl, strict=True)) / batch)
    assert float(m["reward_margin"]) == pytest.approx(
        sum(a - b for a, b in zip(cw, cl, strict=True)) / batch, abs=tol(cw + cl, 4))
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())  # detached metrics
