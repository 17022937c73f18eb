"""Warm parts: engines and learner groups kept between the runs one process starts one after another (the test
suite's in-process flow runs: tests/fixtures_warm.py). A `spillover.flows.parts.RunParts`:

    with WarmParts() as warm:
        grpo_train(cfg_a, parts=warm)
        grpo_train(cfg_b, parts=warm)   # the same engines and learners, reset to a fresh start

Starting the Ray actors of a run (engines, policy, reference) costs seconds of imports and model loading per actor
(on 2 cores a small run takes ~4 s on kept parts, ~23 s on new ones). A borrowed part is reset to what a fresh start
gives: learners re-run their constructor (weights from the new run's model folder, a new optimizer, the seeded RNG,
weight version 0, the configured KL coefficient, no weight-update group); engines load the new model folder as
weight version 0, leave their weight-update group and (torch backend) restart their sampling generator from the
run's seed, so a run's samples do not depend on what the engines served before (SGLang engines keep their stream:
their seed is a launch flag; rollout.deterministic_sampling makes tokens independent of it).

A part is reused only by a run that would start the very same one: the same learner placement (learner section,
trainable or not) or the same engines section, sampling mode and model shape and tokenizer (every file of the model
folder but the weights). CUDA learner groups are not kept. At most `max_idle` idle parts per role are kept (default
1: idle actors hold Ray resources, GPUs included), the least recently used one is shut down first, before a part of a
new key starts; a run that fails gives its parts up instead of back, unless it stopped on refused input (a
ValueError, exit 2: every part was idle).
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from spillover.infra.config.engines import EnginesConfig
    from spillover.infra.config.run_config import RunConfig
    from spillover.rollout.fleet.manager import RolloutManager
    from spillover.tasks.learner.group import LearnerGroup

log = logging.getLogger(__name__)
# Engine settings that RolloutManager.reset applies to running engines (the rest shape what is started).
RUNTIME_ENGINE_SETTINGS = ("weight_sync", "weight_bucket_bytes", "weight_sync_timeout_s", "weight_sync_dir",
                           "health_interval_s", "health_timeout_s")
ENGINE_START_FILES = ("config.json", "generation_config.json", "tokenizer", "special_tokens_map.json", "chat_template",
                      "vocab", "merges.txt", "added_tokens.json")


def model_shape_digest(model_path: str | Path) -> str:
    """A digest of what an engine reads from an HF folder at start besides the weights: the model and generation
    config, the tokenizer and its chat template."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_path).iterdir()):
        if path.is_file() and path.name.startswith(ENGINE_START_FILES):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def learner_key(cfg, trainable: bool) -> str | None:
    """What decides whether a kept learner group can serve a run (the whole learner section, world_size included:
    a sharded group keeps its process group); None: not kept (CUDA groups, whose reuse is untested)."""
    if cfg.learner.device == "cuda":
        return None
    return f"{trainable}|{cfg.learner.model_dump_json()}"


def engine_key(engines_cfg, model_path: str | Path, deterministic: bool) -> str:
    """What the engines were started with: the engines section but what a reset applies (RUNTIME_ENGINE_SETTINGS),
    the sampling mode, the model's shape and tokenizer."""
    started = engines_cfg.model_dump_json(exclude=set(RUNTIME_ENGINE_SETTINGS))
    return f"{started}|{deterministic}|{model_shape_digest(model_path)}"


class WarmParts:
    """Idle engines and learner groups by role, each with the key of the runs it can serve."""

    # no __dict__: Prefect stores grpo_train's parameters as JSON and would otherwise walk every kept actor
    # (spillover.flows.parts.RunParts); with slots it stores "<WarmParts>"
    __slots__ = ("max_idle", "_idle", "_lent", "reused", "started")

    def __init__(self, max_idle: int = 1):
        if max_idle < 1:
            raise ValueError(f"max_idle must be >= 1 (idle parts kept per role); got {max_idle}")
        self.max_idle = max_idle
        self._idle: dict[str, list[tuple[str, Any]]] = {}  # role -> [(key, part)], least recently used first
        # id(part) -> (role, key, part); holding the part keeps its id from coming back as another object's
        self._lent: dict[int, tuple[str, str, Any]] = {}
        self.reused = 0  # parts handed to a run without starting them (tests read it)
        self.started = 0

    def borrow(self, role: str, key: str | None, start: Callable[[], Any], reset: Callable[[Any], None]) -> Any:
        """A kept part with this key, reset; else a new one from start() (with max_idle parts of other keys idle, the
        least recently used one is shut down first, freeing its Ray resources)."""
        idle = self._idle.setdefault(role, [])
        match = next((i for i, (kept, _) in enumerate(idle) if key is not None and kept == key), None)
        if match is not None:
            part = idle.pop(match)[1]
            try:
                reset(part)
            except Exception:
                log.warning("a kept %s could not be reset; starting a new one", role, exc_info=True)
                _shutdown(part)
            else:
                self.reused += 1
                self._lent[id(part)] = (role, key, part)
                return part
        elif len(idle) >= self.max_idle:
            _shutdown(idle.pop(0)[1])
        part = start()
        self.started += 1
        if key is not None and part is not None:
            self._lent[id(part)] = (role, key, part)
        return part

    def give_back(self, part: LearnerGroup | RolloutManager, keep: bool = True) -> None:
        """End of a run: keep the part for the next run (keep=False, or not lent by this pool: shut it down)."""
        if part is None:
            return
        lent = self._lent.pop(id(part), None)
        if lent is None or not keep:
            _shutdown(part)
            return
        role, key, _ = lent
        idle = self._idle.setdefault(role, [])
        idle.append((key, part))
        while len(idle) > self.max_idle:
            _shutdown(idle.pop(0)[1])

    def learners(self, model_path: Path, cfg: RunConfig) -> tuple[LearnerGroup, LearnerGroup | None]:
        """The run's policy group and (grpo.kl_coef > 0) reference group: spillover.tasks.learner.group.create_learners,
        with each group borrowed."""
        from spillover.tasks.learner.group import create_learner_group, create_learners, reset_learner_group

        def borrow(trainable: bool):
            return self.borrow("policy" if trainable else "ref", learner_key(cfg, trainable),
                               lambda: create_learner_group(model_path, cfg, trainable=trainable),
                               lambda group: reset_learner_group(group, model_path, cfg, trainable))

        return create_learners(model_path, cfg, start_group=borrow)

    def engine(self, engines_cfg: EnginesConfig, model_path: Path, deterministic: bool = False,
               seed: int = 0) -> RolloutManager:
        """A spillover.rollout.fleet.manager.RolloutManager serving model_path's weights as version 0, engine i sampling
        from seed + i (a kept torch engine is reseeded; SGLang's seed is a launch flag)."""
        from spillover.rollout.fleet.manager import RolloutManager

        return self.borrow("engine", engine_key(engines_cfg, model_path, deterministic),
                           lambda: RolloutManager(engines_cfg, str(model_path), deterministic_inference=deterministic,
                                                  seed=seed),
                           lambda manager: manager.reset(model_path, engines_cfg, seed))

    def shutdown(self) -> None:
        for idle in self._idle.values():
            for _, part in idle:
                _shutdown(part)
        self._idle.clear()

    def __enter__(self) -> "WarmParts":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _shutdown(part: Any) -> None:
    try:
        part.shutdown()
    except Exception:  # a part that is already gone (its actors were killed) has nothing left to stop
        log.warning("shutting down %r failed", part, exc_info=True)
