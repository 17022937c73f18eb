"""Generation over the dock: the driver loop (rounds), its tool hooks, dispatch, the default rollout and eval, the
request codec."""
