"""Build and tear down what a training run needs: Ray, model, prompts, dock, engines, learners."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from infra.cluster import init_ray
from infra.config import RunConfig
from infra.imports import load_function
from infra.models import load_tokenizer, resolve_model_path
from rollout import toy_task
from rollout.data_source import PromptCursor, read_prompts
from rollout.controller import RolloutController
from rollout.dock import TransferDock
from tasks.run_state import RunState

log = logging.getLogger(__name__)
BUILTIN_TASK_REWARD = "rollout.toy_task.reward"


def prepare_data(cfg: RunConfig, run_dir: Path) -> Path:
    """The prompt file of the run: data.prompts_path, or the built-in task generated into the run dir."""
    if cfg.data.prompts_path:
        return Path(cfg.data.prompts_path)
    return toy_task.generate_dataset(run_dir / "data" / "train.jsonl", cfg.data.num_prompts, cfg.model.seed)


RUN_CONFIG_FILE = "config.json"


def save_run_config(cfg: RunConfig, run_dir: Path) -> None:
    """<run_dir>/config.json: what `spillover resume RUN_DIR` starts from. Credentials are left out
    (a resumed run reads them from its config or the environment again)."""
    data = cfg.model_dump(mode="json", exclude={"storage": {"access_key_id", "secret_access_key"}})
    (run_dir / RUN_CONFIG_FILE).write_text(json.dumps(data, indent=2))


def load_run_config(run_dir: str | Path, overrides: list[str] | None = None) -> RunConfig:
    from infra.config import ConfigError, build_config

    path = Path(run_dir) / RUN_CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: RUN_DIR must be the run_dir of an earlier `spillover train`")
    return build_config(json.loads(path.read_text()), list(overrides or []) + [f"run_dir={run_dir}"])


def build_run(cfg: RunConfig, with_engines: bool = True) -> RunState:
    """Everything the seven tasks need, in one explicit object. Fails early on bad config or input."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    reward_fn = load_function(cfg.grpo.reward_function_path, "grpo.reward_function_path",
                              required_params=("response", "label"))
    controller = RolloutController(cfg)
    model_path = resolve_model_path(cfg.model, run_dir, max_position=max(512, cfg.rollout.max_model_len))
    tokenizer = load_tokenizer(model_path)
    max_prompt = cfg.rollout.max_model_len - cfg.rollout.max_tokens
    prompts = read_prompts(prepare_data(cfg, run_dir), tokenizer, max_prompt, cfg.data.prompt_key,
                           cfg.data.label_key, cfg.data.over_long_prompts)
    if prompts.truncated_count:
        log.warning("%d prompts longer than %d tokens were cut to their last %d tokens (data.over_long_prompts="
                    "truncate); metrics: truncated_prompts", prompts.truncated_count, max_prompt, max_prompt)
    save_run_config(cfg, run_dir)  # only once the config has proven loadable: resume starts from it
    needed = cfg.schedule.num_iterations * cfg.rollout.global_batch_size
    if needed > len(prompts):
        log.warning("%d prompts for %d groups: the run goes over the data more than once", len(prompts), needed)
    stop_ids = sorted({int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set())
    cursor = PromptCursor(len(prompts), seed=cfg.model.seed, shuffle=cfg.data.shuffle)
    dock = TransferDock.from_config(cfg.rollout, stop_ids)
    # async mode: rows at max age must finish before a batch forms (the staleness bound)
    dock.require_max_age_all_finished = cfg.rollout.require_max_age_all_finished or cfg.rollout.mode == "async"
    init_ray(cfg.engines.ray_address)
    from tasks.learner import create_learners

    policy, ref = create_learners(model_path, cfg)
    engine = None
    # engines generate; replayed debug data and SFT samples need them only for eval
    needs_engines = not cfg.schedule.debug_train_only and (not cfg.rollout.sft or bool(cfg.data.eval_paths))
    if with_engines and needs_engines:
        from rollout.manager import RolloutManager

        engine = RolloutManager(cfg.engines, str(model_path))
    run = RunState(cfg, run_dir, tokenizer, prompts, cursor, dock, engine, policy, ref, reward_fn, stop_ids)
    run.controller = controller
    run.model_path = model_path
    run.exact_match_fn = toy_task.exact_match if cfg.grpo.reward_function_path == BUILTIN_TASK_REWARD else None
    run.baseline = (toy_task.prompt_independent_baseline(prompts.labels)[1]
                    if run.exact_match_fn is not None else None)
    return run


def shutdown_run(run: RunState | None) -> None:
    import ray

    if run is None:
        return
    if run.engine is not None:
        run.engine.shutdown()
    for actor in (run.policy, run.ref):
        if actor is not None:
            ray.kill(actor)
