"""One mode of the long-tail benchmark as an iteration loop over the real dock and drivers: the simulated run
(bench/longtail.py) and the real one (bench/longtail_real.py) both step it."""
from __future__ import annotations

import logging
import time

import numpy as np

from ..infra.config.rollout import RolloutConfig
from ..rollout.dock.length_history import prediction_metrics
from ..rollout.dock.transfer_dock import TransferDock
from ..rollout.drivers.requests import SamplingSettings
from ..rollout.drivers.rounds import DetachedRows, generate_rounds
from ..rollout.prompt_data import groups_for_iteration
from .longtail_modes import Workload, pause_mode

log = logging.getLogger("longtail")
ENDLESS = 10**9  # iterations of the run as groups_for_iteration sees it: never the last, never draining


def build_dock(cfg: RolloutConfig, eos_ids: list[int]) -> TransferDock:
    return TransferDock.from_config(cfg, eos_ids)  # the staleness bound as a run has it (rollout.require_max_age_all_finished)


def generate_and_select(dock: TransferDock, engine, cfg: RolloutConfig, eos_ids: list[int], version: int,
                        detached: DetachedRows | None = None) -> dict:
    """What the flow's generate step does: the driver loop's rounds (cfg.mode) until the dock is ready, then the batch."""
    stats = generate_rounds(dock, engine, cfg, SamplingSettings.from_rollout(cfg, eos_ids), version, drain=False,
                            detached=detached)
    dock.select_batch()
    return stats.as_dict()


class ModeRun:
    """The iteration loop of one mode, one iteration per step() (so that --real can interleave the modes
    and share the machine's load fluctuations fairly). prompt_for(group_id) -> token ids; clock() ->
    seconds; update(version) -> seconds the weight update took; usage() -> cumulative engine counters;
    prepare(version), if given, runs before each iteration's generation (untimed); key_for(group_id), if given, the
    prompt's key in the dock's length history (default: a digest of the prompt's tokens)."""

    def __init__(self, mode: str, work: Workload, engine, prompt_for, clock, update, eos_ids: list[int],
                 usage=None, prepare=None, key_for=None):
        self.mode, self.work, self.engine, self.prompt_for = mode, work, engine, prompt_for
        self.key_for = key_for
        # (iteration, the history's prediction for each trained group when it started (NaN: none), its true mean length)
        self.pairs: list[tuple[int, np.ndarray, np.ndarray]] = []
        self.clock, self.update, self.eos_ids, self.usage, self.prepare = clock, update, eos_ids, usage, prepare
        self.cfg = work.rollout_config(mode)
        self.dock = build_dock(self.cfg, eos_ids)
        self.detached = DetachedRows() if self.cfg.overlap else None
        self.rows: list[dict] = []
        self.next_id, self.wall_s = 0, 0.0

    def step(self) -> None:
        wall0, it, dock = time.perf_counter(), len(self.rows), self.dock
        count = groups_for_iteration(dock, ENDLESS)
        ids = np.arange(self.next_id, self.next_id + count)
        keys = [self.key_for(int(g)) for g in ids] if self.key_for else None
        dock.load_groups(ids, [self.prompt_for(int(g)) for g in ids], [0] * count, keys=keys)
        self.next_id += count
        if self.prepare:
            self.prepare(it)
        before, start = self.usage() if self.usage else {}, self.clock()
        stats = generate_and_select(dock, self.engine, self.cfg, self.eos_ids, it, self.detached)
        rollout_s = self.clock() - start
        after = self.usage() if self.usage else {}
        batch = dock.batch_arrays()
        versions = batch["weight_versions"]
        row = {"rollout_s": rollout_s, "rounds": stats["rounds"], "trained": int(batch["response_lengths"].sum()),
               "stale": int((versions < it).sum()), "max_lag": int(it - versions.min()) if len(versions) else 0,
               "generated": stats["tokens_generated"], "detached": stats["detached_tokens"],
               **{k: after[k] - before[k] for k in after if k != "clock_s"}}
        cleared = dock.clear(keep_generating=self.cfg.overlap)
        if self.cfg.start_order == "predicted_longest":
            predicted = np.asarray([np.nan if p is None else p for p in cleared["predicted_group_len"]], dtype=float)
            self.pairs.append((it, predicted, np.asarray(cleared["true_group_len"], dtype=float)))
        row["update_s"] = self.update(it + 1)
        if "recomputed_prefill_tokens" in after:  # over the whole iteration: pauses fall in the update
            end = self.usage()
            row["update_busy_s"] = end["engine_busy_s"] - after["engine_busy_s"]  # overlap: detached requests
            row["recomputed_prefill"] = (end["recomputed_prefill_tokens"] + end["continued_prefill_tokens"]
                                         - before["recomputed_prefill_tokens"] - before["continued_prefill_tokens"])
        self.rows.append(row)
        self.wall_s += time.perf_counter() - wall0
        log.info("%s iteration %d: %s", self.mode, it, {k: round(v, 3) if isinstance(v, float) else v
                                                       for k, v in row.items()})

    def result(self, warmup: int) -> dict:
        out = summarize(self.mode, self.cfg, self.rows[warmup:], self.wall_s, getattr(self.engine, "slots", None),
                        self.work.token_scale)
        if self.usage and "tokens_generated" in self.usage():
            # every token the engines made either reached the dock, waits in a detached answer, or was lost
            waiting = sum(len(a.output_ids) for a in self.engine.collect_detached().values()) \
                if self.detached is not None else 0
            lost = self.usage()["tokens_generated"] - sum(r["generated"] for r in self.rows) - waiting
            out["discarded_tokens_per_update"] = round(lost * self.work.token_scale / len(self.rows))
        out["predictor_r"] = self.predictor_r(warmup)
        return out

    def predictor_r(self, warmup: int) -> float | None:
        """Pearson correlation of the history's predicted and the true mean length of the measured iterations'
        trained groups (those whose prompt had a history); None where no predictor runs or too few were known."""
        pairs = [(p, t) for it, p, t in self.pairs if it >= warmup]
        if not pairs:
            return None
        return prediction_metrics(np.concatenate([p for p, _ in pairs]), np.concatenate([t for _, t in pairs]))[
            "predictor_r"]


def run_mode(mode: str, work: Workload, engine, prompt_for, clock, update, iterations: int, warmup: int,
             eos_ids: list[int], usage=None, key_for=None) -> dict:
    """All iterations of one mode -> its JSON summary (see ModeRun)."""
    run = ModeRun(mode, work, engine, prompt_for, clock, update, eos_ids, usage, key_for=key_for)
    for _ in range(warmup + iterations):
        run.step()
    return run.result(warmup)


TOKEN_KEYS = ("trained", "stale", "generated", "tokens_generated", "prefill_tokens", "detached", "recomputed_prefill")


def summarize(mode: str, cfg: RolloutConfig, rows: list[dict], wall_s: float, slots: tuple[int, int] | None,
              token_scale: int = 1) -> dict:
    def total(key):
        return float(sum(r[key] for r in rows)) * (token_scale if key in TOKEN_KEYS else 1)

    rollout, update, trained = total("rollout_s"), total("update_s"), total("trained")
    out = {"mode": mode, "tokens_per_s": round(trained / (rollout + update), 1),
           "iteration_s": round((rollout + update) / len(rows), 3),
           "engine_idle_share": None, "stale_token_share": round(total("stale") / trained, 4), "speedup": None,
           "rollout_s": round(rollout / len(rows), 3), "update_s": round(update / len(rows), 3),
           "rollout_tokens_per_s": round(trained / rollout, 1), "rollout_speedup": None, "slot_idle_share": None,
           "max_version_lag": max(r["max_lag"] for r in rows), "token_staleness_max": max(r["max_lag"] for r in rows),
           "scheduling": cfg.scheduling, "tail_factor": cfg.tail_factor,
           "rounds_per_iteration": total("rounds") / len(rows),
           "generated_tokens_per_iteration": round(total("generated") / len(rows)),
           "trained_tokens_per_iteration": round(trained / len(rows)),
           "token_scale": token_scale, "max_split": cfg.max_split, "max_age": cfg.effective_max_age, "driver": cfg.mode,
           "over_sampling_groups": cfg.over_sampling_groups, "measured_iterations": len(rows),
           "wall_s": round(wall_s, 1), "overlap": cfg.overlap, "pause_mode": pause_mode(mode),
           "detached_tokens_per_iteration": round(total("detached") / len(rows))}
    if slots and "engine_busy_s" in rows[0]:
        engines, per_engine = slots
        out["engine_idle_share"] = round(max(0.0, 1 - total("engine_busy_s") / (engines * rollout)), 4)
        out["slot_idle_share"] = round(max(0.0, 1 - total("slot_busy_s") / (engines * per_engine * rollout)), 4)
    if "prefill_tokens" in rows[0]:
        out["prefill_tokens_per_iteration"] = round(total("prefill_tokens") / len(rows))
    if "recomputed_prefill" in rows[0]:
        # prefill done again because a request stopped (abort at the ready point, at a pause, or collected) or its
        # KV was dropped (retract): what partial rollout pays instead of discarding tokens
        out["recomputed_prefill_tokens_per_update"] = round(total("recomputed_prefill") / len(rows))
        if slots and total("update_s"):
            out["update_engine_busy_share"] = round(total("update_busy_s") / (slots[0] * total("update_s")), 4)
    return out
