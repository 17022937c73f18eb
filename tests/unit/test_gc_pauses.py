"""spillover.infra.gc_pauses: the heap built before the training loop leaves the collector's view, and comes back."""
from __future__ import annotations

import gc

from spillover.infra.gc_pauses import long_lived_heap_frozen


def test_freezes_inside_and_unfreezes_after():
    keep = [[i] for i in range(1000)]  # long-lived containers built "before the loop"
    assert gc.get_freeze_count() == 0
    with long_lived_heap_frozen():
        assert gc.get_freeze_count() >= len(keep)
        fresh = [[i] for i in range(10)]
        assert gc.is_tracked(fresh[0])
        tracked = {id(o) for o in gc.get_objects()}
        assert id(fresh[0]) in tracked and id(keep[0]) not in tracked  # frozen: not walked by collections
    assert gc.get_freeze_count() == 0
    assert id(keep[0]) in {id(o) for o in gc.get_objects()}


def test_an_outer_freeze_is_left_alone():
    outer = [[i] for i in range(100)]
    gc.freeze()
    try:
        with long_lived_heap_frozen():
            pass
        # still frozen by the outer freeze (a count would drift: frozen objects are freed by refcount)
        assert id(outer[0]) not in {id(o) for o in gc.get_objects()} and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
