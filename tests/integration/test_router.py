"""The real sglang-router launched by spillover.rollout.fleet.router: loopback only, worker registration,
generation through it, and no process left behind."""
from __future__ import annotations

import httpx
import psutil

from spillover.rollout.fleet.router import Router
from run_processes import children_of


def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(ip, port) of every TCP socket in LISTEN state owned by pid (IPv4 and IPv6)."""
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


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
    try:
        assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # exited, not yet reaped by its wrapper
    except psutil.NoSuchProcess:
        pass
