"""The KL coefficient's controller (grpo.kl_ctrl), as in the seed/verl: fixed, or adaptive towards a target KL.

Adaptive (Ziegler et al. 2019; verl's AdaptiveKLController): after each update,
    error = clip(measured_kl / target - 1, -0.2, 0.2);  coef *= 1 + error * n_samples / horizon
so a KL above the target raises the penalty and one below lowers it, by at most 20% per `horizon` samples.
The policy learner holds the coefficient and keeps it in its checkpoint state, so a resumed run continues
with the coefficient it had.
"""
from __future__ import annotations

import math

MAX_ERROR = 0.2


def next_kl_coef(coef: float, measured_kl: float, n_samples: int, mode: str, target: float, horizon: int) -> float:
    """The coefficient for the next update, given the one just used and the KL it measured (per token)."""
    if mode == "fixed" or not math.isfinite(measured_kl):
        return float(coef)
    if mode != "adaptive":
        raise ValueError(f"grpo.kl_ctrl must be fixed or adaptive; got {mode!r}")
    error = min(max(measured_kl / target - 1.0, -MAX_ERROR), MAX_ERROR)
    return float(coef) * (1.0 + error * n_samples / horizon)
