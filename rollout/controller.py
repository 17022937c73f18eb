"""RolloutController: which samples an iteration trains on and where they come from.

The rollout and eval functions are the default rollout (imported) or loaded by import path, with the seed's signature
`fn(args, rollout_id, data_source, evaluation=False)`, where `args` is the RunConfig and `data_source` a
spillover.rollout.context.RolloutContext (dock with carried-over and surplus rows, fleet, prompts, weight version).
Debug rollout data replaces generation when `storage.load_debug_rollout_data` is set, and is written
after every rollout when `storage.save_debug_rollout_data` is set.
"""
from __future__ import annotations

from ..infra.config.run_config import RunConfig
from .debug_data import load_debug_rollout_data, save_debug_rollout_data
from .contracts.rollout_function import RolloutOutput, flatten_rollout, load_rollout_function, to_rollout_output
from .drivers.default_rollout import generate_rollout
from .drivers.evaluation import eval_log_dict, eval_step

DEFAULT_ROLLOUT = f"{generate_rollout.__module__}.{generate_rollout.__name__}"  # rollout.rollout_function_path's default


class RolloutController:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        rollout = cfg.rollout
        # Loaded now: a wrong path or signature stops the run at start-up, naming the setting.
        self.rollout_fn = None if cfg.storage.load_debug_rollout_data else function_at(
            rollout.rollout_function_path, "rollout.rollout_function_path")
        # A custom eval function runs without data.eval_paths too (it may bring its own data, as in slime); the
        # default one needs them.
        eval_path = rollout.eval_function_path or DEFAULT_ROLLOUT
        wanted = bool(cfg.data.eval_paths or rollout.eval_function_path)
        self.eval_fn = function_at(eval_path, "rollout.eval_function_path") if wanted else None

    @property
    def uses_dock(self) -> bool:
        """The built-in partial-rollout generator fills the dock; custom, SFT and replayed data do not."""
        return self.rollout_fn is not None and self.cfg.rollout.rollout_function_path == DEFAULT_ROLLOUT

    def generate(self, rollout_id: int, context) -> RolloutOutput:
        storage = self.cfg.storage
        if storage.load_debug_rollout_data:
            groups = load_debug_rollout_data(storage.load_debug_rollout_data, rollout_id, storage)
            out = to_rollout_output(groups, source=storage.load_debug_rollout_data)
        else:
            out = to_rollout_output(self.rollout_fn(self.cfg, rollout_id, context, evaluation=False),
                                    source=self.cfg.rollout.rollout_function_path)
        if storage.save_debug_rollout_data:
            save_debug_rollout_data(storage.save_debug_rollout_data, rollout_id, out.batch.sample_groups(), storage)
        return out

    def eval(self, rollout_id: int, context, train_step: int) -> dict[str, float]:
        """eval/<key>, eval/<key>-truncated_ratio per eval data set, and eval/step (the rollout id)."""
        if self.eval_fn is None or self.cfg.schedule.debug_train_only:
            return {}
        results = self.eval_fn(self.cfg, rollout_id, context, evaluation=True)
        if not isinstance(results, dict):
            results = {"default": flatten_rollout(results, source="the eval function")}
        return eval_log_dict(results, eval_step(rollout_id, train_step, use_train_step=False))


def function_at(path: str, setting: str):
    """The default rollout as imported; any other import path loaded and its signature checked."""
    return generate_rollout if path == DEFAULT_ROLLOUT else load_rollout_function(path, setting)
