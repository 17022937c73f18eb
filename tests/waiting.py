"""wait_for: the suite's one poll loop. Tests wait on something another process or thread does (a server coming up,
a process going away, records being flushed); each waits with this, so a timeout always says what was awaited and
the last value seen, not only "timed out"."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


class WaitTimedOut(TimeoutError):
    def __init__(self, what: str, timeout: float, last: object):
        super().__init__(f"{what}: not within {timeout:g} s; last seen: {last!r}"[:6000])
        self.last = last


def wait_for(probe: Callable[[], T], timeout: float, what: str, *, every: float = 0.1,
             until: Callable[[T], bool] = bool, not_yet: tuple[type[Exception], ...] = ()) -> T:
    """Call probe() every `every` s until until(value) holds -> that value (probed at least once, and once more at
    the deadline). An exception of a not_yet type counts as "not yet" (it is the last value seen); any other
    propagates at once. Past timeout s: WaitTimedOut naming `what` and the last value seen."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = probe()
        except not_yet as err:
            last: object = err
        else:
            if until(value):
                return value
            last = value
        left = deadline - time.monotonic()
        if left <= 0:
            raise WaitTimedOut(what, timeout, last)
        time.sleep(min(every, left))
