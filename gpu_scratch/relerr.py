import copy, torch
from posttrain.modeling import load_causal_lm, completion_logprobs, compile_pointwise_blocks
from posttrain.data import pad_sequences
for dtype in ("float32", "bfloat16"):
    e = load_causal_lm("builtin", dtype=dtype, device="cuda"); f = copy.deepcopy(e); compile_pointwise_blocks(f)
    b = {k: v.cuda() for k, v in pad_sequences([[5, 6, 7], [8, 9]] * 2, [[20, 21], [22], [23, 24, 25], [30]], 0).items()}
    o = []
    for m in (e, f):
        lp = completion_logprobs(m, b["input_ids"], b["attention_mask"], b["loss_mask"]); lp.sum().backward()
        o.append([lp.detach().float()] + [p.grad.float() for p in m.parameters()])
    r = [((x - y).norm() / y.norm().clamp_min(1e-12)).item() for x, y in zip(o[1], o[0])]
    print(dtype, "max rel err norm", max(r), "logprobs", r[0])
