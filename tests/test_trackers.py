"""Experiment trackers, sample tables and progress lines, against the real libraries writing
to a temporary directory (W&B offline, MLflow's local SQLite store, TensorBoard's events,
trackio's local database): what a run leaves there is read back with each library's own
reader (W&B's offline file with its protobuf records)."""

from __future__ import annotations

import glob
import importlib.util
import json
import sqlite3
import struct
from pathlib import Path

import pytest

from posttrain.cli import main

# (found, not imported: trackio reads TRACKIO_DIR when it is imported)
pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("wandb", "mlflow", "trackio",
                                                      "tensorboard")),
    reason="needs posttrain[trackers]")

COMMON = ["grpo", "--prompts_per_step", "4", "--group_size", "4", "--builtin_train_size", "32",
          "--builtin_eval_size", "8", "--log_every", "1", "--device", "cpu", "--seed", "1",
          "--tensorboard", "false", "--log_samples_every", "2", "--log_samples", "6"]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Every tracker's files under tmp_path, W&B without an account."""
    for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                 "WANDB_CONFIG_DIR": tmp_path / "wandb-config",
                 "WANDB_CACHE_DIR": tmp_path / "wandb-cache",
                 "WANDB_DATA_DIR": tmp_path / "wandb-data",
                 "TRACKIO_DIR": tmp_path / "trackio"}.items():
        monkeypatch.setenv(k, str(v))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)  # (the run directory's, unless a test sets it)
    return tmp_path


def _wandb_records(path: str):
    """The records of a W&B run file: a 7-byte header, then 32 KiB blocks of chunks (CRC,
    length, kind: 1 whole, 2 first, 3 middle, 4 last), each record a protobuf Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(buf)
            buf = b""
            yield r


def _wandb_history(path: str) -> list[dict]:
    rows = []
    for r in _wandb_records(path):
        if r.WhichOneof("record_type") == "history":
            row: dict = {}
            for item in r.history.item:
                key = item.key or item.nested_key[0]
                if len(item.nested_key) <= 1:
                    row[key] = json.loads(item.value_json)
                else:
                    row.setdefault(key, {})[item.nested_key[1]] = json.loads(item.value_json)
            rows.append(row)
    return rows


def test_report_to_every_tracker_and_a_resume_continues_the_same_runs(offline, capsys):
    run = offline / "run"
    args = [*COMMON, "--report_to", "wandb,mlflow,tensorboard,trackio", "--output_dir",
            str(run), "--save_every", "2"]
    assert main([*args, "--max_steps", "4"]) == 0
    captured = capsys.readouterr()
    for line in captured.out.strip().splitlines():  # stdout stays the command's JSON
        json.loads(line)
    lines = [x for x in captured.err.splitlines() if x.startswith("[grpo] step ")]
    assert len(lines) == 4 and all(" reward " in x and " tok/s " in x and " left " in x
                                   for x in lines)
    run_id = json.loads((run / "checkpoint-2" / "manifest.json").read_text())["run_id"]
    assert main([*args, "--max_steps", "6", "--resume_from", str(run / "checkpoint-2")]) == 0
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r for r in metrics if "reward/mean" in r}
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]

    # W&B: two offline files with the posttrain run's id (wandb sync joins them into one
    # run), the second's rows from step 3 on, the config, the sample tables
    files = sorted(glob.glob(str(run / "wandb" / "offline-run-*" / f"run-{run_id}.wandb")))
    assert len(files) == 2
    first, second = (_wandb_history(f) for f in files)
    by_step = {r["step"]: r for r in second if "reward/mean" in r}
    assert sorted(by_step) == [3, 4, 5, 6]
    assert all(by_step[s]["reward/mean"] == pytest.approx(logged[s]["reward/mean"])
               for s in by_step)
    assert [r["step"] for r in first if "sample_table" in r] == [2, 4]
    assert [r["step"] for r in second if "sample_table" in r] == [4, 6]
    configs = [r for f in files for r in _wandb_records(f) if r.WhichOneof("record_type") == "run"]
    assert all({i.key: json.loads(i.value_json) for i in c.run.config.update}["lr"] == 1e-4
               for c in configs)

    # MLflow: one run, found again by its tag; every step's metrics, the config, the tables
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run}/mlflow.db")
    exp = client.get_experiment_by_name("posttrain")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].data.tags["posttrain.run_id"] == run_id
    assert runs[0].data.params["algo"] == "grpo" and runs[0].info.status == "FINISHED"
    history = client.get_metric_history(runs[0].info.run_id, "reward/mean")
    assert sorted({m.step for m in history}) == [1, 2, 3, 4, 5, 6]
    last = {m.step: m.value for m in history}
    assert last[6] == pytest.approx(logged[6]["reward/mean"])
    arts = {a.path for a in client.list_artifacts(runs[0].info.run_id, "samples")}
    assert arts == {f"samples/step-{s:06d}.json" for s in (2, 4, 6)}
    assert (run / "mlartifacts").is_dir()  # in the run directory, not the working one

    # TensorBoard: the scalars of every step, the sample tables as text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    assert {e.step for e in ea.Scalars("reward/mean")} == {1, 2, 3, 4, 5, 6}
    assert "sample_table" in " ".join(ea.Tags()["tensors"])

    # trackio: one run by name, rows of every step
    db = sqlite3.connect(offline / "trackio" / "posttrain.db")
    names = {r[0] for r in db.execute("SELECT DISTINCT run_name FROM metrics")}
    assert names == {f"run-{run_id[:8]}"}
    steps = {r[0] for r in db.execute("SELECT step FROM metrics WHERE run_name = ?",
                                      (f"run-{run_id[:8]}",))}
    assert {1, 2, 3, 4, 5, 6} <= steps

    # samples.jsonl: the resume cut the killed rows past its checkpoint, each table once
    rows = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2] * 6 + [4] * 6 + [6] * 6


def test_sample_rows_hold_the_step_and_posttrain_samples_prints_them(tmp_path, capsys):
    run = tmp_path / "run"
    assert main([*COMMON, "--max_steps", "2", "--output_dir", str(run)]) == 0
    rows = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and {r["step"] for r in rows} == {2}
    for r in rows:
        assert r["prompt"].endswith("=") and r["finish"] in ("stop", "length")
        assert r["reward"] == r["reward/builtin"] and r["correct"] == (r["reward"] >= 1)
        assert r["length"] >= 1
    for g in {r["group"] for r in rows}:  # GRPO: the advantage's sign is the reward's
        group = [r for r in rows if r["group"] == g]  # against its group's mean
        if len(group) < 4:
            continue  # (the table cut this group short: its mean is not known here)
        mean = sum(r["reward"] for r in group) / len(group)
        for r in group:
            assert (r["advantage"] > 0) == (r["reward"] > mean)
            assert (r["advantage"] == 0) == (r["reward"] == mean)
    capsys.readouterr()
    assert main(["samples", str(run)]) == 0
    out = capsys.readouterr().out
    assert "step 2" in out and out.count("sample ") >= 6
    for r in rows:
        assert r["prompt"] in out and r["completion"] in out
    assert main(["samples", str(run), "--step", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no sample table at step 1" in err and "steps 2" in err and "\n" not in err
    assert main(["samples", str(tmp_path)]) == 2
    assert "--log_samples_every" in capsys.readouterr().err


def test_episode_tables_hold_the_whole_episode(tmp_path):
    run = tmp_path / "run"
    assert main(["grpo", "--env", "builtin", "--prompts_per_step", "2", "--group_size", "2",
                 "--builtin_train_size", "16", "--builtin_eval_size", "4", "--max_steps", "1",
                 "--device", "cpu", "--tensorboard", "false", "--log_samples_every", "1",
                 "--output_dir", str(run)]) == 0
    rows = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["turns"] >= 1 for r in rows)
    assert any(r["turns"] > 1 and len(r["completion"]) > 0 for r in rows)


@pytest.mark.parametrize("value, message", [
    ("wandb,nosuch", "report_to: unknown tracker 'nosuch'"),
    ("mlflow", "report_to=mlflow needs the mlflow package"),
])
def test_a_bad_or_missing_tracker_is_one_line_before_anything_loads(tmp_path, monkeypatch,
                                                                    capsys, value, message):
    from posttrain.trainers.loop import trackers

    real = importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlflow" else real(name, *a))
    assert main([*COMMON, "--max_steps", "1", "--report_to", value,
                 "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not (tmp_path / "run").exists()


def test_a_tracker_that_cannot_start_stops_the_run_in_one_line(tmp_path, monkeypatch, capsys):
    """An MLflow store that cannot be opened (its directory is a file): one line naming the
    tracker, exit 2, before the first step."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/a-file/mlflow.db")
    out = tmp_path / "run"
    assert main([*COMMON, "--max_steps", "1", "--report_to", "mlflow", "--output_dir",
                 str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: report_to=mlflow: the tracker did not start")
    assert not (out / "final").exists()


def test_a_tracker_that_fails_while_logging_is_dropped_and_the_run_goes_on(tmp_path, caplog):
    from posttrain.trainers.loop.metrics import MetricsWriter
    from posttrain.trainers.loop.trackers import Tracker

    class Broken(Tracker):
        calls = 0

        def log(self, step, metrics):
            Broken.calls += 1
            raise ConnectionError("lost")

    writer = MetricsWriter(tmp_path)
    writer.trackers = [Broken()]
    writer.write(1, {"a": 1.0})
    writer.write(2, {"a": 2.0})
    writer.close()
    assert Broken.calls == 1 and writer.trackers == []
    assert "Broken failed (ConnectionError: lost): no longer logging to it" in caplog.text
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["a"] for r in rows] == [1.0, 2.0]


def test_wandb_writes_under_wandb_dir_where_it_is_set(offline, monkeypatch):
    """W&B's files go under ``WANDB_DIR`` where the user set it, under the run directory
    otherwise."""
    from posttrain.trainers.loop.trackers import WandB

    run, chosen = offline / "run", offline / "chosen"
    run.mkdir()
    chosen.mkdir()
    monkeypatch.setenv("WANDB_DIR", str(chosen))
    for run_id in ("setdir", "default"):
        tracker = WandB(run, run_id, {"lr": 1.0})
        tracker.log(1, {"reward/mean": 0.5})
        tracker.close()
        monkeypatch.delenv("WANDB_DIR", raising=False)
    assert glob.glob(str(chosen / "wandb" / "offline-run-*" / "run-setdir.wandb"))
    assert not glob.glob(str(run / "wandb" / "offline-run-*" / "run-setdir.wandb"))
    assert glob.glob(str(run / "wandb" / "offline-run-*" / "run-default.wandb"))
