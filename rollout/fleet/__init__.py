"""The engine fleet: engine actors on Ray behind the sglang-router, their clients and weight updates."""
