"""The placement plan (infra/config/placement_plan.py), its memory estimate (infra/config/memory.py) and the preflight's input
checks (flows/check_inputs.py) as pure functions; `spillover check` as a process: tests/integration/test_check_cli.py."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from spillover.infra.config.run_config import build_config, load_config
from spillover.infra.config.memory import memory_lines, model_shape
from spillover.infra.config.placement_plan import Cluster, engine_bundle, learner_bundle, placement_plan, plan_problems

RECIPES = sorted(Path("configs/gpu").glob("*.yaml"))
QWEN_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)


def gpus(name_counts: dict, plan) -> dict:
    return {g.name: g.total_gpus for g in plan.groups if g.name in name_counts}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipes_run_the_reference_on_the_policys_gpus(recipe):
    """The recipes (grpo.kl_coef > 0) hold the reference in the policy's ranks: 2 GPUs for the 0.5B ones, 4 for the
    1.5B ones; learner.reference_placement=separate gives it GPUs of its own again (3 and 6)."""
    cfg = load_config(recipe)
    assert cfg.grpo.kl_coef > 0 and cfg.learner.reference_placement == "with_policy"
    plan = placement_plan(cfg)
    ranks = cfg.learner.world_size
    engines = cfg.engines.rollout_num_gpus
    assert engines == ranks and {g.name: g.total_gpus for g in plan.groups} == {"policy learner": ranks,
                                                                               "engine": engines}
    assert "learner.reference_placement=with_policy" in plan.groups[0].note
    assert plan.total_gpus == 2 * ranks and plan_problems(plan, Cluster(gpus=2 * ranks)) == []
    short = plan_problems(plan, Cluster(gpus=2 * ranks - 1, source="--gpus"))
    assert len(short) == 1 and f"needs {2 * ranks} GPUs" in short[0]
    assert all(f in short[0] for f in ("learner.world_size", "engines.rollout_num_gpus"))
    separate = placement_plan(load_config(recipe, ["learner.reference_placement=separate"]))
    assert {g.name: g.total_gpus for g in separate.groups} == {"policy learner": ranks, "reference learner": ranks,
                                                              "engine": engines}
    [short] = plan_problems(separate, Cluster(gpus=2 * ranks, source="--gpus"))
    assert all(f in short for f in (f"needs {3 * ranks} GPUs", "grpo.kl_coef > 0, learner.reference_placement=separate",
                                    "learner.reference_placement=with_policy runs the reference on the policy's GPUs"))


def test_what_is_started_decides_the_count():
    gpu = ["learner.device=cuda", "engines.backend=sglang", "engines.rollout_num_gpus=2"]
    assert placement_plan(build_config({}, gpu)).total_gpus == 3  # 1 rank, no KL: 2 engine GPUs
    assert placement_plan(build_config({}, gpu + ["grpo.kl_coef=0.1"])).total_gpus == 3  # the reference in the policy
    for placement in ("with_policy_offloaded", "separate"):
        assert placement_plan(build_config({}, gpu + ["grpo.kl_coef=0.1", f"learner.reference_placement={placement}"]
                                           )).total_gpus == {"separate": 4}.get(placement, 3)
    colocated = build_config({}, ["learner.device=cuda", "learner.world_size=2", "placement.colocate=true",
                                  "engines.backend=sglang", "engines.rollout_num_gpus=2", "grpo.micro_batch_size=16"])
    plan = placement_plan(colocated)
    assert plan.total_gpus == 2 and [g.gpus for g in plan.groups if g.name == "engine"] == [0.0]
    rm = build_config({}, gpu + ["grpo.reward_models=[{path: /rm, num_gpus: 1, name: judge}]"])
    assert gpus({"reward model judge": 1}, placement_plan(rm)) == {"reward model judge": 1.0}
    replay = build_config({}, gpu + ["schedule.debug_train_only=true", "storage.load_debug_rollout_data=x/{rollout_id}"])
    assert [g.name for g in placement_plan(replay).groups] == ["policy learner"]
    assert [g.name for g in placement_plan(build_config({}, gpu), eval_only=True).groups] == ["engine"]
    torch_engines = build_config({})  # torch engines use GPUs only where the cluster has enough of them
    assert placement_plan(torch_engines).total_gpus == 0 and placement_plan(torch_engines, cluster_gpus=2).total_gpus == 2


def test_bundles_are_the_ones_the_placing_code_requests():
    from types import SimpleNamespace

    import spillover.rollout.fleet.engine_pool as engine_pool
    import spillover.tasks.learner.group as learner_group

    engines = build_config({}, ["engines.num_cpus_per_engine=0.5"]).engines
    assert engine_bundle(engines, False)["CPU"] == engine_pool.EnginePool._bundle_cpu(SimpleNamespace(cfg=engines))
    assert engine_bundle(engines, True) == {"GPU": 1, "CPU": max(0.5, engine_pool.GPU_ACTOR_FRACTION)}
    assert engine_bundle(build_config({}).engines, False)["CPU"] == engine_pool.MIN_BUNDLE_CPU
    learner = build_config({}, ["learner.device=cuda", "learner.gpus_per_rank=0.5"]).learner
    assert learner_bundle(learner) == {"CPU": learner_group.BUNDLE_MIN_CPU, "GPU": 0.5}


def test_multi_node_placement_with_local_storage_is_refused():
    cfg = build_config({}, ["learner.device=cuda", "engines.backend=sglang", "engines.rollout_num_gpus=1"])
    plan = placement_plan(cfg)
    two_nodes = Cluster(gpus=8, nodes=2, gpus_per_node=4, source="the Ray cluster")
    for url in (None, "/data/ckpt", "file:///data/ckpt"):
        [line] = plan_problems(plan, two_nodes, url)
        assert "storage.url=" in line and "2 nodes" in line and "s3://" in line
    assert plan_problems(plan, two_nodes, "s3://bucket/run") == []
    assert plan_problems(plan, two_nodes, None, writes_checkpoints=False) == []  # eval writes no checkpoints
    assert plan_problems(plan, Cluster(gpus=8, nodes=1, gpus_per_node=8), None) == []
    spread = build_config({}, ["learner.world_size=2", "learner.placement_strategy=STRICT_SPREAD",
                               "grpo.micro_batch_size=16"])
    assert "spreads the ranks" in plan_problems(placement_plan(spread), Cluster(gpus=None), None)[0]
    wide = build_config({}, ["engines.backend=sglang", "engines.rollout_num_gpus=8", "engines.gpus_per_engine=8"])
    lines = plan_problems(placement_plan(wide), Cluster(gpus=12, nodes=1, gpus_per_node=6), "s3://b/r")
    assert lines and "engines.gpus_per_engine (8) spans nodes" in lines[0]


def test_weights_by_cuda_ipc_to_an_engine_spanning_nodes_are_refused():
    """SGLang's /update_weights_from_tensor hands every tensor-parallel rank CUDA IPC handles to memory on the engine's
    first node: ranks on other nodes cannot open them and the engine dies. engines.weight_sync=tensor and colocated
    engines load that way (placement.colocate holds them to one GPU each); the distributed path broadcasts to every rank
    instead."""
    wide = ["learner.device=cuda", "engines.backend=sglang", "engines.rollout_num_gpus=16", "engines.gpus_per_engine=16"]
    two_nodes = Cluster(gpus=32, nodes=2, gpus_per_node=16, source="the Ray cluster")
    eight_per_node = Cluster(gpus=32, nodes=4, gpus_per_node=8, source="the Ray cluster")
    tensor = placement_plan(build_config({}, wide + ["engines.weight_sync=tensor"]))
    [line] = plan_problems(tensor, eight_per_node, "s3://b/r")
    assert all(f in line for f in ("engines.weight_sync=tensor", "engines.gpus_per_engine=16 > 8",
                                   "engines.weight_sync=distributed")), line
    assert plan_problems(tensor, two_nodes, "s3://b/r") == []  # the engine fits one node
    assert plan_problems(placement_plan(build_config({}, wide + ["engines.weight_sync=distributed"])), eight_per_node,
                         "s3://b/r") == []
    torch_backend = placement_plan(build_config({}, ["engines.weight_sync=tensor", "engines.gpus_per_engine=16",
                                                     "engines.rollout_num_gpus=16"]))
    assert not any("IPC" in line for line in plan_problems(torch_backend, eight_per_node, "s3://b/r"))


def test_memory_estimate_of_a_recipe():
    shape = model_shape(QWEN_05B)
    assert 0.48e9 < shape.params < 0.50e9  # Qwen2.5-0.5B: 494M parameters
    cfg = load_config("configs/gpu/qwen2.5-0.5b-gsm8k.yaml")
    lines = memory_lines(placement_plan(cfg), cfg, shape)
    assert [line.split(":")[0] for line in lines] == ["policy learner", "engine"]  # the reference in the policy's
    assert "~9.2 GiB" in lines[0] and "KL reference" in lines[0] and "256 slots at 1536 tokens" in lines[1]  # +1.8
    offloaded = load_config("configs/gpu/qwen2.5-0.5b-gsm8k.yaml", ["learner.reference_placement=with_policy_offloaded"])
    [policy, _] = memory_lines(placement_plan(offloaded), offloaded, shape)
    assert "~7.4 GiB" in policy and "~1.8 GiB only during its pass" in policy
    separate = load_config("configs/gpu/qwen2.5-0.5b-gsm8k.yaml", ["learner.reference_placement=separate"])
    lines = memory_lines(placement_plan(separate), separate, shape)
    assert [line.split(":")[0] for line in lines] == ["policy learner", "reference learner", "engine"]
    assert "~7.4 GiB" in lines[0] and "~1.8 GiB" in lines[1]


def test_reward_keywords_match_the_reward_task():
    from spillover.flows.check_inputs import REWARD_KEYWORDS
    from spillover.tasks.reward import REWARD_KEYWORDS as used

    assert REWARD_KEYWORDS == used


def _prompts(tmp_path, rows: list) -> str:
    path = tmp_path / "p.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_data_check_names_the_first_bad_line_and_null_labels(tmp_path):
    from spillover.flows.check_inputs import check_data
    from spillover.infra.models import build_char_tokenizer

    tok = build_char_tokenizer()
    good = [{"prompt": f"a*{n}=", "label": n} for n in range(1, 5)]
    assert check_data(build_config({}, [f"data.prompts_path={_prompts(tmp_path, good)}"]), tok) == []
    path = _prompts(tmp_path, good + ['{"prompt": "a*5=", "label": 5'] + good)
    [line] = check_data(build_config({}, [f"data.prompts_path={path}"]), tok)
    assert line.startswith(f"{path}:5: not valid JSON")
    path = _prompts(tmp_path, good + [{"prompt": "a*5=", "label": None}])
    [line] = check_data(build_config({}, [f"data.prompts_path={path}"]), tok)
    assert line.startswith(f"{path}:5: label 'label' is null")
    path = _prompts(tmp_path, good + [{"prompt": "a*5=", "label": "five"}])
    [line] = check_data(build_config({}, [f"data.prompts_path={path}"]), tok)
    assert f"{path}:5: label 'label' is 'five'" in line and "integer" in line
    math = build_config({}, [f"data.prompts_path={path}", "grpo.reward_function_path=spillover.rollout.builtin.math_reward.reward"])
    assert check_data(math, tok) == []  # any label for the math reward
    [line] = check_data(build_config({}, ["data.eval_paths={test: /nowhere.jsonl}"]), tok)
    assert "data.eval_paths.test='/nowhere.jsonl' does not exist" in line


def bad_signature(response):
    return 0.0


def test_import_and_model_checks(tmp_path, tiny_model_dir):
    from spillover.flows.check_inputs import check_imports, check_model

    [line] = check_imports(build_config({}, ["grpo.reward_function_path=nosuch_pkg.reward"]))
    assert line.startswith("grpo.reward_function_path='nosuch_pkg.reward': cannot import module 'nosuch_pkg'")
    [line] = check_imports(build_config({}, ["grpo.reward_function_path=test_placement_plan.bad_signature"]))
    assert "must accept (response, label" in line
    tokenizer, problems = check_model(build_config({}, [f"model.path={tiny_model_dir}"]))
    assert tokenizer is not None and problems == []
    _, problems = check_model(build_config({}, [f"model.path={tmp_path}"]))
    assert problems and "has no config.json and no *.safetensors weights" in problems[0]


def test_quiet_console_drops_only_prefects_own_info_lines():
    import prefect

    from spillover.infra.prefect.env import PrefectEngineLines

    quiet = PrefectEngineLines()
    engine_file = str(Path(prefect.__file__).parent / "task_engine.py")

    def record(name, level, path):
        return logging.LogRecord(name, level, path, 1, "msg", None, None)

    assert not quiet.filter(record("prefect.task_runs", logging.INFO, engine_file))  # Finished in state Completed()
    assert quiet.filter(record("prefect.flow_runs", logging.INFO, "/work/flows/train.py"))  # the iteration summary
    assert quiet.filter(record("prefect.task_runs", logging.WARNING, engine_file))
    assert quiet.filter(record("spillover.checkpoint", logging.INFO, engine_file))


def test_verbose_takes_the_quiet_filter_off_the_console():
    from spillover.flows.cli import build_parser, parse_args
    from spillover.infra.prefect.env import PrefectEngineLines, quiet_console

    root = logging.getLogger()
    handler = logging.StreamHandler()
    root.addHandler(handler)
    try:
        quiet_console(verbose=False)
        quiet_console(verbose=False)
        assert [type(f) for f in handler.filters] == [PrefectEngineLines]
        quiet_console(verbose=True)
        assert handler.filters == []
    finally:
        root.removeHandler(handler)
    assert parse_args(build_parser(), ["train", "--verbose"]).verbose
    assert not parse_args(build_parser(), ["train"]).verbose


def test_this_machine_counts_the_gpus_ray_would(monkeypatch):
    from spillover.flows.check import choose_cluster, local_cluster

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert local_cluster().gpus == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert local_cluster().gpus == 0
    planned = choose_cluster(build_config({}), gpus=8, nodes=2)  # --gpus wins over RAY_ADDRESS and this machine
    assert (planned.gpus, planned.nodes, planned.gpus_per_node) == (8, 2, 4) and "--gpus 8 --nodes 2" in planned.source
