import json

import pytest

from spillover.rollout.sample import AlignmentError, Sample, Status, convert_samples_to_train_data


def make(i=0, **kw):
    return Sample(group_index=0, index=i, prompt_tokens=[5, 6], **kw)


def test_append_segment_keeps_arrays_aligned():
    s = make()
    s.append_segment([1, 2], [-0.1, -0.2], weight_version=3)
    s.append_segment([4], [-0.4], weight_version=[5])
    assert s.response_tokens == [1, 2, 4] and s.weight_versions == [3, 3, 5]
    assert s.tokens == [5, 6, 1, 2, 4] and s.response_length == 3


@pytest.mark.parametrize("tokens, logprobs, versions", [([1, 2], [-0.1], 0), ([1], [-0.1], [0, 1])])
def test_misaligned_segment_raises_and_changes_nothing(tokens, logprobs, versions):
    s = make()
    with pytest.raises(AlignmentError):
        s.append_segment(tokens, logprobs, versions)
    assert s.response_tokens == [] and s.rollout_logprobs == []


def test_constructor_refuses_misaligned_arrays():
    with pytest.raises(AlignmentError, match="response has 2 tokens"):
        make(response_tokens=[1, 2], rollout_logprobs=[0.0], weight_versions=[0, 0])


def test_train_data_has_the_seed_fields():
    a = make(0, reward=1.0, status=Status.COMPLETED, metadata={"raw_reward": 0.5, "round_number": 2})
    a.append_segment([1, 2], [-0.1, -0.2], 0)
    b = make(1, reward=0.0, status=Status.TRUNCATED, metadata={"raw_reward": 0.1, "round_number": 1})
    b.append_segment([3], [-0.3], 0)
    data = convert_samples_to_train_data([[a, b]])
    assert data["tokens"] == [[5, 6, 1, 2], [5, 6, 3]]
    assert data["response_lengths"] == [2, 1] and data["rewards"] == [1.0, 0.0]
    assert data["truncated"] == [0, 1] and data["sample_indices"] == [0, 1]
    assert data["loss_masks"] == [[1, 1], [1]]
    assert data["raw_reward"] == [0.5, 0.1] and data["round_number"] == [2, 1]


def test_train_data_wrong_loss_mask_names_both_lengths():
    s = make(reward=1.0)
    s.append_segment([1, 2], [-0.1, -0.2], 0)
    s.loss_mask = [1]
    with pytest.raises(AlignmentError, match="loss mask length 1 != response length 2"):
        convert_samples_to_train_data([s])


def test_json_round_trip():
    s = make(3, reward=0.25, label={"n": 3}, status=Status.ABORTED, metadata={"age": 2})
    s.append_segment([1, 2], [-0.5, -1.5], [1, 2], loss_mask=[1, 0])
    back = Sample.from_dict(json.loads(json.dumps(s.to_dict())))  # as debug rollout data stores it
    assert back == s and back.status is Status.ABORTED


def test_first_explicit_mask_keeps_earlier_tokens_trained():
    s = make()
    s.append_segment([1, 2, 3], [-0.1] * 3, 0)
    s.append_segment([4], [-0.4], 0, loss_mask=[0])
    assert s.loss_mask == [1, 1, 1, 0]
