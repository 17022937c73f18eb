"""TrainBatch validation and micro-batch padding (positions predicting each response token)."""
import pytest

from tasks.batching import TrainBatch, make_micro_batch, micro_batch_indices, pad_per_token


def _batch(**over):
    cols = dict(tokens=[[5, 6, 7, 8], [5, 9], [4, 4, 4, 4, 4, 4]], response_lengths=[2, 1, 3],
                loss_masks=[[1, 1], [1], [1, 0, 1]], advantages=[0.5, -0.5, 0.0],
                rollout_logprobs=[[-1.0, -2.0], [-3.0], [-0.1, -0.2, -0.3]], weight_versions=[[0, 1], [1], [0, 0, 0]])
    cols.update(over)
    return TrainBatch(**cols)


def test_micro_batch_positions_targets_and_masks():
    mb = make_micro_batch(_batch(), [0, 1, 2], pad_id=0)
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 0, 0], [5, 9, 0, 0, 0, 0], [4, 4, 4, 4, 4, 4]]
    assert mb.attention_mask.sum(1).tolist() == [4, 2, 6]
    # sample 0: 4 tokens, 2 response -> logits at 1, 2 predict tokens 2, 3
    assert mb.logit_positions.tolist() == [[1, 2, 0], [0, 0, 0], [2, 3, 4]]
    assert mb.targets.tolist() == [[7, 8, 0], [9, 0, 0], [4, 4, 4]]
    assert mb.response_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]
    assert mb.loss_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 0, 1]]
    assert mb.weight_versions.tolist() == [[0, 1, -1], [1, -1, -1], [0, 0, 0]]
    assert mb.advantages.shape == (3, 1)
    assert pad_per_token([[1.0, 2.0], [3.0], [4.0, 5.0, 6.0]], [1, 0], 3).tolist() == [[3, 0, 0], [1, 2, 0]]


def test_micro_batch_indices_groups_similar_lengths_stably():
    assert micro_batch_indices([5, 2, 9, 2, 7], 2) == [[1, 3], [0, 4], [2]]
    with pytest.raises(ValueError, match="micro_batch_size"):
        micro_batch_indices([1], 0)


def test_train_batch_names_the_bad_field():
    with pytest.raises(ValueError, match="sample 0: loss_masks has 1"):
        _batch(loss_masks=[[1], [1], [1, 0, 1]])
    with pytest.raises(ValueError, match="advantages has 2 entries"):
        _batch(advantages=[0.0, 1.0])
    with pytest.raises(ValueError, match="at least one prompt token"):
        _batch(tokens=[[7, 8], [5, 9], [4, 4, 4, 4, 4, 4]])


def test_from_train_data_flattens_group_advantages():
    b = _batch()
    data = {"tokens": b.tokens, "response_lengths": b.response_lengths, "loss_masks": b.loss_masks, "rewards": [0] * 3}
    got = TrainBatch.from_train_data(data, [[0.5, -0.5, 0.0]], b.rollout_logprobs, b.weight_versions)
    assert got.advantages == [0.5, -0.5, 0.0] and got.tokens == b.tokens
