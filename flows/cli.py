"""`spillover` command line: train (more commands join as they land). Exit codes: 0 ok, 1 run failed,
2 bad config or input."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from infra.config import ConfigError, load_config
from infra.prefect_env import apply_process_defaults

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/tiny.yaml", help="YAML run config (default: configs/tiny.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. rollout.max_split=4 run_dir=runs/exp1")


def cmd_train(args) -> int:
    cfg = load_config(args.config, args.overrides)
    from flows.train import grpo_train

    summary = grpo_train(cfg)
    print(json.dumps(summary, indent=2))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spillover", description="GRPO training with partial rollout.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train from a config (local Ray, CPU engines, ephemeral Prefect)")
    _add_config_args(train)
    train.set_defaults(fn=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    apply_process_defaults()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as err:
        print(f"spillover: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (FileNotFoundError, ValueError) as err:
        print(f"spillover: {type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
