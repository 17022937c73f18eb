"""Where a run reports: metrics files, the terminal, wandb, Prefect artifacts."""
