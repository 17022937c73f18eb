"""spillover check's model-length rule (flows/check_inputs.py check_model_length): SGLang ends every request 2
tokens short of its context length (sglang 0.5.23 scheduler.init_req_max_new_tokens caps max_new_tokens at
context_len - 1 - input - 1), so with SGLang engines rollout.max_model_len must leave those 2 positions, or a row whose
budget runs to the end could never finish."""
from __future__ import annotations

import json

from spillover.flows.check_inputs import check_model_length
from spillover.infra.config.run_config import build_config


def model_folder(tmp_path, positions: int):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": positions}))
    return tmp_path


def test_sglang_engines_need_two_positions_beyond_max_model_len(tmp_path):
    folder = model_folder(tmp_path, 512)
    torch_cfg = build_config(overrides=["rollout.max_model_len=512"])
    assert check_model_length(torch_cfg, folder) == []  # our engine generates up to the last position
    sglang = build_config(overrides=["engines.backend=sglang", "rollout.max_model_len=512"])
    [problem] = check_model_length(sglang, folder)
    assert "rollout.max_model_len (512) leaves SGLang no room" in problem and "lower rollout.max_model_len to 510" in problem
    assert check_model_length(build_config(overrides=["engines.backend=sglang", "rollout.max_model_len=510"]), folder) == []
    wider = build_config(overrides=["engines.backend=sglang", "rollout.max_model_len=512",
                                    "engines.sglang_args={context_length: 1024}"])
    assert check_model_length(wider, folder) == []
