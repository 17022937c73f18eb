"""Generation over the dock: the driver loop (rounds), its tool hooks, dispatch, the default rollout, the request codec."""
