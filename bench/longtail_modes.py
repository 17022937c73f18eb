"""The modes of bench/longtail.py and the workload they share: mode -> RolloutConfig (see its docstring)."""
from __future__ import annotations

from dataclasses import dataclass

from ..infra.config.rollout import RolloutConfig

# mode -> (max_split, driver, max_age ("async": --async-max-age), over-sampled groups ("os": --over-sampling-groups),
#          scheduling, tail_factor (tail batching; 0 off)[, tail_engines]); a "_pinned" name: the simulated pool
#          queues every row on the engine dispatch chose (SimulatedRun), "_router" (--real): none pinned
MODE_SPECS = {
    "no_partial": (1, "sync", None, 0, "fifo", 0.0),
    "sync_split2": (2, "sync", None, 0, "fifo", 0.0),
    "sync_split4": (4, "sync", None, 0, "fifo", 0.0),
    "sync_split8": (8, "sync", None, 0, "fifo", 0.0),
    "async": (2, "async", "async", 0, "fifo", 0.0),
    "over_sampling": (1, "async", "async", "os", "fifo", 0.0),
    "sync_split4_la": (4, "sync", None, 0, "length_aware", 0.0),
    "async_la": (2, "async", "async", 0, "length_aware", 0.0),
    "over_sampling_la": (1, "async", "async", "os", "length_aware", 0.0),
    "tail_batching": (1, "async", "async", "os", "length_aware", 4.0),
    "async_age2": (2, "async", 2, 0, "fifo", 0.0),
    "async_age2_la": (2, "async", 2, 0, "length_aware", 0.0),
    "over_sampling_age2_la": (1, "async", 2, "os", "length_aware", 0.0),
    "async_la_pinned": (2, "async", "async", 0, "length_aware", 0.0),
    "async_la_router": (2, "async", "async", 0, "length_aware", 0.0),
    "async_age2_la_pinned": (2, "async", 2, 0, "length_aware", 0.0),
    "no_partial_la_pinned": (1, "sync", None, 0, "length_aware", 0.0),
    "async_age2_tail_engine_pinned": (2, "async", 2, 0, "length_aware", 4.0, 1),
    "async_tail_engine_pinned": (2, "async", "async", 0, "length_aware", 4.0, 1),
    "no_partial_tail_engine_pinned": (1, "sync", None, 0, "length_aware", 4.0, 1),
}
# rollout.overlap (issue 31): mode -> (its MODE_SPECS-shaped spec, the engines' pause mode at a weight update);
# max_age 3 (no trained token more than 2 versions old) or 2; overlap_os_age4 over-samples and allows 3 versions
_OVERLAP = (2, "async", 3, 0, "length_aware", 0.0)
_OVERLAP_AGE2 = (2, "async", 2, 0, "length_aware", 0.0)
OVERLAP_MODES = {
    "overlap_abort": (_OVERLAP, "abort"),
    "overlap_retract": (_OVERLAP, "retract"),
    "overlap_in_place": (_OVERLAP, "in_place"),
    "overlap_age2_abort": (_OVERLAP_AGE2, "abort"),
    "overlap_age2_in_place": (_OVERLAP_AGE2, "in_place"),
    "overlap_os_age4_in_place": ((2, "async", 4, "os", "length_aware", 0.0), "in_place"),
}
# issue 38: a mode -> (its base mode, the rollout settings it adds): the start cutoff (no group starts in the update
# unless it started before the batch choice) and start pacing (at most so many new groups start per step)
SETTING_MODES = {
    "overlap_age2_cutoff_in_place": ("overlap_age2_in_place", {"start_cutoff": True}),
    "overlap_os_age4_paced_in_place": ("overlap_os_age4_in_place", {"start_groups_per_step": 768}),
    # max_age 3 with 32 over-sampled groups (GBS / 16 at the bench's GBS 512): the staleness <= 2 mode
    "overlap_os32_in_place": ("overlap_in_place", {"over_sampling_groups": 32}),
    # the same, the requests still running at the next step adopted instead of aborted and sent again
    "overlap_os32_adopt_in_place": ("overlap_in_place", {"over_sampling_groups": 32, "adopt_detached": True}),
    "overlap_os_age4_adopt_in_place": ("overlap_os_age4_in_place", {"adopt_detached": True}),
    # max_age 3, 80 over-sampled groups, adopted: with the history (_hist) the recurring workload's staleness <= 2 mode
    "overlap_os80_adopt_in_place": ("overlap_in_place", {"over_sampling_groups": 80, "adopt_detached": True}),
}
# mode + "_hist" -> that mode with rollout.start_order = predicted_longest (the per-prompt length history
# orders the groups' start: --workload recurring, where prompts come back every epoch)
HISTORY_MODES = {f"{mode}_hist": mode for mode in ("async_la", "overlap_in_place", "overlap_age2_in_place",
                                                   "overlap_os_age4_in_place", "overlap_age2_cutoff_in_place",
                                                   "overlap_os32_in_place", "overlap_os32_adopt_in_place",
                                                   "overlap_os80_adopt_in_place")}
MODES = tuple(MODE_SPECS) + tuple(OVERLAP_MODES) + tuple(SETTING_MODES) + tuple(HISTORY_MODES)
TODAY_MODES = tuple(MODE_SPECS)  # the default workload's modes
DISAGGREGATED_MODES = ("no_partial", "async_la", "async_age2_la", "over_sampling_la") + tuple(OVERLAP_MODES) + tuple(
    SETTING_MODES)
RECURRING_MODES = ("no_partial", "overlap_in_place", "overlap_age2_in_place", "overlap_os_age4_in_place",
                   "overlap_in_place_hist", "overlap_age2_in_place_hist", "overlap_os_age4_in_place_hist",
                   "overlap_age2_cutoff_in_place_hist")


def base_mode(mode: str) -> tuple[str, dict]:
    """A mode -> (its MODE_SPECS or OVERLAP_MODES name, the rollout settings HISTORY_MODES and SETTING_MODES add)."""
    settings = {"start_order": "predicted_longest" if mode in HISTORY_MODES else "oldest"}
    mode = HISTORY_MODES.get(mode, mode)
    mode, added = SETTING_MODES.get(mode, (mode, {}))
    return mode, {**settings, **added}


def pause_mode(mode: str) -> str | None:
    """The pause mode of an overlap mode; None for the others."""
    mode, _ = base_mode(mode)
    return OVERLAP_MODES[mode][1] if mode in OVERLAP_MODES else None


@dataclass
class Workload:
    gbs: int
    n: int
    max_tokens: int
    prompt_tokens: int
    async_max_age: int
    over_sampling_groups: int
    update_s: float
    token_scale: int = 1  # tokens the dock and engine see = real tokens / token_scale
    swap_s: float = 0.0   # of update_s: the weight swap, when the engines pause (overlap modes generate through the rest)

    def rollout_config(self, mode: str) -> RolloutConfig:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        mode, settings = base_mode(mode)
        overlap = mode in OVERLAP_MODES
        spec = OVERLAP_MODES[mode][0] if overlap else MODE_SPECS[mode]
        split, driver, age, extra, scheduling, tail, *tail_engines = spec
        age = self.async_max_age if age == "async" else age
        extra = self.over_sampling_groups if extra == "os" else extra
        max_tokens, prompt = self.max_tokens // self.token_scale, self.prompt_tokens // self.token_scale
        fields = dict(global_batch_size=self.gbs, n_samples_per_prompt=self.n, max_tokens=max_tokens,
                      max_model_len=max_tokens + prompt, max_split=split, mode=driver, max_age=age,
                      over_sampling_groups=extra, scheduling=scheduling, tail_factor=tail,
                      tail_engines=tail_engines[0] if tail_engines else 0, overlap=overlap)
        return RolloutConfig(**{**fields, **settings})
