"""The columnar RolloutBatch (rollout/batch.py): construction checks, conversions, and the learner's padded
micro-batches (positions predicting each response token)."""
import numpy as np
import pytest

from batch_views import select_groups
from spillover.bench.batches import from_sequences, row_sequence
from spillover.rollout.batch import RolloutBatch, split, to_samples
from spillover.rollout.sample import Sample, Status
from spillover.tasks.learner.micro_batches import check_per_token, make_micro_batch, micro_batch_indices, pad_per_token


def _batch(**over):
    cols = dict(sequences=[[5, 6, 7, 8], [5, 9], [4, 4, 4, 4, 4, 4]], response_lengths=[2, 1, 3],
                loss_masks=[[1, 1], [1], [1, 0, 1]], advantages=[0.5, -0.5, 0.0],
                rollout_logprobs=[[-1.0, -2.0], [-3.0], [-0.1, -0.2, -0.3]], weight_versions=[[0, 1], [1], [0, 0, 0]])
    cols.update(over)
    return from_sequences(**cols)


def test_micro_batch_positions_targets_and_masks():
    batch = _batch()
    mb = make_micro_batch(batch, [0, 1, 2], pad_id=0)
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 0, 0], [5, 9, 0, 0, 0, 0], [4, 4, 4, 4, 4, 4]]
    assert mb.attention_mask.sum(1).tolist() == [4, 2, 6]
    # sample 0: 4 tokens, 2 response -> logits at 1, 2 predict tokens 2, 3 (padding positions are masked)
    assert [p[:r] for p, r in zip(mb.logit_positions.tolist(), [2, 1, 3])] == [[1, 2], [0], [2, 3, 4]]
    assert mb.targets.tolist() == [[7, 8, 0], [9, 0, 0], [4, 4, 4]]
    assert mb.response_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]
    assert mb.loss_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 0, 1]]
    assert mb.weight_versions.tolist() == [[0, 1, -1], [1, -1, -1], [0, 0, 0]]
    assert mb.advantages.flatten().tolist() == [0.5, -0.5, 0.0]
    flat = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], dtype=np.float32)
    assert pad_per_token(flat, batch, [1, 0], 3).tolist() == [[3, 0, 0], [1, 2, 0]]
    check_per_token("old_logprobs", flat, batch)
    with pytest.raises(ValueError, match="old_logprobs must be one value per response token"):
        check_per_token("old_logprobs", flat[:5], batch)


def test_packed_micro_batch_is_one_row_with_restarting_positions_and_the_same_response_fields():
    batch = _batch()
    padded, packed = make_micro_batch(batch, [2, 0], pad_id=0), make_micro_batch(batch, [2, 0], pad_id=0, packed=True)
    assert packed.input_ids.tolist() == [[4, 4, 4, 4, 4, 4, 5, 6, 7, 8]] and packed.attention_mask is None
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]]
    assert packed.cu_seqlens.tolist() == [0, 6, 10] and packed.max_seqlen == 6
    assert packed.computed_positions == 10 and padded.computed_positions == 12  # 2 x 6: two positions of padding
    # sample 0 starts at 6 in the row: its logits at 6 + 1, 6 + 2 predict its response tokens
    assert [p[:r] for p, r in zip(packed.logit_positions.tolist(), [3, 2])] == [[2, 3, 4], [7, 8]]
    for field in ("targets", "response_mask", "loss_mask", "advantages", "rollout_logprobs", "weight_versions"):
        assert getattr(packed, field).tolist() == getattr(padded, field).tolist(), field


def test_micro_batch_indices_groups_similar_lengths_stably():
    assert micro_batch_indices([5, 2, 9, 2, 7], 2) == [[1, 3], [0, 4], [2]]
    with pytest.raises(ValueError, match="micro_batch_size"):
        micro_batch_indices([1], 0)


def test_batch_names_the_bad_field():
    with pytest.raises(ValueError, match="loss_mask has 5 entries but the responses have 6 tokens"):
        _batch(loss_masks=[[1], [1], [1, 0, 1]])
    with pytest.raises(ValueError, match="advantages must be 3 finite numbers"):
        _batch(advantages=[0.0, 1.0])
    with pytest.raises(ValueError, match="advantages must be 3 finite numbers"):
        _batch(advantages=[0.0, float("nan"), 1.0])
    with pytest.raises(ValueError, match="at least one prompt token"):
        _batch(sequences=[[7, 8], [5, 9], [4, 4, 4, 4, 4, 4]])


def test_derived_columns_and_group_selection():
    batch = _batch(n=1)
    assert batch.seq_lengths.tolist() == [4, 2, 6] and batch.loss_tokens.tolist() == [2, 1, 2]
    assert row_sequence(batch, 2).tolist() == [4] * 6 and batch.response_lists() == [[7, 8], [9], [4, 4, 4]]
    sub = select_groups(batch, [2, 0])
    assert sub.response_lists() == [[4, 4, 4], [7, 8]] and sub.advantages.tolist() == [0.0, 0.5]
    assert sub.rollout_logprobs.tolist() == pytest.approx([-0.1, -0.2, -0.3, -1.0, -2.0])
    assert [p.tolist() for p in split(sub.prompt_tokens, sub.prompt_lengths)] == [[4, 4, 4], [5, 6]]


def test_samples_round_trip_through_columns():
    groups = [[Sample(7, 14 + i, [3, 4], [5 + i, 2], [-0.5, -0.25], [1, 2], label="x",
                      status=Status.COMPLETED if i else Status.TRUNCATED, metadata={"age": i}) for i in range(2)]]
    batch = RolloutBatch.from_samples(groups)
    assert batch.n == 2 and batch.group_ids.tolist() == [7] and batch.truncated.tolist() == [True, False]
    back = to_samples(batch)
    for got, want in zip(back[0], groups[0]):
        assert (got.prompt_tokens, got.response_tokens, got.rollout_logprobs, got.weight_versions, got.status,
                got.label, got.metadata["age"]) == (want.prompt_tokens, want.response_tokens, want.rollout_logprobs,
                                                    want.weight_versions, want.status, want.label, want.metadata["age"])
    assert batch.sample_groups()[0][0] is groups[0][0]  # the user's own samples reach the reward function
    with pytest.raises(ValueError, match="groups of one size"):
        RolloutBatch.from_samples([groups[0], groups[0][:1]])


def test_failed_and_aborted_samples_are_not_trained():
    groups = [[Sample(0, i, [3], [5, 6], [-1.0, -1.0], [0, 0], status=status, loss_mask=[1, 0] if i == 0 else None)
               for i, status in enumerate((Status.COMPLETED, Status.FAILED, Status.ABORTED, Status.TRUNCATED))]]
    batch = RolloutBatch.from_samples(groups)
    assert batch.loss_mask.tolist() == [1, 0, 0, 0, 0, 0, 1, 1] and batch.loss_tokens.tolist() == [1, 0, 0, 2]


def test_dock_columns_hold_each_rows_prompt_and_response():
    from spillover.rollout.dock.transfer_dock import TransferDock

    dock = TransferDock(2, 3, 1, max_tokens=4, max_model_len=16, eos_token_ids=[1])
    dock.load_groups([10, 11], [[3, 4, 5], [6]], ["a", "b"])
    rows = dock.take_rows()
    lengths = [1, 2, 4, 3, 1, 2]
    responses = [[7 + r] * (n - 1) + [1] for r, n in zip(rows.tolist(), lengths)]
    dock.put_generation(rows, responses, [[-0.5 * r] * n for r, n in zip(rows.tolist(), lengths)], 3, [False] * 6)
    dock.select_batch()
    batch = dock.rollout_batch()
    assert batch.group_ids.tolist() == [10, 11] and batch.labels == ("a", "b") and len(batch) == 6
    assert [row_sequence(batch, r).tolist() for r in range(6)] == [p + resp for p, resp in
                                                               zip([[3, 4, 5]] * 3 + [[6]] * 3, responses)]
    assert batch.rollout_logprobs.tolist() == [-0.5 * r for r, n in zip(range(6), lengths) for _ in range(n)]
    assert batch.weight_versions.tolist() == [3] * sum(lengths) and not batch.truncated.any()
    samples = to_samples(batch)
    assert [[s.index for s in g] for g in samples] == [[30, 31, 32], [33, 34, 35]]
    assert samples[1][0].prompt_tokens == [6] and samples[1][0].response_tokens == responses[3]
