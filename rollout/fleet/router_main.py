"""`python -m spillover.rollout.fleet.router_main [router flags]`: the sglang-router's Rust router, started with the
flags of `python -m sglang_router.launch_router` (the router's own argument classes parse them).

Why not launch_router itself: it imports the router's Python debugging balancer (mini_lb) at module level, which
imports all of SGLang where SGLang is installed (every GPU machine): ~7 CPU-s per router start instead of ~0.1 s.
The Rust router is the same either way."""
from __future__ import annotations

import argparse
import sys

import setproctitle
from sglang_router.router import Router
from sglang_router.router_args import RouterArgs

PROCESS_TITLE = "sglang::router"  # launch_router's title: process listings and leak checks look for it


def parse_router_args(argv: list[str]) -> RouterArgs:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)


def main(argv: list[str] | None = None) -> None:
    args = parse_router_args(sys.argv[1:] if argv is None else argv)
    setproctitle.setproctitle(PROCESS_TITLE)
    args._validate_router_args()  # launch_router's own check before starting, a private method of the same classes
    Router.from_args(args).start()


if __name__ == "__main__":
    main()
