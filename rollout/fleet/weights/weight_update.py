"""`WeightUpdate`: the one message that carries new weights to the engines (RolloutManager.update_weights).

kind         source                                                       how it reaches the engines
disk         an HF folder (path)                                          /update_weights_from_disk on each engine
tensor       a state dict of HF-named tensors (or of their ObjectRefs),  each engine actor posts it to its server,
             or its Ray ObjectRef                                         fetched and freed bucket by bucket
distributed  the policy learner group (PolicyLearner)                     SGLang's weight-update group, broadcast
colocated    the policy learner group whose ranks host the engines        each rank loads the engine it hosts

`version` is the learner's weight version (an int: the number of updates it has made); every engine reports it
after loading, and the rollout tags each generated token with it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

from ...contracts.fleet import PolicyLearner
from ...sglang.protocol import parse_version

if TYPE_CHECKING:  # imported where a tensor or learner source is checked: the GPU machine's checks run without Ray
    import ray

WeightKind = Literal["disk", "tensor", "distributed", "colocated"]
WEIGHT_KINDS: tuple[str, ...] = get_args(WeightKind)
FROM_POLICY: tuple[str, ...] = ("distributed", "colocated")  # kinds whose source is the learner group itself


@dataclass(frozen=True)
class WeightUpdate:
    kind: WeightKind
    source: str | dict | ray.ObjectRef | PolicyLearner  # what the kind needs (the table above)
    version: int

    def __post_init__(self) -> None:
        if self.kind not in WEIGHT_KINDS:
            raise ValueError(f"WeightUpdate.kind must be one of {', '.join(WEIGHT_KINDS)}; got {self.kind!r}")
        if not isinstance(self.version, int) or isinstance(self.version, bool):
            raise TypeError(f"WeightUpdate.version must be an int (the learner's weight version); got "
                            f"{self.version!r} ({type(self.version).__name__})")
        if self.kind == "disk":
            if not isinstance(self.source, (str, Path)):
                raise TypeError(f"a disk WeightUpdate's source is an HF folder path; got {type(self.source).__name__}")
            object.__setattr__(self, "source", str(self.source))  # engines read the path as text
            return
        import ray

        if self.kind == "tensor" and not isinstance(self.source, (dict, ray.ObjectRef)):
            raise TypeError(f"a tensor WeightUpdate's source is a state dict or its ObjectRef; got "
                            f"{type(self.source).__name__}")
        if self.kind in FROM_POLICY and isinstance(self.source, (str, Path, dict, ray.ObjectRef)):
            raise TypeError(f"a {self.kind} WeightUpdate's source is the policy learner group; got "
                            f"{type(self.source).__name__}")


def reported_version(reported: int | str | None, engine: str) -> int:
    """The weight version an engine reports (/model_info; SGLang sends it as text) as an int."""
    version = parse_version(reported)
    if isinstance(version, int) and not isinstance(version, bool):
        return version
    raise ValueError(f"{engine} reports weight version {reported!r}, not a whole number: engines start at the "
                     f"learner's version (0) and every update sets an int")
