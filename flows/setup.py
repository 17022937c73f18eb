"""Build and tear down what a training run needs: Ray, model, prompts, dock, engines, learners.

The result is a `Run`: the long-lived parts, built once (from a checkpoint when resuming) and handed to the
tasks piece by piece; no task replaces any of them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from .parts import NewParts, RunParts
from ..infra.cluster import init_ray
from ..infra.config.parsing import ConfigError
from ..infra.config.run_config import RunConfig, save_run_config
from ..infra.config.placement_plan import needs_engines as plan_needs_engines, placement_plan, plan_problems
from ..infra.imports import load_function
from ..infra.storage.model_staging import is_remote_model, stage_on_other_nodes
from ..infra.data_files import DataFile, data_file, pin_data
from ..infra.hub_models import is_hub_id, resolve_on_other_nodes, resolve_reward_models
from ..infra.models import end_token_ids, load_tokenizer, resolve_model_path
from ..rollout.builtin import toy_task
from ..rollout.context import RolloutContext, build_context
from ..rollout.controller import RolloutController
from ..rollout.prompt_data import read_prompt_file
from ..rollout.scoring.reward_models import start_reward_models
from ..tasks.reward import REWARD_KEYWORDS, RewardSetup

if TYPE_CHECKING:
    from ..infra.storage.checkpoint import CheckpointState
    from ..rollout.fleet.manager import RolloutManager
    from ..tasks.learner.group import LearnerGroup

log = logging.getLogger(__name__)
BUILTIN_TASK_REWARD = "spillover.rollout.builtin.toy_task.reward"


@dataclass(frozen=True)
class Run:
    cfg: RunConfig
    run_dir: Path
    model_path: Path
    controller: RolloutController
    context: RolloutContext          # rollout functions' data_source (per iteration: context.for_iteration)
    reward: RewardSetup
    policy: LearnerGroup | None      # None: rollout only (no learner)
    ref: LearnerGroup | None         # None: no KL, or the policy's ranks hold the reference (with_policy)
    fleet: RolloutManager | None     # None: no engines (replayed debug data, SFT without eval)
    parts: RunParts                  # where policy, ref and fleet go back to (shutdown_run)
    baseline: float | None = None    # the built-in task's prompt-independent baseline reward

    @property
    def prompts(self):
        return self.context.prompts

    @property
    def dock(self):
        return self.context.dock

    @property
    def cursor(self):
        return self.context.cursor


def prepare_data(cfg: RunConfig, run_dir: Path) -> Path | DataFile:
    """The prompt file of the run: data.prompts_path (a Hub file from huggingface_hub's cache, an S3 object's copy in
    data.cache_dir), or the built-in task generated into the run dir."""
    if cfg.data.prompts_path:
        return data_file(cfg.data.prompts_path, "data.prompts_path", cfg)
    if cfg.data.builtin_task == "calculator":
        from ..rollout.builtin import calculator

        return calculator.generate_dataset(run_dir / "data" / "train.jsonl", cfg.data.num_prompts, cfg.model.seed)
    if cfg.data.builtin_task == "arithmetic":
        from ..rollout.builtin import arith_task

        return arith_task.generate_dataset(run_dir / "data" / "train.parquet", cfg.data.num_prompts, cfg.model.seed)
    return toy_task.generate_dataset(run_dir / "data" / "train.jsonl", cfg.data.num_prompts, cfg.model.seed)


def needs_engines(cfg: RunConfig) -> bool:
    """Engines generate; replayed debug data and SFT samples need them only for eval (infra/config/placement_plan.py)."""
    return plan_needs_engines(cfg)


def refuse_unplaceable(cfg: RunConfig, resuming: bool) -> None:
    """Refuse, before any placement group waits for resources (120-600 s), a placement plan that the joined Ray
    cluster cannot hold, or multi-node placement with node-local storage (`spillover check` says the same earlier)."""
    from .check import cluster_from_ray

    cluster = cluster_from_ray(cfg.engines.ray_address)
    problems = plan_problems(placement_plan(cfg, cluster.gpus, resuming=resuming), cluster, cfg.storage.url)
    if problems:
        raise ConfigError("; ".join(problems))


def build_run(cfg: RunConfig, saved: CheckpointState | None = None, parts: RunParts | None = None) -> Run:
    """Everything the tasks need. Fails early on bad config or input.

    saved: the checkpoint to resume from (the dock and cursor come from it; weights are restored by
    spillover.tasks.run_state.restore_weights). parts: where engines and learner groups come from (flows/parts.py;
    None: started for this run, shut down by shutdown_run)."""
    parts = parts if parts is not None else NewParts()
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    reward_fn = load_function(cfg.grpo.reward_function_path, "grpo.reward_function_path",
                              required_params=("response", "label"), optional_keywords=REWARD_KEYWORDS)
    controller = RolloutController(cfg)
    model_path = resolve_model_path(cfg.model, run_dir, max(512, cfg.rollout.max_model_len), cfg.storage)
    if is_hub_id(cfg.model.path):  # the run's config keeps the commit: a resume loads these weights, not the Hub's newest
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"revision": model_path.name})})
    cfg, reward_model_entries = resolve_reward_models(cfg)  # likewise: Hub ids at their commits, actors load snapshots
    cfg = pin_data(cfg)  # hf:// and s3:// data fetched here, once; the config names the Hub commit each was read at
    tokenizer = load_tokenizer(model_path)
    max_prompt = cfg.rollout.max_model_len - cfg.rollout.max_tokens
    prompts = read_prompt_file(prepare_data(cfg, run_dir), tokenizer, cfg.data, max_prompt)
    if prompts.truncated_count:
        log.warning("%d prompts longer than %d tokens were cut to their last %d tokens (data.over_long_prompts="
                    "truncate); metrics: truncated_prompts", prompts.truncated_count, max_prompt, max_prompt)
    save_run_config(cfg, run_dir)  # only once the config has proven loadable: resume starts from it
    needed = cfg.schedule.num_iterations * cfg.rollout.global_batch_size
    if needed > len(prompts):
        log.warning("%d prompts for %d groups: the run goes over the data more than once", len(prompts), needed)
    stop_ids = () if cfg.rollout.ignore_eos else end_token_ids(model_path, tokenizer)  # the dock ends no row at EOS
    context = build_context(cfg, tokenizer, prompts, stop_ids, reward_fn, saved)  # a bad checkpoint fails here
    init_ray(cfg.engines.ray_address)
    refuse_unplaceable(cfg, resuming=saved is not None)
    if is_remote_model(cfg.model.path):  # every node reads the model from its own local copy
        stage_on_other_nodes(str(model_path), cfg.storage)
    if is_hub_id(cfg.model.path):  # likewise: each node's Hub cache holds the recorded commit at the same path
        resolve_on_other_nodes(cfg.model.path, cfg.model.revision, model_path)
    for i, (entry, loaded) in enumerate(zip(cfg.grpo.reward_models, reward_model_entries)):
        if is_hub_id(entry.path):
            resolve_on_other_nodes(entry.path, entry.revision, Path(loaded.path), f"grpo.reward_models[{i}].path")
    reward_models = start_reward_models(reward_model_entries, cfg.model.dtype)  # first: a bad folder fails early
    try:
        learners, fleet = start_learners_and_engines(cfg, model_path, parts, resuming=saved is not None)
    except BaseException:  # no Run holds them yet, so shutdown_run could not give them back
        reward_models.shutdown()
        raise
    builtin = cfg.grpo.reward_function_path == BUILTIN_TASK_REWARD
    context = context.with_fleet(fleet)
    reward = RewardSetup(tokenizer, stop_ids, reward_fn, cfg.grpo.reward_function_path, cfg.grpo.rule_reward_weight,
                         exact_match=toy_task.exact_match if builtin else None,
                         prompt_texts=lambda ids: [prompts.texts[i] for i in context.cursor.dataset_indices(ids).tolist()],
                         concurrency=cfg.grpo.reward_concurrency, timeout_s=cfg.grpo.reward_timeout_s,
                         reward_models=reward_models,
                         keep_sample_rewards=builtin)  # a custom rollout function's own rewards, unless one is set
    return Run(cfg, run_dir, Path(model_path), controller, context, reward, learners[0], learners[1], fleet, parts, baseline=toy_task.prompt_independent_baseline(prompts.labels)[1] if builtin else None)


def start_learners_and_engines(cfg: RunConfig, model_path: Path, parts: RunParts, resuming: bool = False
                               ) -> tuple[tuple[LearnerGroup | None, LearnerGroup | None], RolloutManager | None]:
    """((policy, ref), fleet) from `parts`. Colocated engines live in the policy's ranks (placement.colocate): both
    are started for the run (parts shuts them down at its end). schedule.debug_rollout_only starts no learner
    ((None, None)), unless resuming: the policy then carries the checkpoint's weights to the engines (it never
    trains)."""
    if cfg.placement.colocate:
        return start_colocated(cfg, model_path, parts)
    if cfg.schedule.debug_rollout_only and not resuming:
        learners = (None, None)
    else:
        learners = parts.learners(model_path, cfg)
    if not needs_engines(cfg):
        return learners, None
    try:
        return learners, parts.fleet(cfg.engines, model_path, cfg.rollout.deterministic_sampling, cfg.model.seed)
    except BaseException:
        give_back(parts, learners, keep=False)
        raise


def start_colocated(cfg: RunConfig, model_path: Path, parts: RunParts
                    ) -> tuple[tuple[LearnerGroup, LearnerGroup | None], RolloutManager | None]:
    from ..rollout.fleet.manager import RolloutManager
    from ..tasks.learner.group import create_learners

    learners = create_learners(model_path, cfg)
    if not needs_engines(cfg):
        return learners, None
    try:
        return learners, RolloutManager(cfg.engines, str(model_path), hosts=learners[0].actors, seed=cfg.model.seed,
                                        deterministic_inference=cfg.rollout.deterministic_sampling)
    except BaseException:
        give_back(parts, learners, keep=False)
        raise


def give_back(parts: RunParts, started: Iterable[LearnerGroup | RolloutManager | None], keep: bool) -> None:
    """Each engine fleet and learner group back to where it came from (kept there for the next run if keep)."""
    for part in started:
        if part is not None:
            parts.give_back(part, keep=keep)


def shutdown_run(run: Run | None, keep_parts: bool = True) -> None:
    """keep_parts=False: a run that failed gives its parts up, even to a RunParts that would keep them."""
    if run is None:
        return
    give_back(run.parts, (run.fleet, run.policy, run.ref), keep_parts)
    run.context.close()
    if run.reward.reward_models:
        run.reward.reward_models.shutdown()
