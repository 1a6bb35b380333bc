"""The ``posttrain`` command line.

    posttrain sft|rm|dpo|grpo|ppo [--config FILE.yaml] [--key value ...]
    posttrain eval --model DIR [--task builtin | --data FILE --reward module:function]
    posttrain merge RUN/final --output DIR
    posttrain plot RUN_DIR... [--metrics KEY ...] [--output FILE.png]
    posttrain compare [--algos ...] [--seeds 3] [--budget tokens|seconds] [--moe [only]]
    posttrain demo

Training commands map a YAML file and ``--key value`` overrides onto the same typed config
dataclass; ``posttrain sft --help`` lists every key with its default and meaning.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys

from posttrain import __version__


def _commands() -> dict:
    """Each training command: its help, its config class and its entry point (module,
    function). The RL commands' algorithm lists come from the algorithm table."""
    from posttrain.core.algorithms import algorithm_names

    grpo = ", ".join(algorithm_names(critic=False))
    ppo = ", ".join(algorithm_names(token_rewards=True))
    return {
        "sft": ("supervised fine-tuning on prompt/completion or chat data", "SFTConfig",
                ("offline", "run_sft")),
        "rm": ("Bradley–Terry reward model on preference pairs", "RMConfig",
               ("offline", "run_rm")),
        "dpo": ("direct preference optimisation against a frozen reference", "DPOConfig",
                ("offline", "run_dpo")),
        "grpo": (f"on-policy RL with a verifiable reward: --algo {grpo}", "RLConfig",
                 ("online", "run_rl")),
        "ppo": (f"RLHF with a per-token KL penalty in the reward: --algo {ppo} (ppo: actor, "
                "critic, reference, reward model or function)", "PPOConfig",
                ("online", "run_rl")),
        "distill": ("on-policy distillation: the student samples, the teacher's distribution "
                    "at every sampled token is the target (--teacher DIR, --beta: 1 reverse "
                    "KL, 0 forward KL, between generalised JSD)", "DistillConfig",
                    ("online.distill", "run_distill")),
    }


COMMANDS = ("sft", "rm", "dpo", "grpo", "ppo", "distill")


def _config_class(name: str):
    from posttrain import config

    return getattr(config, name)


def _entry(module: str, fn: str):
    import importlib

    return getattr(importlib.import_module(f"posttrain.trainers.{module}"), fn)


def _config_help(cls) -> str:
    from dataclasses import fields

    from posttrain.config import field_docs

    docs = field_docs(cls)
    lines = ["config keys (--key value, or key: value in the YAML file):"]
    for f in fields(cls):
        lines.append(f"  --{f.name} (default {f.default!r})\n      {docs.get(f.name, '')}")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    """A command's parser whose help ends with its config keys, read from the config class's
    source only when help is shown (not on every run)."""

    config_class: str | None = None

    def format_help(self) -> str:
        if self.config_class and self.epilog is None:
            self.epilog = _config_help(_config_class(self.config_class))
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="posttrain",
        description="Post-training for causal language models: SFT, reward models, DPO, "
                    "PPO, GRPO, DAPO, GSPO.",
    )
    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (anywhere on the command line)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, cls_name, _) in _commands().items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.config_class = cls_name
        p.add_argument("--config", help="YAML file of config keys")
    ev = sub.add_parser("eval", help="greedy accuracy and mean reward of a model, as JSON")
    ev.add_argument("--model", default="builtin",
                    help="model directory, hub id, builtin, or a LoRA adapter directory")
    ev.add_argument("--task", default=None, help="'builtin': the built-in task's held-out split")
    ev.add_argument("--data", default=None, help="JSONL/Parquet prompts (plus reward columns)")
    ev.add_argument("--reward", default=None, help="one term: math, code, format, length, "
                    "module:function or file.py:function")
    ev.add_argument("--n", type=int, default=500, help="examples from the built-in task")
    ev.add_argument("--max_new_tokens", type=int, default=16)
    ev.add_argument("--batch_size", type=int, default=64)
    ev.add_argument("--device", default="auto")
    ev.add_argument("--trust_remote_code", action="store_true")
    ev.add_argument("--env", default=None,
                    help="episodes: an environment class (file.py:Name, module:Name or "
                         "builtin); one greedy episode per row")
    ev.add_argument("--env_kwargs", default=None, help="the environment's arguments (JSON)")
    ev.add_argument("--tools", default=None, help="episodes with tool calls: file.py:fn1,fn2")
    ev.add_argument("--tool_error_reward", type=float, default=0.0)
    ev.add_argument("--max_turns", type=int, default=4)
    ev.add_argument("--max_episode_tokens", type=int, default=256)
    ev.add_argument("--env_timeout", type=float, default=30.0)
    ev.add_argument("--agent", default=None,
                    help="episodes played by an agent program (file.py:fn, module:fn or "
                         "builtin) through the run's OpenAI-compatible endpoint; one greedy "
                         "episode per row")
    ev.add_argument("--agent_timeout", type=float, default=300.0)
    ev.add_argument("--agent_concurrency", type=int, default=256)
    ev.add_argument("--tool_parser", default="auto",
                    help="--agent: hermes, llama3_json, mistral, plain or ask (auto: from the "
                         "chat template)")
    ev.add_argument("--fast", default="true", choices=["true", "false"],
                    help="false: the plain path (hf engine, no posttrain.fast speed-ups)")
    mg = sub.add_parser("merge", help="a LoRA run's adapter merged into its base: a plain "
                                      "Hugging Face model")
    mg.add_argument("adapter", help="an adapter directory: RUN/final or RUN/checkpoint-N")
    mg.add_argument("--output", required=True, help="where the merged model goes")
    mg.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    mg.add_argument("--trust_remote_code", action="store_true")
    pl = sub.add_parser("plot", help="runs' metrics against the step, as a PNG")
    pl.add_argument("runs", nargs="+", help="run directories (each with a metrics.jsonl)")
    pl.add_argument("--metrics", nargs="+", default=None,
                    help="metric keys (default: accuracy, reward, loss and KL where logged)")
    pl.add_argument("--output", default="metrics.png", help="the PNG to write")
    sm = sub.add_parser("samples", help="a run's sample tables (log_samples_every), printed "
                                        "readably")
    sm.add_argument("run", help="a run directory (with a samples.jsonl)")
    sm.add_argument("--step", type=int, default=None, help="the step (default: the last)")
    from posttrain.compare import DEFAULT_ALGOS

    cp = sub.add_parser("compare", help="the algorithms side by side on the built-in task: "
                                        "same start, same budget, several seeds; a Markdown "
                                        "report with learning curves")
    cp.add_argument("--algos", nargs="+", default=list(DEFAULT_ALGOS),
                    help="sft (the start), dpo, ppo and the grpo family's --algo names")
    cp.add_argument("--seeds", type=int, default=3)
    cp.add_argument("--budget", default="tokens", choices=["tokens", "seconds"],
                    help="equal completion tokens (sampled, or trained on offline) or equal "
                         "seconds of training steps")
    cp.add_argument("--tokens", type=int, default=40_000)
    cp.add_argument("--seconds", type=float, default=20.0)
    cp.add_argument("--moe", nargs="?", const="only", default="true",
                    choices=["true", "false", "only"],
                    help="also GRPO and GSPO, with and without routing replay, on a small "
                         "mixture-of-experts policy sampled in bfloat16; --moe alone: only "
                         "that study")
    cp.add_argument("--moe_seeds", type=int, default=None, help="default: --seeds")
    cp.add_argument("--output", default="runs/compare")
    cp.add_argument("--device", default="cpu")
    sub.add_parser("demo", help="train a toy policy with every RL algorithm of the core "
                                "(seconds, CPU)")
    return parser


def _run_eval(args) -> int:
    from posttrain import data as data_mod
    from posttrain import fast
    from posttrain.builtin import task
    from posttrain.config import ConfigError, check_device
    from posttrain.evaluate import evaluate_policy
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.rewards import load_reward
    from posttrain.rollout import make_engine

    for key in ("n", "max_new_tokens", "batch_size", "max_turns", "max_episode_tokens",
                "agent_concurrency"):
        if getattr(args, key) < 1:
            raise ConfigError(f"eval --{key} must be ≥ 1, got {getattr(args, key)}")
    check_device(args.device)
    if args.env or args.tools or args.agent:
        return _run_eval_episodes(args)
    if args.data is None:
        if args.task not in (None, "builtin"):
            raise ConfigError(f"unknown task {args.task!r}; use --task builtin or --data")
        rows, reward_fn = task.rl_rows(args.n, "eval"), task.reward
        if args.reward:
            reward_fn = load_reward(args.reward).fn
    else:
        if not args.reward:
            raise ConfigError("--data needs --reward (math, code, format, length, "
                              "module:function or file.py:function)")
        _, rows = data_mod.load(args.data, "rl")
        reward_fn = load_reward(args.reward).fn
    tok = load_tokenizer(args.model, args.trust_remote_code)
    use_fast = args.fast == "true"
    model = fast.prepare_model(load_causal_lm(args.model, device=args.device,
                                              trust_remote_code=args.trust_remote_code),
                               use_fast)
    engine = make_engine("auto", model, tok, use_fast)
    result = evaluate_policy(model, tok, rows, reward_fn, args.max_new_tokens, args.batch_size,
                             engine=engine)
    print(_json({"model": args.model, **result}))
    if not math.isfinite(result["mean_reward"]):
        print(f"error: the mean reward is {result['mean_reward']}: the reward function "
              "returned a value that is not a finite number", file=sys.stderr)
        return 2
    return 0


def _run_eval_episodes(args) -> int:
    """``eval --env`` / ``--tools`` / ``--agent``: one greedy episode per row, as training
    evaluates."""
    from posttrain import data as data_mod
    from posttrain import fast
    from posttrain.builtin import episodes
    from posttrain.config import ConfigError
    from posttrain.episodes import EnvSpec, EpisodeLimits, Renderer, tool_spec
    from posttrain.episodes.evaluate import evaluate_episodes
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.rewards import parse_rewards
    from posttrain.rollout import make_engine

    if sum(map(bool, (args.env, args.tools, args.agent))) > 1:
        raise ConfigError("eval: --env, --tools and --agent each play the episodes; choose "
                          "one")
    if args.agent and args.env_kwargs:
        raise ConfigError("eval: --env_kwargs are --env's class's; an --agent takes none")
    if args.agent_timeout <= 0:
        raise ConfigError(f"eval --agent_timeout must be > 0, got {args.agent_timeout}")
    if args.tools and args.env_kwargs:
        raise ConfigError("eval: --env_kwargs are --env's class's; --tools' environment "
                          "takes the functions alone")
    model_name = args.model
    builtin = "builtin" in (args.env, args.agent)
    if builtin and model_name == "builtin":
        model_name = "builtin-episodes"
    if args.data is None:
        if not builtin:
            kind = "env" if args.env else "tools" if args.tools else "agent"
            raise ConfigError(f"eval --{kind} needs --data")
        rows = episodes.rows(args.n, "eval")
    else:
        rows = data_mod.load(args.data, "rl" if args.tools else "env")[1]
    if args.tools and not args.reward:
        raise ConfigError("eval --tools needs --reward: the terms that score the answer")
    tok = load_tokenizer(model_name, args.trust_remote_code)
    spec = tools = None
    if args.agent:
        from posttrain.agents import AgentSpec

        spec = AgentSpec.parse(args.agent, args.agent_timeout, args.agent_concurrency,
                               args.tool_parser)
    elif args.tools:
        spec, tools = tool_spec(args.tools, tok, args.tool_error_reward, args.env_timeout)
    else:
        spec = EnvSpec.parse(args.env, args.env_kwargs, args.env_timeout)
    use_fast = args.fast == "true"
    model = fast.prepare_model(load_causal_lm(model_name, device=args.device,
                                              trust_remote_code=args.trust_remote_code),
                               use_fast)
    engine = make_engine("auto", model, tok, use_fast)
    errors: list[str] = []
    rewards = parse_rewards(args.reward or "")
    if args.agent:
        result = _eval_agents(spec, engine, tok, rows, rewards, args, errors)
    else:
        result = evaluate_episodes(engine, tok, spec, rows, rewards,
                                   EpisodeLimits(args.max_turns, args.max_episode_tokens),
                                   args.max_new_tokens, args.batch_size, Renderer(tok, tools),
                                   "answer" if args.tools else "transcript", errors)
    print(_json({"model": model_name, **result}))
    if errors:  # (they count as wrong; say why)
        first = " ".join(errors[0].split())
        print(f"eval: {len(errors)} of {len(rows)} rows skipped (counted as wrong); the "
              f"first: {first:.600}", file=sys.stderr)
    return 0


def _eval_agents(spec, engine, tok, rows, rewards, args, errors) -> dict:
    """``eval --agent``: one greedy episode per row through an endpoint of its own."""
    from posttrain.agents import Hub, greedy_agents
    from posttrain.episodes.evaluate import summary

    hub = Hub(spec, tok, args.max_episode_tokens)
    try:
        return summary(*greedy_agents(hub, engine, tok, rows, rewards, args.max_new_tokens,
                                      batch_size=args.batch_size, errors=errors))
    finally:
        hub.close()


def _run_merge(args) -> int:
    from pathlib import Path

    from posttrain.models import lora

    adapter, output = Path(args.adapter), Path(args.output)
    if not (adapter / "adapter_config.json").is_file():
        raise ValueError(f"{adapter}: no adapter_config.json (not a LoRA run's final/ or "
                         "checkpoint; a full fine-tune is already a plain model)")
    if output.exists() and any(output.iterdir()):
        raise ValueError(f"--output {output} exists and is not empty; choose another")
    _quiet_transformers()
    lora.merge(adapter, output, args.dtype, args.trust_remote_code)
    print(_json({"merged": str(output), "adapter": str(adapter)}))
    return 0


def _json(record: dict) -> str:
    """``record`` as strict JSON: a value that is not a finite number becomes null."""
    def clean(v):
        return None if isinstance(v, float) and not math.isfinite(v) else v
    return json.dumps({k: clean(v) for k, v in record.items()}, allow_nan=False)


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _one_line(e: BaseException) -> str:
    """An exception as the one line the user sees: the message of a user error (bad config,
    data, path, reward, non-finite value, ...) as it is; anything else with its type and
    where the traceback is."""
    text = " ".join(str(e).split()) or type(e).__name__
    if len(text) > 600:
        text = text[:600] + " ..."
    if isinstance(e, (ValueError, OSError)):
        return f"error: {text}"
    return f"error: {type(e).__name__}: {text} (--debug shows the traceback)"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        parser = build_parser()
        args, rest = parser.parse_known_args(argv)
        if args.command not in COMMANDS and rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return _dispatch(parser, args, rest)
    except KeyboardInterrupt:
        if debug:
            raise
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # every failure is one line; --debug shows the traceback
        if debug:
            raise
        print(_one_line(e), file=sys.stderr)
        return 2


def _dispatch(parser, args, rest) -> int:
    if args.command in COMMANDS:
        from posttrain import config

        _, cls_name, entry = _commands()[args.command]
        cfg = config.load(_config_class(cls_name), args.config, rest)
        _quiet_transformers()
        try:
            metrics = _entry(*entry)(cfg)
        finally:
            from posttrain import dist

            dist.close()
        print(_json({"output_dir": cfg.output_dir,
                     **{k: v for k, v in metrics.items() if k.startswith("eval/")}}))
        return 0
    if args.command == "eval":
        _quiet_transformers()
        return _run_eval(args)
    if args.command == "merge":
        return _run_merge(args)
    if args.command == "plot":
        from posttrain.plot import plot

        print(_json({"plot": str(plot(args.runs, args.metrics, args.output))}))
        return 0
    if args.command == "samples":
        from posttrain.samples import show

        show(args.run, args.step)
        return 0
    if args.command == "compare":
        from posttrain.compare import run_compare

        _quiet_transformers()
        report = run_compare(args.algos, args.seeds, args.budget, args.tokens, args.seconds,
                             {"true": True, "false": False}.get(args.moe, args.moe),
                             args.output, args.device, args.moe_seeds,
                             log=lambda s: print(s, file=sys.stderr, flush=True))
        print(_json({"report": str(report)}))
        return 0
    if args.command == "demo":
        from posttrain.demo import main as demo_main

        return demo_main()
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
