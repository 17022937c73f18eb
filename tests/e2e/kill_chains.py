"""The kill -9 chains of tests/e2e/test_kill_resume.py (see its docstring), run as background work
(tests/background.py): they start with the session, at a low CPU priority, and join the background Ray cluster;
the test runs last, runs the uninterrupted reference meanwhile and compares."""
from __future__ import annotations

import shutil
import signal
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from fixtures_prefect import copy_migrated_database
from partial_evidence import CutRow, cut_rows, trained_samples
from small_run import SMALL_RUN
from spillover_runs import PREFECT_SERVER, RAY_AGENTS, ROUTER, Run, Spillover

TASK_KILLS = ["load_prompts", "generate_until_ready", "compute_reward", "compute_ref_logprob",
              "compute_old_logprob", "update", "clear_and_age_sort", "save_checkpoint"]  # every task of the iteration
EPHEMERAL_LINK = 1  # this link's run starts its own Prefect server (none given): it must die with the run
SMALL = ["schedule.num_iterations=3", *SMALL_RUN, "tracking.wandb_mode=disabled", "tracking.progress=false",
         "engines.rollout_num_gpus=1"]
DETERMINISTIC = ["rollout.deterministic_sampling=true", "grpo.skip_old_logprob=false", "grpo.off_policy=none",
                 "grpo.reward_function_path=small_run.distinct_chars"]


def debug_template(run_dir: Path) -> str:
    """Where each rollout's samples go (storage.save_debug_rollout_data): what the run trained, token by token."""
    return f"{run_dir}/debug/{{rollout_id}}.parquet"


def train_args(run_dir: Path, *extra: str) -> list[str]:
    return ["train", "--config", "configs/tiny.yaml", f"run_dir={run_dir}", *SMALL, *DETERMINISTIC,
            f"storage.save_debug_rollout_data={debug_template(run_dir)}", *extra]


@dataclass(frozen=True)
class PartialEvidence:
    """What a chain shows of partial rollout: checkpoint 0's cut rows (read after the first kill, before pruning
    removes the checkpoint) and the samples that the finishing resume (from checkpoint 0) trained in iteration 1."""
    cut: list[CutRow]
    resumed_trained: dict[int, dict]


def assert_checkpoints(url: str, expected: list[tuple[int, bool]], storage_cfg=None, after: str = "") -> None:
    """(iteration, has a manifest) of every checkpoint prefix at url."""
    from spillover.infra.storage.checkpoint import list_checkpoints
    from spillover.infra.storage.store import open_store

    got = [(c.iteration, c.complete) for c in list_checkpoints(open_store(url, storage_cfg))]
    assert got == expected, after


def kill_chain(spillover: Spillover, run_dir: Path, url: str, storage_cfg, first_args: list[str],
               kills: list[tuple[str, list[tuple[int, bool]]]], ray_address: str, own_ray: tuple[int, ...] = (),
               ephemeral_link: int | None = None, migrated_db: Path | None = None, stopping=None,
               **env) -> PartialEvidence:
    """`train` (first_args) killed at kills[0], then `resume` killed at each further point, then a `resume` that
    finishes; after each kill, the checkpoints at url are the given (iteration, complete) list. Links numbered
    in own_ray (-1: the last, finishing one) start their own local Ray; the others join ray_address. The
    ephemeral link's Prefect server starts on a copy of migrated_db (an empty database costs ~100 migrations,
    ~8 s on 2 cores; what is checked is that the server dies with the run). `stopping` (an Event) ends the chain
    before its next link. -> checkpoint 0's cut rows and what the finishing resume trained in iteration 1."""
    from spillover.infra.storage.store import open_store

    previous, cut = None, []
    links = [*kills, (None, [(1, True), (2, True)])]
    own_ray = {link % len(links) for link in own_ray}
    for link, (kill_at, left_behind) in enumerate(links):
        if stopping is not None and stopping.is_set():
            raise RuntimeError(f"the session ended before the chain's link {link}")
        args = first_args if link == 0 else ["resume", str(run_dir)]
        last = link == len(links) - 1
        ray = {} if link in own_ray else {"RAY_ADDRESS": ray_address}
        kill = {} if last else {"SPILLOVER_KILL_AT": kill_at}
        if link == ephemeral_link and migrated_db is not None:
            copy_migrated_database(migrated_db, spillover.prefect_home)
        if last:  # what the killed links wrote goes: iteration 1's samples are then the finishing resume's own
            shutil.rmtree(run_dir / "debug", ignore_errors=True)
        # a run that starts its own Ray runs at normal priority: Ray gives its raylet 30 s (tests/background.py)
        run = spillover.run(args, ephemeral_prefect=link == ephemeral_link, nice=False if link in own_ray else None,
                            **kill, **ray, **env)
        if last:
            assert run.returncode == 0, spillover.output(run)
        else:
            assert run.returncode == -signal.SIGKILL, f"{kill_at}: {spillover.output(run)}"
        assert run.saw(ROUTER), (kill_at, run.seen)
        if link == ephemeral_link:
            assert run.saw(PREFECT_SERVER), (kill_at, run.seen)
        assert_checkpoints(url, left_behind, storage_cfg, after=f"kill at {kill_at}")
        if link == 0:
            cut = cut_rows(open_store(url, storage_cfg), 0)
        if previous is not None:  # checked now: its processes had the whole of this run to exit
            spillover.check_gone(previous, ignore=RAY_AGENTS)
        previous = run
    spillover.check_gone(previous)
    return PartialEvidence(cut, trained_samples(debug_template(run_dir), 1))


@dataclass
class KillChains:
    """The two chains' runners, locations and futures."""
    s3_runner: Spillover
    file_runner: Spillover
    s3_dir: Path
    file_dir: Path
    url: str
    s3_chain: Future = field(repr=False)
    file_chain: Future = field(repr=False)

    @property
    def runs(self) -> list[Run]:
        return self.s3_runner.runs + self.file_runner.runs


def start_kill_chains(background, s3_server, prefect_harness, watch, tmp: Path) -> KillChains:
    """Submit the two chains (the kill points split between them) to the background work; `watch` (the session's
    watch_until_gone) checks each run's last processes once its chain ended."""
    s3_runner, file_runner = (Spillover(prefect_harness.api_url, tmp / name, nice=True) for name in ("s3", "file"))
    s3_dir, file_dir = tmp / "s3-run", tmp / "file-run"
    url = s3_server.url(f"kill-resume-{uuid.uuid4().hex[:8]}")
    s3_cfg = s3_server.storage_config()
    location = [f"storage.url={url}", f"storage.endpoint_url={s3_server.endpoint_url}", "storage.region=us-east-1"]
    keys = [f"storage.access_key_id={s3_server.access_key}", f"storage.secret_access_key={s3_server.secret_key}"]
    aws = {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key}
    task_kills = [(f"{task}:1", [(0, True)]) for task in TASK_KILLS]
    half = len(task_kills) // 2

    def chain(spillover: Spillover, *args, **kwargs) -> PartialEvidence:
        try:
            return kill_chain(spillover, *args, ray_address=background.ray_address(), stopping=background.stopping,
                              **kwargs)
        finally:
            for run in spillover.runs:
                watch(run)

    s3_chain = background.submit(chain, s3_runner, s3_dir, url, s3_cfg, train_args(s3_dir, *location, *keys),
                                 task_kills[:half] + [("checkpoint_manifest:1", [(0, True), (1, False)])],
                                 own_ray=(0,), ephemeral_link=EPHEMERAL_LINK,
                                 migrated_db=prefect_harness.database, **aws)
    file_chain = background.submit(chain, file_runner, file_dir, str(file_dir / "checkpoints"), None,
                                   train_args(file_dir, "placement.colocate=true"), task_kills[half:], own_ray=(-1,))
    return KillChains(s3_runner, file_runner, s3_dir, file_dir, url, s3_chain, file_chain)
