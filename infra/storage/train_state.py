"""Turn training state that is not plain tensors into tensors + JSON for a checkpoint, and back.

- Optimizer state dicts -> (flat tensors, JSON index of param groups and non-tensor values).
- RNG states (python, numpy, torch, CUDA) -> JSON-able dict.
No pickle anywhere.
"""
from __future__ import annotations

import base64
import json
import random

import numpy as np
import torch


def flatten_optimizer_state(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """optimizer.state_dict() -> ({"<param id>.<key>": tensor}, index). The index is JSON-able: param groups
    and the non-tensor values of each param's state (e.g. a float step)."""
    tensors: dict[str, torch.Tensor] = {}
    index_state = {}
    for pid, values in state_dict["state"].items():
        entry = {"tensors": [], "values": {}}
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{pid}.{key}"] = value
                entry["tensors"].append(key)
            else:
                entry["values"][key] = value
        index_state[str(pid)] = entry
    index = {"param_groups": state_dict["param_groups"], "state": index_state}
    try:
        index = json.loads(json.dumps(index))  # tuples (betas) -> lists; fails loudly on odd values
    except TypeError as err:
        raise ValueError(f"optimizer state has a value that is not a tensor or JSON-able: {err}") from None
    return tensors, index


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], index: dict) -> dict:
    """Inverse of flatten_optimizer_state: a dict for optimizer.load_state_dict."""
    state = {}
    for pid, entry in index["state"].items():
        values = dict(entry["values"])
        for key in entry["tensors"]:
            values[key] = tensors[f"{pid}.{key}"]
        state[int(pid)] = values
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else dict(g) for g in index["param_groups"]]
    return {"state": state, "param_groups": groups}


def _bytes_to_text(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _text_to_bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def capture_rng_states() -> dict:
    """Python, numpy (legacy global), torch CPU and CUDA generator states as JSON-able values."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out = {"python": [version, list(mt), gauss],
           "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
           "torch": _bytes_to_text(torch.get_rng_state())}
    if torch.cuda.is_available():
        out["cuda"] = [_bytes_to_text(s) for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng_states(states: dict) -> None:
    version, mt, gauss = states["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_text_to_bytes(states["torch"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_text_to_bytes(s) for s in states["cuda"]])
