"""Multi-turn tool use: the environment interface and the pool of envs whose calls the tool hooks run."""
