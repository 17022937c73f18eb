"""tests/warm_parts.WarmParts' bookkeeping with stand-in parts (the real engines and learners: tests/integration/
test_warm_parts.py): which part a run gets, when it is reset, kept or shut down."""
from __future__ import annotations

import pytest

from spillover.flows.parts import NewParts, RunParts
from spillover.infra.config.run_config import load_config
from warm_parts import WarmParts, engine_key, learner_key, model_shape_digest


class Part:
    def __init__(self, name: str):
        self.name, self.resets, self.down = name, 0, False

    def shutdown(self):
        self.down = True


def borrow(pool, key, name, fail_reset=False):
    def reset(part):
        if fail_reset:
            raise RuntimeError("gone")
        part.resets += 1
    return pool.borrow("engine", key, lambda: Part(name), reset)


def test_a_kept_part_is_reset_and_reused_only_for_its_key():
    pool = WarmParts()
    a = borrow(pool, "k1", "a")
    pool.give_back(a)
    assert borrow(pool, "k1", "b") is a and a.resets == 1 and pool.reused == 1
    pool.give_back(a)
    c = borrow(pool, "k2", "c")  # another key: the idle one is shut down first (it holds Ray resources)
    assert c.name == "c" and a.down and pool.started == 2
    pool.give_back(c, keep=False)  # a failed run gives its part up
    assert c.down and borrow(pool, "k2", "d").name == "d"


def test_a_part_that_cannot_be_reset_is_replaced():
    pool = WarmParts()
    a = borrow(pool, "k", "a")
    pool.give_back(a)
    b = borrow(pool, "k", "b", fail_reset=True)
    assert b.name == "b" and a.down and pool.reused == 0


def test_unkeyed_and_foreign_parts_are_shut_down_one_idle_part_per_role():
    pool = WarmParts()
    sharded = borrow(pool, None, "sharded")
    pool.give_back(sharded)
    assert sharded.down
    foreign = Part("foreign")
    pool.give_back(foreign)
    assert foreign.down
    first, second = borrow(pool, "k", "first"), borrow(pool, "k", "second")  # two runs at once: two parts
    pool.give_back(first)
    pool.give_back(second)
    assert first.down and not second.down
    pool.shutdown()
    assert second.down


def test_with_max_idle_parts_of_several_keys_wait_and_the_least_recently_used_goes_first():
    pool = WarmParts(max_idle=2)
    a, b = borrow(pool, "k1", "a"), borrow(pool, "k2", "b")
    pool.give_back(a)
    pool.give_back(b)
    assert borrow(pool, "k1", "a2") is a and not b.down  # the other key's part stays kept
    pool.give_back(a)  # now k2 (b) is the least recently used
    c = borrow(pool, "k3", "c")  # a third key: b is shut down before c starts, a stays
    assert b.down and not a.down and pool.started == 3
    pool.give_back(c)
    assert borrow(pool, "k1", "a3") is a and borrow(pool, "k3", "c2") is c and pool.reused == 3
    with pytest.raises(ValueError, match="max_idle"):
        WarmParts(max_idle=0)


@pytest.mark.parametrize("parts", [WarmParts(), NewParts()], ids=["WarmParts", "NewParts"])
def test_parts_pass_prefects_parameter_check_and_are_stored_by_type_name(parts):
    """grpo_train takes them as a flow parameter: Prefect checks it against RunParts and stores only the type name
    (not every actor a pool holds)."""
    from spillover.flows.train import grpo_train

    assert isinstance(parts, RunParts)
    checked = grpo_train.validate_parameters({"config": load_config("configs/tiny.yaml"), "parts": parts})
    assert checked["parts"] is parts
    assert grpo_train.serialize_parameters({"parts": parts}) == {"parts": f"<{type(parts).__name__}>"}


@pytest.mark.parametrize("override, kept", [([], True), (["learner.world_size=2"], True),
                                            (["learner.device=cuda"], False)])
def test_cpu_learner_groups_are_kept_cuda_ones_are_not(override, kept):
    cfg = load_config("configs/tiny.yaml", override)
    assert (learner_key(cfg, True) is not None) is kept


def test_a_sharded_group_serves_only_its_own_world_size():
    one, two = (load_config("configs/tiny.yaml", [f"learner.world_size={n}"]) for n in (1, 2))
    assert learner_key(one, True) != learner_key(two, True)


def test_the_engine_digest_ignores_weights_and_sees_the_tokenizer(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 64}')
    (folder / "tokenizer.json").write_text('{"vocab": 1}')
    (folder / "model.safetensors").write_bytes(b"1")
    before = model_shape_digest(folder)
    (folder / "model.safetensors").write_bytes(b"2")
    (folder / "spillover_weights.json").write_text('{"weight_version": 3}')
    assert model_shape_digest(folder) == before
    (folder / "tokenizer.json").write_text('{"vocab": 2}')
    assert model_shape_digest(folder) != before


def test_engines_are_kept_across_what_a_reset_applies_not_across_what_they_started_with(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    key = engine_key(load_config("configs/tiny.yaml").engines, tmp_path, False)
    runtime = load_config("configs/tiny.yaml", ["engines.weight_sync=distributed", "engines.health_interval_s=5"])
    assert engine_key(runtime.engines, tmp_path, False) == key
    assert engine_key(load_config("configs/tiny.yaml", ["engines.rollout_num_gpus=1"]).engines, tmp_path, False) != key
    assert engine_key(load_config("configs/tiny.yaml").engines, tmp_path, True) != key  # deterministic inference
