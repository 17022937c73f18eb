"""Where a run's engines and learner groups come from and go back to.

A run gets them from the `RunParts` its caller passes (`grpo_train(config, parts=...)`, `build_run(cfg, saved,
parts)`, `evaluate(..., parts=...)`), or, when none is passed, from `NewParts`: started for the run, shut down
after it. A caller that runs many short runs in one process (the test suite: tests/warm_parts.py) can lend parts
it keeps between runs instead; how it keeps and resets them is its own business, not the flow's.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..infra.config.engines import EnginesConfig
    from ..infra.config.run_config import RunConfig
    from ..rollout.fleet.manager import RolloutManager
    from ..tasks.learner.group import LearnerGroup


@runtime_checkable  # Prefect checks a flow's parameters against their annotations (isinstance for this one)
class RunParts(Protocol):
    """The engines and learner groups of a run: each asked for once at its start and given back once at its end.

    Prefect stores a flow's parameters as JSON (fastapi's jsonable_encoder, which walks an object's vars()): an
    implementation passed to `grpo_train` should have `__slots__` and no `__dict__`, so that Prefect stores its type
    name instead of walking every actor it holds."""

    def learners(self, model_path: Path, cfg: RunConfig) -> tuple[LearnerGroup, LearnerGroup | None]:
        """The run's policy group and (grpo.kl_coef > 0, learner.reference_placement=separate) reference group, both
        starting from model_path's weights: what spillover.tasks.learner.group.create_learners starts."""
        ...

    def fleet(self, engines_cfg: EnginesConfig, model_path: Path, deterministic: bool = False,
               seed: int = 0) -> RolloutManager:
        """Engines serving model_path's weights as weight version 0, engine i sampling from seed + i."""
        ...

    def give_back(self, part: LearnerGroup | RolloutManager, keep: bool = True) -> None:
        """The run is over with this part; keep=False: the run failed and the part may be unsound (shut it down).
        A part this source did not hand out (colocated engines and learners) is shut down too."""
        ...


class NewParts:
    """Parts started for one run and shut down after it: what a run gets when its caller lends none."""

    __slots__ = ()  # see RunParts: Prefect stores the parameter as "<NewParts>"

    def learners(self, model_path: Path, cfg: RunConfig) -> tuple[LearnerGroup, LearnerGroup | None]:
        from ..tasks.learner.group import create_learners

        return create_learners(model_path, cfg)

    def fleet(self, engines_cfg: EnginesConfig, model_path: Path, deterministic: bool = False,
               seed: int = 0) -> RolloutManager:
        from ..rollout.fleet.manager import RolloutManager

        return RolloutManager(engines_cfg, str(model_path), deterministic_inference=deterministic, seed=seed)

    def give_back(self, part: LearnerGroup | RolloutManager, keep: bool = True) -> None:
        part.shutdown()  # a LearnerGroup removes its placement group too
