"""The rollout section's multi-turn tool fields (issue 15), a base of `RolloutConfig` in infra/config/run_config.py (kept apart
so that file stays small). With `rollout.env_path` set the default rollout function drives multi-turn trajectories
(rollout/drivers/multi_turn.py) against an environment built per sample (rollout/tools/env.py)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from spillover.infra.config.base import Section

__all__ = ["ToolFields"]


class ToolFields(Section):
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

    @model_validator(mode="after")
    def _check_tools(self) -> "ToolFields":
        if not self.env_path:
            return self
        if not self.tool_call_stop or any(not s for s in self.tool_call_stop):
            raise ValueError(f"rollout.env_path={self.env_path!r} needs rollout.tool_call_stop: the non-empty stop "
                             "strings that end a tool call (e.g. ['</calc>'])")
        if len(getattr(self, "stop", [])) + len(self.tool_call_stop) > 32:
            raise ValueError("rollout.stop and rollout.tool_call_stop together hold more than 32 strings (SGLang's "
                             "limit per request)")
        if getattr(self, "scheduling", "fifo") != "fifo":
            raise ValueError("rollout.scheduling=length_aware does not apply to multi-turn rollouts (rollout.env_path "
                             "is set): use rollout.scheduling=fifo")
        return self
