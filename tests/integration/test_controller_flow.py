"""The rollout controller inside the flow: debug data saved and replayed without engines, eval metrics,
and SFT mode training on pre-generated samples."""
import json

import pytest
import torch

from spillover.infra.config.parsing import ConfigError
from spillover.infra.config.run_config import load_config
from spillover.infra.imports import ImportPathError

from test_train_flow import small_config
from wandb_records import read_segments


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_debug_data_replay_reproduces_training_and_eval_is_logged(prefect_harness, ray_session, warm_parts,
                                                                  tmp_path):
    from spillover.flows.train import grpo_train

    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps({"prompt": f"a*{n}=", "label": n}) + "\n" for n in (2, 3, 5)))
    template = str(tmp_path / "debug" / "rollout_{rollout_id}.parquet")
    first = tmp_path / "first"
    grpo_train(small_config(first, iterations=2, **{"storage.save_debug_rollout_data": template,
                                                    "schedule.eval_interval": 1, "tracking.wandb_mode": "offline",
                                                    "data.eval_paths": json.dumps({"toy": str(eval_file)})}),
               parts=warm_parts)
    original = rows(first)
    assert (tmp_path / "debug" / "rollout_1.parquet").is_file()
    for row in original:
        assert {"eval/toy", "eval/toy-truncated_ratio", "eval/step"} <= set(row)
        assert 0.0 <= row["eval/toy"] <= 1.0 and row["eval/step"] == row["iteration"]
    # the keys the README promises, read back from the run's real offline wandb record
    (segment,) = read_segments(first, 1)
    logged = {key for record in segment["history"] for key in record}
    assert {"eval/toy", "eval/toy-truncated_ratio", "eval/step", "train/loss", "train/lr", "train/optimizer_steps",
            "train/token_staleness_max", "rollout/reward_mean", "rollout/partial_rows", "time/update_s",
            "time/task_generate_until_ready_s", "time/iteration_s"} <= logged, sorted(logged)
    assert not {"rollout/lr", "rollout/update_s", "rollout/optimizer_steps", "rollout/eval/toy"} & logged

    replay = tmp_path / "replay"
    grpo_train(small_config(replay, iterations=2, **{"storage.load_debug_rollout_data": template,
                                                     "schedule.debug_train_only": "true"}), parts=warm_parts)
    replayed = rows(replay)
    for a, b in zip(original, replayed):
        assert a["trained_stream_ids"] == b["trained_stream_ids"]
        assert a["reward_mean"] == pytest.approx(b["reward_mean"])
        assert a["response_length_max"] == b["response_length_max"]
    # same samples, same initial weights, deterministic learner: the first update is the same
    assert original[0]["loss"] == pytest.approx(replayed[0]["loss"], rel=1e-5, abs=1e-7)


def test_sft_mode_raises_the_likelihood_of_the_given_responses(prefect_harness, ray_session, warm_parts, tmp_path):
    from spillover.flows.train import grpo_train
    from spillover.infra.storage.checkpoint import load_latest_checkpoint
    from spillover.bench.reference_lm import load_causal_lm
    from spillover.infra.storage.store import open_store

    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"a*{n}=", "response": "a" * n}) + "\n" for n in (1, 2, 3, 4)))
    run_dir = tmp_path / "sft_run"
    cfg = small_config(run_dir, iterations=4, **{"rollout.rollout_function_path": "spillover.rollout.builtin.sft.generate_sft_rollout",
                                                 "rollout.n_samples_per_prompt": 1, "grpo.micro_batch_size": 4,
                                                 "grpo.off_policy": "none", "data.sft_path": str(sft),
                                                 "optimizer.lr": 0.01})
    grpo_train(cfg, parts=warm_parts)
    sft_rows = rows(run_dir)
    assert [r["sft_samples"] for r in sft_rows] == [4, 4, 4, 4]
    # what an SFT run reports: the per-token NLL (falling), the real lengths, nothing stale, no reward
    assert sft_rows[-1]["nll"] < sft_rows[0]["nll"] and all(r["stale_token_share"] == 0.0 for r in sft_rows)
    assert sft_rows[0]["response_length_max"] == 5 and "reward_mean" not in sft_rows[0]

    ids = [14, 44, 7, 41]  # "a*3=" in the tiny char tokenizer
    resp = [14, 14, 14, 1]  # "aaa" + EOS
    tokens = torch.tensor([ids + resp])

    def response_logprob(model):
        with torch.no_grad():
            logp = torch.log_softmax(model(tokens).logits[0, len(ids) - 1:-1], -1)
        return float(logp.gather(1, torch.tensor(resp)[:, None]).sum())

    model = load_causal_lm(run_dir / "tiny_model")
    before = response_logprob(model)
    state = load_latest_checkpoint(open_store(str(run_dir / "checkpoints")))
    weights = {k[len("model/"):]: v for k, v in state.tensors["policy"].items() if k.startswith("model/")}
    model.load_state_dict(weights, strict=False)
    assert response_logprob(model) > before + 1.0


def test_wrong_rollout_function_fails_at_start_naming_the_path(prefect_harness, tmp_path):
    from spillover.flows.setup import build_run

    with pytest.raises(ImportPathError, match="rollout.rollout_function_path='spillover.rollout.drivers.default_rollout.nope'"):
        build_run(small_config(tmp_path / "bad", iterations=1,
                               **{"rollout.rollout_function_path": "spillover.rollout.drivers.default_rollout.nope"}))
    with pytest.raises(ConfigError, match="grpo.off_policy must be none in SFT mode"):
        load_config("configs/tiny.yaml", ["rollout.rollout_function_path=spillover.rollout.builtin.sft.generate_sft_rollout"])
