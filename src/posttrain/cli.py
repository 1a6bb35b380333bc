"""The ``posttrain`` command line."""

from __future__ import annotations

import argparse
import sys

from posttrain import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain",
        description="Post-training for causal language models: SFT, reward models, DPO, "
                    "PPO, GRPO, DAPO, GSPO.",
    )
    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("demo", help="train a toy policy with every RL algorithm of the core "
                                "(seconds, CPU)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        from posttrain.demo import main as demo_main

        return demo_main()
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
