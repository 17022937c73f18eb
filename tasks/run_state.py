"""The run's full state to and from storage: policy weights + optimizer (safetensors), the dock with its
partial responses, the prompt cursor, weight version, wandb run id, the config and the iteration's
metrics row. A checkpoint is written at the end of an iteration, after clear/age-sort, by its own task."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import ray
from prefect import task
from prefect.cache_policies import NONE

from ..infra.storage.checkpoint import CheckpointState, load_latest_checkpoint, save_checkpoint
from ..infra.storage.checkpoint_list import checkpoint_url
from ..infra.config.parsing import ConfigError
from ..infra.config.run_config import RunConfig
from ..infra.storage.store import Store, open_store
from ..rollout.prompt_data import PromptCursor
from ..rollout.dock.transfer_dock import TransferDock
from ..rollout.contracts.fleet import Fleet
from .learner.group import LearnerGroup
from .learner.state import from_format_1
from .results import Checkpointed

log = logging.getLogger("spillover")

# Fields a resumed run must share with the run that wrote the checkpoint.
# The dock restores its own staleness bound, group capacity and end-of-response ids, so those may not change either.
RESUME_INVARIANTS = ("model.path", "model.tiny", "model.seed", "data.prompts_path", "data.num_prompts",
                     "rollout.global_batch_size", "rollout.n_samples_per_prompt", "rollout.max_tokens",
                     "rollout.max_model_len", "rollout.max_split", "rollout.max_age", "rollout.over_sampling_groups",
                     "rollout.ignore_eos")


def open_checkpoint_store(cfg: RunConfig) -> Store:
    return open_store(checkpoint_url(cfg), cfg.storage)


def _get(data: dict, dotted: str):
    for part in dotted.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def check_resume_compatible(saved: dict, cfg: RunConfig) -> None:
    """Refuse to resume a checkpoint written with a different model, data or batch shape."""
    now = cfg.model_dump(mode="json")
    changed = [f"{key}: checkpoint {_get(saved, key)!r}, config {_get(now, key)!r}"
               for key in RESUME_INVARIANTS if _get(saved, key) != _get(now, key)]
    if changed:
        raise ConfigError("the checkpoint comes from a different run (" + "; ".join(changed) + "); resume with "
                          "the run's own config, or start a new run_dir")


def write_learner_shards(store: Store, policy: LearnerGroup, cfg: RunConfig, iteration: int) -> list[dict] | None:
    """A learner group of world_size > 1: every rank writes its own slices of the learner state under the
    checkpoint's prefix, concurrently (tasks/learner/shards.py) -> what each wrote; None: one process, whose
    full state goes with the rest."""
    if getattr(policy, "world_size", 1) <= 1:
        return None
    from ..infra.storage.checkpoint import checkpoint_name

    return ray.get(policy.each("write_state_shards", checkpoint_url(cfg), cfg.storage, checkpoint_name(iteration)))


def capture(policy: LearnerGroup, dock: TransferDock, cursor: PromptCursor, cfg: RunConfig, iteration: int, weight_version: int, metrics: dict,
            wandb_run_id: str | None, learner_shards: list[dict] | None = None) -> CheckpointState:
    """learner_shards: write_learner_shards' result (the learner state is then in those objects, its layout
    and meta in meta["learner_shards"]), else None (the full state from rank 0 goes in tensors["policy"])."""
    if learner_shards is None:
        tensors, learner_meta = ray.get(policy.get_state.remote())
        groups, shard_infos = {"policy": tensors}, None
    else:
        shard_infos = [part["info"] for part in learner_shards]
        groups, learner_meta = {}, next(info["meta"] for info in shard_infos if info["rank"] == 0)
    dock_arrays, dock_meta = dock.snapshot()
    meta = {"next_iteration": iteration + 1, "weight_version": weight_version, "learner": learner_meta,
            "dock": dock_meta, "cursor": cursor.state_dict(), "wandb_run_id": wandb_run_id,
            "config": cfg.model_dump(mode="json"), "metrics": metrics,
            **({"learner_shards": shard_infos} if shard_infos else {})}
    return CheckpointState(iteration=iteration, tensors=groups, arrays={"dock": dock_arrays}, meta=meta)


def should_checkpoint(cfg: RunConfig, iteration: int) -> bool:
    last = iteration == cfg.schedule.num_iterations - 1
    return last or (iteration + 1) % cfg.storage.checkpoint_interval == 0


@task(name="save_checkpoint", cache_policy=NONE)
def save_run_checkpoint(store: Store | None, policy: LearnerGroup | None, dock: TransferDock,
                        cursor: PromptCursor, cfg: RunConfig, iteration: int,
                        weight_version: int, metrics: dict, wandb_run_id: str | None) -> Checkpointed:
    """The run's state after clear/age-sort, every storage.checkpoint_interval iterations and after the last.
    metrics: the iteration's metrics.jsonl row (restored if the crash comes before it is appended)."""
    if store is None or not should_checkpoint(cfg, iteration):
        return Checkpointed()
    start = time.perf_counter()
    shards = write_learner_shards(store, policy, cfg, iteration)
    state = capture(policy, dock, cursor, cfg, iteration, weight_version, metrics, wandb_run_id, shards)
    prefix = save_checkpoint(store, state, keep=cfg.storage.keep_checkpoints, written=shards)
    return Checkpointed(metrics={"checkpoint_s": time.perf_counter() - start}, prefix=prefix)


def load_resume_point(cfg: RunConfig, store: Store) -> CheckpointState | None:
    """The newest verified checkpoint (corrupt ones are skipped with a warning), checked against cfg."""
    state = load_latest_checkpoint(store)
    if state is not None:
        check_resume_compatible(state.meta["config"], cfg)
    return state


def written_decay_horizon(saved_config: dict) -> int:
    """The lr decay horizon (optimizer steps) of the config a checkpoint records, as the release that wrote it read
    it: optimizer.decay_steps, else schedule.num_iterations x grpo.num_steps_per_rollout."""
    return _get(saved_config, "optimizer.decay_steps") or (
        _get(saved_config, "schedule.num_iterations") * _get(saved_config, "grpo.num_steps_per_rollout"))


def restore_weights(policy: LearnerGroup, fleet: Fleet | None, state: CheckpointState) -> int:
    """Learner state into the policy actor, its weights to the fleet's engines -> the weight version."""
    meta = state.meta
    if "learner_shards" in meta:  # written rank by rank: put the slices together, each rank keeps its own
        from .learner.shards import assemble

        parts = [(state.tensors[f"policy-rank{info['rank']:03d}"], info) for info in meta["learner_shards"]]
        tensors, learner_meta = assemble(parts)
    else:
        tensors, learner_meta = state.tensors["policy"], meta["learner"]
    if learner_meta.get("format") == 1:  # before the lr decay was recorded: the one its config gave
        learner_meta = from_format_1(learner_meta, written_decay_horizon(meta["config"]))
    ray.get(policy.set_state.remote(tensors, learner_meta))
    version = int(meta["weight_version"])
    if fleet is not None:
        fleet.load_policy_weights(policy, version)
    log.info("resumed from iteration %d (weight version %d)", state.iteration, version)
    return version


def rewind_metrics(run_dir: Path, next_iteration: int, saved_row: dict | None) -> None:
    """metrics.jsonl as of the checkpoint: rows of iterations that will be redone go; the checkpoint's own
    row comes back if the crash happened before it was appended."""
    from ..infra.tracking.run_tracker import read_metrics, write_metrics

    rows = [r for r in read_metrics(run_dir) if r.get("iteration", 0) < next_iteration]
    if saved_row is not None and not any(r.get("iteration") == saved_row.get("iteration") for r in rows):
        rows.append(saved_row)
    write_metrics(run_dir, sorted(rows, key=lambda r: r.get("iteration", 0)))


def open_and_check(cfg: RunConfig, resume: bool) -> tuple[Store, CheckpointState | None]:
    """The run's checkpoint store, checked reachable now; the state to resume from (None: fresh start).

    A fresh start on a location that already holds checkpoints is refused: it would mix two runs.
    """
    from ..infra.storage.checkpoint import list_checkpoints
    from ..infra.storage.store import check_storage

    from ..infra.storage.store import StorageError

    try:
        store = check_storage(checkpoint_url(cfg), cfg.storage)
    except StorageError as err:  # at start: a config to fix (URL, endpoint, credentials), not a crashed run
        raise ConfigError(str(err)) from None
    if not resume:
        done = [c.iteration for c in list_checkpoints(store) if c.complete]
        if done:
            raise ConfigError(f"{store.url} already holds checkpoints (up to iteration {max(done)}); continue "
                              f"with `spillover resume {cfg.run_dir}` or pick a new run_dir / storage.url")
        return store, None
    return store, load_resume_point(cfg, store)
