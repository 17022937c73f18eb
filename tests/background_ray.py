"""The background runs' own Ray cluster (tests/background.py), as a script: started under `nice`, it starts a local
Ray on 127.0.0.1 (every Ray process, workers included, inherits its priority), prints the address on its first line,
then answers each line of driver pids on stdin with one JSON line: the actors that those drivers' jobs created
(ActorClassName, State, Pid; read from the GCS). Closing stdin shuts the cluster down.

Joined `spillover` runs are told apart by their driver's pid (Ray's job table keeps it), so runs of several tests can
share the cluster and each test checks only its own."""
from __future__ import annotations

import json
import sys


def actors_of(driver_pids: set[int]) -> list[dict]:
    from ray._private.state import actors, jobs

    mine = {job["JobID"] for job in jobs() if job["DriverPid"] in driver_pids}
    return [{"ActorClassName": a["ActorClassName"], "State": a["State"], "Pid": a["Pid"]}
            for a in actors().values() if a["JobID"] in mine]


def main() -> None:
    import ray

    from spillover.infra.cluster import init_ray

    init_ray(num_cpus=8)
    print(ray.get_runtime_context().gcs_address, flush=True)
    try:
        for line in sys.stdin:
            print(json.dumps(actors_of({int(pid) for pid in line.split()})), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
