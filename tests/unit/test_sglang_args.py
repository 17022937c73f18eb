"""engines.sglang_args, the deterministic flag and the router policy, checked against SGLang 0.5.23's recorded
ServerArgs (tests/sglang_contract.py reads ../shared/sglang-contract/server_args.json, not our extract of it)."""
from __future__ import annotations

import pytest

from spillover.infra.config.engines import EnginesConfig

from spillover.infra.config.run_config import build_config
from spillover.infra.config.parsing import ConfigError
from spillover.rollout.sglang import backend as sgl
from spillover.infra.config.sglang_flags import MANAGED, server_fields, server_flags
from sglang_contract import record


def contract_fields() -> dict[str, dict]:
    return {f["name"]: f for f in record("server_args.json")["fields"]}


def test_the_shipped_extract_holds_every_recorded_field():
    """Every field of the recorded contract, with its flags (the extract has all of SGLang's parser: the contract
    tests check it against SGLang's own parser)."""
    fields = contract_fields()
    assert set(fields) <= set(server_fields()) and len(server_fields()) > 500
    for name, field in fields.items():
        assert server_fields()[name]["cli_flags"] == field["cli_flags"], name
    assert set(MANAGED) <= set(fields)


def test_flags_are_sglangs_own():
    args = {"mem_fraction_static": 0.7, "context_length": 8192, "chunked_prefill_size": 4096,
            "cuda_graph_max_bs_decode": 256, "attention_backend": "fa3", "disable_radix_cache": True,
            "enable_weights_cpu_backup": False}
    argv = server_flags(EnginesConfig(sglang_args=args).sglang_args, deterministic=True)
    flags = {f["cli_flags"][0]: f for f in contract_fields().values()}
    names = [a for a in argv if a.startswith("--")]
    assert all(n in flags for n in names), names
    assert argv == ["--mem-fraction-static", "0.7", "--context-length", "8192", "--chunked-prefill-size", "4096",
                    "--cuda-graph-max-bs-decode", "256", "--attention-backend", "fa3", "--disable-radix-cache",
                    "--enable-deterministic-inference"]
    assert flags["--enable-deterministic-inference"]["type"] == "bool"


@pytest.mark.parametrize("args, match", [
    ({"mem_fraction": 0.7}, "did you mean mem_fraction_static"),
    ({"cuda_graph_max_bs": 8}, "cuda-graph-max-bs-decode"),
    ({"tp_size": 2}, "engines.gpus_per_engine"),
    ({"enable_deterministic_inference": True}, "rollout.deterministic_sampling"),
    ({"disable_radix_cache": "yes"}, "true or false"),
    ({"attention_backend": "flash"}, "not one of"),
])
def test_bad_sglang_args_name_the_key_and_the_fix(args, match):
    with pytest.raises(ValueError, match=match) as err:
        EnginesConfig(sglang_args=args)
    assert f"engines.sglang_args.{next(iter(args))}" in str(err.value)


def test_config_overrides_and_router_policy():
    cfg = build_config(overrides=["engines.sglang_args={mem_fraction_static: 0.6}", "engines.weight_sync=distributed",
                                  "engines.weight_bucket_bytes=1048576"])
    assert cfg.engines.sglang_args == {"mem_fraction_static": 0.6} and cfg.engines.weight_bucket_bytes == 2**20
    assert cfg.engines.resolved_router_policy("sglang") == "cache_aware"
    assert cfg.engines.resolved_router_policy("torch") == "round_robin"
    assert build_config(overrides=["engines.router_policy=power_of_two"]).engines.resolved_router_policy("sglang") \
        == "power_of_two"
    policies = record("router.json")["policies"]
    assert policies["default"] == "cache_aware"
    assert {"cache_aware", "round_robin", "random", "power_of_two"} <= set(policies["regular"])
    with pytest.raises(ConfigError, match="router_policy"):
        build_config(overrides=["engines.router_policy=fastest"])
    with pytest.raises(ConfigError, match="weight_sync"):
        build_config(overrides=["engines.weight_sync=nccl"])


def test_launch_command_carries_the_extra_flags():
    spec = sgl.SGLangLaunch(model_path="/m", host="127.0.0.1", port=1, nccl_port=2,
                            extra_args=tuple(server_flags({"mem_fraction_static": 0.5}, deterministic=True)))
    cmd = sgl.launch_command(spec)
    assert cmd[-3:] == ["--mem-fraction-static", "0.5", "--enable-deterministic-inference"]


def test_pool_launch_options_put_the_run_flags_after_the_callers():
    from spillover.infra.config.sglang_flags import sglang_launch_options

    cfg = EnginesConfig(backend="sglang", sglang_args={"context_length": 4096})
    options = sglang_launch_options(cfg, {"mem_fraction_static": 0.8, "extra_args": ("--trust-remote-code",)}, True)
    assert options["mem_fraction_static"] == 0.8
    spec = sgl.SGLangLaunch(model_path="/m", host="h", port=1, nccl_port=2, **options)
    assert sgl.launch_command(spec)[-4:] == ["--trust-remote-code", "--context-length", "4096",
                                             "--enable-deterministic-inference"]
    assert sglang_launch_options(EnginesConfig(), None, False) == {"extra_args": ()}


def test_flags_beyond_the_recorded_contract_and_no_x_switches():
    """Every ServerArgs flag is accepted (quantization was refused when only the recorded 81 were known); a
    --X/--no-X switch set to false is passed as --no-X, since its default may be true."""
    fields = server_fields()
    negatable = next(name for name, f in fields.items() if f.get("cli_kind", "").startswith("boolean_optional")
                     and name not in MANAGED)
    argv = server_flags(EnginesConfig(sglang_args={"quantization": "fp8", negatable: False}).sglang_args)
    assert argv == ["--quantization", "fp8", fields[negatable]["cli_flags"][1]]
    assert fields[negatable]["cli_flags"][1].startswith("--no-")
