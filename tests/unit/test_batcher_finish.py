"""The torch engine's batch loop (rollout/torch_engine/batcher.py) without HTTP or Ray: how a request finishes.

SGLang 0.5.23 (../shared/sglang-contract/README.md, "Stop before length"): a stop token produced as the last
allowed token finishes as {"type": "stop", "matched": id}, the token included in output_ids and logprobs.
"""
from __future__ import annotations

import pytest
import torch

from spillover.rollout.torch_engine.batcher import ContinuousBatcher, EngineRequest
from spillover.rollout.torch_engine.lean_forward import LeanDecoder, read_safetensors, read_shape
from spillover.rollout.sglang.protocol import FinishReason, GenerateResponse, SamplingParams

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def batcher(tiny_model_dir):
    decoder = LeanDecoder(read_shape(tiny_model_dir), read_safetensors(tiny_model_dir), torch.float32,
                          torch.device("cpu"))
    loop = ContinuousBatcher(decoder, max_running_requests=2, max_len=64, seed=0)
    loop.start()
    yield loop
    loop.stop()


def finish(batcher, max_new: int, stop_ids=()) -> GenerateResponse:
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, sampling_seed=7)  # seeded: repeatable
    request = EngineRequest(rid="r" * 32, input_ids=list(PROMPT), params=params, return_logprob=True,
                            max_output=max_new, stop_ids=frozenset(stop_ids))
    return batcher.submit(request).result(timeout=60)


def test_a_stop_token_on_the_last_allowed_position_is_a_stop(batcher):
    free = finish(batcher, 12).output_ids  # no stop token
    # a token whose first appearance is at position k: make it the stop token and allow exactly k + 1 tokens
    k = next(i for i, tok in enumerate(free) if tok not in free[:i] and i > 0)
    answer = finish(batcher, k + 1, stop_ids=[free[k]])
    assert answer.output_ids == free[:k + 1]
    assert answer.meta_info.finish_reason == FinishReason(type="stop", matched=free[k])
    assert [e[1] for e in answer.meta_info.output_token_logprobs] == free[:k + 1]  # the stop token included
    early = finish(batcher, k + 3, stop_ids=[free[k]])  # an earlier stop is a stop as before
    assert early.output_ids == free[:k + 1] and early.meta_info.finish_reason.type == "stop"
    limit = finish(batcher, k)  # the budget without a stop token: length
    assert limit.meta_info.finish_reason == FinishReason(type="length", length=k)


def test_a_token_that_ends_a_stop_string_and_is_a_stop_token_reports_the_string(batcher):
    """SGLang checks stop strings before stop tokens: a chat model whose '<|im_end|>' is both reports the string."""
    free = finish(batcher, 12).output_ids
    k = next(i for i, tok in enumerate(free) if tok not in free[:i] and i > 0)
    decode = lambda ids: "".join(f"<{t}>" for t in ids)  # one token -> one unambiguous piece of text
    params = SamplingParams(max_new_tokens=12, temperature=1.0, sampling_seed=7)
    request = EngineRequest(rid="s" * 32, input_ids=list(PROMPT), params=params, return_logprob=True, max_output=12,
                            stop_ids=frozenset([free[k]]), stop_strings=(f"<{free[k]}>",), stop_tail_tokens=2,
                            decode=decode)
    answer = batcher.submit(request).result(timeout=60)
    assert answer.output_ids == free[:k + 1]
    assert answer.meta_info.finish_reason == FinishReason(type="stop", matched=f"<{free[k]}>")
