"""`python bench/longtail.py --real`: the long-tail benchmark on real engines, in wall time.

Two torch CPU engines with the tiny model run as Ray actors behind the real sglang-router (one
RolloutManager); the same iteration loop as the simulated run drives the real dock and drivers. Weight
updates are real (update_weights_from_disk of the same checkpoint, with a new version), so the reported
versions and stale_token_share are the engines' own.

The tiny model's sampled tokens carry no length distribution of their own, so `NaturalLengths` gives
each (group, sample) a lognormal natural length: it sends every request with max_new_tokens cut to what
that sample has left and ignore_eos, and marks an answer that reaches the natural length as a stop. The
compute -- prefill, decode, continuous batching, abort, HTTP and the router -- is the engines' own.
Engine idle time comes from polling every engine's /v1/loads.
"""
from __future__ import annotations

import heapq
import logging
import tempfile
import threading
import time
from pathlib import Path

import httpx

from .mode_run import ModeRun
from .simulator.workload import LognormalLengths
from ..rollout.fleet.weights.weight_update import WeightUpdate
from ..rollout.sglang.protocol import FinishReason, GenerateJob, GenerateResponse

log = logging.getLogger("longtail.real")


class NaturalLengths:
    """Wraps a RolloutManager: per-sample natural lengths over real generation (see the module doc)."""

    def __init__(self, manager, lengths: LognormalLengths):
        self.manager, self.lengths = manager, lengths
        self.num_engines = manager.num_engines  # length-aware dispatch pins rows to the manager's engines
        self.prompts: dict[tuple[int, ...], int] = {}
        self.continuations: dict[tuple[int, ...], tuple[int, int, int]] = {}  # full ids -> (group, j, plen)
        self.natural: dict[int, list[int]] = {}
        self.free_j: dict[int, list[int]] = {}
        self.lock = threading.Lock()

    def register_prompt(self, group: int, ids: list[int]) -> list[int]:
        self.prompts[tuple(ids)] = group
        self.natural[group] = [int(x) for x in self.lengths.group_lengths(group)]
        self.free_j[group] = list(range(len(self.natural[group])))
        return ids

    def _plan(self, job: GenerateJob) -> tuple[GenerateJob, tuple]:
        request = job.request
        ids = tuple(request.input_ids)
        with self.lock:
            if ids in self.continuations:
                group, j, plen = self.continuations.pop(ids)
            else:
                group, plen = self.prompts[ids], len(ids)
                j = heapq.heappop(self.free_j[group])
        left = self.natural[group][j] - (len(ids) - plen)
        budget = int(request.sampling_params.max_new_tokens)
        cut = max(0, min(budget, left))
        params = request.sampling_params.model_copy(update={"max_new_tokens": cut, "ignore_eos": True})
        return (GenerateJob(request.model_copy(update={"sampling_params": params}), job.engine),
                (ids, group, j, plen, cut, left <= budget))

    def _fix(self, plan: tuple, answer: GenerateResponse) -> None:
        ids, group, j, plen, cut, reaches_natural = plan
        out = answer.output_ids
        if answer.meta_info.finish_reason.type != "abort" and len(out) == cut and reaches_natural:
            answer.meta_info.finish_reason = FinishReason(type="stop", matched="natural length")
            return
        with self.lock:
            if out or len(ids) > plen:
                self.continuations[ids + tuple(out)] = (group, j, plen)
            else:
                heapq.heappush(self.free_j[group], j)  # nothing generated: the sample starts afresh later

    def generate(self, jobs: list[GenerateJob], on_result=None) -> list[GenerateResponse]:
        planned = [self._plan(job) for job in jobs]
        fixed = [False] * len(jobs)

        def fix(i: int, answer: GenerateResponse) -> None:
            if not fixed[i]:
                fixed[i] = True
                self._fix(planned[i][1], answer)

        def wrapped(i: int, answer: GenerateResponse) -> bool | None:
            fix(i, answer)
            return on_result(i, answer)  # True stops the round (the manager aborts and returns once idle)

        answers = self.manager.generate([p[0] for p in planned], on_result=wrapped if on_result else None)
        for i, answer in enumerate(answers):
            fix(i, answer)
        return answers


class LoadSampler:
    """Polls every engine's /v1/loads; usage() integrates busy engine time and running requests."""

    def __init__(self, urls: list[str], interval_s: float = 0.02):
        self.urls, self.interval_s = urls, interval_s
        self.busy_s = self.slot_s = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            last = time.perf_counter()
            while not self.stop.wait(self.interval_s):
                running = []
                for url in self.urls:
                    try:
                        loads = client.get(url + "/v1/loads").json()["loads"]
                        running.append(sum(entry["num_running_reqs"] for entry in loads))
                    except (httpx.HTTPError, KeyError, ValueError):
                        running.append(0)
                now = time.perf_counter()
                self.busy_s += (now - last) * sum(r > 0 for r in running)
                self.slot_s += (now - last) * sum(running)
                last = now

    def usage(self) -> dict:
        return {"engine_busy_s": self.busy_s, "slot_busy_s": self.slot_s}

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


class RealRun:
    def __init__(self, args):
        from ..infra.config.engines import EnginesConfig
        from ..infra.models import build_tiny_model, load_tokenizer

        if args.token_scale != 1:
            raise SystemExit("--token-scale applies to the simulated engine only; drop it with --real")
        self.args = args
        if not args.local:
            from ..infra.cluster import init_ray  # sets Ray's loopback environment before ray is imported

            init_ray()
        self.tmp = tempfile.TemporaryDirectory(prefix="longtail-")
        self.model_dir = build_tiny_model(Path(self.tmp.name) / "tiny",
                                         max_position=max(512, args.max_tokens + args.prompt_tokens))
        self.tokenizer = load_tokenizer(self.model_dir)
        cfg = EnginesConfig(rollout_num_gpus=args.engines, gpus_per_engine=1, max_running_requests=args.slots,
                            health_timeout_s=30.0)
        log.info("starting %d %s engines (%d slots each)", args.engines, "local" if args.local else "CPU", args.slots)
        if args.local:  # in this process, no Ray or router (the GPU machine has neither): bench/local_engines.py
            from .local_engines import LocalEngines

            self.manager = LocalEngines(str(self.model_dir), args.engines, args.slots, args.device)
        else:
            from ..rollout.fleet.manager import RolloutManager

            self.manager = RolloutManager(cfg, self.model_dir, use_gpu=False)
        self.sampler = LoadSampler(self.manager.urls)
        self.slots = (args.engines, args.slots)
        self.eos = int(self.tokenizer.eos_token_id)
        self.version = 0

    def mode_run(self, mode: str, work):
        """One mode's ModeRun on the shared engines; the engines are set to the mode's version first."""
        lengths = LognormalLengths(n=work.n, median=self.args.median, sigma=self.args.sigma, seed=self.args.seed,
                                   group_share=self.args.group_share)
        engine = NaturalLengths(self.manager, lengths)
        engine.slots = self.slots
        if mode.endswith("_router"):
            engine.num_engines = 1  # length-aware order only: every row through the router, none pinned

        def prompt_for(group: int) -> list[int]:
            ids = self.tokenizer(f"q{group}:", add_special_tokens=False)["input_ids"]
            return engine.register_prompt(group, ids)

        def prepare(version: int) -> None:
            if self.version != version:
                self.manager.update_weights(WeightUpdate("disk", self.model_dir, version))
                self.version = version

        def update(version: int) -> float:
            start = time.perf_counter()
            self.manager.update_weights(WeightUpdate("disk", self.model_dir, version))
            self.version = version
            return time.perf_counter() - start

        return ModeRun(mode, work, engine, prompt_for, time.perf_counter, update, [self.eos], self.sampler.usage,
                       prepare)

    def close(self) -> None:
        self.sampler.close()
        self.manager.shutdown()
        if not self.args.local:
            import ray

            ray.shutdown()
        self.tmp.cleanup()
