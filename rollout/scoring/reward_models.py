"""Reward models (grpo.reward_models): HF sequence-classification folders run as Ray actors, as MindSpeed-RL's
reward workers. Each scores `prompt text + response text` (its own tokenizer, the text's last max_length tokens)
as the model's single logit; the total reward is rule_reward_weight x rule reward + sum of weight x score.

The actors are long-lived parts of the run (built with it, killed with it); scoring is one call per model per
iteration, all models at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


class RewardModelError(ValueError):
    """A reward model folder that cannot score; the message names the setting and the fix."""


class RewardModelActor:
    """One reward model on CPU or one GPU: score(texts) -> one float per text, in eval mode (deterministic)."""

    def __init__(self, path: str, dtype: str = "float32", max_length: int = 4096, batch_size: int = 16,
                 threads: int = 1):
        import torch
        from transformers import AutoModelForSequenceClassification

        from ...infra.models import load_tokenizer

        torch.set_num_threads(threads)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.tokenizer = load_tokenizer(path)
        self.tokenizer.truncation_side = "left"  # the response's end decides
        self.tokenizer.padding_side = "right"
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=getattr(torch, dtype), local_files_only=True).to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise RewardModelError(f"grpo.reward_models path {path!r}: the model has num_labels="
                                   f"{self.model.config.num_labels}; a reward model needs num_labels=1 (one score)")
        if self.tokenizer.pad_token_id is None or self.model.config.pad_token_id is None:
            raise RewardModelError(f"grpo.reward_models path {path!r}: the tokenizer and model config need a pad "
                                   "token (pad_token_id), so the score is read at each text's last token")
        self.max_length, self.batch_size = int(max_length), int(batch_size)

    def score(self, texts: list[str]) -> list[float]:
        import torch

        out: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(texts[start:start + self.batch_size], padding=True, truncation=True,
                                     max_length=self.max_length, add_special_tokens=False, return_tensors="pt")
                logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits
                out += logits[:, 0].float().cpu().tolist()
        return out


@dataclass(frozen=True)
class RewardModels:
    """The run's reward model actors and their weights."""
    actors: tuple = ()
    weights: tuple[float, ...] = ()
    names: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.actors)

    def score(self, texts: list[str]) -> tuple[np.ndarray, dict[str, float]]:
        """-> (sum of weight x score per text: float64[k], {reward_model/<name>_mean: mean raw score})."""
        import ray

        scores = ray.get([actor.score.remote(texts) for actor in self.actors])
        total = np.zeros(len(texts), dtype=np.float64)
        metrics = {}
        for name, weight, values in zip(self.names, self.weights, scores):
            values = np.asarray(values, dtype=np.float64)
            if values.shape != (len(texts),) or not np.isfinite(values).all():
                raise RewardModelError(f"reward model {name!r} returned {values.shape} scores (non-finite: "
                                       f"{int((~np.isfinite(values)).sum())}) for {len(texts)} texts")
            total += weight * values
            metrics[f"reward_model_{name}_mean"] = float(values.mean())
        return total, metrics

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)


def start_reward_models(configs: list[Any], dtype: str = "float32") -> RewardModels:
    """One Ray actor per grpo.reward_models entry (Ray must be initialised); waits until each has loaded."""
    import ray

    if not configs:
        return RewardModels()
    actors, names = [], []
    for i, cfg in enumerate(configs):
        actor_cls = ray.remote(num_cpus=0, num_gpus=cfg.num_gpus)(RewardModelActor)
        actors.append(actor_cls.remote(cfg.path, dtype, cfg.max_length, cfg.batch_size))
        names.append(cfg.name or f"{i}")
    try:
        ray.get([a.__ray_ready__.remote() for a in actors])
    except ray.exceptions.RayActorError as err:
        for actor in actors:
            ray.kill(actor)
        cause = err.cause if isinstance(getattr(err, "cause", None), Exception) else err
        raise RewardModelError(f"grpo.reward_models: a reward model did not start: {cause}") from None
    return RewardModels(tuple(actors), tuple(float(c.weight) for c in configs), tuple(names))
