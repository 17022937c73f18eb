"""spillover: GRPO training with partial rollout. Installed as the `spillover` package (pyproject.toml maps this
folder to it), so flows/, tasks/, rollout/ and infra/ import as spillover.flows, spillover.tasks, ...."""
