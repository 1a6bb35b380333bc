"""Loading and saving Hugging Face models: causal LMs for policies, scalar-head models for
rewards and critics, and the backbone of a (possibly wrapped) model.

Wherever a model is asked for, a peft adapter directory (a LoRA run's ``final/`` or
checkpoint) is one too: its base, named in ``adapter_config.json``, loaded with the adapter
merged in (:func:`adapter_base`).

``trust_remote_code`` is off unless the caller turns it on. Weights are read and written as
safetensors; everything is saved as a Hugging Face directory that plain ``transformers``
loads. Nothing here is tuned for a machine: the speed machinery is ``posttrain.fast``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import urllib.parse
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

BUILTIN = "builtin"
ADAPTER_CONFIG = "adapter_config.json"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

BUILTIN_EPISODES = "builtin-episodes"


def builtin_model_dir(name: str = BUILTIN) -> Path:
    """The shipped default model (see ``posttrain.builtin.build``); ``builtin-episodes``: it
    SFT'd on the built-in multi-turn task (``posttrain.builtin.episodes``)."""
    return Path(__file__).parent.parent / "builtin" / (
        "episodes_model" if name == BUILTIN_EPISODES else "model")

class ModelError(ValueError):
    """A model, tokenizer or checkpoint that cannot be found or read, with its path."""


def resolve(name: str) -> str:
    """``"builtin"`` → the shipped model's directory; an existing directory as it is; a name
    that looks like a local path but does not exist is an error here (never sent to the hub);
    anything else is a hub id, which must be in the local cache or the hub reachable."""
    if name in (BUILTIN, BUILTIN_EPISODES):
        path = builtin_model_dir(name)
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"the built-in model {name} is missing from {path}; rebuild it with "
                "`python -m posttrain.builtin.build" +
                (" --episodes`" if name == BUILTIN_EPISODES else "`"))
        return str(path)
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelError(f"model {name}: a file, not a model directory")
        if is_adapter(path):
            raise ModelError(f"model {name}: a LoRA adapter, not a whole model, and this "
                             f"needs one: merge it first (posttrain merge {name} --output DIR)")
        if not (path / "config.json").is_file():
            raise ModelError(f"model {name}: no config.json, so not a Hugging Face model "
                             "directory (a run's model is its final/ or checkpoint-<step>/)")
        return str(path)
    if _looks_local(name):
        raise FileNotFoundError(f"model {name}: no such directory")
    _check_hub(name)
    return name


def _looks_local(name: str) -> bool:
    """A path, not a hub id (``org/name`` or ``name`` of letters, digits, ``-_.``)."""
    return (os.path.isabs(name) or name.startswith((".", "~")) or name.endswith("/")
            or "\\" in name or re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) is None)


def _check_hub(name: str) -> None:
    """Fail fast on a hub id that is neither cached nor reachable (instead of minutes of
    retries)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return
    except Exception:  # an old huggingface_hub or a name it rejects: let transformers say
        return
    from huggingface_hub import constants

    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    if constants.HF_HUB_OFFLINE or offline:
        raise ModelError(f"model {name!r}: no such local directory, and not in the Hugging "
                         "Face cache (HF_HUB_OFFLINE is set)")
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return  # through a proxy only the download itself can tell
    host = urllib.parse.urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((host.hostname, host.port or 443), timeout=3).close()
    except OSError:
        raise ModelError(f"model {name!r}: no such local directory, not in the Hugging Face "
                         f"cache, and {host.hostname} cannot be reached") from None


def diagnose(path: str) -> str | None:
    """Which file of a model directory is broken, and how, or None if none looks broken:
    config and tokenizer JSON that does not parse, a safetensors file whose header does not
    parse or whose size is not what its header says (a truncated download or copy)."""
    root = Path(path)
    if not root.is_dir():
        return None
    for f in sorted(root.glob("*.json")):
        try:
            json.loads(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return f"{f}: not valid JSON ({e})"
    for f in sorted(root.glob("*.safetensors")):
        with f.open("rb") as raw:
            head = raw.read(8)
            try:
                n = struct.unpack("<Q", head)[0]
                if n > f.stat().st_size - 8:
                    raise ValueError
                header = json.loads(raw.read(n))
                end = max((v["data_offsets"][1] for k, v in header.items()
                           if k != "__metadata__"), default=0)
            except (struct.error, ValueError, KeyError, TypeError):
                return f"{f}: not a safetensors file (unreadable header)"
        if f.stat().st_size != 8 + n + end:
            return (f"{f}: {f.stat().st_size} bytes where its header needs {8 + n + end} "
                    "(truncated or corrupt)")
    return None


def _loaded(what: str, name: str, load):
    """``load()``, with any failure reported as a :class:`ModelError` naming the file."""
    try:
        return load()
    except Exception as e:  # transformers raises OSError, ValueError, safetensors errors...
        detail = diagnose(name) or " ".join(str(e).split())[:300]
        raise ModelError(f"{what} {name}: cannot be loaded: {detail}") from e


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)

class LoRAError(ValueError):
    """LoRA asked for where it cannot run (peft missing, no such layers)."""


def require_peft(purpose: str = "lora_rank"):
    """The peft module, or one line saying how to install it (``purpose`` needs it)."""
    try:
        import peft
    except ImportError:
        raise LoRAError(f"{purpose} needs peft: pip install 'posttrain[lora]'") from None
    return peft


def is_adapter(name: str | Path) -> bool:
    """Whether ``name`` is a peft adapter directory: ``adapter_config.json`` and no
    ``config.json`` of its own."""
    path = Path(name).expanduser()
    return (str(name) not in (BUILTIN, BUILTIN_EPISODES) and (path / ADAPTER_CONFIG).is_file()
            and not (path / "config.json").is_file())


def adapter_base(name: str | Path) -> str:
    """The base model of the adapter directory ``name``: ``base_model_name_or_path`` of its
    ``adapter_config.json`` as written (posttrain writes the absolute path of the directory it
    loaded, the built-in model's included; ``builtin`` is the built-in model), else that path
    relative to the adapter's directory (an adapter moved together with its base), else a hub
    id. The base may be an adapter directory itself (a LoRA run that started from one)."""
    path = Path(name).expanduser()
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        base = config.get("base_model_name_or_path")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise ModelError(f"adapter {name}: {ADAPTER_CONFIG} cannot be read ({e})") from None
    if not isinstance(base, str) or not base:
        raise ModelError(f"adapter {name}: {ADAPTER_CONFIG} names no base model "
                         "(base_model_name_or_path)")
    given, beside = Path(base).expanduser(), path / base
    if base in (BUILTIN, BUILTIN_EPISODES) or given.exists():
        found = base
    elif not given.is_absolute() and beside.exists():
        found = str(beside)
    elif _looks_local(base):
        raise ModelError(f"adapter {name}: its base model {base} ({ADAPTER_CONFIG}'s "
                         "base_model_name_or_path) does not exist")
    else:
        return base  # a hub id: resolve() checks it
    if Path(found).expanduser().resolve() == path.resolve():
        raise ModelError(f"adapter {name}: {ADAPTER_CONFIG} names the adapter itself as its "
                         "base model")
    return found


def _merged_adapter(name: str | Path, load_base):
    """The model of adapter directory ``name``: its base (``load_base(adapter_base(name))``)
    with the adapter merged into the weights, a plain model that computes base + adapter, so
    the lean decoder, a frozen reference and a fresh adapter on top all see the adapter's
    model. It is named by the adapter's directory, which an adapter trained on top of it
    then records as its base."""
    peft = require_peft(f"model {name} is a LoRA adapter; loading it")
    base_name = adapter_base(name)
    try:
        base = load_base(base_name)
    except (ModelError, FileNotFoundError) as e:
        raise ModelError(f"adapter {name}: its base model: {e}") from e
    model = _loaded("adapter", str(name), lambda: peft.PeftModel.from_pretrained(
        base, str(name), is_trainable=False).merge_and_unload())
    model.requires_grad_(True)  # as from_pretrained leaves it (peft froze the base)
    model.name_or_path = model.config._name_or_path = str(Path(name).expanduser().resolve())
    return model


def check_causal_lm(name: str, config) -> None:
    """Refuse, by its config, a model that is not a causal LM (a BERT encoder, a sequence
    classifier, T5): ``AutoModelForCausalLM`` loads some of them anyway (BERT as a
    ``BertLMHeadModel``, a classifier's backbone under a random head), which then fail or
    sample noise far from the cause."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {}):
        return  # remote code that declares a causal LM
    known = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    archs = list(getattr(config, "architectures", None) or [])
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and (
            not archs or any(a in known or a.endswith("ForCausalLM") for a in archs)):
        return
    raise ModelError(f"model {name}: not a causal language model "
                     f"({', '.join(archs) or config.model_type}); posttrain needs one that "
                     "AutoModelForCausalLM loads (*ForCausalLM)")


def load_tokenizer(name: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """``name``'s tokenizer; an adapter directory's own (posttrain saves it with the
    adapter), else its base's."""
    if is_adapter(name):
        if not (Path(name).expanduser() / "tokenizer_config.json").is_file():
            return load_tokenizer(adapter_base(name), trust_remote_code)
        path = str(Path(name).expanduser())
    else:
        path = resolve(name)
    tok = _loaded("tokenizer of", path, lambda: AutoTokenizer.from_pretrained(
        path, trust_remote_code=trust_remote_code))
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer of {name} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    return tok

def load_causal_lm(name: str, dtype: str = "float32", device: str = "auto",
                   trust_remote_code: bool = False) -> PreTrainedModel:
    """The causal LM ``name`` (a directory, hub id, ``builtin`` or adapter directory)."""
    if is_adapter(name):
        return _merged_adapter(name, lambda base: load_causal_lm(base, dtype, device,
                                                                 trust_remote_code))
    path = resolve(name)
    check_causal_lm(name, _loaded("model", path, lambda: AutoConfig.from_pretrained(
        path, trust_remote_code=trust_remote_code)))
    model = _loaded("model", path, lambda: AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code))
    return model.to(pick_device(device))

def load_reward_model(name: str, tokenizer: PreTrainedTokenizerBase, dtype: str = "float32",
                      device: str = "auto", trust_remote_code: bool = False,
                      head_batch: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> PreTrainedModel:
    """A sequence-classification model with one output: a ``*ForSequenceClassification``
    checkpoint as it is, or a causal-LM checkpoint whose backbone gets a fresh scalar head;
    an adapter directory on either (a LoRA reward model's saves its head).

    ``head_batch``: ``(input_ids, attention_mask)`` on which a fresh head is drawn to give
    unit-scale scores (:func:`init_unit_score_head`) instead of keeping transformers' draw;
    a checkpoint's own head is never touched."""
    if is_adapter(name):
        return _merged_adapter(name, lambda base: load_reward_model(
            base, tokenizer, dtype, device, trust_remote_code, head_batch))
    path = resolve(name)
    auto = AutoModelForSequenceClassification
    model, info = _loaded("reward model", path, lambda: auto.from_pretrained(
        path, num_labels=1, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code,
        output_loading_info=True))
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model = model.to(pick_device(device))
    head = getattr(model, "score", None)
    if head_batch is not None and isinstance(head, torch.nn.Linear) and (
            {f"score.{k}" for k, _ in head.named_parameters()} & set(info["missing_keys"])):
        init_unit_score_head(model, *head_batch)
    return model


@torch.no_grad()
def init_unit_score_head(model: PreTrainedModel, input_ids: torch.Tensor,
                         attention_mask: torch.Tensor) -> None:
    """Draw the scalar head ``w`` from torch's global generator (N(0, 1), bias 0), then scale
    it so that its scores of the ``(N, T)`` sequences given have standard deviation 1: a
    unit-variance start measured on the data (LSUV, Mishkin & Matas 2016), whatever the
    width and however alike the pooled states are.

    transformers draws it N(0, 0.02²) whatever the states. Under AdamW every backbone weight
    moves about lr per step however small ``w`` is, so the score moves in proportion to
    |w|. The built-in model's pooled (eos) states are nearly one vector (a pair's chosen and
    rejected at cosine 0.9996; a 0.02 head scores them 0.004 apart and all sequences within
    0.012): the Bradley–Terry loss sat at ln 2 for hundreds of steps, and where it left was
    decided by float rounding (docs/benchmarks.md, "Reward-model robustness")."""
    from posttrain.models.logprobs import sequence_scores

    head = model.score
    head.weight.normal_(0.0, 1.0)
    if head.bias is not None:
        head.bias.zero_()
    was_training = model.training
    model.eval()
    device = head.weight.device
    scores = sequence_scores(model, input_ids.to(device), attention_mask.to(device))
    model.train(was_training)
    spread = scores.float().std()  # (NaN for a single sequence)
    if bool(torch.isfinite(spread)) and float(spread) > 1e-6:
        head.weight.div_(spread.to(head.weight.dtype))
    else:  # states alike to float precision (or one sequence): N(0, 1/H), unit scale per |h|
        head.weight.mul_(head.in_features ** -0.5)


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path,
               state_dict: dict | None = None) -> None:
    """Save as a Hugging Face directory (safetensors weights, config, tokenizer).
    ``state_dict``: the weights to write instead of ``model``'s own (a sharded model's,
    gathered whole)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if state_dict is None:  # (a peft model writes its adapter)
        model.save_pretrained(path, safe_serialization=True)
    else:
        model.save_pretrained(path, safe_serialization=True, state_dict=state_dict)
    name = type(model).__name__
    if state_dict is not None and name.startswith("FSDP") and "Peft" not in name:
        # fully_shard swaps the class for FSDP<Name>; the directory names the model's own
        model.config.architectures = [name.removeprefix("FSDP")]
        model.config.save_pretrained(path)
    tokenizer.save_pretrained(path)


def backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of ``model`` (what returns ``last_hidden_state``), through any
    wrapper: a peft ``PeftModel`` (whose ``base_model`` is its ``LoraModel``, not the
    backbone) is unwrapped to the model it adapts first."""
    inner = model
    get_base = getattr(inner, "get_base_model", None)  # peft wrappers
    if callable(get_base):
        inner = get_base()
    base = getattr(inner, "base_model", None)
    if base is None or base is inner:
        raise ValueError(f"{type(model).__name__} has no decoder backbone (base_model)")
    return base


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of ``model``'s backbone."""
    layers = getattr(backbone(model), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: its backbone has no `layers`")
    return layers


def moe_experts(config) -> tuple[int, int] | None:
    """``(experts, experts per token)`` of a mixture-of-experts config (Mixtral, Qwen-MoE,
    DeepSeek names), else None."""
    n = next((getattr(config, k) for k in ("num_local_experts", "num_experts",
                                           "n_routed_experts") if getattr(config, k, None)),
             None)
    top_k = next((getattr(config, k) for k in ("num_experts_per_tok", "moe_top_k")
                  if getattr(config, k, None)), None)
    return (int(n), int(top_k)) if n and top_k else None


def active_parameters(model: torch.nn.Module) -> int:
    """Parameters a token's forward pass uses: all of them for a dense model; for a
    mixture-of-experts model the routed experts count ``top_k / experts`` of their size
    (that sets its FLOPs per token, and so every cost decision made from a parameter
    count). Shared experts and the router count in full."""
    total = sum(p.numel() for p in model.parameters())
    moe = moe_experts(getattr(model, "config", None))
    if moe is None:
        return total
    n, top_k = moe
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    return total - routed + routed * top_k // n


def for_device(table: dict[str, int], device: torch.device) -> int:
    """A per-device-type threshold: ``device``'s entry, the CPU's for a device type the
    table does not list."""
    return table.get(device.type, table["cpu"])
