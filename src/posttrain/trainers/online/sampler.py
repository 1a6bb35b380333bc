"""The trainer's side of its rollout engine: what the engine samples from, building it
(one line and exit 2 for a backend that cannot run here), and the weight-sync guard with
its probe."""

from __future__ import annotations

import copy

import torch

from posttrain.config import ConfigError
from posttrain.models import lora
from posttrain.rollout import Request, SamplingParams, make_engine
from posttrain.rollout.guard import SyncGuard


def sampler_module(cfg, policy, sharded: bool):
    """What an in-process engine samples from: the policy itself (with LoRA the lean decoder
    merges the adapters into its per-call weights), or a plain copy of it that each sync
    overwrites from the weight stream, where the run is sharded (the copy in the run's
    dtype, not FSDP's masters') or ``rollout_dtype`` asks for another dtype (the copy in
    that one), or rollouts are asynchronous (the engine samples from an older version while
    the learner updates); with LoRA the copy's adapted layers are merged, as the stream
    sends them.
    None for vllm and vllm_server: the engine holds its own copy."""
    if cfg.vllm_engine:
        return None
    dtype = getattr(torch, cfg.rollout_dtype if cfg.samples_in_own_dtype else cfg.dtype)
    if not (sharded or cfg.samples_in_own_dtype or cfg.async_staleness):
        return policy
    if lora.is_adapted(policy):
        plain = lora.plain_copy(policy)  # (it shares the frozen base tensors with the policy)
        return (copy.deepcopy(plain).to(dtype) if cfg.samples_in_own_dtype else plain).eval()
    return copy.deepcopy(policy).to(dtype).eval()


def build_engine(cfg, policy, sampler, tokenizer):
    """The rollout engine: on the policy itself (unsharded lean / hf), on the sharded run's
    plain copy ``sampler``, or vLLM started from the policy's weights (its own copy)."""
    options = None
    if cfg.rollout_backend == "vllm":
        from posttrain.rollout.vllm import VLLMOptions

        options = VLLMOptions(cfg.rollout_dtype, cfg.vllm_kv_cache_gb,
                              cfg.vllm_gpu_memory_utilization, cfg.vllm_sleep,
                              cfg.vllm_tensor_parallel_size, cfg.max_length, cfg.seed)
    source = sampler if sampler is not None else policy
    if cfg.rollout_backend == "vllm_server":
        return server_engine(cfg, policy, tokenizer)
    try:
        return make_engine(cfg.rollout_backend, source, tokenizer, cfg.fast,
                           shares_weights=source is policy, options=options)
    except ValueError as e:  # a backend that cannot run this model
        raise ConfigError(str(e)) from None
    except RuntimeError as e:  # not installed, or it cannot load the model
        if type(e).__name__ == "EngineUnavailable":
            raise ConfigError(f"rollout_backend=vllm: {e}") from None
        raise


def server_engine(cfg, policy, tokenizer):
    """The ``vllm_server`` engine over the servers ``rollout_servers`` names, or over
    ``launch_rollout_servers`` servers started now (owned by the engine, stopped with it;
    under torchrun rank 0 starts and owns them, and every rank samples from them)."""
    import os

    from posttrain.rollout.vllm_server import ServerOptions, VLLMServerEngine

    dtype = getattr(torch, cfg.rollout_dtype if cfg.samples_in_own_dtype else cfg.dtype)
    fleet = None
    if cfg.launch_rollout_servers:
        fleet, key, urls = _launch(cfg, policy, tokenizer, dtype)
    else:
        key = os.environ.get("POSTTRAIN_ROLLOUT_KEY")
        urls = cfg.server_urls
    options = ServerOptions(urls, key, cfg.rollout_timeout,
                            dtype=str(dtype).removeprefix("torch."),
                            startup_timeout=cfg.rollout_server_startup,
                            adapter="posttrain-policy" if cfg.lora_push == "adapter" else None,
                            transfer=cfg.rollout_transfer, address=_nccl_address(urls)
                            if cfg.rollout_transfer == "nccl" else "127.0.0.1")
    try:
        return VLLMServerEngine(policy, tokenizer, options, fleet)
    except BaseException:
        if fleet is not None:
            fleet.close()
        raise


def _nccl_address(urls: list[str]) -> str:
    """Where the servers reach rank 0 for the NCCL transport (``rollout_transfer``): the
    loopback when all are local, else POSTTRAIN_NCCL_ADDRESS, else this host's address on
    the route to the first remote server (a host name can resolve to a loopback address)."""
    import os
    import socket
    import urllib.parse

    from posttrain.rollout.server_calls import is_local

    remote = [u for u in urls if not is_local(u)]
    if not remote:
        return "127.0.0.1"
    if os.environ.get("POSTTRAIN_NCCL_ADDRESS"):
        return os.environ["POSTTRAIN_NCCL_ADDRESS"]
    url = urllib.parse.urlsplit(remote[0])
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((url.hostname, url.port or 80))  # (sends nothing: picks the route)
            return s.getsockname()[0]
    except OSError as e:
        raise ValueError(f"rollout_transfer nccl: no route to {remote[0]} to take this "
                         f"host's address from ({e}); set POSTTRAIN_NCCL_ADDRESS") from None


def _launch(cfg, policy, tokenizer, dtype):
    """``(fleet, key, urls)`` of the servers this run starts: rank 0 starts them (its fleet;
    None on the other ranks) and sends every rank their addresses and key, or its error."""
    import json
    import secrets
    from pathlib import Path

    from posttrain import dist
    from posttrain.rollout.fleet import Fleet
    from posttrain.rollout.server_calls import shared_value

    fleet = error = None
    message = ""
    if dist.is_main():
        key = secrets.token_urlsafe(24)
        longest = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
        try:
            fleet = Fleet(policy, tokenizer, cfg.launch_rollout_servers, key,
                          Path(cfg.output_dir) / "rollout-servers", dtype=dtype,
                          max_model_len=longest, devices=cfg.server_devices,
                          extra_args=cfg.rollout_server_args,
                          kv_cache_gb=cfg.vllm_kv_cache_gb, seed=cfg.seed,
                          lora_rank=cfg.lora_rank if cfg.lora_push == "adapter" else None,
                          transfer=cfg.rollout_transfer)
            message = json.dumps({"key": key, "urls": fleet.urls})
        except BaseException as e:  # (the other ranks wait for the message: send it)
            error = e
            message = json.dumps({"error": f"{type(e).__name__}: {e}"})
    got = json.loads(shared_value(message))  # (rank 0's, on every rank)
    if error is not None:
        raise error
    if "error" in got:
        raise RuntimeError(f"rank 0 could not start the rollout servers: {got['error']}")
    return fleet, got["key"], got["urls"]


def make_guard(cfg, engine, policy, prompts: list[tuple[int, ...]]) -> SyncGuard | None:
    """The guard of an engine with weights of its own (None for one that decodes with the
    policy itself, or with ``sync_guard`` off). Its probe: ``prompts`` and the engine's
    greedy completions of them, scored now, while both hold the same weights."""
    if not cfg.sync_guard or engine.shares_weights or not hasattr(engine, "dtype"):
        return None
    ro = engine.generate([Request(p) for p in prompts], 1, SamplingParams(
        temperature=0.0, max_new_tokens=cfg.max_new_tokens))
    return SyncGuard(engine, policy, *ro.sequences(), engine.dtype,
                     next(policy.parameters()).dtype)
