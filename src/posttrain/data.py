"""Reading, validating and tokenising training data.

Sources: JSON Lines (``.jsonl``, or ``.json`` holding lines or one list), Parquet
(``.parquet``, needs ``pyarrow``), a directory written by ``datasets.save_to_disk``, or a list
of dicts (the built-in task). Formats:

    sft          {"prompt": str, "completion": str}   or   {"messages": [{"role", "content"}, ...]}
    preference   {"prompt": str, "chosen": str, "rejected": str, "margin": number (optional)}
    rl           {"prompt": str, ...}   (other columns are passed to reward functions)

Every row is checked before training starts. A problem raises :class:`DataError` naming the
file, the row (1-based, as an editor shows a JSONL line) and the field. Over-long rows are
errors unless ``overlong`` is ``truncate`` (the completion is cut) or ``drop``; then a
counted warning is printed. Loss masks cover completion tokens (and the closing eos) only.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

BUILTIN_SOURCE = "<built-in task>"


class DataError(ValueError):
    """A problem in the data, located by source, row and field."""

    def __init__(self, source: str, row: int | None, field: str | None, message: str):
        where = source + (f", row {row}" if row is not None else "") + \
            (f", field '{field}'" if field else "")
        super().__init__(f"{where}: {message}")
        self.source, self.row, self.field = source, row, field


# --- reading ---------------------------------------------------------------------------------

def read_rows(source: str | list[dict]) -> tuple[str, list[dict]]:
    """``(name, rows)`` from a file, a saved dataset directory or a list of dicts."""
    if isinstance(source, list):
        return BUILTIN_SOURCE, source
    path = Path(source)
    name = str(source)
    if not path.exists():
        raise DataError(name, None, None, "no such file or directory")
    if path.is_dir():
        return name, _read_dataset_dir(path)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return name, _read_json(path)
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(name, None, None, "reading Parquet needs pyarrow: "
                            "pip install 'posttrain[data]'") from None
        try:
            return name, pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow's errors for a file that is not Parquet
            raise DataError(name, None, None, f"cannot read as Parquet: {e}") from None
    raise DataError(name, None, None, f"unsupported file type {suffix!r}; use .jsonl, "
                    ".json, .parquet or a datasets directory")


def _decode(path: Path, raw: bytes) -> str:
    """``raw`` as UTF-8 text, or a :class:`DataError` naming the line of the first bad byte."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(str(path), line, None, f"not valid UTF-8 text (byte {e.start}: "
                        f"{raw[e.start:e.start + 1]!r}); save the file as UTF-8") from None


def _read_json(path: Path) -> list[dict]:
    text = _decode(path, path.read_bytes())
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(str(path), None, None, f"invalid JSON: {e}") from None
        return rows
    rows = []
    # Split on "\n" only: str.splitlines would also split inside JSON strings holding
    # U+2028, U+0085 or \x0c, which JSON allows unescaped.
    for i, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(str(path), i, None, f"invalid JSON: {e.msg}") from None
        if not isinstance(row, dict):
            raise DataError(str(path), i, None,
                            f"expected a JSON object, got {type(row).__name__}")
        # Keep editor line numbers for messages, even when blank lines were skipped.
        rows.append(dict(row, _line=i))
    return rows


def _read_dataset_dir(path: Path) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise DataError(str(path), None, None, "reading a datasets directory needs the "
                        "datasets package: pip install 'posttrain[data]'") from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(str(path), None, None, f"DatasetDict without a 'train' split "
                            f"(has {list(ds)})")
        ds = ds["train"]
    return ds.to_list()


# --- validation ------------------------------------------------------------------------------

def _row_number(row: dict, index: int) -> int:
    return row.get("_line", index + 1)


def _need_text(source: str, row: dict, n: int, field: str) -> str:
    if field not in row:
        raise DataError(source, n, field, "missing")
    value = row[field]
    if not isinstance(value, str):
        raise DataError(source, n, field, f"expected a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(source, n, field, "empty text")
    return value


def _messages(source: str, row: dict, n: int) -> list[dict]:
    msgs = row["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise DataError(source, n, "messages", "expected a non-empty list of messages")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                not isinstance(m.get("content"), str):
            raise DataError(source, n, f"messages[{j}]",
                            "expected {'role': str, 'content': str}")
    if msgs[-1]["role"] != "assistant":
        raise DataError(source, n, "messages", "the last message must be the assistant's")
    if not msgs[-1]["content"].strip():
        raise DataError(source, n, f"messages[{len(msgs) - 1}].content", "empty text")
    return msgs


def validate(source: str, rows: list, kind: str) -> list[dict]:
    """Check every row for ``kind`` (sft, preference, rl, env); return rows with ``_row``
    set."""
    if kind not in ("sft", "preference", "rl", "env"):
        raise ValueError(f"unknown data kind {kind!r}")
    if not rows:
        raise DataError(source, None, None, "no rows")
    out = []
    for i, row in enumerate(rows):
        n = _row_number(row, i) if isinstance(row, dict) else i + 1
        if not isinstance(row, dict):
            raise DataError(source, n, None, f"expected a JSON object, got {type(row).__name__}")
        clean = {k: v for k, v in row.items() if k != "_line"}
        clean["_row"] = n
        if kind == "sft":
            if "messages" in row:
                clean["messages"] = _messages(source, row, n)
            elif "prompt" in row or "completion" in row:
                _need_text(source, row, n, "prompt")
                _need_text(source, row, n, "completion")
            else:
                raise DataError(source, n, "completion", "missing: an SFT row needs "
                                "prompt and completion, or messages")
        elif kind == "preference":
            for field in ("prompt", "chosen", "rejected"):
                _need_text(source, row, n, field)
            margin = row.get("margin")
            if margin is not None and (not isinstance(margin, numbers.Real)
                                       or isinstance(margin, bool)):
                raise DataError(source, n, "margin", f"expected a number, got "
                                f"{type(margin).__name__}")
            if margin is not None and not math.isfinite(float(margin)):
                raise DataError(source, n, "margin", f"expected a finite number, got {margin}")
        elif kind == "rl":
            _need_text(source, row, n, "prompt")
        out.append(clean)  # env: any object (the environment reads it)
    return out


def load(source: str | list[dict], kind: str) -> tuple[str, list[dict]]:
    """Read and validate: ``(name, rows)``."""
    name, rows = read_rows(source)
    return name, validate(name, rows, kind)


# --- tokenisation ----------------------------------------------------------------------------

@dataclass
class Encoded:
    """A tokenised prompt with one or more completions (each ending in eos)."""

    prompt: list[int]
    completions: list[list[int]]
    row: int
    margin: float | None = None
    ref_logps: tuple[float, ...] | None = None
    """Cached reference log-likelihoods of the completions (DPO)."""
    trained: list[list[int]] | None = None
    """Per completion, 1 on the tokens the loss trains (a multi-turn conversation's
    assistant turns); None: all of them."""


class Tokenise:
    """Tokenises rows with the over-long policy; counts what it truncated or dropped."""

    def __init__(self, tokenizer, max_length: int, overlong: str, source: str):
        self.tok, self.max_length, self.overlong, self.source = (tokenizer, max_length,
                                                                 overlong, source)
        self.truncated = 0
        self.dropped = 0

    def _ids(self, text: str, special: bool) -> list[int]:
        return self.tok(text, add_special_tokens=special)["input_ids"]

    def __call__(self, row: dict, prompt: str, completions: dict[str, str]) -> Encoded | None:
        p = self._ids(prompt, special=True)
        outs = []
        for field, text in completions.items():
            c = [*self._ids(text, special=False), self.tok.eos_token_id]
            if len(p) + len(c) > self.max_length:
                if self.overlong == "error":
                    raise DataError(self.source, row["_row"], field,
                                    f"{len(p) + len(c)} tokens with the prompt, over "
                                    f"max_length={self.max_length}; raise max_length or set "
                                    "overlong to truncate or drop")
                if self.overlong == "drop" or len(p) >= self.max_length:
                    self.dropped += 1
                    return None
                c = c[: self.max_length - len(p)]
                self.truncated += 1
            outs.append(c)
        margin = row.get("margin")
        return Encoded(p, outs, row["_row"], None if margin is None else float(margin))

    def report(self) -> None:
        if self.truncated or self.dropped:
            log.warning("%s: %d completions truncated and %d rows dropped at max_length=%d",
                        self.source, self.truncated, self.dropped, self.max_length)


def encode_sft(tokenizer, source: str, rows: list[dict], max_length: int, overlong: str
               ) -> list[Encoded]:
    tk = Tokenise(tokenizer, max_length, overlong, source)
    out = []
    for row in rows:
        if "messages" in row:
            enc = encode_conversation(tk, row)
        else:
            enc = tk(row, row["prompt"], {"completion": row["completion"]})
        if enc is not None:
            out.append(enc)
    tk.report()
    return out


def encode_conversation(tk: Tokenise, row: dict) -> Encoded | None:
    """A ``messages`` row as one sequence, trained on every assistant turn (its content and
    eos) and on nothing else: the messages before the first assistant turn are the prompt,
    and what lies between assistant turns (the turn's closing, the other roles' messages,
    the next generation prompt) is appended untrained, in the layout episodes are sampled
    in (``posttrain.episodes.render``)."""
    from posttrain.episodes.render import Renderer

    msgs, renderer = row["messages"], Renderer(tk.tok)
    first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    prompt = renderer.start(msgs[:first])
    ids: list[int] = []
    trained: list[int] = []
    i = first
    while i < len(msgs):
        turn = [*tk._ids(msgs[i]["content"], special=False), tk.tok.eos_token_id]
        ids += turn
        trained += [1] * len(turn)
        j = i + 1
        while j < len(msgs) and msgs[j]["role"] != "assistant":
            j += 1
        if j < len(msgs):  # another assistant turn follows: what comes between, untrained
            between = renderer.between(True, msgs[i + 1:j])
            ids += between
            trained += [0] * len(between)
        i = j
    if len(prompt) + len(ids) > tk.max_length:
        if tk.overlong == "error":
            raise DataError(tk.source, row["_row"], "messages",
                            f"{len(prompt) + len(ids)} tokens, over max_length="
                            f"{tk.max_length}; raise max_length or set overlong to truncate "
                            "or drop")
        keep = tk.max_length - len(prompt)
        if tk.overlong == "drop" or keep <= 0 or not any(trained[:keep]):
            tk.dropped += 1
            return None
        ids, trained = ids[:keep], trained[:keep]
        tk.truncated += 1
    return Encoded(prompt, [ids], row["_row"], trained=[trained])


def encode_pairs(tokenizer, source: str, rows: list[dict], max_length: int, overlong: str
                 ) -> list[Encoded]:
    tk = Tokenise(tokenizer, max_length, overlong, source)
    out = [e for row in rows
           if (e := tk(row, row["prompt"], {"chosen": row["chosen"],
                                             "rejected": row["rejected"]})) is not None]
    tk.report()
    return out


def pad_sequences(prompts: list[list[int]], completions: list[list[int]], pad_id: int,
                  trained: list[list[int] | None] | None = None) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and completion ``loss_mask``, ``(B, T)``;
    ``trained``: per completion, 1 on its tokens the loss takes (None: all)."""
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    lengths = torch.tensor([len(x) for x in seqs])
    starts = torch.tensor([len(p) for p in prompts])
    T = int(lengths.max())
    input_ids = torch.tensor([x + [pad_id] * (T - len(x)) for x in seqs])  # one copy, no loop
    cols = torch.arange(T)
    attention_mask = (cols < lengths[:, None]).long()
    loss_mask = (attention_mask.bool() & (cols >= starts[:, None])).long()
    if trained is not None and any(t is not None for t in trained):
        for i, (p, t) in enumerate(zip(prompts, trained, strict=True)):
            if t is not None:
                loss_mask[i, len(p):len(p) + len(t)] = torch.tensor(t, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def pack_sequences(prompts: list[list[int]], completions: list[list[int]], pad_id: int,
                   trained: list[list[int] | None] | None = None,
                   budget: int | None = None,
                   together: list[list[int]] | None = None) -> dict[str, torch.Tensor]:
    """The sequences (prompt + completion) one after another without padding, ``(R, T)``:
    ``input_ids``, ``position_ids`` restarting at 0 for each sequence (from which the
    model's attention keeps each sequence to itself: transformers' packed-sequence mask),
    the completion ``loss_mask`` (``trained`` as in :func:`pad_sequences`), and
    ``sequence_ids`` (each token's sequence, -1 on padding) and ``ends`` ``(N, 2)`` (the row
    and column of each sequence's last token), which read per-sequence results back.

    A row holds sequences up to ``budget`` tokens (None: all in one row; a longer one has a
    row of its own); a shorter row ends in pad ids, a block of their own, off the loss.
    ``together``: groups of sequence indices never split across rows (a preference pair's
    chosen and rejected), laid out in that order; default: each sequence alone, in order."""
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    lengths = [len(x) for x in seqs]
    losses = [[0] * len(p) + list(t or []) + [1] * (len(c) - len(t or []))  # (as padded)
              for p, c, t in zip(prompts, completions, trained or [None] * len(prompts),
                                 strict=True)]
    groups = together if together is not None else [[i] for i in range(len(lengths))]
    rows = [[i for g in row for i in groups[g]] for row in
            packed_rows([sum(lengths[i] for i in g) for g in groups], budget)]
    T = max(sum(lengths[i] for i in row) for row in rows)
    out = {k: torch.full((len(rows), T), v, dtype=torch.long)
           for k, v in (("input_ids", pad_id), ("position_ids", 0), ("loss_mask", 0),
                        ("sequence_ids", -1))}
    out["ends"] = torch.zeros(len(lengths), 2, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            n = lengths[i]
            out["input_ids"][r, at:at + n] = torch.tensor(seqs[i], dtype=torch.long)
            out["loss_mask"][r, at:at + n] = torch.tensor(losses[i], dtype=torch.long)
            out["position_ids"][r, at:at + n] = torch.arange(n)
            out["sequence_ids"][r, at:at + n] = i
            out["ends"][i] = torch.tensor([r, at + n - 1])
            at += n
        out["position_ids"][r, at:] = torch.arange(T - at)
    return out


def packed_rows(sizes: list[int], budget: int | None) -> list[list[int]]:
    """The rows :func:`pack_sequences` lays items of ``sizes`` tokens out in: indices in
    order, a new row when the next item would pass ``budget`` (None: one row)."""
    rows: list[list[int]] = []
    used = 0
    for i, n in enumerate(sizes):
        if not rows or (budget is not None and used + n > budget):
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def per_sequence(values: torch.Tensor, sequence_ids: torch.Tensor, n: int) -> torch.Tensor:
    """``(n,)`` sums of packed per-token ``values`` ``(R, T')`` by sequence, with
    ``sequence_ids`` ``(R, T')`` aligned to them (-1: none)."""
    keep = sequence_ids >= 0
    out = torch.zeros(n, dtype=values.dtype, device=values.device)
    return out.index_add(0, sequence_ids[keep], values[keep])


def pad_left(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(ids, mask)``, ``(B, Lp)``: every prompt ends at column ``Lp - 1``, so
    continuations of all rows start at the same column."""
    Lp = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (Lp - len(p)) + p for p in prompts])
    mask = torch.arange(Lp) >= torch.tensor([Lp - len(p) for p in prompts])[:, None]
    return ids, mask.long()


def pad_shared_prompts(prompts: list[list[int]], completions: list[list[int]], pad_id: int
                       ) -> dict[str, torch.Tensor]:
    """Prompts once, left-padded ``(B, Lp)``, and their completions in blocks, right-padded
    ``(k·B, Lc)`` (rows ``j·B + i`` belong to prompt ``i``): the layout of
    :func:`posttrain.models.shared_prompt_logprobs`."""
    prompt_ids, prompt_mask = pad_left(prompts, pad_id)
    Lc = max(len(c) for c in completions)
    completion_ids = torch.tensor([c + [pad_id] * (Lc - len(c)) for c in completions])
    completion_mask = torch.arange(Lc) < torch.tensor([len(c) for c in completions])[:, None]
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
            "completion_ids": completion_ids, "completion_mask": completion_mask.long()}


def check_prompt_lengths(tokenizer, source: str, rows: list[dict], max_new_tokens: int,
                         max_length: int) -> None:
    """RL rows: each prompt plus the token budget must fit ``max_length`` tokens."""
    for i, row in enumerate(rows):
        n = len(tokenizer(row["prompt"])["input_ids"])
        if n + max_new_tokens > max_length:
            raise DataError(source, row.get("_row", i + 1), "prompt",
                            f"{n} tokens + max_new_tokens {max_new_tokens} > max_length "
                            f"{max_length}")
