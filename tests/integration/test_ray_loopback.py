"""No spillover package init writes the environment at import (tests/unit/test_no_env_writes_at_import.py
scans every module for direct writes), and a local Ray started by spillover.infra.cluster.init_ray
listens only on loopback even when `ray` was imported before Ray's loopback variables were set (Ray reads
them at its import), and a driver started without any Ray variable joins it through RAY_ADDRESS=127.0.0.1:port
(Ray would swap that for the host's address and retry for minutes). Runs in a child process: this one's Ray and
environment are the session's."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys
before = dict(os.environ)
import ray  # noqa: E402  (first, before any loopback variable is set)
before.update({k: v for k, v in os.environ.items() if k not in before})  # what ray itself sets
import flows, tasks, rollout, infra  # noqa: F401,E401  (the package inits used to set Ray's variables)
from spillover.infra.cluster import init_ray
written = sorted(k for k, v in os.environ.items() if before.get(k) != v)
init_ray(num_cpus=2)

@ray.remote(num_cpus=0)
def pid():
    return os.getpid()

ray.get(pid.remote())  # a worker runs
# a driver from a plain shell (no loopback variable) joins with RAY_ADDRESS=127.0.0.1:port
import subprocess, time
join_env = {k: v for k, v in before.items() if not k.startswith("RAY_")}
join_env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
started = time.monotonic()
try:
    joined = subprocess.run([sys.executable, "-c", "from spillover.infra.cluster import init_ray; init_ray(); print('joined')"],
                            env=join_env, capture_output=True, text=True, timeout=60).stdout.strip().endswith("joined")
except subprocess.TimeoutExpired:
    joined = False
join_s = time.monotonic() - started
import psutil
procs = [psutil.Process()] + psutil.Process().children(recursive=True)
listeners = []
for p in procs:
    try:
        conns = p.net_connections(kind="tcp")
    except psutil.Error:
        continue
    listeners += [(p.name(), c.laddr.ip) for c in conns if c.status == psutil.CONN_LISTEN]
ray.shutdown()
print(json.dumps({"written_at_import": written, "listeners": listeners, "joined": joined, "join_s": join_s,
                  "address": join_env["RAY_ADDRESS"]}))
"""


def test_imports_write_no_environment_and_ray_listens_only_on_loopback():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "PREFECT_")) or k in ("RAY_ADDRESS",)}
    env.pop("RAY_ADDRESS", None)
    tmp = tempfile.mkdtemp(prefix="rayl", dir="/tmp")  # short: Ray's socket paths are length-limited
    env["RAY_TMPDIR"] = tmp
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=240)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["written_at_import"] == []
    assert len(report["listeners"]) >= 3  # GCS, raylet, worker: the check saw them
    bad = [(name, ip) for name, ip in report["listeners"] if ip not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")]
    assert bad == []
    # joining a loopback cluster sets the loopback variable too (else Ray swaps 127.0.0.1 for the host's address)
    assert report["address"].startswith("127.0.0.1:") and report["joined"], report
