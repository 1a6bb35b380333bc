"""Reading, validating and tokenising data: formats, located errors, over-long policy, masks."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from posttrain import data
from posttrain.builtin.tokenizer import build_tokenizer
from posttrain.data import DataError

SFT_ROWS = [{"prompt": "1+2=", "completion": "3"}, {"prompt": "10+5=", "completion": "15"}]
PREF_ROWS = [{"prompt": "1+2=", "chosen": "3", "rejected": "4", "margin": 0.5},
             {"prompt": "2+2=", "chosen": "4", "rejected": "5"}]
PAD, EOS = 0, 2


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def ids(text: str) -> list[int]:
    """The byte tokenizer's ids, worked out by hand: 3 + each UTF-8 byte."""
    return [3 + b for b in text.encode()]


def write_jsonl(path, lines: list) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines),
                    encoding="utf-8")
    return str(path)


def strip(rows):
    return [{k: v for k, v in r.items() if k != "_row"} for r in rows]


# --- reading ---------------------------------------------------------------------------------

def test_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", SFT_ROWS)
    name, rows = data.load(path, "sft")
    assert name == path
    assert strip(rows) == SFT_ROWS
    assert [r["_row"] for r in rows] == [1, 2]


def test_jsonl_blank_lines_keep_line_numbers(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n" + json.dumps(SFT_ROWS[0]) + "\n\n  \n" + json.dumps(SFT_ROWS[1]) + "\n")
    _, rows = data.load(str(path), "sft")
    assert [r["_row"] for r in rows] == [2, 5]
    assert strip(rows) == SFT_ROWS


def test_jsonl_crlf(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(("\r\n".join(json.dumps(r) for r in SFT_ROWS) + "\r\n").encode())
    assert strip(data.load(str(path), "sft")[1]) == SFT_ROWS


def test_jsonl_unicode_line_separator_inside_string(tmp_path):
    # U+2028 is legal unescaped inside a JSON string; JSONL splits on "\n" only.
    row = {"prompt": "a\u2028b\u0085c", "completion": "d\x0ce"}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(row, ensure_ascii=False) + "\n" + json.dumps(SFT_ROWS[0]) + "\n",
                    encoding="utf-8")
    _, rows = data.load(str(path), "sft")
    assert strip(rows) == [row, SFT_ROWS[0]]
    assert [r["_row"] for r in rows] == [1, 2]


def test_json_list(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(PREF_ROWS, indent=2))
    _, rows = data.load(str(path), "preference")
    assert strip(rows) == PREF_ROWS
    assert [r["_row"] for r in rows] == [1, 2]


def test_json_holding_lines(tmp_path):
    path = write_jsonl(tmp_path / "d.json", SFT_ROWS)
    assert strip(data.load(path, "sft")[1]) == SFT_ROWS


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(PREF_ROWS), path)
    _, rows = data.load(str(path), "preference")
    assert strip(rows) == [PREF_ROWS[0], {**PREF_ROWS[1], "margin": None}]


def test_datasets_dir(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(SFT_ROWS).save_to_disk(str(tmp_path / "ds"))
    _, rows = data.load(str(tmp_path / "ds"), "sft")
    assert strip(rows) == SFT_ROWS


def test_datasets_dict_dir_uses_train(tmp_path):
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(SFT_ROWS[:1]),
                               "test": datasets.Dataset.from_list(SFT_ROWS[1:])})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert strip(data.load(str(tmp_path / "dd"), "sft")[1]) == SFT_ROWS[:1]


def test_list_source():
    name, rows = data.load(list(SFT_ROWS), "sft")
    assert name == data.BUILTIN_SOURCE
    assert strip(rows) == SFT_ROWS


def test_sft_messages_row(tmp_path):
    row = {"messages": [{"role": "system", "content": "be brief"},
                        {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "hello"}]}
    _, rows = data.load(write_jsonl(tmp_path / "d.jsonl", [row]), "sft")
    assert strip(rows) == [row]


def test_rl_rows_keep_extra_columns(tmp_path):
    _, rows = data.load(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "answer": "7"}]), "rl")
    assert strip(rows) == [{"prompt": "p", "answer": "7"}]


def test_unknown_kind():
    with pytest.raises(ValueError, match="kind"):
        data.validate("x", [{"prompt": "a"}], "ppo")


# --- located errors --------------------------------------------------------------------------

def check_error(e: pytest.ExceptionInfo, source: str, row: int | None, field: str | None):
    err = e.value
    assert isinstance(err, DataError)
    assert (err.source, err.row, err.field) == (source, row, field)
    msg = str(err)
    assert msg.startswith(source)
    if row is not None:
        assert f"row {row}" in msg
    if field is not None:
        assert f"field '{field}'" in msg


@pytest.mark.parametrize("kind,bad,row,field", [
    ("sft", {"prompt": "a"}, 3, "completion"),
    ("sft", {"completion": "a"}, 3, "prompt"),
    ("sft", {"text": "a"}, 3, "completion"),
    ("sft", {"prompt": "a", "completion": 3}, 3, "completion"),
    ("sft", {"prompt": "a", "completion": "  \n"}, 3, "completion"),
    ("sft", {"prompt": "", "completion": "b"}, 3, "prompt"),
    ("preference", {"prompt": "a", "chosen": "b"}, 3, "rejected"),
    ("preference", {"prompt": "a", "chosen": ["b"], "rejected": "c"}, 3, "chosen"),
    ("preference", {"prompt": "a", "chosen": "b", "rejected": "c", "margin": "1"}, 3, "margin"),
    ("preference", {"prompt": "a", "chosen": "b", "rejected": "c", "margin": True}, 3,
     "margin"),
    ("rl", {"answer": "1"}, 3, "prompt"),
    ("sft", {"messages": [{"role": "user", "content": "hi"}]}, 3, "messages"),
    ("sft", {"messages": []}, 3, "messages"),
    ("sft", {"messages": "hi"}, 3, "messages"),
    ("sft", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}, 3,
     "messages[1]"),
    ("sft", {"messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": " "}]}, 3, "messages[1].content"),
    ("sft", ["not", "an", "object"], 3, None),
])
def test_row_errors(tmp_path, kind, bad, row, field):
    good = {"sft": SFT_ROWS[0], "preference": PREF_ROWS[0], "rl": {"prompt": "p"}}[kind]
    path = tmp_path / "d.jsonl"
    # a blank line before the bad row: row 3 is the editor's line number, not the index
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(bad) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(DataError) as e:
        data.load(str(path), kind)
    check_error(e, str(path), row, field)


def test_wrong_type_message(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": 3}])
    with pytest.raises(DataError, match="expected a string, got int"):
        data.load(path, "sft")


def test_json_list_error_row_is_index(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([PREF_ROWS[0], PREF_ROWS[1], {**PREF_ROWS[1], "margin": "x"}]))
    with pytest.raises(DataError) as e:
        data.load(str(path), "preference")
    check_error(e, str(path), 3, "margin")


def test_invalid_json_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [SFT_ROWS[0], "", '{"prompt": "a", "completion":'])
    with pytest.raises(DataError, match="invalid JSON") as e:
        data.load(path, "sft")
    check_error(e, path, 3, None)


def test_invalid_json_list(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[{"prompt": "a"},')
    with pytest.raises(DataError, match="invalid JSON") as e:
        data.load(str(path), "sft")
    check_error(e, str(path), None, None)


def test_unsupported_extension(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("prompt,completion\na,b\n")
    with pytest.raises(DataError, match=r"unsupported file type '\.csv'") as e:
        data.load(str(path), "sft")
    check_error(e, str(path), None, None)


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="no such file") as e:
        data.load(path, "sft")
    check_error(e, path, None, None)


def test_no_rows(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DataError, match="no rows"):
        data.load(str(path), "sft")


def test_dataset_dict_without_train(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"test": datasets.Dataset.from_list(SFT_ROWS)}).save_to_disk(
        str(tmp_path / "dd"))
    with pytest.raises(DataError, match="train"):
        data.load(str(tmp_path / "dd"), "sft")


# --- tokenisation ----------------------------------------------------------------------------

def test_encode_sft_ids(tok):
    rows = data.validate("src", SFT_ROWS, "sft")
    enc = data.encode_sft(tok, "src", rows, 64, "error")
    assert [e.prompt for e in enc] == [ids("1+2="), ids("10+5=")]
    assert [e.completions for e in enc] == [[[*ids("3"), EOS]], [[*ids("15"), EOS]]]
    assert [e.row for e in enc] == [1, 2]
    assert all(e.margin is None for e in enc)


def test_encode_pairs_margin(tok):
    rows = data.validate("src", PREF_ROWS, "preference")
    enc = data.encode_pairs(tok, "src", rows, 64, "error")
    assert enc[0].prompt == ids("1+2=")
    assert enc[0].completions == [[*ids("3"), EOS], [*ids("4"), EOS]]
    assert enc[0].margin == 0.5 and isinstance(enc[0].margin, float)
    assert enc[1].margin is None


def test_integer_margin_becomes_float(tok):
    rows = data.validate("src", [{**PREF_ROWS[0], "margin": 2}], "preference")
    assert data.encode_pairs(tok, "src", rows, 64, "error")[0].margin == 2.0


def test_chat_rows_use_chat_template(tok):
    row = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "yo"}]}
    rows = data.validate("src", [row], "sft")
    (enc,) = data.encode_sft(tok, "src", rows, 64, "error")
    assert enc.prompt == ids("<|system|>S\n<|user|>hi\n<|assistant|>")
    assert enc.completions == [[*ids("yo"), EOS]]


def test_chat_without_template_falls_back(tok):
    plain = build_tokenizer()
    plain.chat_template = None
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    (enc,) = data.encode_sft(plain, "src", data.validate("src", [row], "sft"), 64, "error")
    assert enc.prompt == plain("user: hi\nassistant: ")["input_ids"]
    assert enc.completions == [[*plain("yo", add_special_tokens=False)["input_ids"],
                                plain.eos_token_id]]


def long_rows():
    # prompt 4 tokens; completions of 2, 7 and 3 tokens (+ eos)
    return data.validate("src", [{"prompt": "abcd", "completion": "xy"},
                                 {"prompt": "abcd", "completion": "0123456"},
                                 {"prompt": "efgh", "completion": "zzz"}], "sft")


def test_overlong_error_names_field(tok):
    with pytest.raises(DataError) as e:
        data.encode_sft(tok, "src", long_rows(), 8, "error")
    check_error(e, "src", 2, "completion")
    assert "12 tokens" in str(e.value) and "max_length=8" in str(e.value)


def test_overlong_error_pairs_names_field(tok):
    rows = data.validate("src", [{"prompt": "p", "chosen": "a", "rejected": "bbbbbbbb"}],
                         "preference")
    with pytest.raises(DataError) as e:
        data.encode_pairs(tok, "src", rows, 5, "error")
    check_error(e, "src", 1, "rejected")


def test_overlong_error_chat_names_messages(tok):
    row = {"messages": [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "a long answer"}]}
    with pytest.raises(DataError) as e:
        data.encode_sft(tok, "src", data.validate("src", [row], "sft"), 20, "error")
    check_error(e, "src", 1, "messages")


def test_overlong_truncate(tok, caplog):
    with caplog.at_level(logging.WARNING, logger="posttrain.data"):
        enc = data.encode_sft(tok, "src", long_rows(), 8, "truncate")
    assert [e.row for e in enc] == [1, 2, 3]
    assert enc[1].prompt == ids("abcd")
    assert enc[1].completions == [ids("0123")]  # cut to 8 - 4 tokens, eos cut too
    assert enc[0].completions == [[*ids("xy"), EOS]]  # short rows untouched
    assert all(len(e.prompt) + len(e.completions[0]) <= 8 for e in enc)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "1 completions truncated and 0 rows dropped at max_length=8" in warnings[0].message


def test_overlong_drop(tok, caplog):
    with caplog.at_level(logging.WARNING, logger="posttrain.data"):
        enc = data.encode_sft(tok, "src", long_rows(), 8, "drop")
    assert [e.row for e in enc] == [1, 3]
    assert "0 completions truncated and 1 rows dropped" in caplog.text


def test_tokenise_counts(tok):
    tk = data.Tokenise(tok, 8, "truncate", "src")
    rows = long_rows()
    for r in rows:
        tk(r, r["prompt"], {"completion": r["completion"]})
    # a prompt that alone reaches max_length cannot be truncated: it is dropped
    tk({"_row": 9}, "abcdefgh", {"completion": "x"})
    assert (tk.truncated, tk.dropped) == (1, 1)


def test_drop_pairs_counts_rows(tok, caplog):
    rows = data.validate("src", [{"prompt": "p", "chosen": "a", "rejected": "bbbbbbbb"},
                                 {"prompt": "p", "chosen": "a", "rejected": "b"}], "preference")
    with caplog.at_level(logging.WARNING, logger="posttrain.data"):
        enc = data.encode_pairs(tok, "src", rows, 5, "drop")
    assert [e.row for e in enc] == [2]
    assert "1 rows dropped" in caplog.text


def test_no_warning_when_nothing_over_long(tok, caplog):
    with caplog.at_level(logging.WARNING, logger="posttrain.data"):
        data.encode_sft(tok, "src", long_rows(), 64, "drop")
    assert not caplog.records


def test_pad_sequences_exact():
    out = data.pad_sequences([[5, 6], [7]], [[8, 9, 2], [10, 2]], pad_id=0)
    assert torch.equal(out["input_ids"], torch.tensor([[5, 6, 8, 9, 2], [7, 10, 2, 0, 0]]))
    assert torch.equal(out["attention_mask"], torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]))
    assert torch.equal(out["loss_mask"], torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]]))
    assert all(v.dtype == torch.long for v in out.values())


def test_loss_mask_covers_completion_and_eos_only(tok):
    rows = data.validate("src", SFT_ROWS, "sft")
    enc = data.encode_sft(tok, "src", rows, 64, "error")
    batch = data.pad_sequences([e.prompt for e in enc], [e.completions[0] for e in enc],
                               tok.pad_token_id)
    # row 0: "1+2=" then "3" </s>, padded by one to the longer row's 5 + 3 tokens
    assert batch["input_ids"][0].tolist() == [*ids("1+2=3"), EOS, PAD, PAD]
    masked = [batch["input_ids"][i][batch["loss_mask"][i].bool()].tolist() for i in range(2)]
    assert masked == [[*ids("3"), EOS], [*ids("15"), EOS]]
