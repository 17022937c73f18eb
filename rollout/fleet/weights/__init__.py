"""How a fleet's engines get new weights: the update (disk, tensor, distributed, colocated), one strategy per kind,
and the bucketed poster to one engine."""
