"""The engine fleet as everything above it sees it (drivers, the rollout context, eval, the tasks), and the policy
learner as the fleet sees it. rollout/fleet/manager.py's RolloutManager is the fleet; bench/simulator's
SimulatedEngine stands in for the part the driver loop uses (num_engines, generate, collect_detached)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ..sglang.protocol import GenerateJob, GenerateResponse

if TYPE_CHECKING:  # the GPU machine's checks import the weight files without Ray
    import ray

OnResult = Callable[[int, GenerateResponse], "bool | None"]
"""on_result(index, answer) as each answer arrives; returning True (the bool itself: a callback's incidental
truthy result does not count) stops the round (see Fleet.generate)."""


class RemoteMethod(Protocol):
    def remote(self, *args: object, **kwargs: object) -> ray.ObjectRef: ...


class PolicyLearner(Protocol):
    """The policy learner group (tasks/learner/group.py LearnerGroup) as the fleet loads its weights: each method's
    `.remote(...)` runs on every rank and returns rank 0's ObjectRef; `each(name, ...)` returns every rank's."""

    @property
    def state_dict_refs(self) -> RemoteMethod: ...         # .remote() -> ObjectRef of {name: ObjectRef} (tensor sync)

    @property
    def save_weights(self) -> RemoteMethod: ...            # .remote(folder) -> the HF folder written (disk sync)

    @property
    def weight_specs(self) -> RemoteMethod: ...            # .remote() -> [(name, dtype, shape)] (distributed sync)

    @property
    def broadcast_weights(self) -> RemoteMethod: ...       # .remote(group_name, buckets) (distributed sync)

    @property
    def weight_sync_address(self) -> RemoteMethod: ...     # .remote() -> (address, port) of rank 0's rendezvous

    @property
    def join_weight_group(self) -> RemoteMethod: ...       # .remote(address, port, world_size, name, backend, timeout_s)

    @property
    def leave_weight_group(self) -> RemoteMethod: ...      # .remote(name)

    def each(self, name: str, *args: object, **kwargs: object) -> list[ray.ObjectRef]: ...


class Fleet(Protocol):
    num_engines: int            # what length-aware dispatch pins rows to (1: the router chooses, rows are only ordered)
    colocated: bool             # the engines live in the policy learner's ranks (placement.colocate)
    loop: asyncio.AbstractEventLoop  # where on_result callbacks (and multi-turn env calls) run

    def generate(self, jobs: list[GenerateJob], on_result: OnResult | None = None,
                 detach: bool = False) -> list[GenerateResponse | None]:
        """Answers in input order. An on_result that returns True stops the round: nothing more is sent,
        running requests come back with their tokens so far (finish_reason abort), unsent ones with none,
        and generate returns once the engines are idle.

        detach=True (rollout.overlap): an on_result that returns True makes the call return at once instead;
        the requests not answered yet keep running (not aborted) and their entries are None until
        collect_detached() hands them over. detach=True without on_result returns at the call (the driver's
        dock was ready already): every request runs on, detached. Requests adopted by
        collect_detached(adopt=True) join the call as indices len(jobs) + k (k: their order by index there)."""
        ...

    def collect_detached(self, adopt: bool = False) -> dict[int, GenerateResponse]:
        """The answers of every request the last detached call left unanswered: index in that call's request
        list -> answer. What still runs is aborted first (its partial output, finish_reason abort). {} when
        nothing is detached. adopt=True (rollout.adopt_detached): only the requests that have ended answer; the
        others run on, and the next generate call takes them over. Weight updates while detached requests run pause them in the engines' pause mode
        (abort: they end at the pause, partial answers kept here; in_place: they go on with their KV; retract:
        they go on after recomputing their KV), so later tokens carry the new version
        (meta_info.weight_versions spans)."""
        ...

    def load_policy_weights(self, policy: PolicyLearner, version: int) -> dict[int, int | None]:
        """Every engine loads the policy's current weights as `version`, the way the fleet's engines.weight_sync
        (or colocation) asks; -> engine index -> the version it reports."""
        ...

    def overlap_stats(self) -> dict[str, float]:
        """Counters since the fleet started (rollout.overlap): detached_tokens, updates_while_generating, ..."""
        ...

    def offload(self) -> None:
        """Release every engine's memory (colocation); the next weight load brings it back."""
        ...

    def take_colocation_log(self) -> list[str]:
        """What the hosting process did since the last take, in order (colocated fleets)."""
        ...
