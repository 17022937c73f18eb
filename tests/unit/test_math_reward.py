"""The built-in math reward (spillover.rollout.builtin.math_reward): math-verify in a worker process with a time limit per call."""
from __future__ import annotations

import psutil
import pytest

from spillover.rollout.builtin.math_reward import MathVerifier, gold_text

CASES = [  # (response, label, reward)
    (r"so the answer is \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    ("the answer is 1/2", r"\frac12", 1.0),
    ("0.5", "1/2", 1.0),
    (r"$\boxed{\boxed{3}}$", "3", 1.0),                       # nested boxes
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
    (r"\boxed{3.0}", 3, 1.0),
    (r"$\sqrt{4}$", "2", 1.0),
    ("3 apples plus 4 gives 7", 7, 1.0),                      # last number
    ("x = 5 then 6", "6", 1.0),
    ("x = 5 then 6", "5", 0.0),                               # the last number counts, not the first
    (r"\boxed{2} and later 5", "2", 1.0),                     # a boxed answer beats the last number
    ("#### 1,000", "1,000", 1.0),                             # thousands commas in label and response
    ("#### 1000", 1000, 1.0),
    ("so it is 18 dollars", "18", 1.0),
    ("5 meters", "5", 1.0),                                   # units
    (r"\boxed{5\text{ cm}}", "5", 1.0),
    ("The answer is 50%", "0.5", 1.0),                        # percentages
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),                    # expressions
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0),                    # sets
    (r"\boxed{-7}", "-7", 1.0),
    (r"\boxed{-7}", "7", 0.0),
    (r"\boxed{\pi}", "3.14159", 0.0),                         # numbers are not rounded into pi
    (r"\boxed{\frac{2}{3}}", "0.67", 0.0),
    (r"\boxed{4}", "5", 0.0),                                 # wrong
    ("the answer is 12", "13", 0.0),
    ("I do not know", "3", 0.0),                              # no answer
    ("", "3", 0.0),
    (r"\boxed{}", "3", 0.0),                                  # empty box
    (r"\boxed{\frac{1}{2}", "0.5", 1.0),                      # an unclosed box still holds the fraction
    ("12", r"$12$", 1.0),                                     # label already in $...$
    ("12", r"\boxed{12}", 1.0),                               # label already boxed
    ("ten", "10", 0.0),
]


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier(timeout_s=10.0)
    yield v
    v.close()


def test_table(verifier):
    got = [verifier.score(r, label) for r, label, _ in CASES]
    wrong = [(r, label, want, g) for (r, label, want), g in zip(CASES, got) if g != want]
    assert not wrong, wrong
    assert len(CASES) >= 30


def math_workers() -> list[psutil.Process]:
    """The math-verify worker processes this test process started (alive ones: a child that has exited and is not
    reaped yet, of this test or of another one in the session, is a zombie whose command line cannot be read)."""
    workers = []
    for child in psutil.Process().children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and \
                    "spillover.rollout.builtin.math_reward" in " ".join(child.cmdline()):
                workers.append(child)
        except psutil.Error:  # gone or a zombie between the listing and the read
            continue
    return workers


def test_pathological_input_hits_the_time_limit_and_the_worker_is_replaced():
    others = {w.pid for w in math_workers()}  # the module fixture's
    v = MathVerifier(timeout_s=1.0)
    try:
        assert v.score("warm up: 1", "1") == 1.0  # start-up is not charged to a call
        (worker,) = [w for w in math_workers() if w.pid not in others]
        assert v.score(r"\boxed{9^{9^{9^{9}}}}", "1") == 0.0  # sympy would evaluate this tower for minutes
        assert v.timeouts == 1  # scored 0 by the time limit, not by an answer
        assert not worker.is_running()  # the worker stuck on the tower was killed, not left computing
        assert v.score(r"\boxed{2}", 2) == 1.0
        assert len({w.pid for w in math_workers()} - others - {worker.pid}) == 1  # a fresh worker answered
    finally:
        v.close()


def test_bad_labels_and_limits():
    with pytest.raises(TypeError, match="a math label must be a number or a string; got list"):
        gold_text([1])
    with pytest.raises(TypeError, match="got NoneType"):
        MathVerifier().score("1", None)
    with pytest.raises(ValueError, match="time limit must be > 0"):
        MathVerifier(0)
    assert gold_text(" 1,234 ") == "$1234$" and gold_text(r"\frac12") == r"$\frac12$"
