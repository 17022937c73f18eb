"""The `rollout` section: batch sizes, partial rollout and staleness, sampling, dispatch, rollout functions and
multi-turn tool use."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Section


SFT_ROLLOUT_FUNCTION = "spillover.rollout.builtin.sft.generate_sft_rollout"


class RolloutConfig(Section):
    global_batch_size: int = Field(16, ge=1, description="GBS: prompt groups trained per iteration.")
    n_samples_per_prompt: int = Field(8, ge=1, description="Responses per prompt (group size n). GRPO needs >= 2.")
    max_tokens: int = Field(32, ge=1, description="Most response tokens per sample, over all its rounds.")
    max_model_len: int = Field(64, ge=2, description="Most prompt + response tokens per sample.")
    max_split: int = Field(
        2, description="Partial rollout: a response is generated in up to max_split rounds of "
        "max_tokens // max_split tokens. 1 = plain GRPO (no partial rollout).")
    max_age: int | None = Field(
        None, description="Most iterations a row may be carried over; empty = max_split (async mode or "
        "over_sampling_groups: at least 2).")
    require_max_age_all_finished: bool = Field(
        True, description="The staleness bound, in sync and async mode: a batch waits until every prompt group at "
        "max age has finished (a group's age counts the updates since its first token), so no trained token is more "
        "than max_age - 1 weight versions old; with over-sampling, extra groups start only when they can be trained "
        "in time. false: off (rows may be carried up to max_split iterations and longer with over-sampling).")
    mode: Literal["sync", "async"] = Field("sync", description="sync: chunked rounds; async: stop signal + abort.")
    overlap: bool = Field(
        False, description="Async mode: once the dock is ready the requests still running are not aborted; they "
        "keep generating through reward, logprobs, update, clear and checkpoint (weight updates pause them in "
        "the engines' pause mode, tokens after the swap carry the new version), and their answers go into the dock at "
        "the next generation step. The staleness bound (max_age) holds as without it.")
    over_sampling_groups: int = Field(0, ge=0, description="Extra groups dispatched beyond GBS (APRIL).")
    scheduling: Literal["fifo", "length_aware"] = Field(
        "fifo", description="Dispatch order: fifo = the dock's (oldest first); length_aware = longest expected remaining "
        "work first (carried-over rows, a group's finished siblings; rollout/drivers/scheduling.py), rows spread over engines.")
    start_order: Literal["oldest", "predicted_longest"] = Field(
        "oldest", description="length_aware: the order groups start in. oldest = oldest group first, then the longest "
        "expected remaining work from tokens generated so far and finished siblings (a group not started yet expects "
        "the mean completed length, so new groups start in load order); predicted_longest = the same, but a group "
        "whose prompt was trained in an earlier epoch expects the mean length its groups reached (a per-prompt "
        "history the dock keeps and checkpoints), so after each weight swap the groups predicted longest start first.")
    start_groups_per_step: int | None = Field(
        None, ge=0, description="length_aware, start pacing: at most this many groups that have not started yet begin "
        "in one generation step; the others wait in the dock unstarted (their staleness clock does not run) and go "
        "in a later step, unless nothing else is left to generate (then they go at once, so pacing never stalls a "
        "step). Empty = no limit (every group the dock lets start goes at once).")
    start_cutoff: bool = Field(
        False, description="overlap: groups that have not started by the batch choice do not start during the update "
        "(their queued requests are dropped unstarted and go again in the next generation step, under the new "
        "weights), so a group's staleness clock never starts in an update and it gets a full iteration to finish. "
        "Faster at max_age 2 (the engines then run only work already started through the update); slower at "
        "max_age >= 3, where the requests that start in the update keep the engines full.")
    adopt_detached: bool = Field(
        False, description="overlap: the requests still running when the next generation step starts keep running "
        "(the step adopts them) instead of being aborted and sent again, which saves their prefill: with the prefix "
        "cache flushed after an in_place update, each costs a prefill of its prompt and partial response. Requests "
        "carry SGLang's extra_key of their weight version, so no request reuses a prefix cached under older weights.")
    tail_factor: float = Field(0.0, ge=0, description="Tail batching (length_aware): rows expected above this x the "
                               "median remaining work wait for the long round; 0 = off.")
    tail_round_every: int = Field(2, ge=1, description="Tail batching: every k-th iteration is a long round.")
    tail_engines: int = Field(0, ge=0, description="length_aware with tail_factor: engines reserved for the tail rows, "
                              "every round (they run few requests, so fast steps); 0 = tail rows wait for the long round.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (the learner uses the same).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(-1, description="Top-k sampling; -1 = off.")
    stop: list[str] = Field(
        default_factory=list, max_length=32, description="Stop strings (SGLang's sampling_params.stop, at most "
        "32): generation ends once the response text contains one (its tokens stay in the response).")
    ignore_eos: bool = Field(
        False, description="SGLang's sampling_params.ignore_eos: responses end only at max_tokens or a rollout.stop "
        "string, never at an EOS or stop token id (those tokens stay in the response text the reward reads). For "
        "length stress tests and benchmarks; evaluation still ends at EOS.")
    deterministic_sampling: bool = Field(
        False, description="Seed every request (SGLang's sampling_params.sampling_seed, from model.seed, the group "
        "and the sample index): samples then do not depend on batching, timing or restarts, so a resumed run "
        "repeats an uninterrupted one. The sglang backend needs --enable-deterministic-inference for it.")
    rollout_function_path: str = Field(
        "spillover.rollout.drivers.default_rollout.generate_rollout", description="Import path of the rollout function.")
    eval_function_path: str | None = Field(
        None, description="Import path of the eval function (slime's signature, called with evaluation=True every "
        "schedule.eval_interval iterations, with or without data.eval_paths); empty = the built-in eval over "
        "data.eval_paths.")

    # multi-turn tool use (rollout/drivers/tool_turns.py, rollout/tools/env.py)
    env_path: str | None = Field(
        None, description="Multi-turn tool use: import path of an environment class or factory, called with no "
        "arguments once per sample; the object has `async reset(sample) -> str` and `async step(action_text) -> "
        "StepResult(observation, done, reward=None)` (rollout/tools/env.py; built in: "
        "spillover.rollout.builtin.calculator.CalculatorEnv). "
        "Empty = single-turn generation.")
    max_turns: int = Field(
        4, ge=1, description="Most model turns per trajectory: each tool call ends one, the final answer is the last; "
        "a tool call in the last allowed turn ends the episode without running the tool.")
    tool_call_stop: list[str] = Field(
        default_factory=list, max_length=16, description="Stop strings that end a tool call (e.g. '</calc>', or '=' "
        "for the calculator): generation stops there and the action text (the turn's text up to and including the string) "
        "goes to env.step. Needed with env_path.")
    tool_timeout_s: float = Field(10.0, gt=0, description="Time limit of one env.reset / env.step call.")
    max_concurrent_tool_calls: int = Field(64, ge=1, description="Env calls running at once (the whole rollout).")
    max_tool_output_tokens: int = Field(
        256, ge=1, description="Observation tokens kept per tool call; a longer observation is cut and ends with "
        "' ...truncated' (the trajectory's token budget rollout.max_tokens also bounds it).")
    on_tool_error: Literal["observe", "end"] = Field(
        "observe", description="An env call that raises or times out: observe = its error text becomes the "
        "observation; end = the episode ends there. Neither fails the run.")

    @property
    def partial(self) -> bool:
        return self.max_split > 1

    @property
    def effective_max_age(self) -> int:
        """max_age, else max_split; async mode and over-sampling carry unfinished groups at least once (APRIL)."""
        if self.max_age is not None:
            return self.max_age
        return max(2, self.max_split) if self.mode == "async" or self.over_sampling_groups else self.max_split

    @property
    def sft(self) -> bool:
        return self.rollout_function_path == SFT_ROLLOUT_FUNCTION

    @model_validator(mode="after")
    def _check(self) -> "RolloutConfig":
        if self.n_samples_per_prompt < 2 and not self.sft:
            raise ValueError("rollout.n_samples_per_prompt must be >= 2 for GRPO (group-normalised advantages "
                             f"need a group); got {self.n_samples_per_prompt}")
        if self.max_split < 1:
            raise ValueError(f"rollout.max_split must be >= 1 (1 = no partial rollout); got {self.max_split}")
        if self.max_tokens < self.max_split:
            raise ValueError(f"rollout.max_tokens ({self.max_tokens}) must be >= rollout.max_split "
                             f"({self.max_split}): each round generates max_tokens // max_split tokens")
        if self.max_model_len <= self.max_tokens:
            raise ValueError(f"rollout.max_model_len ({self.max_model_len}) must exceed rollout.max_tokens "
                             f"({self.max_tokens}) to leave room for the prompt")
        if self.max_age is not None and self.max_age < 1:
            raise ValueError(f"rollout.max_age must be >= 1; got {self.max_age}")
        if self.start_order != "oldest" and self.scheduling != "length_aware":
            raise ValueError(f"rollout.start_order={self.start_order} orders rows by their expected length: it needs "
                             "rollout.scheduling=length_aware")
        if self.start_groups_per_step is not None and self.scheduling != "length_aware":
            raise ValueError("rollout.start_groups_per_step paces length-aware dispatch: it needs "
                             "rollout.scheduling=length_aware (or leave it empty)")
        if self.start_cutoff and not self.overlap:
            raise ValueError("rollout.start_cutoff=true holds queued groups back through the update: it needs "
                             "rollout.overlap=true (without overlap nothing runs through the update)")
        if self.adopt_detached and not self.overlap:
            raise ValueError("rollout.adopt_detached=true keeps the requests left running through the update: it "
                             "needs rollout.overlap=true (without overlap nothing runs past a generation step)")
        if self.overlap and self.mode != "async":
            raise ValueError(f"rollout.overlap=true needs rollout.mode=async (got mode={self.mode}): the sync driver's "
                             "rounds end with every request, so nothing runs on; set rollout.mode=async or "
                             "rollout.overlap=false")
        if any(not s for s in self.stop):
            raise ValueError("rollout.stop holds an empty string; give non-empty stop strings")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> "RolloutConfig":
        if not self.env_path:
            return self
        if not self.tool_call_stop or any(not s for s in self.tool_call_stop):
            raise ValueError(f"rollout.env_path={self.env_path!r} needs rollout.tool_call_stop: the non-empty stop "
                             "strings that end a tool call (e.g. ['</calc>'])")
        if len(self.stop) + len(self.tool_call_stop) > 32:
            raise ValueError("rollout.stop and rollout.tool_call_stop together hold more than 32 strings (SGLang's "
                             "limit per request)")
        if self.overlap:
            raise ValueError("rollout.overlap=true does not apply to multi-turn rollouts (rollout.env_path is set: a "
                             "tool call cannot wait through the update): use rollout.overlap=false")
        if self.scheduling != "fifo":
            raise ValueError("rollout.scheduling=length_aware does not apply to multi-turn rollouts (rollout.env_path "
                             "is set): use rollout.scheduling=fifo")
        return self
