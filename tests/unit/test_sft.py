"""SFT mode: pre-generated samples from JSONL, grouped one per group, and the proof that the PPO objective
with advantage 1 at ratio 1 has the NLL gradient (with the real loss functions and the tiny model)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from spillover.infra.config.run_config import build_config
from spillover.bench.reference_lm import load_causal_lm
from spillover.infra.models import build_char_tokenizer
from spillover.rollout.contracts.rollout_function import flatten_rollout
from batch_views import convert_samples_to_train_data
from spillover.rollout.sample import Sample, Status
from spillover.rollout.batch import is_sft_batch
from spillover.rollout.builtin.sft import SFT_WEIGHT_VERSION, SFTDataError, generate_sft_rollout
from spillover.tasks.grpo_loss import aggregate, clipped_policy_loss
from reference_logprobs import full_token_logprobs


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def config(path, gbs=2, max_model_len=64, **extra):
    return build_config({"data": {"sft_path": path}, "rollout": {"global_batch_size": gbs, "max_tokens": 32,
                                                                  "max_model_len": max_model_len},
                         "grpo": {"micro_batch_size": 2}, **extra})


@pytest.fixture
def tok():
    return build_char_tokenizer()


@pytest.fixture
def source(tok):
    return SimpleNamespace(tokenizer=tok)


def test_text_rows_are_tokenized_with_eos_and_handed_out_gbs_groups_in_order(tmp_path, tok, source):
    rows = [{"prompt": f"a*{i}=", "response": "a" * i, "label": i} for i in range(1, 6)]
    cfg = config(write_jsonl(tmp_path / "sft.jsonl", rows), gbs=2)
    eos = tok.eos_token_id
    seen = []
    for rollout_id in range(3):  # 6 groups from 5 rows: the third rollout wraps around
        groups = generate_sft_rollout(cfg, rollout_id, source)
        assert flatten_rollout(groups) == groups and [len(g) for g in groups] == [1, 1]
        seen += [g[0] for g in groups]
    assert [s.group_index for s in seen] == list(range(6))
    assert [s.label for s in seen] == [1, 2, 3, 4, 5, 1]
    first = seen[0]
    assert first.prompt_tokens == tok("a*1=", add_special_tokens=False)["input_ids"]
    assert first.response_tokens == tok("a", add_special_tokens=False)["input_ids"] + [eos]
    assert first.status == Status.COMPLETED and first.reward == 0.0 and first.index == 0
    assert first.metadata == {"sft": True, "sft_line": 1}
    assert first.weight_versions == [SFT_WEIGHT_VERSION] * 2 and first.rollout_logprobs == [0.0, 0.0]
    data = convert_samples_to_train_data(seen)
    assert data["loss_masks"][3] == [1] * 5 and data["truncated"] == [0] * 6
    assert is_sft_batch([[s] for s in seen])


def test_token_rows_keep_their_ids_and_loss_mask(tmp_path, source):
    rows = [{"prompt_tokens": [3, 4], "response_tokens": [5, 6, 1], "loss_mask": [0, 1, 1]},
            {"prompt_tokens": [7], "response_tokens": [8]}]
    cfg = config(write_jsonl(tmp_path / "sft.jsonl", rows), gbs=2)
    groups = generate_sft_rollout(cfg, 0, source)
    data = convert_samples_to_train_data(groups)
    assert data["tokens"] == [[3, 4, 5, 6, 1], [7, 8]]
    assert data["loss_masks"] == [[0, 1, 1], [1]] and data["response_lengths"] == [3, 1]


def test_text_loss_mask_covers_the_written_response_and_eos_is_trained(tmp_path, tok, source):
    cfg = config(write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "q", "response": "ab", "loss_mask": [0, 1]}]), gbs=1)
    (sample,), = generate_sft_rollout(cfg, 0, source)
    assert sample.loss_mask == [0, 1, 1] and sample.response_tokens[-1] == tok.eos_token_id


def test_without_a_tokenizer_in_the_data_source_the_model_path_tokenizer_is_used(tmp_path, tiny_model_dir, tok):
    cfg = config(write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "a*2=", "response": "aa"}]), gbs=1,
                 model={"path": str(tiny_model_dir)})
    (sample,), = generate_sft_rollout(cfg, 0, data_source=None)
    assert sample.prompt_tokens == tok("a*2=", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("rows, match", [
    (["{not json"], r"sft.jsonl:1: not valid JSON"),
    ([{"prompt": "a"}, ], r"sft.jsonl:1: needs 'prompt' and 'response'"),
    ([{"prompt": "a", "response": ""}], r"'response' must be a non-empty string"),
    ([{"prompt_tokens": [1], "response_tokens": [-1]}], r"'response_tokens' must be a non-empty list of token ids"),
    ([{"prompt_tokens": [1]}], r"'response_tokens' must be"),
    ([{"prompt_tokens": [1], "response_tokens": [2, 3], "loss_mask": [1]}],
     r"'loss_mask' has 1 entries but the response has 2 tokens"),
    ([{"prompt_tokens": [1], "response_tokens": [2], "loss_mask": [2]}], r"'loss_mask' must be a list of 0/1"),
    ([{"prompt_tokens": [1] * 40, "response_tokens": [2] * 30}], r"70 tokens, more than rollout.max_model_len"),
])
def test_bad_rows_name_the_file_and_line(tmp_path, source, rows, match):
    cfg = config(write_jsonl(tmp_path / "sft.jsonl", rows), gbs=1)
    with pytest.raises(SFTDataError, match=match):
        generate_sft_rollout(cfg, 0, source)


def test_bad_settings_are_refused(tmp_path, source):
    with pytest.raises(SFTDataError, match="needs data.sft_path"):
        generate_sft_rollout(config(None), 0, source)
    with pytest.raises(SFTDataError, match="does not exist"):
        generate_sft_rollout(config(str(tmp_path / "nope.jsonl")), 0, source)
    with pytest.raises(SFTDataError, match="has no eval mode"):
        generate_sft_rollout(config(str(tmp_path / "nope.jsonl")), 0, source, evaluation=True)


def test_a_mixed_batch_is_refused():
    sft = Sample(0, 0, [1], metadata={"sft": True})
    with pytest.raises(ValueError, match="mixes SFT samples"):
        is_sft_batch([[sft], [Sample(1, 0, [1])]])
    assert not is_sft_batch([[Sample(1, 0, [1])]])


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean"])
def test_ppo_loss_with_advantage_one_at_ratio_one_has_the_nll_gradient(tmp_path, tiny_model_dir, source, loss_agg):
    rows = [{"prompt": "a*3=", "response": "aaa", "loss_mask": [1, 0, 1]}, {"prompt": "a*12=", "response": "a" * 12}]
    cfg = config(write_jsonl(tmp_path / "sft.jsonl", rows), gbs=2)
    data = convert_samples_to_train_data(generate_sft_rollout(cfg, 0, source))
    model = load_causal_lm(tiny_model_dir)
    width = max(data["response_lengths"])
    seqs = [t + [0] * (max(map(len, data["tokens"])) - len(t)) for t in data["tokens"]]
    mask = torch.tensor([m + [0] * (width - len(m)) for m in data["loss_masks"]], dtype=torch.float32)

    def response_logprobs():  # [B, T]: logprob of each response token given everything before it
        logits = model(torch.tensor(seqs)).logits
        out = torch.zeros(len(seqs), width)
        for i, (tokens, n) in enumerate(zip(data["tokens"], data["response_lengths"])):
            start = len(tokens) - n
            out[i, :n] = full_token_logprobs(logits[i:i + 1, start - 1:start - 1 + n], torch.tensor([tokens[start:]]))[0]
        return out

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    logp = response_logprobs()
    old = logp.detach()  # the learner's old logprobs of the same weights: ratio 1
    advantages = torch.ones(len(seqs), 1)
    ppo, clipped = clipped_policy_loss(logp, old, advantages, clip_eps=0.2)
    assert clipped.sum() == 0
    ppo_grads = grads(aggregate(ppo, mask, loss_agg))
    nll_grads = grads(aggregate(-response_logprobs(), mask, loss_agg))
    assert any(g.abs().sum() > 0 for g in nll_grads)
    for a, b in zip(ppo_grads, nll_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_binary_sft_file_names_the_file_and_line(tmp_path, source):
    path = tmp_path / "sft.jsonl"
    path.write_bytes(b'{"prompt": "a", "response": "b"}\n\x1f\x8b\x08\x00binary\n')
    with pytest.raises(SFTDataError, match=r"sft.jsonl:2: not UTF-8 text .*SFT sample file"):
        generate_sft_rollout(config(str(path), gbs=1), 0, source)
