"""The HF causal LM of a folder, loaded as is: what benchmarks and tests compare the engines' and learners' tokens,
logprobs and weights against (a run loads its model through the learner and the engines, never this way)."""
from __future__ import annotations

from pathlib import Path


def load_causal_lm(path: str | Path, dtype: str = "float32", device: str | None = None):
    """Load any HF causal LM from a local folder (eager attention: fastest for tiny models on CPU)."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model.path {str(p)!r} has no config.json: point it at an HF checkpoint folder")
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        p, dtype=getattr(torch, dtype), local_files_only=True, attn_implementation="eager")
    if device:
        model.to(device)
    return model
