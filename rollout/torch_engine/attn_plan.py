"""How a decode step reads the KV cache: one view, one gather, or two length groups.

Attention cost grows with rows x keys read, and a batch reads up to its longest row. With long-tailed
lengths a few long rows would make every short row pay for their keys, so the step splits the rows
into a short and a long group when that saves more than a group's fixed cost (the numbers below are
in row-keys, measured on the tiny model on CPU).
"""
from __future__ import annotations

GATHER_FACTOR = 1.3  # a gathered row-key (copy + attend) vs one read through a view
GROUP_OVERHEAD = 1000.0  # the fixed cost of one more attention group per step, in row-keys


def plan_attention(slots: list[int], kv_lens: list[int]) -> tuple[bool, list[tuple[list[int], int]]]:
    """slots: the running rows' cache slots (ascending); kv_lens: keys each row must read.

    -> (use_view, groups). use_view: attend rows [0, slots[-1]] of the cache through one view (idle
    slots in that range ride along). Otherwise groups: (batch indices, kv_len) pairs to gather.
    """
    n, kmax = len(slots), max(kv_lens)
    view_cost = (slots[-1] + 1) * kmax
    gather_cost = GATHER_FACTOR * n * kmax
    order = sorted(range(n), key=kv_lens.__getitem__)
    best, split = min(view_cost, gather_cost), 0
    for i in range(1, n):
        cost = GATHER_FACTOR * (i * kv_lens[order[i - 1]] + (n - i) * kmax) + GROUP_OVERHEAD
        if cost < best:
            best, split = cost, i
    if split == 0:
        return view_cost <= gather_cost, [(list(range(n)), kmax)]
    return False, [(order[:split], kv_lens[order[split - 1]]), (order[split:], kmax)]
