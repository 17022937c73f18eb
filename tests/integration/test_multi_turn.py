"""Multi-turn tool trajectories (the driver loop with its tool hooks, rollout/drivers/tool_turns.py) against real engines (Ray actors behind the real router,
the 'varied' tiny model) and the real dock: cut anywhere and continued == uncut; tool failures; custom rollout
functions that do their own multi-turn logic."""
from __future__ import annotations

import asyncio
import threading

import numpy as np

from spillover.infra.config.rollout import RolloutConfig

from spillover.infra.config.run_config import build_config
from spillover.infra.models import load_tokenizer
from spillover.rollout.dock import turns as dock_turns
from spillover.rollout.dock.transfer_dock import TransferDock
from spillover.rollout.drivers.requests import SamplingSettings
from spillover.rollout.drivers.rounds import generate_rounds
from spillover.rollout.drivers.tool_turns import ToolTurns
from spillover.rollout.tools.env_pool import EnvPool
from spillover.rollout.sample import Sample
from spillover.rollout.sglang.protocol import GenerateJob, GenerateRequest
from spillover.rollout.tools.env import StepResult

EOS = 1
STOPS = ["e", "t", "a", "o", "i", "n"]  # the varied model's output is near uniform: ~1 token in 8 ends a tool call


class Echo:
    """Deterministic and stateful (its observations count its steps, so a wrong replay shows); even groups get a first
    observation; with a gate, odd groups' second and later steps wait until it opens."""

    def __init__(self, gate: threading.Event | None = None):
        self.steps, self.gate, self.group = 0, gate, 0

    async def reset(self, sample):
        self.group = sample.group_index
        return "go " if self.group % 2 == 0 else ""

    async def step(self, action):
        while self.gate is not None and self.group % 2 == 1 and self.steps >= 1 and not self.gate.is_set():
            await asyncio.sleep(0.005)
        self.steps += 1
        return StepResult(f" {len(action)}.{self.steps} ", done=self.steps >= 3, reward=float(self.steps))


def cfg(**kw) -> RolloutConfig:
    base = dict(global_batch_size=2, n_samples_per_prompt=4, max_tokens=40, max_model_len=56, max_split=4,
                deterministic_sampling=True, env_path="test_multi_turn.Echo", tool_call_stop=STOPS, max_turns=4)
    return RolloutConfig(**{**base, **kw})


def loaded(rollout: RolloutConfig, groups: int = 4, short_even: bool = False) -> TransferDock:
    """short_even: even groups' prompts leave room for 12 tokens only ("go " + 9), so they finish within two rounds."""
    room = rollout.max_model_len - 12
    prompts = [[14] * (room - 4) + [44, 11, 41, g] if short_even and g % 2 == 0 else [14, 44, 11, 41 + g]
               for g in range(groups)]
    dock = TransferDock.from_config(rollout, [EOS])
    dock.load_groups(np.arange(groups), prompts, ["x"] * groups)
    return dock


def run(dock, rollout, manager, envs, tokenizer, drain):
    """-> (generation stats, tool stats), with the env calls on the manager's loop."""
    sampling = SamplingSettings.from_rollout(rollout, [EOS], seed=7)
    tools = ToolTurns(dock, 0, rollout, envs, tokenizer, manager.loop)
    return generate_rounds(dock, manager, rollout, sampling, 0, drain, hooks=tools), tools.stats


def trajectories(dock) -> dict:
    """(group id, index) -> (tokens, mask, versions, turns) of the selected batch."""
    out = {}
    for slot in dock.select_batch().tolist():
        for i in range(dock.n):
            row = slot * dock.n + i
            tokens, mask = dock_turns.trajectory(dock, row)
            out[(int(dock.group_ids[slot]), i)] = (tokens.tolist(), mask.tolist(), int(dock.turns[row]))
    return out


def test_cut_mid_generation_and_with_a_tool_call_pending_then_continued_equals_uncut(rollout_manager,
                                                                                     varied_model_dir):
    tokenizer = load_tokenizer(varied_model_dir)
    reference_cfg = cfg(global_batch_size=4, max_split=1, mode="async")
    reference = loaded(reference_cfg, short_even=True)
    envs = EnvPool(Echo, 5.0, 8)
    try:
        _, ref_tools = run(reference, reference_cfg, rollout_manager, envs, tokenizer, drain=True)
    finally:
        envs.close()
    want = trajectories(reference)
    assert ref_tools.calls >= 4 and sum(t[2] for t in want.values()) == ref_tools.calls
    assert any(0 in t[1] and t[1][0] == 1 for t in want.values())  # tool tokens after policy tokens
    assert all(t[1][:3] == [0, 0, 0] for (g, _), t in want.items() if g % 2 == 0)  # even groups: "go " first

    # rounds of 5 tokens; GBS 2 of 4 groups: the short even groups finish first, while the odd groups' rows are
    # mid-generation or wait for a tool behind a closed gate
    cut_cfg = cfg(max_split=8)
    dock, gate = loaded(cut_cfg, short_even=True), threading.Event()
    envs = EnvPool(lambda: Echo(gate), 5.0, 8)
    try:
        _, first = run(dock, cut_cfg, rollout_manager, envs, tokenizer, drain=False)
        got = trajectories(dock)
        assert first.carried_mid_tool >= 1  # cut with a tool call pending (a second one: its env needs a replay)
        carried = np.repeat(dock.group_ids >= 0, dock.n) & ~dock.complete
        assert (dock.turns[carried & dock.awaiting_tool] >= 2).any()
        partial = np.repeat(dock.group_ids >= 0, dock.n) & ~dock.complete & ~dock.awaiting_tool & dock.generated
        assert partial.any()  # and cut mid-generation
    finally:
        envs.close()
    dock.clear()
    dock = TransferDock.restore(*dock.snapshot(), "a snapshot in memory")  # as after a restart: new dock, new envs (rebuilt by replay)
    gate.set()
    envs = EnvPool(lambda: Echo(gate), 5.0, 8)
    try:
        _, second = run(dock, cut_cfg, rollout_manager, envs, tokenizer, drain=True)
    finally:
        envs.close()
    got.update(trajectories(dock))
    assert second.rebuilds >= 1
    assert got == want  # token for token, mask for mask, the same turns


class Failing:
    """Call 1 raises, call 2 hangs, call 3 answers with 1000 characters."""

    def __init__(self):
        self.calls = 0

    async def reset(self, sample):
        return ""

    async def step(self, action):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("boom")
        if self.calls == 2:
            await asyncio.sleep(30)
        return StepResult("9" * 1000)


def test_tool_errors_timeouts_and_huge_outputs_never_fail_the_run(rollout_manager, varied_model_dir):
    tokenizer = load_tokenizer(varied_model_dir)
    rollout = cfg(global_batch_size=4, max_split=1, mode="async", max_tokens=150, max_model_len=170,
                  tool_timeout_s=0.3, max_tool_output_tokens=40, max_turns=8)
    dock, envs = loaded(rollout), EnvPool(Failing, 0.3, 16)
    try:
        _, tools = run(dock, rollout, rollout_manager, envs, tokenizer, drain=True)
    finally:
        envs.close()
    assert tools.errors >= 1 and tools.calls >= 1
    for (tokens, mask, turns) in trajectories(dock).values():
        segments, current = [], []
        for token, m in zip(tokens, mask):
            if m == 0:
                current.append(token)
            elif current:
                segments, current = segments + [tokenizer.decode(current)], []
        segments += [tokenizer.decode(current)] if current else []
        expected = [tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) for text in (  # the char vocab
            "error: RuntimeError: boom", "error: tool timed out after 0.3 s", "9" * 27 + " ...truncated")]  # has no A-Z
        assert all(s == e or e.startswith(s) for s, e in zip(segments, expected)), segments  # (the budget may cut)
    ended_cfg = cfg(global_batch_size=4, max_split=1, mode="async", on_tool_error="end")
    dock, envs = loaded(ended_cfg), EnvPool(Failing, 0.3, 16, on_error="end")
    try:
        _, ended_tools = run(dock, ended_cfg, rollout_manager, envs, tokenizer, drain=True)
    finally:
        envs.close()
    ended = trajectories(dock)
    called = {key: tokens for key, (tokens, mask, turns) in ended.items() if turns == 1}
    # every row's env fails its first call (one env per row), so each call made is an error that ends its episode
    assert len(called) >= len(ended) // 2 and ended_tools.calls == ended_tools.errors == len(called), \
        (len(called), len(ended), ended_tools)
    for tokens, mask, turns in ended.values():
        assert all(mask) and turns <= 1  # the episode ended at the failing call, nothing appended
    for tokens in called.values():  # and it ended right there: its last token completed the tool call's stop
        text, before = tokenizer.decode(tokens), tokenizer.decode(tokens[:-1])
        assert any(s in text for s in STOPS) and not any(s in before for s in STOPS), text


def custom_multi_turn_rollout(args, rollout_id, data_source, evaluation=False):
    """slime's signature, its own multi-turn loop: generate, append a tool answer (loss mask 0), generate again."""
    tool = data_source.tokenizer.encode(" 42 ", add_special_tokens=False)
    groups = []
    for g in range(args.rollout.global_batch_size):
        samples = [Sample(group_index=g, index=g * 2 + i, prompt_tokens=[14, 44, 11, 41 + g], label="x")
                   for i in range(2)]
        for turn in range(2):
            params = {"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True}
            answers = data_source.fleet.generate([GenerateJob(GenerateRequest(
                input_ids=s.tokens, return_logprob=True, sampling_params=params)) for s in samples])
            for s, a in zip(samples, answers):
                s.append_segment(a.output_ids, a.meta_info.logprobs, 0)
                if turn == 0:
                    s.append_segment(tool, [0.0] * len(tool), 0, loss_mask=[0] * len(tool))
        groups.append(samples)
    return groups


def test_custom_rollout_functions_keep_their_own_loss_mask(rollout_manager, varied_model_dir):
    from spillover.rollout.context import RolloutContext
    from spillover.rollout.controller import RolloutController

    run_cfg = build_config({"rollout": {"rollout_function_path": "test_multi_turn.custom_multi_turn_rollout",
                                        "global_batch_size": 2, "n_samples_per_prompt": 2},
                            "grpo": {"micro_batch_size": 4}})
    context = RolloutContext(dock=None, fleet=rollout_manager, tokenizer=load_tokenizer(varied_model_dir),
                             prompts=None, cursor=None, stop_token_ids=(EOS,), reward_fn=None)
    batch = RolloutController(run_cfg).generate(0, context).batch
    assert batch.response_lengths.tolist() == [10] * 4
    assert batch.loss_mask.tolist() == ([1] * 3 + [0] * 4 + [1] * 3) * 4
    assert batch.loss_tokens.tolist() == [6] * 4
