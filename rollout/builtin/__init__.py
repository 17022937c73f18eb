"""The built-in tasks and rewards (toy, arithmetic, calculator, math), SFT rollout, data conversion."""
