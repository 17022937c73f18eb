"""The built-in task: "a*7=" -> "aaaaaaa". Small enough for a tiny model to learn with GRPO in minutes.

Targets n follow a long-tailed distribution, so response lengths have a tail even once learned; the
reward is dense (partial credit for the right length and for writing a's), so GRPO has signal from
the first iteration.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

MAX_N = 24


def draw_targets(count: int, seed: int) -> np.ndarray:
    """n in [1, MAX_N], lognormal-ish: most short, a few long. -> int[count]"""
    rng = np.random.default_rng(seed)
    n = np.ceil(rng.lognormal(mean=1.6, sigma=0.6, size=count)).astype(int)
    return np.clip(n, 1, MAX_N)


def make_prompt(n: int) -> str:
    return f"a*{n}="


def generate_dataset(path: str | Path, count: int, seed: int = 0) -> Path:
    """Write `count` JSONL rows {"prompt", "label"} to `path` (idempotent for the same count and seed)."""
    p = Path(path)
    rows = [{"prompt": make_prompt(int(n)), "label": int(n)} for n in draw_targets(count, seed)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if not p.is_file() or p.read_text() != text:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return p


def score(response: str, n: int) -> float:
    """Reward in [0, 1]: (1 - 2|len - n| / n, floored at 0) x share of characters that are 'a'."""
    if not response:
        return 0.0
    length_score = max(0.0, 1.0 - 2.0 * abs(len(response) - n) / n)
    return length_score * response.count("a") / len(response)


def reward(response: str, label, **_) -> float:
    """Rule reward (import path `spillover.rollout.builtin.toy_task.reward`)."""
    return score(response, int(label))


def exact_match(response: str, label) -> bool:
    return response == "a" * int(label)


def prompt_independent_baseline(labels: list[int] | np.ndarray, max_len: int = 64) -> tuple[str, float]:
    """The best constant answer on this label distribution and its mean reward."""
    labels = np.asarray(labels, dtype=int)
    best = ("", 0.0)
    for k in range(1, max_len + 1):
        r = float(np.mean([score("a" * k, int(n)) for n in labels]))
        if r > best[1]:
            best = ("a" * k, r)
    return best
