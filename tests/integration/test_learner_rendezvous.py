"""A sharded learner group whose rendezvous port is taken before rank 0 listens (another process grabbed it
after `_free_address` found it free: seen in the suite while other runs start) starts its ranks again on a
new port instead of leaving rank 1 waiting for rank 0 for ever."""
import logging
import socket

import ray

import spillover.tasks.learner.group as learner_group
from spillover.infra.config.run_config import build_config


class TakenFirst:
    """Stands in for `_free_address`: the first answer is a port this test holds, then the real one."""

    def __init__(self, port: int, real):
        self.port, self.real, self.calls, self.kwargs = port, real, 0, {}

    def options(self, **kwargs):
        self.kwargs = kwargs
        return self

    def remote(self):
        self.calls += 1
        if self.calls == 1:
            return ray.put(("127.0.0.1", self.port))
        return self.real.options(**self.kwargs).remote()


def test_a_taken_rendezvous_port_restarts_the_ranks(ray_session, tiny_model_dir, monkeypatch, caplog):
    cfg = build_config(overrides=["learner.world_size=2"])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        stand_in = TakenFirst(taken.getsockname()[1], learner_group._free_address)
        monkeypatch.setattr(learner_group, "_free_address", stand_in)
        caplog.set_level(logging.WARNING, logger="spillover.tasks.learner.group")
        group = learner_group.create_learner_group(tiny_model_dir, cfg, trainable=False)
    try:
        assert stand_in.calls == 2
        assert any("was taken before rank 0 listened" in r.getMessage() for r in caplog.records)
        assert ray.get([a.weight_version.remote() for a in group.actors], timeout=60) == [0, 0]
    finally:
        group.shutdown()
