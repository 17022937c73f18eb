"""build_context on a checkpoint (rollout/context.py): what a resumed run refuses before any part starts."""
from __future__ import annotations

import pytest

from spillover.infra.config.parsing import ConfigError
from spillover.infra.config.run_config import build_config
from spillover.infra.storage.checkpoint import CheckpointState
from spillover.rollout.context import build_context
from spillover.rollout.dock.transfer_dock import TransferDock
from spillover.rollout.prompt_data import PromptCursor


def saved(cfg, num_prompts: int, multi_turn: bool) -> CheckpointState:
    rollout = cfg.rollout
    dock = TransferDock(rollout.global_batch_size, rollout.n_samples_per_prompt, rollout.max_split, rollout.max_tokens,
                        rollout.max_model_len, [2], rollout.effective_max_age, multi_turn=multi_turn)
    arrays, meta = dock.snapshot()
    cursor = PromptCursor(num_prompts, seed=0, shuffle=False).state_dict()
    return CheckpointState(iteration=0, arrays={"dock": arrays}, meta={"dock": meta, "cursor": cursor},
                           url="memory://ckpt-00000000")


def test_a_checkpoint_resumes_on_its_own_data_set():
    cfg = build_config()
    context = build_context(cfg, None, [None] * 6, (2,), None, saved(cfg, 6, multi_turn=False))
    assert context.cursor.num_prompts == 6


def test_a_prompt_file_that_changed_size_is_refused():
    cfg = build_config()
    with pytest.raises(ConfigError, match="data.prompts_path: the checkpoint's data set had 6 prompts, 4 are loaded"):
        build_context(cfg, None, [None] * 4, (2,), None, saved(cfg, 6, multi_turn=False))


def test_a_multi_turn_checkpoint_without_its_env_path_is_refused():
    cfg = build_config()
    with pytest.raises(ConfigError, match="rollout.env_path: the checkpoint holds multi-turn rollouts"):
        build_context(cfg, None, [None] * 6, (2,), None, saved(cfg, 6, multi_turn=True))
