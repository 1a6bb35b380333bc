"""``--parallel fsdp``: the trained models sharded with FSDP2 (``fully_shard``), the one
module that imports ``torch.distributed.fsdp``.

Each decoder layer is one FSDP unit and the rest of the model (embeddings, final norm,
head) the root unit: a rank holds 1/N of every parameter, gradient and AdamW state, and a
layer's full parameters exist only while that layer runs (all-gathered before its forward
and again before its backward, freed after). Gradients are reduce-scattered as sums (the
losses are already normalised by the whole step's counts, as under DDP), so N sharded ranks
compute the update of one process.

- **Precision.** On CUDA with ``--dtype bfloat16`` the sharded (master) parameters, their
  gradients and AdamW's states are float32 and each layer computes in bfloat16 (FSDP2's
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``); on the CPU, and for
  float32, everything is the loaded dtype.
- **CPU offload** (``--cpu_offload true``): the shards, gradients and optimiser states live
  in host memory; the device holds the layers being computed.
- **Lockstep.** Every forward and backward of a sharded model is a collective, so every rank
  runs the same number of them: the on-policy update pads a rank's micro-batches with
  zero-weight ones (:func:`lockstep`), evaluation with discarded batches.
- **What stays whole.** The frozen reference (and DPO's) is a plain replicated model (no
  collectives; its memory is not divided). The rollout engine samples from a plain copy of
  the policy whose weights are streamed into it once per RL step
  (``posttrain.models.weights.hf_weights``, one parameter gathered at a time): it costs one
  full copy of the weights per rank, and it lets the lean decoder run; the replay of its
  projections is off (the update's forward is sharded).
- **Checkpoints** hold full (gathered) model and optimiser states in the same format as an
  unsharded run, so a run resumes on any number of ranks and in either mode.
"""

from __future__ import annotations

import torch

from posttrain import dist


def is_sharded(model) -> bool:
    return bool(getattr(model, "posttrain_sharded", False))


def load_dtype(cfg, device: torch.device, adapted: bool | None = None) -> str:
    """The dtype to load trained weights in: float32 masters under FSDP on CUDA with
    bfloat16 (the layers compute in bfloat16), else ``cfg.dtype`` (and always for a model
    that gets LoRA adapters, ``adapted``, by default ``lora_rank > 0``: its base is frozen,
    with no masters to keep, and peft keeps the adapters in float32)."""
    if adapted is None:
        adapted = getattr(cfg, "lora_rank", 0) > 0
    if getattr(cfg, "parallel", "ddp") == "fsdp" and device.type == "cuda" \
            and cfg.dtype == "bfloat16" and not adapted:
        return "float32"
    return cfg.dtype


def shard(model: torch.nn.Module, cfg) -> torch.nn.Module:
    """``model`` sharded in place (the same object is returned): each decoder layer one
    FSDP unit, and the backbone together with the output embeddings (tied or not) and any
    other head one more, and the model the root. posttrain calls the backbone and the head
    directly (log-probs from hidden states, the prompt once per group), not the model's
    forward, so the units are the modules it calls."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    from posttrain.models.loading import decoder_layers

    device = next(model.parameters()).device
    if getattr(cfg, "cpu_offload", False) and device.type != "cuda":
        from posttrain.config import ConfigError

        raise ConfigError("cpu_offload moves FSDP's shards from a GPU to host memory; on "
                          f"{device.type} they are in host memory already: leave it off")
    mp = MixedPrecisionPolicy()
    if device.type == "cuda" and cfg.dtype == "bfloat16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if getattr(cfg, "cpu_offload", False) else OffloadPolicy()
    kw = {"mp_policy": mp, "offload_policy": offload}
    for layer in decoder_layers(model):
        fully_shard(layer, **kw)
    from posttrain.models.loading import backbone

    body = backbone(model)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    top = [body] + [m for _, m in inner.named_children() if m is not body
                    and any(True for _ in m.parameters())]
    fully_shard(top, **kw)
    fully_shard(model, **kw)  # the root (it holds whatever parameters the others do not)
    model.posttrain_sharded = True
    model.posttrain_device = device  # (offloaded shards report the host: see compute_device)
    with torch.no_grad():  # FSDP sets its units up on the root's first forward
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device))
    for m in model.modules():
        if isinstance(m, FSDPModule):  # sums: the losses carry the global normaliser
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    return model


def compute_device(model: torch.nn.Module) -> torch.device:
    """Where ``model`` computes: its parameters' device, or for a sharded model the device
    it was sharded from. With ``--cpu_offload`` the shards live in host memory between
    uses, so their device says ``cpu`` while every forward runs on the GPU."""
    return getattr(model, "posttrain_device", None) or next(model.parameters()).device


def lockstep(count: int, model) -> int:
    """The number of forward/backward calls every rank makes when this rank needs ``count``
    of them: the most any rank needs for a sharded ``model``, else ``count``."""
    if not is_sharded(model) or dist.world_size() == 1:
        return count
    import torch.distributed as td

    t = torch.tensor([count], dtype=torch.long, device=_comm_device())
    td.all_reduce(t, op=td.ReduceOp.MAX)
    return int(t)


def _comm_device() -> torch.device:
    import torch.distributed as td

    return torch.device("cuda", torch.cuda.current_device()) \
        if td.get_backend() == "nccl" else torch.device("cpu")


def full_tensor(x):
    """A sharded tensor (DTensor) gathered whole on every rank; anything else as it is."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def full_state(model) -> dict[str, torch.Tensor] | None:
    """The full state dict of a sharded model on rank 0, None on the others (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                              cpu_offload=True))
    if not dist.is_main():
        return None
    # a tied parameter once, under the name the model gives it (the gathered copies no
    # longer share memory, so save_pretrained would write both)
    keep = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    return {k: v for k, v in sd.items() if k in keep}


def full_optimizer_state(model, opt, params: list) -> dict | None:
    """A sharded model's optimiser state gathered whole, in ``opt.state_dict()``'s layout
    (parameters by position in ``params``) on rank 0, None on the others (collective)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    if not dist.is_main():
        return None
    index = {name: i for i, name in enumerate(_names(model, params))}
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]]
    return {"state": {index[n]: st for n, st in osd["state"].items()}, "param_groups": groups}


def load_optimizer_state(model, opt, params: list, sd: dict) -> None:
    """Load an ``opt.state_dict()``-layout state (full tensors, every rank) into the
    optimiser of a sharded model: each rank keeps its shard."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    names = _names(model, params)
    osd = {"state": {names[int(i)]: st for i, st in sd["state"].items()},
           "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                             "params": [names[int(i)] for i in g["params"]]}
                            for g in sd["param_groups"]]}
    set_optimizer_state_dict(model, opt, osd, options=StateDictOptions(full_state_dict=True))


def _names(model, params: list) -> list[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for p in params]
