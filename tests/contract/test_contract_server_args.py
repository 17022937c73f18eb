"""Every `sglang.launch_server` command line the project builds, through SGLang 0.5.23's own parser and checks:
prepare_server_args(argv) (its argparse and ServerArgs), then ServerArgs.resolve_once() with `--model-path dummy`
(the model-independent resolution; no GPU and no model here, so the model-config and device steps are skipped:
memory fraction, CUDA graphs, attention backend per GPU).

The argv is the project's: SGLangLaunch as EngineActor.start fills it (rollout/fleet/engine_actor.py), with
engines.sglang_args through sglang_launch_options as EnginePool passes them (rollout/fleet/engine_pool.py), and
launch_command (rollout/sglang/backend.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from contract_checks import accepted
from spillover.infra.config.engines import EnginesConfig
from spillover.infra.config.run_config import load_config
from spillover.infra.config.sglang_flags import MANAGED, _is_bool, server_fields, server_flags, sglang_launch_options
from spillover.rollout.sglang.backend import SGLangLaunch, launch_command

GPU_RECIPES = ["qwen2.5-0.5b-gsm8k", "qwen2.5-0.5b-math", "qwen2.5-1.5b-gsm8k", "qwen2.5-1.5b-math"]


def engine_argv(engines: EnginesConfig, model_path: str, seed: int, deterministic: bool, **node) -> list[str]:
    """The argv after `python -m sglang.launch_server` of one engine node, as the pool and actor build it."""
    options = sglang_launch_options(engines, None, deterministic)
    spec = SGLangLaunch(model_path=model_path, host="127.0.0.1", port=30000, nccl_port=30001,
                        tp_size=engines.gpus_per_engine, max_running_requests=engines.max_running_requests,
                        random_seed=seed, weight_version=0, **node, **options)
    argv = launch_command(spec, python="python")
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    return argv[3:]


def parsed(sglang, argv: list[str]) -> dict:
    return accepted(sglang.server_args(argv), f"sglang.launch_server {' '.join(argv)}")["fields"]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_gpu_recipe_launch_commands(sglang, recipe, deterministic):
    run = load_config(f"configs/gpu/{recipe}.yaml")
    argv = engine_argv(run.engines, run.model.path, run.model.seed, deterministic or run.rollout.deterministic_sampling)
    fields = parsed(sglang, argv)
    if fields is not None:  # SGLang's reading of what the project asked for
        assert fields["model_path"] == run.model.path and fields["tp_size"] == run.engines.gpus_per_engine
        assert fields["max_running_requests"] == run.engines.max_running_requests
        assert fields["weight_version"] == "0" and fields["random_seed"] == run.model.seed
        assert fields["enable_memory_saver"] is True
        assert fields["enable_deterministic_inference"] is (deterministic or run.rollout.deterministic_sampling)


def test_multi_node_launch_command(sglang):
    """An engine over two nodes (engines.gpus_per_engine above the GPUs of a node): node 1's command line."""
    engines = EnginesConfig(backend="sglang", rollout_num_gpus=16, gpus_per_engine=16)
    argv = engine_argv(engines, "/models/m", 0, False, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:29600",
                       base_gpu_id=0)
    fields = parsed(sglang, argv)
    if fields is not None:
        assert (fields["nnodes"], fields["node_rank"], fields["dist_init_addr"]) == (2, 1, "10.0.0.1:29600")


@pytest.mark.parametrize("args", [
    {"mem_fraction_static": 0.7, "context_length": 8192, "chunked_prefill_size": 4096,
     "cuda_graph_max_bs_decode": 256, "attention_backend": "fa3", "disable_radix_cache": True,
     "enable_weights_cpu_backup": False},
    {"enable_weights_cpu_backup": True, "mem_fraction_static": 0.5, "cuda_graph_bs_decode": [1, 2, 4, 8],
     "dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3", "cuda_graph_config": {"decode": {"max_bs": 8}}},
])
def test_engines_sglang_args(sglang, args):
    """engines.sglang_args as users write them (validated by EnginesConfig, made flags by server_flags)."""
    engines = EnginesConfig(backend="sglang", sglang_args=args)
    fields = parsed(sglang, engine_argv(engines, "/models/m", 0, False))
    if fields is not None:
        for key, value in args.items():
            assert fields[key] == value, key


def test_every_flag_sglang_args_knows_parses_as_sglangs(sglang_classes):
    """infra/config/sglang_flags.py's extract against SGLang's own parser: every switch it lets users set is a flag
    SGLang takes, every choice it allows SGLang allows, and every valued field given its default parses back to it."""
    fields = server_fields()
    settable = {k: f for k, f in fields.items() if f.get("cli_flags") and k not in MANAGED}
    switches = {k: True for k, f in settable.items() if _is_bool(f)}
    answer = sglang_classes.server_args(["--model-path", "m", *server_flags(switches)], resolve=False)
    accepted(answer, f"every switch of sglang_args ({len(switches)})")
    every_choice = [arg for key, field in settable.items() for choice in field.get("choices") or ()
                    for arg in server_flags({key: choice})]  # argparse checks each repeat of a flag
    accepted(sglang_classes.server_args(["--model-path", "m", *every_choice], resolve=False),
             "every choice sglang_args allows")
    for key, field in settable.items():
        if _is_bool(field) or field.get("default") is None:
            continue
        answer = sglang_classes.server_args(["--model-path", "m", *server_flags({key: field["default"]})],
                                            resolve=False)
        seen = accepted(answer, f"engines.sglang_args.{key}={field['default']!r}")["fields"][key]
        assert seen == field["default"] or str(seen) == str(field["default"]), (key, seen, field["default"])


def test_a_removed_flag_is_refused(sglang):
    """The check bites: SGLang's parser refuses --cuda-graph-max-bs (ambiguous since 0.5.x), which the project's
    own check (engines.sglang_args) refuses first, naming the replacement."""
    engines = EnginesConfig(backend="sglang")
    argv = engine_argv(engines, "/models/m", 0, False) + ["--cuda-graph-max-bs", "8"]
    refused = sglang.server_args(argv)
    assert not refused["ok"] and "cuda-graph-max-bs" in refused["error"]
    with pytest.raises(ValueError, match="cuda-graph-max-bs-decode"):
        EnginesConfig(backend="sglang", sglang_args={"cuda_graph_max_bs": 8})


def test_sglang_refusal_runs_sglangs_parser_out_of_process(sglang_classes):
    """spillover.infra.config.sglang_flags.sglang_refusal (for a preflight: SGLang's parser without importing SGLang into the
    caller) says what the oracle says, and leaves this process without SGLang."""
    import sys

    from spillover.infra.config.sglang_flags import sglang_refusal

    imported_before = "sglang" in sys.modules  # another in-process test may have imported it
    argv = engine_argv(load_config("configs/gpu/qwen2.5-0.5b-gsm8k.yaml").engines, "/models/m", 0, True)
    assert sglang_refusal(argv) is None
    said = sglang_refusal(argv + ["--cuda-graph-max-bs", "8"])
    assert said == sglang_classes.server_args(argv + ["--cuda-graph-max-bs", "8"])["error"]
    assert "ambiguous option: --cuda-graph-max-bs" in said
    assert ("sglang" in sys.modules) == imported_before


def test_the_shipped_flag_list_is_sglangs_own_parser(sglang_classes):
    """infra/config/sglang_flags.json (what engines.sglang_args accepts) is what SGLang's own parser has:
    every flag of ServerArgs.add_cli_args, e.g. quantization, which the recorded contract's 81 fields lacked."""
    import json
    import subprocess
    import sys

    from server_args_extract import SHIPPED

    done = subprocess.run([sys.executable, str(Path(__file__).with_name("server_args_extract.py"))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == json.loads(SHIPPED.read_text()), (
        "infra/config/sglang_flags.json is stale: python tests/contract/server_args_extract.py > it")
    assert "quantization" in json.loads(SHIPPED.read_text())["fields"]
