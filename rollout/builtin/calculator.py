"""The built-in tool: a calculator environment (a safe arithmetic parser, no eval), and the multi-step arithmetic
task it helps with (data.builtin_task=calculator, configs/tiny-tools.yaml).

The tool: the model writes an expression and ends the call with a tool-call stop string, e.g. "12*7+5=" (stop "=")
or "<calc>12*7+5</calc>" (stop "</calc>"); the env evaluates the last run of arithmetic characters holding a digit
(integers and decimals, + - * / and parentheses, unary minus) and answers with the value ("89"), or with an
"error: ..." observation. It keeps no state, so replaying a trajectory's actions rebuilds it exactly.

The task: prompts "12*7+5\n" (a*b+c, a+b*c, a*b-c) with the value as label; `reward` gives 1 when the last number of
the whole trajectory (tool outputs included) is the label, partial credit for a near miss. The tiny model cannot
multiply in its head; writing "12*7+5=" and stopping after the tool's "89" scores 1.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ..tools.env import StepResult

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 1e15
_RUN = re.compile(r"[0-9.+\-*/() ]+")
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d*)?|\.\d+)|(.))")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class CalculatorError(ValueError):
    """The text is no arithmetic expression the calculator can evaluate."""


def evaluate(expression: str) -> float:
    """Value of an arithmetic expression: numbers, + - * /, parentheses, unary minus (recursive descent)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    tokens = []
    for number, other in _TOKEN.findall(expression):
        if number:
            tokens.append(float(number))
        elif other.strip():
            if other not in "+-*/()":
                raise CalculatorError(f"unexpected {other!r}")
            tokens.append(other)
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def take():
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def expr() -> float:
        value = term()
        while peek() in ("+", "-"):
            value = value + term() if take() == "+" else value - term()
        return value

    def term() -> float:
        value = factor()
        while peek() in ("*", "/"):
            if take() == "*":
                value *= factor()
            else:
                divisor = factor()
                if divisor == 0:
                    raise CalculatorError("division by zero")
                value /= divisor
        return value

    def factor() -> float:
        token = peek()
        if token == "-":
            take()
            return -factor()
        if token == "(":
            take()
            value = expr()
            if peek() != ")":
                raise CalculatorError("missing )")
            take()
            return value
        if isinstance(token, float):
            return take()
        raise CalculatorError("expected a number" if token is None else f"unexpected {token!r}")

    if not tokens:
        raise CalculatorError("empty expression")
    value = expr()
    if pos != len(tokens):
        raise CalculatorError(f"unexpected {tokens[pos]!r}")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("number too large")
    return value


def format_number(value: float) -> str:
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0").rstrip(".")


def expression_of(action_text: str) -> str:
    """The last run of arithmetic characters in the action that holds a digit ("" when none)."""
    runs = [run for run in _RUN.findall(action_text) if any(c.isdigit() for c in run)]
    return runs[-1].strip() if runs else ""


class CalculatorEnv:
    """rollout.env_path=spillover.rollout.builtin.calculator.CalculatorEnv: no first observation; each step evaluates the action."""

    async def reset(self, sample) -> str:
        return ""

    async def step(self, action_text: str) -> StepResult:
        expression = expression_of(action_text)
        if not expression:
            return StepResult("error: no expression")
        try:
            return StepResult(format_number(evaluate(expression)))
        except CalculatorError as err:
            return StepResult(f"error: {err}")


# ---- the task -----------------------------------------------------------------------------------------------
FORMS = ("{a}*{b}+{c}", "{a}+{b}*{c}", "{a}*{b}-{c}")


def make_rows(count: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        form = FORMS[int(rng.integers(0, len(FORMS)))]
        a, b, c = (int(x) for x in rng.integers(2, 20, size=3))
        expression = form.format(a=a, b=b, c=c)
        rows.append({"prompt": expression + "\n", "label": format_number(evaluate(expression))})
    return rows


def generate_dataset(path: str | Path, count: int, seed: int = 0) -> Path:
    """Write `count` JSONL rows {"prompt", "label"} to `path` (kept when it already holds the same rows)."""
    p = Path(path)
    text = "".join(json.dumps(r) + "\n" for r in make_rows(count, seed))
    if not p.is_file() or p.read_text() != text:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return p


def reward(response: str, label, **_) -> float:
    """1.0 when the trajectory's last number is the label; else up to 0.5 for a near miss; 0 with no number."""
    numbers = _NUMBER.findall(response)
    if not numbers:
        return 0.0
    got, want = float(numbers[-1]), float(label)
    if got == want:
        return 1.0
    return 0.5 * max(0.0, 1.0 - abs(got - want) / max(1.0, abs(want)))
