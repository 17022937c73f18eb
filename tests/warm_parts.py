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

A run never starts a part over, so the runtime classes carry no reset: here each learner rank constructs itself
again inside its Ray actor (Ray's `__ray_call__`) and the engines' manager is set back through its own members
(`start_learner_group_over`, `start_engines_over`); tests/integration/test_warm_parts.py checks the outcome.

A part is reused only by a run that would start the very same one: the same learner placement (learner section,
trainable or not) or the same engines section, sampling mode and model shape and tokenizer (every file of the model
folder but the weights). CUDA learner groups are not kept. At most `max_idle` idle parts per role are kept (default
1: idle actors hold Ray resources, GPUs included), the least recently used one is shut down first, before a part of a
new key starts; a run that fails gives its parts up instead of back, unless it stopped on refused input (a
ValueError, exit 2: every part was idle).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import ray.cloudpickle

if TYPE_CHECKING:
    from spillover.infra.config.engines import EnginesConfig
    from spillover.infra.config.run_config import RunConfig
    from spillover.rollout.fleet.manager import RolloutManager
    from spillover.tasks.learner.group import LearnerGroup

log = logging.getLogger(__name__)
# Ray's workers cannot import this module (tests/ is on no worker's sys.path): what runs inside an actor travels by
# value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
# Engine settings that start_engines_over applies to running engines (the rest shape what is started).
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
        from spillover.tasks.learner.group import create_learner_group, create_learners

        def borrow(trainable: bool):
            return self.borrow("policy" if trainable else "ref", learner_key(cfg, trainable),
                               lambda: create_learner_group(model_path, cfg, trainable=trainable),
                               lambda group: start_learner_group_over(group, model_path, cfg, trainable))

        return create_learners(model_path, cfg, start_group=borrow)

    def fleet(self, engines_cfg: EnginesConfig, model_path: Path, deterministic: bool = False,
               seed: int = 0) -> RolloutManager:
        """A spillover.rollout.fleet.manager.RolloutManager serving model_path's weights as version 0, engine i sampling
        from seed + i (a kept torch engine is reseeded; SGLang's seed is a launch flag)."""
        from spillover.rollout.fleet.manager import RolloutManager

        return self.borrow("engine", engine_key(engines_cfg, model_path, deterministic),
                           lambda: RolloutManager(engines_cfg, str(model_path), deterministic_inference=deterministic,
                                                  seed=seed),
                           lambda manager: start_engines_over(manager, model_path, engines_cfg, seed))

    def shutdown(self) -> None:
        for idle in self._idle.values():
            for _, part in idle:
                _shutdown(part)
        self._idle.clear()

    def __enter__(self) -> "WarmParts":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def start_learner_group_over(group: LearnerGroup, model_path, cfg, trainable: bool) -> None:
    """A group started anew for another run with the same learner section: every rank constructs itself again at
    once (weights from model_path, fresh state); a sharded group keeps its process group."""
    import ray

    from spillover.tasks.learner.group import rank_options

    if group.world_size != cfg.learner.world_size:
        raise ValueError(f"a learner group of {group.world_size} ranks cannot serve learner.world_size="
                         f"{cfg.learner.world_size}")
    ray.get([actor.__ray_call__.remote(_construct_again, str(model_path),
                                       **rank_options(cfg, trainable, cfg.learner, rank, group.master))
             for rank, actor in enumerate(group.actors)])
    group.pending = []


def _construct_again(learner, model_path: str, **init_kwargs) -> None:
    """Inside a learner rank's actor: start over as a new actor would. Every weight-update group it hosts is left
    first (their torch process groups destroyed); a hosted engine stays (start_engines_over starts it over)."""
    sender = learner.weight_sender
    for group_name in list(sender._groups):
        sender.leave(group_name)
    host = learner.engine_host
    learner.__init__(model_path, **init_kwargs)
    learner.engine_host = host


def start_engines_over(manager: RolloutManager, model_path: str | Path, engines_cfg: EnginesConfig, seed: int) -> None:
    """Serve model_path's weights as version 0, as a newly started manager would: leave the weight-update group, take
    memory back, load the folder on every engine, restart each torch engine's sampling generator from seed + its
    index (SGLang's seed is a launch flag: kept as is). engines_cfg: the new run's engines section (its weight-sync
    and health settings take effect; the settings the engines were started with must be the same: engine_key)."""
    manager.stop_health_monitor()
    manager._call(_serve_anew, manager, str(model_path), engines_cfg, seed)
    if manager.cfg.health_interval_s:
        manager.start_health_monitor(manager.cfg.health_interval_s)


async def _serve_anew(m: RolloutManager, model_path: str, engines_cfg: EnginesConfig, seed: int) -> None:
    """start_engines_over on the manager's loop."""
    from spillover.rollout.fleet.weights.weight_update import WeightUpdate

    await m._gen.collect_detached()  # a new run starts with no request of the last one running
    if m._offloaded:
        await m._memory(False, None)
    async with m._engine_lock:
        await m.weights.leave()
        m.cfg = m.pool.cfg = engines_cfg
        m.weights = m._new_weights(engines_cfg)
        m.model_path = m.pool.model_path = model_path  # what a restarted engine starts from
        await m.weights.disk.load(WeightUpdate("disk", model_path, 0), m.engines)
        m._stale_prefix_cache = False
        m.restarts = 0
        if m.cfg.backend == "torch":  # each engine's seed at start (EnginePool.new_actors): the stream anew
            m.pool.seed = seed  # a restarted engine starts from it too
            await asyncio.gather(*(h.actors[0].__ray_call__.remote(_reseed, m.pool.seed + h.index)
                                   for h in m.engines))


def _reseed(engine, seed: int) -> None:
    """Inside an EngineActor (torch backend): restart its engine's sampling generator from seed, as a start with that
    seed would (other nodes serve nothing)."""
    if engine.server is not None:
        engine.server.batcher.reseed(seed).result(timeout=60)
        engine.seed = seed


def _shutdown(part: Any) -> None:
    try:
        part.shutdown()
    except Exception:  # a part that is already gone (its actors were killed) has nothing left to stop
        log.warning("shutting down %r failed", part, exc_info=True)
