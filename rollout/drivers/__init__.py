"""Generation drivers over the dock: the default rollout (sync rounds, async stream, multi-turn) and dispatch."""
