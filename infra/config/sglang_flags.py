"""SGLang server flags from the run's config (engines.sglang_args), checked against SGLang's own field names.

The names, flags and types come from SGLang 0.5.23's own parser (`sglang_flags.json` next to this file, written
by tests/contract/server_args_extract.py from `ServerArgs.add_cli_args`; types of the fields the project's recorded
sglang-contract lists come from that record). Keys are ServerArgs field names (`mem_fraction_static`,
`context_length`, ...); values become `--flag value` (`true` -> a bare store_true flag, lists -> several values,
dicts -> JSON). Flags spillover sets itself (model path, ports, parallelism, seed, version) are refused here.
"""
from __future__ import annotations

import difflib
import json
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["MANAGED", "check_sglang_args", "server_flags", "server_fields", "sglang_launch_options", "sglang_refusal"]

# Set by the launcher from the engines section and the pool (sglang_backend.launch_command): refused in sglang_args.
MANAGED = {"model_path": "model.path", "host": "(the engine's node)", "port": "(a free port)",
           "nccl_port": "(a free port)", "tp_size": "engines.gpus_per_engine", "base_gpu_id": "(the placement group)",
           "nnodes": "engines.gpus_per_engine", "node_rank": "(the placement group)",
           "dist_init_addr": "(node 0 of the engine)", "random_seed": "model.seed",
           "weight_version": "(the learner's version)", "max_running_requests": "engines.max_running_requests",
           "enable_deterministic_inference": "rollout.deterministic_sampling"}


@cache
def server_fields() -> dict[str, dict[str, Any]]:
    """ServerArgs field name -> {cli_flags, type, default, choices?, cli_kind?} (SGLang 0.5.23)."""
    return json.loads((Path(__file__).with_name("sglang_flags.json")).read_text())["fields"]


@cache
def _absent() -> dict[str, dict[str, Any]]:
    return json.loads((Path(__file__).with_name("sglang_flags.json")).read_text())["absent"]


def _is_bool(field: dict[str, Any]) -> bool:
    return field.get("type") == "bool" or "store_true" in str(field.get("cli_kind", ""))


def check_sglang_args(args: dict[str, Any]) -> dict[str, Any]:
    """Raise ValueError naming engines.sglang_args.<key> and the fix for a key SGLang does not have, a flag
    spillover sets itself, a value outside the field's choices or a non-boolean for a switch; returns args."""
    fields = server_fields()
    for key, value in args.items():
        where = f"engines.sglang_args.{key}"
        if key in _absent():
            gone = _absent()[key]
            raise ValueError(f"{where}: SGLang 0.5.23 removed {gone['old_flag']}; use one of {gone['replacements']}")
        if key not in fields:
            near = difflib.get_close_matches(key.replace("-", "_"), fields, n=3)
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise ValueError(f"{where}: not a field of SGLang 0.5.23's ServerArgs{hint}; keys are ServerArgs field "
                             f"names such as mem_fraction_static, context_length, chunked_prefill_size")
        if key in MANAGED:
            raise ValueError(f"{where}: spillover sets this flag itself from {MANAGED[key]}; remove it here")
        field = fields[key]
        if _is_bool(field) and not isinstance(value, bool):
            raise ValueError(f"{where}: a switch; give true or false, got {value!r}")
        if not field.get("cli_flags"):
            raise ValueError(f"{where}: SGLang 0.5.23 has no command-line flag for it")
        choices = field.get("choices")
        if choices and value is not None and value not in choices:
            raise ValueError(f"{where}: {value!r} is not one of {choices}")
    return args


def server_flags(args: dict[str, Any], deterministic: bool = False) -> list[str]:
    """argv fragment for `sglang.launch_server` from checked sglang_args; deterministic adds
    --enable-deterministic-inference (rollout.deterministic_sampling: seeded sampling is batch-invariant only then)."""
    check_sglang_args(args)
    fields, argv = server_fields(), []
    for key, value in args.items():
        flag = fields[key]["cli_flags"][0]
        if value is False and fields[key].get("cli_kind", "").startswith("boolean_optional"):
            argv.append(fields[key]["cli_flags"][1])  # --no-X: these switches may default to true
            continue
        if value is None or value is False or value == []:
            continue  # store_true switches have no --no-X form: false means leave it off; [] cannot be written
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    if deterministic:
        argv.append(fields["enable_deterministic_inference"]["cli_flags"][0])
    return argv


def sglang_launch_options(cfg: Any, options: dict[str, Any] | None, deterministic: bool) -> dict[str, Any]:
    """SGLangLaunch keyword arguments: `options` with engines.sglang_args appended to its extra_args as flags."""
    options = dict(options or {})
    flags = server_flags(cfg.sglang_args, deterministic=deterministic)
    options["extra_args"] = (*tuple(options.get("extra_args", ())), *flags)
    return options


_PARSE = """
import contextlib, io, sys
said = io.StringIO()
try:
    with contextlib.redirect_stderr(said):
        from sglang.srt.server_args import prepare_server_args
        prepare_server_args(sys.argv[1:])
except SystemExit:
    lines = [line for line in said.getvalue().splitlines() if line.strip()]
    print(lines[-1] if lines else "refused (see sglang.launch_server --help)")
    sys.exit(2)
"""


def sglang_refusal(argv: list[str], timeout_s: float = 120.0) -> str | None:
    """SGLang's own parser (prepare_server_args: its argparse and ServerArgs) on a `sglang.launch_server` argv (after
    the module name) -> None when it accepts, else SGLang's last line (e.g. "sglang serve: error: ambiguous option:
    --cuda-graph-max-bs could match ..."). Needs sglang installed (importlib.util.find_spec("sglang")).

    It runs in a subprocess (~6 CPU-s) on purpose: importing SGLang patches transformers' classes, adds warning
    filters and sets TORCHINDUCTOR_CACHE_DIR and CUDA_CACHE_PATH for every later child process, and
    prepare_server_args resets the root logger (logging.basicConfig(force=True), level info)."""
    done = subprocess.run([sys.executable, "-c", _PARSE, *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode == 0:
        return None
    if done.returncode == 2 and done.stdout.strip():
        return done.stdout.strip().splitlines()[-1]
    raise RuntimeError(f"SGLang's parser could not run (exit {done.returncode}): {done.stderr.strip()[-500:]}")
