"""The state one training run carries between tasks: built by the flow, passed down explicitly.

A plain class on purpose: Prefect walks dataclasses and pydantic models passed as task parameters;
this object (dock, Ray handles, engines) must be handed over as an opaque reference.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from infra.config import RunConfig


class IterationData:
    """What the seven tasks of one iteration hand each other (reset at every iteration)."""

    def __init__(self, iteration: int):
        self.iteration = iteration
        self.samples: list = []            # list[list[Sample]] of the chosen batch
        self.train_batch: Any = None       # tasks.batching.TrainBatch
        self.train_batch_ref: Any = None   # its Ray object ref
        self.ref_logprobs: Any = None      # Ray object ref or None
        self.old_logprobs: Any = None      # Ray object ref or None (None: taken from rollout logprobs)
        self.metrics: dict[str, Any] = {"iteration": iteration}
        self.started = time.perf_counter()
        self.task_s: dict[str, float] = {}
        self.flow_run_id: Any = None       # the iteration's Prefect subflow run (None outside Prefect)


class RunState:
    def __init__(self, cfg: RunConfig, run_dir: Path, tokenizer, prompts, cursor, dock, engine, policy, ref,
                 reward_fn, stop_token_ids: list[int]):
        self.cfg = cfg
        self.run_dir = run_dir
        self.tokenizer = tokenizer
        self.prompts = prompts          # rollout.data_source.PromptSet
        self.cursor = cursor            # rollout.data_source.PromptCursor
        self.dock = dock                # rollout.dock.TransferDock
        self.engine = engine            # RolloutManager (anything with generate(requests))
        self.policy = policy            # Ray actor handle (tasks.learner.LearnerActor)
        self.ref = ref                  # Ray actor handle or None (no KL)
        self.reward_fn = reward_fn
        self.stop_token_ids = stop_token_ids
        self.weight_version = 0
        self.controller = None          # rollout.controller.RolloutController
        self.on_round = None            # progress callback during generation
        self.eval_sets = None           # eval PromptSets, read on first eval
        self.checkpoint_store = None    # infra.storage.Store, or None: no checkpoints
        self.wandb_run_id: str | None = None
        self.current: IterationData | None = None

    def start_iteration(self, iteration: int) -> IterationData:
        self.current = IterationData(iteration)
        return self.current
