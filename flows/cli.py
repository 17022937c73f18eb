"""`spillover` command line: train, resume, eval, serve, submit, report, check. Exit codes: 0 ok, 1 run failed,
2 bad config or input. train, resume, serve and eval run `spillover check`'s preflight (flows/check.py) first, before
Prefect, Ray or any model: a refused input is one line per problem on stderr and exit 2."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from pathlib import Path

from .parts import RunParts
from .run_lock import RunLockedError
from ..infra.config.parsing import ConfigError
from ..infra.data_files import DataFileError
from ..infra.hub_models import HubModelError
from ..infra.storage.errors import CheckpointError, StorageError
from ..infra.config.run_config import load_config
from ..infra.prefect.env import apply_process_defaults, quiet_console

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
PACKAGE_DIRS = tuple(Path(__file__).resolve().parents[1] / name for name in ("flows", "tasks", "rollout", "infra"))


def user_frames(err: BaseException) -> list[str]:
    """The frames of the user's own code in err's traceback and its causes' (not spillover's, an installed package's
    or Python's), formatted as Python prints them, each once: where in their function it failed."""
    installed = (Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve())
    frames, seen, current = [], set(), err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for frame in traceback.extract_tb(current.__traceback__):
            path = Path(frame.filename).resolve()
            key = (frame.filename, frame.lineno, frame.name)
            if key not in {(f.filename, f.lineno, f.name) for f in frames} and not any(
                    path.is_relative_to(p) for p in (*PACKAGE_DIRS, *installed)):
                frames.append(frame)
        current = current.__cause__ or current.__context__
    return traceback.format_list(frames)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/tiny.yaml", help="YAML run config (default: configs/tiny.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. rollout.max_split=4 run_dir=runs/exp1")


class InputRefused(Exception):
    """The preflight's problems, one line each."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def refuse_bad_inputs(args, cfg, **options) -> None:
    """Run the preflight (spillover.flows.check.preflight options) and raise InputRefused with its problems, if any; then make
    the process ready for flows (Prefect imported only now: ~1-3 CPU-s that a refused input does not pay)."""
    from .check import preflight

    report = preflight(cfg, **options)
    if report.problems:
        raise InputRefused(report.problems)
    ready_for_flows(args)


def ready_for_flows(args) -> None:
    """The fate-shared ephemeral Prefect server (infra/prefect/env.py) and the quiet console (--verbose: not)."""
    apply_process_defaults()
    quiet_console(verbose=args.verbose)


def cmd_check(args) -> int:
    from .check import plan_table, preflight

    if args.nodes < 1 or (args.gpus is not None and args.gpus < 0):
        raise ConfigError("--gpus must be >= 0 and --nodes >= 1")
    if args.nodes > 1 and args.gpus is None:
        raise ConfigError("--nodes plans for a machine you are not on: give --gpus N (all nodes together) with it")
    report = preflight(load_config(args.config, args.overrides), gpus=args.gpus, nodes=args.nodes, fresh=True)
    if report.problems:
        raise InputRefused(report.problems)
    print(plan_table(report))
    return EXIT_OK


def cmd_train(args, parts: RunParts | None) -> int:
    cfg = load_config(args.config, args.overrides)
    refuse_bad_inputs(args, cfg, fresh=True)
    from .train import grpo_train

    summary = grpo_train(cfg, parts=parts)
    print(json.dumps(summary, indent=2))
    return EXIT_OK


def cmd_resume(args, parts: RunParts | None) -> int:
    from ..infra.config.run_config import load_run_config
    from ..infra.storage.checkpoint_list import newest_complete_checkpoint

    cfg = load_run_config(args.run_dir, args.overrides)
    done, total = newest_complete_checkpoint(cfg), cfg.schedule.num_iterations
    if done is not None and done + 1 >= total:  # before Ray, Prefect or wandb: nothing of the run is touched
        print(f"{args.run_dir} has trained all {total} iterations (checkpoint {done}): nothing to resume; "
              f"to train longer: `spillover resume {args.run_dir} schedule.num_iterations=N` with N > {total}",
              file=sys.stderr)
        return EXIT_OK
    where = "the start (no checkpoint yet)" if done is None else f"checkpoint {done} (iteration {done + 1} of {total})"
    print(f"resuming {args.run_dir} from {where}", file=sys.stderr)
    refuse_bad_inputs(args, cfg, resuming=True)
    from .train import grpo_train

    summary = grpo_train(cfg, resume=True, parts=parts)
    print(json.dumps(summary, indent=2))
    return EXIT_OK


def cmd_eval(args, parts: RunParts | None) -> int:
    from .eval import eval_data_sets, evaluate, format_table, resolve_target

    target = resolve_target(args.target, args.overrides, args.config)
    data_sets = eval_data_sets(target.cfg, args.data, args.name)
    refuse_bad_inputs(args, target.cfg, purpose="eval", model_dir=target.model_dir,
                      data_paths={"--data": args.data} if args.data else {})
    for result, path in evaluate(target, data_sets, parts):
        print(format_table(result))
        print(path)
    return EXIT_OK


def cmd_export(args) -> int:
    from .eval import export_newest_policy
    from ..infra.config.run_config import load_run_config

    out, source = export_newest_policy(load_run_config(args.run_dir, args.overrides), Path(args.run_dir), Path(args.to))
    print(json.dumps({"path": str(out), **source}))
    return EXIT_OK


def cmd_serve(args) -> int:
    cfg = load_config(args.config, args.overrides)
    refuse_bad_inputs(args, cfg)
    from .serve import serve_deployments

    only = [d.strip() for d in args.deployments.split(",") if d.strip()] if args.deployments else None
    serve_deployments(cfg, cron=args.cron, only=only, limit=args.limit)
    return EXIT_OK


def cmd_submit(args) -> int:
    from .serve import submit_run

    run = submit_run(args.deployment, args.config, args.overrides, wait_s=args.wait, resume=args.resume)
    outcome = run_outcome(run)
    print(json.dumps(outcome))
    if args.wait and outcome["state"] != "COMPLETED":
        print(f"spillover: flow run {run.name} ended {outcome['state']}: {outcome.get('message') or 'no message'} "
              "(its logs and traceback are in the Prefect UI)", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def run_outcome(run) -> dict:
    """A Prefect FlowRun -> what `spillover submit` prints: id, name, state and, unless it completed, the state's
    message (a failed run's: the exception that ended it)."""
    state = run.state.type.value if run.state is not None else "UNKNOWN"
    out = {"flow_run_id": str(run.id), "flow_run_name": run.name, "state": state}
    if state != "COMPLETED" and run.state is not None and run.state.message:
        out["message"] = run.state.message
    return out


def cmd_report(args) -> int:
    from ..infra.tracking.report import write_report

    for path in write_report(args.run_dir):
        print(path)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spillover", description="GRPO training with partial rollout.")
    parser.add_argument("--verbose", action="store_true", help="print Prefect's per-task and flow-run state lines "
                        "on the console too (they are always in the Prefect UI)")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train from a config (local Ray, CPU engines, ephemeral Prefect)")
    _add_config_args(train)
    train.set_defaults(fn=cmd_train)

    resume = sub.add_parser("resume", help="continue a run from its newest verified checkpoint",
                            description="Continue the run in RUN_DIR (its config.json) from the newest verified "
                            "checkpoint, partial responses included. Storage credentials are not saved with the run: "
                            "give them again (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or key=value).")
    resume.add_argument("run_dir", metavar="RUN_DIR", help="the run_dir of an earlier `spillover train`")
    resume.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. schedule.num_iterations=200 (model, data and batch shape "
                        "must stay as they were)")
    resume.set_defaults(fn=cmd_resume)

    evaluate = sub.add_parser(
        "eval", help="pass@1 (greedy) and pass@k (sampled) of a run's newest verified policy or an HF model folder",
        description="Start engines on the newest verified checkpoint of RUN_DIR (or on an HF model folder), "
        "generate a greedy and eval.k sampled responses per prompt of --data (or of each data.eval_paths set), score "
        "them with the run's reward function and write RUN_DIR/eval/NAME.json; seeded by model.seed when the run "
        "samples seeded (rollout.deterministic_sampling).")
    evaluate.add_argument("target", metavar="RUN_DIR|MODEL_DIR|ORG/NAME",
                          help="a run_dir of `spillover train`, an HF folder, or a Hugging Face Hub id")
    evaluate.add_argument("--data", default=None, help="prompt file (JSON Lines or Parquet, the run's data.* keys); "
                          "default: every data set of the run's data.eval_paths, one result file each")
    evaluate.add_argument("--name", default=None, help="result name of --data (default: the data file's stem)")
    evaluate.add_argument("--config", default=None, help="YAML run config for an HF model folder (e.g. a recipe of "
                          "configs/gpu/); a run dir uses its own")
    evaluate.add_argument("overrides", nargs="*", metavar="key=value",  # also after --data: see parse_args
                          help="config overrides, e.g. eval.k=8 eval.temperature=0.6 engines.rollout_num_gpus=1")
    evaluate.set_defaults(fn=cmd_eval)

    export = sub.add_parser("export", help="write a run's newest verified policy as an HF folder",
                            description="The newest verified checkpoint of RUN_DIR (sharded or not) as an HF folder "
                            "(config, tokenizer, model.safetensors, sha256.json) that transformers, the engines and "
                            "model.path (also from s3://) load.")
    export.add_argument("run_dir", metavar="RUN_DIR", help="the run_dir of a training run")
    export.add_argument("--to", required=True, metavar="DIR", help="the folder to write")
    export.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (e.g. storage.url)")
    export.set_defaults(fn=cmd_export)

    serve = sub.add_parser("serve", help="serve the deployments of prefect.yaml from this process (needs "
                           "PREFECT_API_URL of a running `prefect server`)",
                           description="Serve the deployments declared in prefect.yaml; runs start from the UI, "
                           "`prefect deployment run` or `spillover submit` and run here until Ctrl-C.")
    _add_config_args(serve)
    serve.add_argument("--cron", help="cron of the nightly smoke run (default: schedule.cron, else prefect.yaml)")
    serve.add_argument("--deployments", help="comma-separated names to serve (default: all in prefect.yaml)")
    serve.add_argument("--limit", type=int, default=None, help="most flow runs at once (default: no limit)")
    serve.set_defaults(fn=cmd_serve)

    submit = sub.add_parser("submit", help="start a run of a served deployment through the Prefect API",
                            description="Start a flow run of a deployment. Config: --config FILE, else the "
                            "deployment's default config, with key=value overrides on top.")
    submit.add_argument("--deployment", default="grpo-train/train", help="FLOW/DEPLOYMENT (default: grpo-train/train)")
    submit.add_argument("--config", default=None, help="YAML run config (default: the deployment's own)")
    submit.add_argument("--resume", action="store_true",
                        help="the training run goes on from its run_dir's newest checkpoint (as `spillover resume`)")
    submit.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    submit.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                        help="wait up to SECONDS for the run to finish; exit 1 unless it completed")
    submit.set_defaults(fn=cmd_submit)

    report = sub.add_parser("report", help="write PNG plots of a run into RUN_DIR/report/",
                            description="Plots from RUN_DIR/metrics.jsonl: reward, response lengths, rows "
                            "carried over, time per task.")
    report.add_argument("run_dir", metavar="RUN_DIR", help="the run_dir of a training run")
    report.set_defaults(fn=cmd_report)

    check = sub.add_parser(
        "check", help="preflight: refuse in seconds what would stop a run (train, resume, serve and eval run it first)",
        description="Check the config, every line of the data files, the reward/rollout/env functions, the storage, the "
        "model folder and tokenizer, SGLang's flags, and the placement plan (every actor's CPUs and GPUs, a memory "
        "estimate per GPU) against the Ray cluster of RAY_ADDRESS (joined, never started), this machine, or --gpus N. "
        "Prints one line per problem on stderr and exits 2, or prints the plan and exits 0.")
    _add_config_args(check)
    check.add_argument("--gpus", type=float, default=None, metavar="N",
                       help="plan for N GPUs in all (a machine you are not on) instead of the Ray cluster or this one")
    check.add_argument("--nodes", type=int, default=1, metavar="M", help="with --gpus: over M nodes (default 1)")
    check.set_defaults(fn=cmd_check)
    for flow_command in (train, resume, evaluate, serve, submit):  # `spillover train --verbose` too
        flow_command.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                                  help="print Prefect's per-task and flow-run state lines on the console too")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parse_args, but `eval` takes key=value overrides after its options too (argparse alone takes positionals
    only before `--data FILE`)."""
    args, extra = parser.parse_known_args(argv)
    if extra and (args.fn is not cmd_eval or any("=" not in e or e.startswith("-") for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    return args


def main(argv: list[str] | None = None, parts: RunParts | None = None) -> int:
    """parts: where train, resume and eval get engines and learner groups (flows/parts.py; None: started for the
    command; a caller in process, such as the test suite, may lend kept ones)."""
    args = parse_args(build_parser(), argv)
    preflighted = args.fn in (cmd_check, cmd_train, cmd_resume, cmd_eval, cmd_serve)  # Prefect after the check
    apply_process_defaults(prefect=not preflighted)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not preflighted:
        quiet_console(verbose=args.verbose)
    try:
        return args.fn(args, parts) if args.fn in (cmd_train, cmd_resume, cmd_eval) else args.fn(args)
    except InputRefused as err:
        for problem in err.problems:
            print(f"spillover: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (ConfigError, DataFileError, HubModelError) as err:  # each names the setting and the fix
        print(f"spillover: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RunLockedError as err:
        print(f"spillover: {err}", file=sys.stderr)
        return EXIT_FAILED
    except (StorageError, CheckpointError) as err:  # unreachable storage, bad credentials, no usable checkpoint
        print(f"spillover: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (FileNotFoundError, ValueError) as err:
        frames = user_frames(err)  # a user's function failed at run time (a reward, a rollout): where, once
        if frames:
            print("Traceback of your code (most recent call last):\n" + "".join(frames).rstrip(), file=sys.stderr)
        print(f"spillover: {type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
