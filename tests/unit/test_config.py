import pytest

from spillover.infra.config.parsing import ConfigError
from spillover.infra.config.run_config import RunConfig, build_config, load_config


def test_tiny_config_loads_and_partial_is_on():
    cfg = load_config("configs/tiny.yaml")
    assert cfg.rollout.partial and cfg.rollout.effective_max_age == cfg.rollout.max_split
    assert cfg.engines.num_engines == 2


def test_overrides_parse_yaml_values():
    cfg = load_config("configs/tiny.yaml", ["rollout.max_split=4", "optimizer.lr=3e-4", "run_dir=/tmp/x",
                                            "tracking.wandb_mode=disabled"])
    assert cfg.rollout.max_split == 4 and cfg.optimizer.lr == pytest.approx(3e-4)
    assert cfg.run_dir == "/tmp/x" and cfg.tracking.wandb_mode == "disabled"


@pytest.mark.parametrize("overrides, field", [
    (["grpo.micro_batch_size=7"], "grpo.micro_batch_size"),
    (["rollout.max_split=0"], "rollout.max_split"),
    (["rollout.max_tokens=2", "rollout.max_split=4"], "rollout.max_tokens"),
    (["rollout.n_samples_per_prompt=1"], "rollout.n_samples_per_prompt"),
    (["rollout.max_model_len=32"], "rollout.max_model_len"),
    (["engines.rollout_num_gpus=3", "engines.gpus_per_engine=2"], "engines.rollout_num_gpus"),
    (["rollout.temperature=0"], "rollout.temperature"),
    (["rollout.no_such_field=1"], "rollout.no_such_field"),
    (["schedule.debug_train_only=true"], "storage.load_debug_rollout_data"),
    (["rollout.mode=async", "rollout.overlap=true", "placement.colocate=true", "engines.rollout_num_gpus=1"],
     "rollout.overlap=true cannot run with placement.colocate"),
    (["engines.pause_mode=paused"], "engines.pause_mode"),
    (["learner.max_tokens_per_micro_batch=32", "rollout.max_model_len=64"], "rollout.max_model_len (64)"),
    (["rollout.n_samples_per_prompt=0", "rollout.rollout_function_path=spillover.rollout.builtin.sft.generate_sft_rollout"],
     "rollout.n_samples_per_prompt"),
    (["grpo.clip_eps_high=-1"], "grpo.clip_eps_high"),
    (["optimizer.betas=[1.5, 0.9]"], "optimizer.betas"),
])
def test_impossible_values_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny.yaml", overrides)
    assert field in str(err.value)


def test_a_token_budget_replaces_the_micro_batch_count():
    """With learner.max_tokens_per_micro_batch, grpo.micro_batch_size sizes no forward pass: it need not divide a
    step's samples; packing is on unless turned off."""
    cfg = load_config("configs/tiny.yaml", ["grpo.micro_batch_size=7", "learner.max_tokens_per_micro_batch=4096"])
    assert cfg.learner.packs_sequences and cfg.learner.deterministic
    assert not load_config("configs/tiny.yaml").learner.packs_sequences  # default: count micro-batches, padded
    off = load_config("configs/tiny.yaml", ["learner.max_tokens_per_micro_batch=4096", "learner.pack_sequences=false"])
    assert not off.learner.packs_sequences


def test_override_text_that_yaml_would_mangle_stays_as_given():
    """A password with '@' is not YAML (its error would echo it); ' #' would start a YAML comment."""
    cfg = build_config({}, ["storage.secret_access_key=@Sup3r%Secret", "data.system_prompt=Be brief #1 rule",
                            "rollout.max_split=4 # a comment"])
    assert cfg.storage.secret_access_key.get_secret_value() == "@Sup3r%Secret"
    assert cfg.data.system_prompt == "Be brief #1 rule" and cfg.rollout.max_split == 4
    assert build_config({}, ["data.system_prompt='quoted # kept'"]).data.system_prompt == "quoted # kept"


def test_bad_override_syntax_and_missing_file():
    with pytest.raises(ConfigError, match="key=value"):
        build_config({}, ["rollout.max_split"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")


def test_every_field_has_a_description():
    def walk(model):
        for name, f in model.model_fields.items():
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, RunConfig.__mro__[1]) and name != "tiny":
                walk(ann)
            elif name not in ("model", "data", "rollout", "grpo", "optimizer", "engines", "storage",
                              "tracking", "schedule", "tiny"):
                assert f.description, f"{model.__name__}.{name} has no description"
    walk(RunConfig)


def test_secrets_are_hidden_in_repr():
    cfg = build_config({"storage": {"secret_access_key": "hunter2"}})
    assert "hunter2" not in repr(cfg) and "hunter2" not in cfg.model_dump_json()


def test_lr_schedules_are_pure_functions_of_the_step_and_the_decay_span():
    from spillover.infra.config.training import OptimizerConfig

    cos = OptimizerConfig(lr=1.0, lr_decay="cosine", min_lr_ratio=0.1)
    span = cos.fresh_decay(100)
    assert cos.lr_at(0, span) == pytest.approx(1.0) and cos.lr_at(100, span) == pytest.approx(0.1)
    assert cos.lr_at(50, span) == pytest.approx(0.55) and cos.lr_at(500, span) == pytest.approx(0.1)
    lin = OptimizerConfig(lr=2.0, lr_decay="linear", min_lr_ratio=0.0, decay_steps=10)
    assert lin.lr_at(5, lin.fresh_decay(100)) == pytest.approx(1.0)  # decay_steps, not the default horizon
    assert OptimizerConfig(lr=0.5).lr_at(7, span) == 0.5


def test_a_longer_horizon_continues_the_decay_from_where_it_was():
    """A run of 4 updates resumed for 8 (issue 41): stretch (the default) goes on from the lr of the last update
    taken down to the end value at the new horizon; keep holds the recorded horizon (then the end value). Neither
    starts the decay over; a resume with the run's own horizon keeps its span exactly."""
    import math

    from spillover.infra.config.training import DecaySpan, OptimizerConfig

    stretch = OptimizerConfig(lr=1.0, lr_decay="cosine", min_lr_ratio=0.1)
    assert stretch.lr_extension == "stretch"
    recorded = stretch.fresh_decay(4)
    assert stretch.resumed_decay(recorded, next_step=2, default_steps=4) == recorded  # a crash resume
    span = stretch.resumed_decay(recorded, next_step=4, default_steps=8)
    assert span == DecaySpan(3, 0.75, 8)  # from update 3 (the last taken, 3/4 of the decay done) to update 8
    cosine = lambda done: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done))  # noqa: E731
    before = [stretch.lr_at(s, recorded) for s in range(4)]
    after = [stretch.lr_at(s, span) for s in range(4, 8)]
    assert after == pytest.approx([cosine(0.75 + 0.25 * k / 5) for k in range(1, 5)])
    lrs = before + after
    assert all(a > b for a, b in zip(lrs, lrs[1:])) and lrs[-1] > 0.1  # decaying on, reaching 0.1 at update 8
    restarted = [stretch.lr_at(s, stretch.fresh_decay(8)) for s in range(4, 8)]
    assert restarted[0] > before[-1]  # what a new horizon from update 0 gave: the sawtooth

    keep = OptimizerConfig(lr=1.0, lr_decay="cosine", min_lr_ratio=0.1, lr_extension="keep")
    assert keep.resumed_decay(recorded, next_step=4, default_steps=8) == recorded
    assert [keep.lr_at(s, recorded) for s in range(4, 8)] == pytest.approx([0.1] * 4)
    past = stretch.resumed_decay(DecaySpan(3, 0.75, 8), next_step=6, default_steps=4)  # shorter than taken
    assert stretch.lr_at(6, past) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        OptimizerConfig(lr_extension="restart")
