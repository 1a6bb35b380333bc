"""GRPO through vLLM servers against vLLM in the trainer's process: median seconds of a GRPO
step and of a weight push (``time/sync_s`` less the guard's ``time/guard_s``), for
``--rollout_backend vllm`` and ``vllm_server`` with one and two launched servers, runs
alternating (in-process, one server, two servers, in-process, ...) so that a change of the
machine's load falls on every setting alike. The servers' start-up (about a minute each on
2 CPU cores) is not in the step times; the first ``--skip`` steps of each run are left out.

Sizes: ``builtin`` (0.55M), ``medium`` (~25M random init), ``large`` (~180M: the medium body
with a 151,936-token vocabulary, untied). Run it in the vLLM environment (docs/engines.md).

``--lora_rank R`` measures a LoRA run instead: in-process vLLM (merged weights) against one
launched server pushed the merged weights and one pushed the adapter alone
(``--rollout_lora_push merged|adapter``).

On CPU the servers share the cores with the trainer, so the figures measure the client's
and the push's overhead, not what separate devices buy; ``--devices "1;2"`` (GPU machine:
trainer on GPU 0, servers on 1 and 2) measures that: ``benchmarks/gpu_servers.sh``.

Usage: python benchmarks/rollout_servers.py [--sizes builtin,medium] [--steps 6]
       [--repeats 3] [--servers 1,2] [--transfers posttrain,nccl] [--devices "1;2"]
       [--server_args "..."]
       [--lora_rank R] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import SIZES, child_env, scratch

IN_PROCESS = {"in-process vllm": ["--rollout_backend", "vllm"]}


def server_settings(counts: list[int], transfers: tuple[str, ...] = ("posttrain",)
                    ) -> dict[str, list[str]]:
    """In-process vLLM, then one setting per number of launched servers and weight
    transport (``--rollout_transfer``; a transport other than posttrain's is named)."""
    return {**IN_PROCESS, **{
        f"{n} server{'s' if n > 1 else ''}{'' if t == 'posttrain' else f', {t}'}":
        ["--rollout_backend", "vllm_server", "--launch_rollout_servers", str(n),
         "--rollout_transfer", t] for n in counts for t in transfers}}


LORA_SETTINGS = {
    **IN_PROCESS,
    "1 server, merged push": ["--rollout_backend", "vllm_server", "--rollout_lora_push",
                              "merged", "--launch_rollout_servers", "1"],
    "1 server, adapter push": ["--rollout_backend", "vllm_server", "--rollout_lora_push",
                               "adapter", "--launch_rollout_servers", "1"]}


def model_dir(size: str, work: Path) -> str:
    if size == "builtin":
        return "builtin"
    from posttrain.builtin.build import init_model

    path = work / f"model-{size}"
    if not path.exists():
        init_model(path, **SIZES[size])
    return str(path)


def one_run(model: str, setting: list[str], out: Path, steps: int, devices: str | None,
            server_args: str) -> tuple[list[float], list[float]]:
    extra = list(setting)
    if "--launch_rollout_servers" in setting:
        n = int(setting[setting.index("--launch_rollout_servers") + 1])
        if devices:
            extra += ["--rollout_server_devices", ";".join(devices.split(";")[:n])]
        if server_args:
            extra += ["--rollout_server_args", server_args]
    cmd = [sys.executable, "-m", "posttrain", "grpo", "--model", model, "--max_steps",
           str(steps), "--eval_every", "0", "--log_every", "1", "--tensorboard", "false",
           "--output_dir",
           str(out), "--overwrite", "true", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if proc.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps_s = [r["time/step_s"] for r in rows if "time/step_s" in r]
    push_s = [r["time/sync_s"] - r.get("time/guard_s", 0.0) for r in rows
              if "time/sync_s" in r]
    return steps_s, push_s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="builtin,medium")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--skip", type=int, default=1, help="first steps left out of each run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--devices", default=None, help="the servers' CUDA_VISIBLE_DEVICES, ';'")
    p.add_argument("--server_args", default="", help="more flags for every launched server")
    p.add_argument("--lora_rank", type=int, default=0)
    p.add_argument("--servers", default="1,2",
                   help="the launched-server counts measured beside in-process vLLM (not with "
                   "--lora_rank, which measures its own three settings)")
    p.add_argument("--transfers", default="posttrain",
                   help="the weight transports measured (posttrain, nccl: CUDA only)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    settings = server_settings(sorted({int(x) for x in args.servers.split(",")}),
                               tuple(args.transfers.split(",")))
    if args.lora_rank:
        settings = {k: [*v, "--lora_rank", str(args.lora_rank)]
                    for k, v in LORA_SETTINGS.items()}
    with scratch(args.out, "posttrain-bench-servers-") as work:
        print("| size | setting | GRPO step s (median) | push s (median) | step ÷ in-process | "
              "push ÷ step |\n|---|---|---|---|---|---|")
        for size in args.sizes.split(","):
            model = model_dir(size, work)
            got: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in settings}
            for r in range(args.repeats):
                for i, (name, setting) in enumerate(settings.items()):
                    s, q = one_run(model, setting, work / f"{size}-{r}-{i}",
                                   args.steps, args.devices, args.server_args)
                    got[name][0].extend(s[args.skip:])
                    got[name][1].extend(q[args.skip:])
                    print(f"{size} {name} run {r}: steps {[round(x, 3) for x in s]}",
                          file=sys.stderr, flush=True)
            base = statistics.median(got["in-process vllm"][0])
            for name, (s, q) in got.items():
                step, push = statistics.median(s), statistics.median(q)
                print(f"| {size} | {name} | {step:.3f} | {push:.3f} | {step / base:.2f}× | "
                      f"{push / step:.1%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
