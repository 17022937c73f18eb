"""Names the dead-code check (tests/unit/test_dead_code.py) counts as used although no code calls them: what only a
framework calls, by name. Decorated framework entry points (pydantic validators, FastAPI routes, Prefect flows and
tasks) are recognised by their decorator and need no line here. Vulture reads this file; nothing imports it."""

# Ray actor methods called by name on every rank of a learner group (LearnerGroup.each("<name>", ...)).
write_state_shards  # tasks/run_state.py write_learner_shards
load_colocated_weights  # rollout/fleet/weights/fleet_weights.py, colocated engines

# torch's TorchDispatchMode asks its subclasses this (infra/tensor_memory.py).
_should_skip_dynamo

# Prefect's SubprocessASGIServer.start calls this override (infra/prefect/server.py FateSharedServer).
_run_uvicorn_command
