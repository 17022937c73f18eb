import json

import pytest

from spillover.rollout.sample import AlignmentError, Sample, Status


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
