"""Multi-turn tool use: the environment interface and the pool its calls run on."""
