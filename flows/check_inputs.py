"""The input checks of `spillover check` (flows/check.py): each takes the run's config and returns one line per
problem ([] when all is well). They reuse the loading code a run uses (rollout/prompt_data.py, infra/imports.py,
infra/storage/store.py, infra/models.py), so a file or function that passes here loads at start; none imports torch, Ray
or Prefect.
"""
from __future__ import annotations

import importlib.util
import json
import os
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["REWARD_KEYWORDS", "check_data", "check_imports", "check_model", "check_reward_models", "check_sglang_flags",
           "check_storage_access"]

REWARD_KEYWORDS = ("sample", "samples", "metadata")  # tasks/reward.py's (which imports Prefect); a unit test compares
BUILTIN_TASK_REWARD = "spillover.rollout.builtin.toy_task.reward"

SGLANG_RESERVED_TOKENS = 2  # SGLang caps output at context_len - 1 - input - 1 tokens


def check_model(cfg, model_dir: str | Path | None = None) -> tuple[Any, list[str]]:
    """(tokenizer or None, problems) of model.path (or model_dir): an HF folder with config.json, *.safetensors and a
    tokenizer that loads, or a Hub id resolved to one (huggingface_hub's cache; a download when online). Empty
    model.path: the tiny model's tokenizer (the model is built at start); s3://: staged at start, so no tokenizer
    here."""
    from ..infra.hub_models import HubModelError, is_hub_id, resolve_hub_model
    from ..infra.storage.model_staging import is_remote_model

    path = model_dir or cfg.model.path
    if not path:
        if cfg.model.tiny.tokenizer == "bpe":
            from ..infra.tiny_bpe import build_bpe_tokenizer

            return build_bpe_tokenizer(seed=cfg.model.seed), []
        from ..infra.models import build_char_tokenizer

        return build_char_tokenizer(), []
    if is_remote_model(str(path)):
        return None, []
    if is_hub_id(str(path)):
        try:
            path = resolve_hub_model(str(path), cfg.model.revision)[0]
        except HubModelError as err:
            return None, [str(err)]
    folder = Path(path).expanduser()
    fix = "point model.path at an HF checkpoint folder (config.json, *.safetensors, tokenizer files) or an s3:// URL"
    if not folder.is_dir():
        return None, [f"model.path={str(path)!r} is not a folder; {fix}"]
    missing = [what for what, ok in (("config.json", (folder / "config.json").is_file()),
                                     ("*.safetensors weights", any(folder.glob("*.safetensors")))) if not ok]
    problems = [f"model.path={str(path)!r} has no {' and no '.join(missing)}; {fix}"] if missing else []
    problems += check_model_length(cfg, folder)
    try:
        from ..infra.models import load_tokenizer

        return load_tokenizer(folder), problems
    except Exception as err:  # noqa: BLE001 -- whatever transformers raises, the user needs one line
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return None, problems + [f"model.path={str(path)!r}: its tokenizer does not load ({reason}); {fix}"]


def check_data(cfg, tokenizer, extra_paths: dict[str, str] | None = None) -> list[str]:
    """Every prompt file of the run (data.prompts_path, data.eval_paths, extra_paths) read whole with the run's own
    reader: the first bad line or row of each, named with file and line; then every label (null ones, and labels
    the built-in task's reward cannot read). A Hub file (hf://) is fetched into huggingface_hub's cache, an S3 object
    (s3://) into data.cache_dir, where the run finds them; a missing or unreachable one is one line."""
    from ..infra.data_files import DataFileError, data_file
    from ..rollout.prompt_data import PromptFileError, read_prompt_file

    files = {"data.prompts_path": cfg.data.prompts_path,
             **{f"data.eval_paths.{k}": v for k, v in cfg.data.eval_paths.items()}, **(extra_paths or {})}
    max_prompt = cfg.rollout.max_model_len - cfg.rollout.max_tokens
    problems = []
    for setting, path in files.items():
        if not path:
            continue  # data.prompts_path empty: the built-in task is generated at start
        try:
            path = data_file(path, setting, cfg, recheck=True)
        except DataFileError as err:
            problems.append(str(err))
            continue
        if not Path(path).is_file():
            problems.append(f"{setting}={path!r} does not exist; give a JSON Lines or Parquet prompt file")
            continue
        if tokenizer is not None:
            try:
                read_prompt_file(path, tokenizer, cfg.data, max_prompt)
            except PromptFileError as err:
                problems.append(str(err))
                continue
        problems += _label_problems(path, cfg)
    return problems


def _label_problems(path, cfg) -> list[str]:
    """The first row whose label the reward function cannot use: null, or (built-in task) not an integer. Rows of a
    built-in format (data.format) are read converted, as the run reads them (their label is `label`)."""
    from ..rollout.prompt_data import PromptFileError, formatted_rows

    key = cfg.data.label_key if cfg.data.format == "prompt_label" else "label"
    builtin = cfg.grpo.reward_function_path == BUILTIN_TASK_REWARD
    try:
        for where, row in formatted_rows(path, cfg.data.format, [key]):
            label = row.get(key)
            if label is None and key in row:
                return [f"{where}: label {key!r} is null; expected the answer the reward function "
                        f"({cfg.grpo.reward_function_path}) compares with: give one, or set data.label_key"]
            if builtin and (isinstance(label, bool) or not isinstance(label, (int, str)) or
                            not str(label).strip().lstrip("-").isdigit()):
                return [f"{where}: label {key!r} is {label!r}; the built-in task's reward ({BUILTIN_TASK_REWARD}) "
                        "expects an integer n (the answer to 'a*n=')"]
    except PromptFileError as err:  # already reported by the reader (or no tokenizer to read with): the row's error
        return [str(err)]
    return []


def check_imports(cfg, reward_only: bool = False) -> list[str]:
    """The reward, rollout, eval and env functions import and take the arguments the run passes them (reward_only:
    `spillover eval`, which generates without the run's rollout function or tools)."""
    from ..infra.imports import ImportPathError, load_function
    from ..rollout.contracts.rollout_function import load_rollout_function
    from ..rollout.tools.env import load_env_factory

    checks = [lambda: load_function(cfg.grpo.reward_function_path, "grpo.reward_function_path",
                                    required_params=("response", "label"), optional_keywords=REWARD_KEYWORDS)]
    if not reward_only and not cfg.storage.load_debug_rollout_data:
        checks.append(lambda: load_rollout_function(cfg.rollout.rollout_function_path, "rollout.rollout_function_path"))
    if not reward_only and cfg.rollout.eval_function_path:
        checks.append(lambda: load_rollout_function(cfg.rollout.eval_function_path, "rollout.eval_function_path"))
    if not reward_only and cfg.rollout.env_path:
        checks.append(lambda: load_env_factory(cfg.rollout.env_path))
    problems = []
    for check in checks:
        try:
            check()
        except ImportPathError as err:
            problems.append(str(err))
    return problems


def check_fresh_run_dir(cfg) -> list[str]:
    """A fresh `train` on a checkpoint location that already holds checkpoints is refused at start (it would mix two
    runs): say so now, with the way on."""
    from ..infra.storage.checkpoint_list import newest_complete_checkpoint
    from ..infra.storage.store import StorageError

    try:
        done = newest_complete_checkpoint(cfg)
    except StorageError:
        return []  # check_storage_access names an unreachable location
    if done is None:
        return []
    return [f"run_dir={cfg.run_dir} already holds checkpoints (up to iteration {done}): resume it with "
            f"`spillover resume {cfg.run_dir}`, or choose another run_dir (or storage.url)"]


def check_reward_models(cfg) -> list[str]:
    """Each grpo.reward_models entry named by Hub id resolves (huggingface_hub's cache; a download when online), as
    the run resolves it at start; a local folder is the reward model actor's to load."""
    from ..infra.hub_models import HubModelError, is_hub_id, resolve_hub_model

    problems = []
    for i, entry in enumerate(cfg.grpo.reward_models):
        if is_hub_id(entry.path):
            try:
                resolve_hub_model(entry.path, entry.revision, field=f"grpo.reward_models[{i}].path")
            except HubModelError as err:
                problems.append(str(err))
    return problems


def check_model_length(cfg, folder: Path) -> list[str]:
    """rollout.max_model_len within what the model's positions reach (config.json max_position_embeddings). SGLang
    engines (engines.sglang_args.context_length, else those positions) end every request 2 tokens short of their
    context length (scheduler.init_req_max_new_tokens), so a row needs that much room more there: otherwise a row
    whose budget runs to the last positions could never finish."""
    try:
        positions = json.loads((folder / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        positions = None
    problems = []
    wanted = cfg.rollout.max_model_len
    if isinstance(positions, int) and wanted > positions:
        problems.append(f"rollout.max_model_len ({wanted}) is more than the model's max_position_embeddings "
                        f"({positions}, {folder / 'config.json'}): lower rollout.max_model_len (and rollout.max_tokens "
                        "with it)")
    context = cfg.engines.sglang_args.get("context_length", positions)
    if cfg.engines.backend == "sglang" and isinstance(context, int) and wanted > context - SGLANG_RESERVED_TOKENS:
        problems.append(f"rollout.max_model_len ({wanted}) leaves SGLang no room: its engines end a request "
                        f"{SGLANG_RESERVED_TOKENS} tokens short of their context length ({context}); lower "
                        f"rollout.max_model_len to {context - SGLANG_RESERVED_TOKENS} or raise "
                        "engines.sglang_args.context_length")
    return problems


def check_storage_access(cfg, deadline_s: float = 10.0) -> list[str]:
    """storage.url reachable and writable: an s3:// location by a probe object written, read back and deleted within
    deadline_s (spillover.infra.storage.store.check_storage); a local one by the nearest existing folder being writable (nothing is
    created)."""
    from ..infra.config.placement_plan import is_local_storage

    if is_local_storage(cfg.storage.url):
        target = Path((cfg.storage.url or "").removeprefix("file://") or Path(cfg.run_dir) / "checkpoints")
        target = target.expanduser().absolute()
        existing = next((p for p in (target, *target.parents) if p.exists()), Path("/"))
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            return [f"storage.url={cfg.storage.url or str(target)!r}: {existing} is not a writable folder; use a "
                    "writable path (or run_dir) or an s3:// URL"]
        return []
    from ..infra.storage.store import StorageError, check_storage

    try:
        check_storage(cfg.storage.url, cfg.storage, deadline_s=deadline_s)
    except StorageError as err:
        return [str(err)]
    return []


def check_sglang_flags(cfg, model_dir: str | Path | None) -> list[str]:
    """The engines' `sglang.launch_server` command line through SGLang's own parser (prepare_server_args) where
    sglang is installed; elsewhere config validation checked engines.sglang_args against the recorded flag list."""
    if cfg.engines.backend != "sglang" or importlib.util.find_spec("sglang") is None:
        return []
    from ..infra.config.sglang_flags import sglang_launch_options
    from ..rollout.sglang.backend import SGLangLaunch, launch_command

    options = sglang_launch_options(cfg.engines, None, cfg.rollout.deterministic_sampling)
    spec = SGLangLaunch(str(model_dir or cfg.model.path), "127.0.0.1", 30000, 30001, tp_size=cfg.engines.gpus_per_engine,
                        max_running_requests=cfg.engines.max_running_requests, **options)
    argv = tuple(launch_command(spec)[3:])  # after `python -m sglang.launch_server`
    refusal = sglang_parser_refusal(argv)
    return [f"engines.sglang_args: SGLang's parser refused the server flags {' '.join(argv)}: {refusal}"] if refusal \
        else []


@cache
def sglang_parser_refusal(argv: tuple[str, ...]) -> str | None:
    """SGLang's own parser on argv (spillover.infra.config.sglang_flags.sglang_refusal, in a subprocess), once per argv; None
    when it accepts, or when it cannot run here (the run's own start then reports what SGLang says)."""
    import subprocess

    from ..infra.config.sglang_flags import sglang_refusal

    try:
        return sglang_refusal(list(argv), timeout_s=180.0)
    except (RuntimeError, subprocess.TimeoutExpired):
        return None
