"""infra/storage/checkpoint.py while the real S3 server (SeaweedFS) is SIGKILLed or SIGSTOPped in the middle of a
checkpoint write: past the retry deadline the write fails and the half checkpoint is ignored; an outage that ends
in time only delays it. The backoff waits are skipped (SkippedWaits), the server and its outage are real."""
from __future__ import annotations

import logging
import re
import threading
import time

import pytest
import torch

from spillover.infra.storage.checkpoint import CheckpointState, list_checkpoints, load_latest_checkpoint, save_checkpoint
from spillover.infra.storage.store import StorageUnreachable, open_store
from spillover.infra.storage.errors import RetryPolicy


def _outage_after(store, n_objects, start_outage):
    """Make the store start an outage right after its n-th object write (deterministically mid-checkpoint)."""
    put, count, lock = store.put_buffers, [0], threading.Lock()

    def put_then_outage(key, buffers):
        info = put(key, buffers)
        with lock:
            count[0] += 1
            if count[0] == n_objects:
                start_outage()
        return info
    store.put_buffers = put_then_outage


_BIG = {f"w{i}": torch.full((64, 1024), float(i)) for i in range(8)}  # 8 objects of 256 KiB at 300 kB shards


class SkippedWaits:
    """The retry policy's clock and sleep in the outage tests (the server and its outage stay real): a
    thread's clock is time.monotonic() plus the backoff waits that thread asked for, which are skipped (10 ms
    real, so threads still interleave). From the outage on every wait is recorded per thread; the first
    thread whose write has failed `end_after` times in a row calls `end_outage` (a count, not wall-clock),
    and the other threads' waits last until the server is back, as real waits of seconds would."""

    def __init__(self, end_outage=None, end_after: int = 0):
        self._end_outage, self._end_after = end_outage, end_after
        self._local, self._lock, self._back = threading.local(), threading.Lock(), threading.Event()
        self.outage_on, self.ended_by = False, None
        self.waits: dict[int, list[float]] = {}  # thread -> waits since the outage began

    def policy(self, deadline_s: float) -> RetryPolicy:
        # waits are skipped, so a cap above every recorded one costs nothing and keeps them doubling (a cap of 2 s
        # let two capped waits, jittered, come out in either order)
        return RetryPolicy(deadline_s=deadline_s, first_backoff_s=0.2, max_backoff_s=16, sleep=self.sleep,
                           clock=self.clock)

    def clock(self) -> float:
        return time.monotonic() + getattr(self._local, "skipped", 0.0)

    def sleep(self, seconds: float) -> None:
        self._local.skipped = getattr(self._local, "skipped", 0.0) + seconds
        time.sleep(0.01)
        if not self.outage_on:
            return
        with self._lock:
            mine = self.waits.setdefault(threading.get_ident(), [])
            mine.append(seconds)
            ends = self._end_after and self.ended_by is None and len(mine) >= self._end_after
            if ends:
                self.ended_by = threading.get_ident()
            ending = self.ended_by is not None
        if ends:
            try:
                self._end_outage()
            finally:
                self._back.set()
        elif ending:
            self._back.wait(60)


def _outage_store(s3_server, name, waits: SkippedWaits, deadline_s, timeout_s=(1, 2)):
    url = s3_server.url(name)
    store = open_store(url, s3_server.storage_config(), connect_timeout_s=timeout_s[0], read_timeout_s=timeout_s[1],
                       retry=waits.policy(deadline_s))
    open_store(url, s3_server.storage_config()).delete("")  # clean-up under the default deadline (a busy
    # machine can make one request outlast the short deadline these stores are given for the outage)
    return store


def test_s3_down_past_the_deadline_fails_and_the_half_checkpoint_is_ignored(outage_s3_server):
    waits = SkippedWaits()
    store = _outage_store(outage_s3_server, "outage-deadline", waits, deadline_s=2)
    save_checkpoint(store, CheckpointState(1, {"policy": _BIG}, {}, {"v": 1}))

    def outage():
        waits.outage_on = True
        outage_s3_server.kill()
    _outage_after(store, 3, outage)
    try:
        with pytest.raises(StorageUnreachable, match="ckpt-00000002") as err:
            save_checkpoint(store, CheckpointState(2, {"policy": _BIG}, {}, {"v": 2}), max_object_bytes=300_000)
    finally:
        outage_s3_server.start()
    failed_for, attempts = re.search(r"kept failing for (\d+\.\d) s \((\d+) attempts\)", str(err.value)).groups()
    assert float(failed_for) >= 2 and int(attempts) >= 3  # it backed off until the (skipped-wait) deadline
    assert [(i.iteration, i.complete) for i in list_checkpoints(store)] == [(1, True), (2, False)]
    assert load_latest_checkpoint(store).meta == {"v": 1}


@pytest.mark.parametrize("how", ["killed", "paused"])
def test_s3_down_during_write_retries_with_backoff(outage_s3_server, how, caplog):
    """weed SIGKILLed (connection refused) or SIGSTOPped (timeouts) mid-checkpoint; it comes back once one
    object's write has failed 4 times with growing waits (skipped, see SkippedWaits), and the checkpoint
    completes."""
    server = outage_s3_server
    stop, restart = (server.kill, server.start) if how == "killed" else (server.pause, server.resume)
    waits = SkippedWaits(end_outage=restart, end_after=4)
    # paused: every attempt runs into the time limits, so they are short (a healthy request takes milliseconds)
    store = _outage_store(server, f"outage-{how}", waits, deadline_s=60,
                          timeout_s=(1, 2) if how == "killed" else (0.25, 0.25))
    save_checkpoint(store, CheckpointState(1, {"policy": _BIG}, {}, {"v": 1}))

    def outage():
        waits.outage_on = True
        stop()
    _outage_after(store, 3, outage)
    caplog.set_level(logging.WARNING, logger="spillover.storage")
    try:
        save_checkpoint(store, CheckpointState(2, {"policy": _BIG}, {}, {"v": 2}), max_object_bytes=300_000)
    finally:
        restart()  # a no-op when it is up
    assert waits.ended_by is not None, "the write finished without the outage ending: it never retried"
    grew = waits.waits[waits.ended_by][:4]
    assert len(grew) == 4 and grew[0] >= 0.15 and all(b > a for a, b in zip(grew, grew[1:])), grew
    assert any("retrying" in r.getMessage() for r in caplog.records)
    got = load_latest_checkpoint(store)
    assert got.iteration == 2 and got.meta == {"v": 2}
    assert all(torch.equal(got.tensors["policy"][k], v) for k, v in _BIG.items())
