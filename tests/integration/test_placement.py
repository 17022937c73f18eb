"""Engine placement on a two-node Ray cluster on this machine (`ray.cluster_utils.Cluster`).

The cluster runs in a child process (this file run as a script, started with the session as background work:
tests/fixtures_early.py): a Ray driver can join only one cluster, and the session's Ray is already joined. The child
sets the loopback variable before importing Ray and uses a private RAY_TMPDIR, so the cluster's address file never
points another process's `ray.init()` at it. Each node offers 2 logical CPUs; a CPU engine slot (bundle) takes 1, so
a node holds 2 slots.

Checks: PACK keeps two engines on one node, STRICT_SPREAD (started, serving) puts them on different
nodes, a 4-slot engine spans both nodes and only its node-0 actor serves and is registered with the router, generation
goes through, an s3:// model is staged on both nodes (issue 12) and a STRICT_SPREAD world_size 2 learner group trains
on it, a model by Hub id resolves to the driver's snapshot folder on the other node, and every listening socket of the cluster (Ray, engines, router, learners) is on loopback.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

# the child runs in the background (tests/fixtures_early.py)
pytestmark = pytest.mark.early("placement_child", cpu_s=35)


@pytest.fixture(scope="module")
def placement_report(placement_child) -> dict:
    return placement_child.result()


@pytest.mark.slow
def test_pack_keeps_engines_on_one_node(placement_report):
    nodes = placement_report["pack"]
    assert len(nodes) == 2 and len(set(nodes)) == 1


@pytest.mark.slow
def test_strict_spread_puts_engines_on_different_nodes(placement_report):
    nodes = placement_report["spread"]
    assert len(nodes) == 2 and len(set(nodes)) == 2
    assert placement_report["spread_healthy"] == [200, 200]  # start_all returns serving engines


@pytest.mark.slow
def test_multi_node_engine_serves_only_from_node_zero(placement_report):
    multi = placement_report["multi_node"]
    assert len(multi["actors"]) == 2
    node0, node1 = multi["actors"]
    assert node0["node_id"] != node1["node_id"]
    assert node0["url"] and node1["url"] is None
    assert multi["router_workers"] == [node0["url"]]
    assert multi["generated"] == [4, 4]


@pytest.mark.slow
def test_every_node_stages_the_s3_model_and_a_spread_learner_group_trains_on_both(placement_report):
    """One machine cannot give the nodes separate disks: the second node's staging task finds the driver's copy in
    the shared cache folder and checks every file against the driver's digests before using it (same path)."""
    staging, learners = placement_report["staging"], placement_report["learners"]
    assert len(staging) == 2 and len({s["node_id"] for s in staging}) == 2  # a staging task ran on each node
    assert staging[0]["downloaded"] and "model.safetensors" in staging[0]["files"]
    assert len(set(learners["nodes"])) == 2 and learners["model_path"] == staging[0]["path"]
    assert learners["weight_version"] == 1 and learners["loss_finite"] and learners["weights_changed"]


@pytest.mark.slow
def test_every_node_resolves_a_hub_model_at_the_drivers_commit(placement_report):
    """model.path by Hub id on two nodes (flows/setup.py): the other node's task resolves the recorded commit in its
    own Hub cache (offline here: the same HF_HOME on one machine) to the folder the driver's actors load."""
    hub = placement_report["hub"]
    assert hub["driver"]["path"].endswith("/snapshots/" + "c" * 40)
    assert [o["path"] for o in hub["others"]] == [hub["driver"]["path"]]
    assert hub["others"][0]["node_id"] != hub["driver"]["node_id"]


@pytest.mark.slow
def test_cluster_listens_only_on_loopback(placement_report):
    assert placement_report["node_ips"] == ["127.0.0.1", "127.0.0.1"]
    assert placement_report["gcs_address"].startswith("127.0.0.1:")
    assert placement_report["non_loopback_listeners"] == [] and placement_report["learner_listeners"] == []


# ---- the child process ------------------------------------------------------------------------------
def _descendants(root: int) -> set[int]:
    return {root, *(child.pid for child in psutil.Process(root).children(recursive=True))}


def _non_loopback_listeners(pids: set[int]) -> list[str]:
    import re

    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
    bad = []
    for line in lines:
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        local = line.split()[3]
        if owners & pids and not local.startswith(("127.0.0.1:", "[::1]:", "[::ffff:127.0.0.1]:")):
            bad.append(line)
    return bad


def _stage_and_train(staging: dict) -> dict:
    """Stage the s3:// model on both nodes (as build_run does), then a world_size 2 STRICT_SPREAD learner group on
    the staged folder: one update from a rank on each node."""
    import ray

    from spillover.infra.config.run_config import StorageConfig, build_config
    from spillover.infra.hub_models import resolve_hub_model, resolve_on_other_nodes
    from spillover.infra.storage.model_staging import stage_model, stage_on_other_nodes
    from learner_batches import random_batch
    from spillover.tasks.learner.group import create_learner_group

    storage = StorageConfig(endpoint_url=staging["endpoint_url"])
    path, digests, downloaded = stage_model(staging["url"], storage, staging["cache_dir"])
    others = stage_on_other_nodes(path, storage)  # checked against this node's digests there (raises if not)
    report = {"staging": [{"node_id": ray.get_runtime_context().get_node_id(), "downloaded": downloaded,
                           "files": sorted(digests), "path": path}, *others]}
    hub = staging["hub"]  # a model by Hub id: every node resolves the driver's commit in its own cache
    folder, commit = resolve_hub_model(hub["repo_id"], hub["commit"])
    report["hub"] = {"driver": {"node_id": ray.get_runtime_context().get_node_id(), "path": str(folder)},
                     "others": resolve_on_other_nodes(hub["repo_id"], commit, folder)}
    cfg = build_config(overrides=["grpo.kl_coef=0", "grpo.micro_batch_size=2", "rollout.global_batch_size=2",
                                  "rollout.n_samples_per_prompt=4", "optimizer.lr=0.01", "learner.world_size=2",
                                  "learner.placement_strategy=STRICT_SPREAD"])
    group = create_learner_group(path, cfg, trainable=True)
    try:
        before = ray.get(group.state_dict_ref.remote())
        metrics = ray.get(group.update.remote(ray.put(random_batch(1, max_response=14)), None, None))
        after = ray.get(group.state_dict_ref.remote())
        report["learners"] = {"nodes": [ray.get(a.node_id.remote()) for a in group.actors], "model_path": path,
                              "weight_version": int(metrics["weight_version"]),
                              "loss_finite": bool(abs(float(metrics["loss"])) < float("inf")),
                              "weights_changed": any(not bool((before[k] == after[k]).all()) for k in before)}
        report["learner_listeners"] = _non_loopback_listeners(_descendants(os.getpid()))
    finally:
        group.shutdown()
    return report


def _child(model_dir: str, staging: dict) -> dict:
    os.environ.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                       "RAY_USAGE_STATS_ENABLED": "0"})
    import asyncio

    import ray
    from ray.cluster_utils import Cluster

    from spillover.infra.config.engines import EnginesConfig
    import httpx

    from background import lower_priority
    from spillover.rollout.fleet.engine_pool import EnginePool
    from spillover.rollout.fleet.manager import RolloutManager
    from spillover.rollout.sglang.protocol import GenerateJob, GenerateRequest

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        lower_priority(os.getpid())  # background work (tests/background.py), once the nodes are up
        report: dict = {"gcs_address": cluster.address,
                        "node_ips": sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])}
        one_slot = EnginesConfig(rollout_num_gpus=2, gpus_per_engine=1, num_cpus_per_engine=1, max_running_requests=4)
        pool = EnginePool(one_slot, model_dir, strategy="PACK", use_gpu=False)  # placement only: actors, no servers
        actors = [pool.new_actors(i)[0][0] for i in range(2)]
        report["pack"] = [ray.get(a.info.remote())["node_id"] for a in actors]
        for actor in actors:
            ray.kill(actor)
        pool.shutdown()
        pool = EnginePool(one_slot, model_dir, strategy="STRICT_SPREAD", use_gpu=False, torch_threads=1)
        asyncio.run(pool.start_all())  # returns once every engine answers /health
        report["spread"] = [h.node_ids[0] for h in pool.engines]
        report["spread_healthy"] = [httpx.get(h.url + "/health_generate", timeout=30).status_code for h in pool.engines]
        pool.shutdown()
        spanning = EnginesConfig(rollout_num_gpus=4, gpus_per_engine=4, num_cpus_per_engine=4, max_running_requests=4)
        with RolloutManager(spanning, model_dir, slots_per_node=2, use_gpu=False, torch_threads=1) as manager:
            engine = manager.engines[0]
            params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
            answers = manager.generate([GenerateJob(GenerateRequest(input_ids=[5, 6, 7], sampling_params=params))
                                        for _ in range(2)])
            report["multi_node"] = {"actors": [ray.get(a.info.remote()) for a in engine.actors],
                                    "router_workers": manager.router.workers(),
                                    "generated": [len(a.output_ids) for a in answers]}
            report["non_loopback_listeners"] = _non_loopback_listeners(_descendants(os.getpid()))
        report.update(_stage_and_train(staging))  # once the engines are gone: the learners need the CPU slots
        return report
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1], json.loads(sys.argv[2]))), flush=True)
