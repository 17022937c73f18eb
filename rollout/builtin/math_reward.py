"""The built-in math reward: 1.0 when the response's final answer equals the label, else 0.0.

`grpo.reward_function_path=spillover.rollout.builtin.math_reward.reward`. The answer is the response's last `\\boxed{...}`
(nesting allowed), else its last number; equality is math-verify's: LaTeX and plain forms, numeric
equivalence (`\\frac{1}{2}` = `0.5` = `1/2`), percentages, units, sets and expressions (sympy). The label is
a number or a string (LaTeX with or without `$`, a boxed answer, `1,000`).

Every check runs in one worker process (`python -m spillover.rollout.builtin.math_reward --serve`) with a time limit per call (`MATH_REWARD_TIMEOUT_S`, default 5 s):
sympy can take minutes on pathological input (a tower of powers), and math-verify's own limit uses SIGALRM,
which works only on a process's main thread. A call past the limit scores 0.0 and the worker is replaced.
"""
from __future__ import annotations

import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
from typing import Any

log = logging.getLogger(__name__)
DEFAULT_TIMEOUT_S = 5.0
START_TIMEOUT_S = 120.0  # importing sympy and math-verify in a fresh process
_NUMBER = re.compile(r"^\s*-?[\d,]*\.?\d+\s*$")


def gold_text(label: Any) -> str:
    """The label as math-verify gold text: numbers and bare LaTeX go inside $...$; thousands commas go."""
    if isinstance(label, bool) or not isinstance(label, (str, int, float)):
        raise TypeError(f"a math label must be a number or a string; got {type(label).__name__} {label!r}")
    text = str(label).strip()
    if _NUMBER.match(text):
        text = text.replace(",", "")
    return text if "$" in text or "\\boxed" in text else f"${text}$"


def check_answer(response: str, label: Any) -> float:
    """1.0 when the response's boxed answer (else last number or expression) equals the label; in-process,
    no time limit (the worker calls this)."""
    from math_verify import parse, verify

    predicted = parse(response, parsing_timeout=None)
    if not predicted:
        return 0.0
    gold = parse(gold_text(label), parsing_timeout=None)
    return 1.0 if gold and verify(gold, predicted, timeout_seconds=None) else 0.0


def serve(stdin, stdout) -> None:
    """The worker (`python -m spillover.rollout.builtin.math_reward --serve`): one JSON [response, label] per input line -> one
    JSON line {"score": x} or {"error": "..."}; "ready" first; it ends when its input closes (the caller exited)."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    import math_verify  # noqa: F401  (imported before 'ready', so start-up is not charged to a call)

    stdout.write(b'"ready"\n')
    stdout.flush()
    for line in stdin:
        try:
            response, label = json.loads(line)
            out = {"score": check_answer(response, label)}
        except Exception as err:  # a label that is not a math answer: the caller raises it
            out = {"error": f"{type(err).__name__}: {err}"}
        stdout.write(json.dumps(out).encode() + b"\n")
        stdout.flush()


class MathVerifier:
    """check_answer in a worker process (a plain `python -m` subprocess: no multiprocessing, so the caller's
    __main__ is never re-imported), each call limited to `timeout_s`. Thread-safe (calls take turns)."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S):
        if timeout_s <= 0:
            raise ValueError(f"the math reward's time limit must be > 0 seconds; got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.timeouts = 0  # calls that ran past the limit (scored 0)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def _start(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "spillover.rollout.builtin.math_reward", "--serve"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE)
        if self._read_line(START_TIMEOUT_S) != "ready":
            self.close()
            raise RuntimeError(f"the math-verify worker did not start within {START_TIMEOUT_S:.0f} s")

    def _read_line(self, timeout_s: float):
        """The worker's next JSON line, or None when none came within timeout_s (or it exited)."""
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        line = self._proc.stdout.readline() if ready else b""
        return json.loads(line) if line else None

    def score(self, response: str, label: Any) -> float:
        gold_text(label)  # a bad label raises here, in the caller
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            self._proc.stdin.write(json.dumps([str(response), label]).encode() + b"\n")
            self._proc.stdin.flush()
            out = self._read_line(self.timeout_s)
            if out is None:
                self.timeouts += 1
                log.warning("math reward: a check ran past %.1f s (response %r...); scored 0", self.timeout_s,
                            str(response)[:60])
                self.close()
                return 0.0
        if "error" in out:
            raise ValueError(out["error"])
        return float(out["score"])

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=5)
            for pipe in (self._proc.stdin, self._proc.stdout):
                pipe.close()
        self._proc = None


_verifiers: dict[float, MathVerifier] = {}  # one worker per process and time limit, started on first use
_verifiers_lock = threading.Lock()


def verifier(timeout_s: float | None = None) -> MathVerifier:
    """This process's verifier for `timeout_s` (default: $MATH_REWARD_TIMEOUT_S, else 5 s)."""
    limit = float(timeout_s if timeout_s is not None else os.environ.get("MATH_REWARD_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    with _verifiers_lock:
        if limit not in _verifiers:
            _verifiers[limit] = MathVerifier(limit)
        return _verifiers[limit]


def reward(response: str, label: Any) -> float:
    """grpo.reward_function_path=spillover.rollout.builtin.math_reward.reward: 1.0 for a correct final answer, else 0.0."""
    return verifier().score(response, label)


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    protocol, sys.stdout = sys.stdout.buffer, sys.stderr  # stray prints cannot corrupt the answers
    serve(sys.stdin.buffer, protocol)
