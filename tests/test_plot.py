"""posttrain plot: any runs' metrics as one PNG; bad input is one line."""

from __future__ import annotations

import json

import pytest

from posttrain.cli import main

pytest.importorskip("matplotlib")


def _run(path, rows):
    path.mkdir(parents=True)
    lines = [json.dumps(r) for r in rows]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def test_two_runs_one_png(tmp_path, capsys):
    a = _run(tmp_path / "grpo", [{"step": 0, "eval/accuracy": 0.28},
                                 *({"step": s, "reward/mean": s / 10, "train/loss": 1 - s / 10}
                                   for s in range(1, 6)), {"step": 5, "eval/accuracy": 0.9}])
    b = _run(tmp_path / "dapo", [{"step": s, "reward/mean": s / 8, "kl/seq_mean": None}
                                 for s in range(1, 6)])
    (b / "metrics.jsonl").write_text((b / "metrics.jsonl").read_text() + '{"step": 6, "rew')
    out = tmp_path / "fig" / "runs.png"
    assert main(["plot", str(a), str(b), "--output", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    assert json.loads(capsys.readouterr().out)["plot"] == str(out)
    assert main(["plot", str(a), "--metrics", "train/loss", "--output",
                 str(tmp_path / "one.png")]) == 0


def test_bad_input_is_one_line(tmp_path, capsys):
    a = _run(tmp_path / "grpo", [{"step": 1, "reward/mean": 0.5}])
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    assert main(["plot", str(a), "--metrics", "eval/acuracy", "--output",
                 str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no run logged eval/acuracy" in err[0] and "reward/mean" in err[0]
