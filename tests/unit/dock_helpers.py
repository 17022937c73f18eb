"""Small-dock helpers shared by the dock tests of tests/unit."""
from __future__ import annotations

import numpy as np

from spillover.rollout.dock.transfer_dock import TransferDock

EOS = 0


def make_dock(gbs=2, n=2, max_split=2, max_tokens=8, max_model_len=16, **kw) -> TransferDock:
    return TransferDock(gbs, n, max_split, max_tokens, max_model_len, [EOS], **kw)


def load(dock: TransferDock, ids, prompt_len=2) -> np.ndarray:
    return dock.load_groups(np.asarray(ids), [[100 + g] * prompt_len for g in ids], [f"label-{g}" for g in ids])


def put(dock: TransferDock, rows, lengths, eos=False, version=1, stop=None) -> None:
    """Each row gets `length` tokens 10, 11, ...; the last one EOS when eos."""
    rows = np.asarray(rows)
    lengths = np.broadcast_to(np.asarray(lengths), rows.shape)
    eos = np.broadcast_to(np.asarray(eos), rows.shape)
    tokens = [list(range(10, 10 + m)) for m in lengths.tolist()]
    for t, e in zip(tokens, eos.tolist()):
        if e and t:
            t[-1] = EOS
    stop = np.zeros(len(rows), bool) if stop is None else np.asarray(stop)
    dock.put_generation(rows, tokens, [[-0.5] * len(t) for t in tokens], version, stop)


def finish_groups(dock: TransferDock, slots) -> None:
    """Complete every row of these group slots with a 1-token EOS answer (rows must be waiting)."""
    rows = (np.asarray(slots)[:, None] * dock.n + np.arange(dock.n)).reshape(-1)
    dock.in_flight[rows] = True  # as if take_rows handed exactly these out
    put(dock, rows, 1, eos=True)


def group_order(dock: TransferDock) -> np.ndarray:
    """Occupied group slots, oldest first."""
    slots = np.flatnonzero(dock.group_ids >= 0)
    return slots[dock.oldest_first(slots)]
