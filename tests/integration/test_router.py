"""The real sglang-router launched by spillover.rollout.fleet.router: loopback only, worker registration,
generation through it, and no process left behind."""
from __future__ import annotations

import os
from pathlib import Path

import httpx

from spillover.rollout.fleet.router import Router
from run_processes import children_of


def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(ip, port) of every TCP socket in LISTEN state owned by pid (IPv4 and IPv6, from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A = LISTEN
                continue
            hex_ip, hex_port = cols[1].split(":")
            if v6:
                ip = "::1" if hex_ip == "00000000000000000000000001000000" else hex_ip
            else:
                ip = ".".join(str(int(hex_ip[i:i + 2], 16)) for i in (6, 4, 2, 0))
            found.add((ip, int(hex_port, 16)))
    return found


def test_router_binds_loopback_and_manages_workers(torch_engines):
    router = Router.launch(host="127.0.0.1")
    pid = router.pid
    assert children_of(router.proc.pid) == [pid] != [router.proc.pid]  # router.proc is its wrapper (fate_share)
    try:
        addresses = listening_addresses(pid)
        assert len(addresses) >= 2, addresses  # the router and its prometheus port
        assert all(ip in ("127.0.0.1", "::1") for ip, _ in addresses), addresses
        assert router.workers() == []
        for server in torch_engines:
            router.add_worker(server.url)
        assert sorted(router.workers()) == sorted(s.url for s in torch_engines)
        resp = httpx.post(router.url + "/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}})
        assert resp.status_code == 200 and resp.json()["meta_info"]["completion_tokens"] == 3
        router.remove_worker(torch_engines[0].url)
        assert router.workers() == [torch_engines[1].url]
        before = [server.batcher.generated_tokens for server in torch_engines]  # each engine's own token count
        for _ in range(3):  # round robin over what is left: every request lands on the remaining engine
            resp = httpx.post(router.url + "/generate", json={"input_ids": [5], "sampling_params": {
                "max_new_tokens": 4, "ignore_eos": True}})
            assert resp.status_code == 200 and resp.json()["meta_info"]["completion_tokens"] == 4
        after = [server.batcher.generated_tokens for server in torch_engines]
        assert [a - b for a, b in zip(after, before)] == [0, 3 * 4], (before, after)
    finally:
        router.stop()
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
