"""The multi-turn environment interface (rollout/tools/env.py), the calculator (rollout/builtin/calculator.py) and the env
pool (rollout/tools/env_pool.py): time limits, errors, truncation, replay. No engine here
(tests/integration/test_multi_turn.py drives trajectories through the real router)."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from spillover.infra.config.parsing import ConfigError
from spillover.infra.config.run_config import build_config
from spillover.infra.imports import ImportPathError
from spillover.infra.models import build_char_tokenizer
from spillover.rollout.builtin.calculator import CalculatorEnv, CalculatorError, evaluate, expression_of, make_rows, reward
from spillover.rollout.tools.env_pool import EnvPool
from spillover.rollout.stop_strings import completing_token
from spillover.rollout.tools.env import (TRUNCATION_MARKER, StepResult, guarded_call, load_env_factory,
                               observation_tokens, split_actions)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_calculator_parses_arithmetic_safely():
    assert evaluate("12*7+5") == 89 and evaluate("2*(3+4)") == 14 and evaluate("-3--2") == -1
    assert evaluate("7/2") == 3.5 and evaluate(" 1 + 2 * 3 ") == 7
    for bad, why in (("1/0", "division by zero"), ("3-", "expected a number"), ("(2", "missing"),
                     ("2+3)", "unexpected"), ("__import__('os')", "unexpected"), ("9" * 20, "too large"),
                     ("1+" * 150 + "1", "longer than")):
        with pytest.raises(CalculatorError, match=why):
            evaluate(bad)
    assert expression_of("so 12*7+5=") == "12*7+5" and expression_of("<calc>3*4</calc>") == "3*4"
    assert expression_of("ab=") == ""


def test_calculator_env_and_task():
    env = CalculatorEnv()
    assert asyncio.run(env.reset(None)) == ""
    assert asyncio.run(env.step("12*7+5=")) == StepResult("89")
    assert asyncio.run(env.step("x=")).observation == "error: no expression"
    assert asyncio.run(env.step("3-=")).observation.startswith("error: ")
    rows = make_rows(50, seed=1)
    assert all(evaluate(r["prompt"].strip()) == float(r["label"]) for r in rows) and make_rows(50, seed=1) == rows
    assert reward("12*7+5=89", "89") == 1.0 and reward("", "89") == 0.0 and 0 < reward("=88", "89") < 0.5


class Flaky:
    """reset says hello; step 1 raises, step 2 hangs, step 3 answers hugely, step 4 returns a wrong type."""

    def __init__(self):
        self.calls, self.hang_cancelled = 0, False

    async def reset(self, sample):
        return "hello"

    async def step(self, action):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("boom")
        if self.calls == 2:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.hang_cancelled = True
                raise
        if self.calls == 3:
            return StepResult("9" * 1000, done=False, reward=0.5)
        return 42


def test_guarded_calls_turn_errors_and_timeouts_into_outcomes(tok):
    env = Flaky()

    async def calls():
        return [await guarded_call(env, "reset", None, 0.2, "observe")] + [
            await guarded_call(env, "step", "a=", 0.2, "observe") for _ in range(4)]
    reset, raised, hung, huge, wrong = asyncio.run(calls())
    assert env.hang_cancelled and env.calls == 4  # the hanging step was cut at its limit, and the calls went on
    assert reset.observation == "hello" and not reset.error
    assert raised.error and raised.observation == "error: RuntimeError: boom" and not raised.done
    assert hung.error and hung.timed_out and hung.observation == "error: tool timed out after 0.2 s"
    assert not huge.error and huge.reward == 0.5
    assert wrong.error and "must return StepResult" in wrong.observation
    ended = asyncio.run(guarded_call(Flaky(), "step", "a=", 0.2, "end"))
    assert ended.error and ended.done and ended.observation == ""
    ids = observation_tokens(huge.observation, tok, cap=20)  # huge output: cut to the cap, and says so
    assert len(ids) == 20 and tok.decode(ids).endswith(TRUNCATION_MARKER) and tok.decode(ids).startswith("9")
    assert observation_tokens("84", tok, cap=12) == tok.encode("84", add_special_tokens=False)
    assert tok.decode(observation_tokens("9" * 50, tok, cap=5)) == "99999"  # a cap below the marker: just cut


def test_sync_env_methods_run_in_a_thread_under_the_limit():
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    class Blocking:
        def reset(self, sample):
            return ""

        def step(self, action):
            started.set()
            release.wait(30)  # blocks until the test has its outcome (30 s: only if the limit failed to cut it)
            finished.set()
            return StepResult("late")

    async def call():
        outcome = await guarded_call(Blocking(), "step", "x", 0.1, "observe")
        blocked_meanwhile = started.is_set() and not finished.is_set()
        release.set()  # asyncio.run waits for the thread to end
        return outcome, blocked_meanwhile

    outcome, blocked_meanwhile = asyncio.run(call())
    assert outcome.timed_out and blocked_meanwhile  # the call came back at its limit while the step still blocked
    assert outcome.observation == "error: tool timed out after 0.1 s" and finished.is_set()


def test_actions_are_split_at_tool_stops_and_across_cuts(tok):
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    tokens = enc("ab 1+2=") + enc("3") + enc("x=y=") + enc("") + enc("no call")
    mask = [1] * 7 + [0] + [1] * 4 + [1] * 7
    assert split_actions(np.array(tokens), np.array(mask), ["="], tok.decode) == ["ab 1+2=", "x=", "y="]
    # a stop string split by a cut: '=' alone is never split; a two-character one is found across the boundary
    assert completing_token(enc("1+2"), enc("+=rest"), ["=+"], tok.decode) is None
    assert completing_token(enc("1+2="), enc("+rest"), ["=+"], tok.decode) == 1


def test_completing_token_finds_what_the_engine_could_not_see(tok):
    """rollout/stop_strings.py: a string split by a cut ends at the first new token that completes it; one the
    engine saw whole in its own output is its own (None), except when it ends at the last token (an abort can return
    that token unchecked); a multi-byte string's window counts bytes."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    assert completing_token(enc("the an"), enc("swer: 4"), ["answer"], tok.decode) == 4
    assert completing_token(enc("ab"), enc("c=+ and on"), ["=+"], tok.decode) is None  # inside the output: seen
    assert completing_token(enc("ab"), enc("c=+"), ["=+"], tok.decode) == 3  # an aborted answer's last token
    assert completing_token([], enc("=+"), ["=+"], tok.decode) == 2
    assert completing_token(enc("ab"), enc("cd"), ["=+"], tok.decode) is None
    assert completing_token(enc("x"), [], ["=+"], tok.decode) is None
    # fewer tokens before the cut than the window: the string's start is among them all the same
    assert completing_token(enc("xab"), enc("cdeZZZ"), ["abcde"], tok.decode) == 3
    assert completing_token(enc("xxxxab"), enc("cdeZZZ"), ["abcde"], tok.decode) == 3
    # a string already complete before the cut (a tool call whose observation was empty) is not found again
    assert completing_token(enc("1+2=+"), enc("abc"), ["=+"], tok.decode) is None
    assert completing_token(enc("1+2=+"), enc("4=+"), ["=+"], tok.decode) == 3


def test_env_path_and_tool_settings_are_checked():
    with pytest.raises(ImportPathError, match="rollout.env_path"):
        load_env_factory("spillover.rollout.builtin.calculator.NoSuchEnv")
    with pytest.raises(ImportPathError, match="no arguments"):
        load_env_factory("spillover.rollout.builtin.calculator.evaluate")
    with pytest.raises(ConfigError, match="tool_call_stop"):
        build_config({"rollout": {"env_path": "spillover.rollout.builtin.calculator.CalculatorEnv"}})
    with pytest.raises(ConfigError, match="length_aware"):
        build_config({"rollout": {"env_path": "spillover.rollout.builtin.calculator.CalculatorEnv", "tool_call_stop": ["="],
                                  "scheduling": "length_aware"}})
    cfg = build_config({"rollout": {"env_path": "spillover.rollout.builtin.calculator.CalculatorEnv", "tool_call_stop": ["="]}})
    assert cfg.rollout.max_turns == 4 and cfg.rollout.on_tool_error == "observe"


class Counting:
    """A stateful env: each observation says how many steps it has seen (replay must restore that count)."""

    def __init__(self):
        self.steps = 0

    async def reset(self, sample):
        return ""

    async def step(self, action):
        self.steps += 1
        return StepResult(f"{action}{self.steps}")


def test_env_pool_keeps_envs_and_rebuilds_them_by_replay():
    pool = EnvPool(Counting, timeout_s=1.0, max_concurrent=2)

    async def calls() -> None:
        assert (await pool.reset((0, 0), None)).observation == ""
        assert (await pool.step((0, 0), None, None, "a", 0)).observation == "a1"
        assert (await pool.step((0, 0), None, None, "b", 0)).observation == "b2"
        pool.discard((0, 0))  # a call cut off: the env is rebuilt from the actions before it
        assert (await pool.step((0, 0), None, ["a", "b"], "c", 0)).observation == "c3" and pool.rebuilds == 1
        assert (await pool.step((1, 0), None, ["x"], "y", 0)).observation == "y2"  # never seen: a restart

    asyncio.run(calls())
    asyncio.run(pool.step((1, 0), None, None, "z", 0))  # another loop: the pool's concurrency limit follows it
    pool.keep_only({(1, 0)})
    assert not pool.has((0, 0), 3) and pool.has((1, 0), 3)
    pool.close()
    assert not pool.envs
