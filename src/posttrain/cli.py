"""The ``posttrain`` command line.

    posttrain sft|rm|dpo|grpo|ppo [--config FILE.yaml] [--key value ...]
    posttrain eval --model DIR [--task builtin | --data FILE --reward module:function]
    posttrain demo

Training commands map a YAML file and ``--key value`` overrides onto the same typed config
dataclass; ``posttrain sft --help`` lists every key with its default and meaning.
"""

from __future__ import annotations

import argparse
import json
import logging
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
    }


COMMANDS = ("sft", "rm", "dpo", "grpo", "ppo")


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain",
        description="Post-training for causal language models: SFT, reward models, DPO, "
                    "PPO, GRPO, DAPO, GSPO.",
    )
    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, cls_name, _) in _commands().items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           epilog=_config_help(_config_class(cls_name)),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--config", help="YAML file of config keys")
    ev = sub.add_parser("eval", help="greedy accuracy and mean reward of a model, as JSON")
    ev.add_argument("--model", default="builtin", help="model directory, hub id or builtin")
    ev.add_argument("--task", default=None, help="'builtin': the built-in task's held-out split")
    ev.add_argument("--data", default=None, help="JSONL/Parquet prompts (plus reward columns)")
    ev.add_argument("--reward", default=None, help="module:function or file.py:function")
    ev.add_argument("--n", type=int, default=500, help="examples from the built-in task")
    ev.add_argument("--max_new_tokens", type=int, default=16)
    ev.add_argument("--batch_size", type=int, default=64)
    ev.add_argument("--device", default="auto")
    ev.add_argument("--trust_remote_code", action="store_true")
    ev.add_argument("--fast", default="true", choices=["true", "false"],
                    help="false: the plain path (hf engine, no posttrain.fast speed-ups)")
    sub.add_parser("demo", help="train a toy policy with every RL algorithm of the core "
                                "(seconds, CPU)")
    return parser


def _run_eval(args) -> int:
    from posttrain import data as data_mod
    from posttrain import fast
    from posttrain.builtin import task
    from posttrain.evaluate import evaluate_policy, load_reward_function
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.rollout import make_engine

    if args.data is None:
        if args.task not in (None, "builtin"):
            raise SystemExit(f"error: unknown task {args.task!r}; use --task builtin or --data")
        rows, reward_fn = task.rl_rows(args.n, "eval"), task.reward
        if args.reward:
            reward_fn = load_reward_function(args.reward)
    else:
        if not args.reward:
            raise SystemExit("error: --data needs --reward module:function")
        _, rows = data_mod.load(args.data, "rl")
        reward_fn = load_reward_function(args.reward)
    tok = load_tokenizer(args.model, args.trust_remote_code)
    use_fast = args.fast == "true"
    model = fast.prepare_model(load_causal_lm(args.model, device=args.device,
                                              trust_remote_code=args.trust_remote_code),
                               use_fast)
    engine = make_engine("auto", model, tok, use_fast)
    result = evaluate_policy(model, tok, rows, reward_fn, args.max_new_tokens, args.batch_size,
                             engine=engine)
    print(json.dumps({"model": args.model, **result}))
    return 0


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    from posttrain.config import ConfigError
    from posttrain.data import DataError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command not in COMMANDS and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command in COMMANDS:
            from posttrain import config

            _, cls_name, entry = _commands()[args.command]
            cfg = config.load(_config_class(cls_name), args.config, rest)
            _quiet_transformers()
            metrics = _entry(*entry)(cfg)
            print(json.dumps({"output_dir": cfg.output_dir, **{
                k: v for k, v in metrics.items() if k.startswith("eval/")}}))
            return 0
        if args.command == "eval":
            _quiet_transformers()
            return _run_eval(args)
        if args.command == "demo":
            from posttrain.demo import main as demo_main

            return demo_main()
    except (ConfigError, DataError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # bad --reward spec and similar user errors
        if args.command != "eval":
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
