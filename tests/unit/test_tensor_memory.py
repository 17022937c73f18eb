"""TensorMemoryProbe counts what a region allocates: an in-place load nothing, a new tensor its bytes while it lives.
(That a probed load imports no torch._dynamo in an engine process: tests/unit/test_engine_tokenizer.py.)"""
from __future__ import annotations

import torch

from spillover.infra.tensor_memory import TensorMemoryProbe


def test_in_place_copies_count_nothing_and_new_tensors_count_their_bytes():
    a, b = torch.zeros(1000), torch.ones(1000)
    with TensorMemoryProbe() as probe:
        a.copy_(b)
        a[:10].mul_(2)
    assert probe.peak_bytes == 0
    with TensorMemoryProbe() as probe:
        c = a + b
        del c
        d = torch.cat([a, b])
    assert probe.peak_bytes == d.nbytes == probe.largest_bytes and probe.largest_shape == (2000,)

