"""Rollout functions by import path: start-up checks of path and signature, and flattening of results."""
from __future__ import annotations

import textwrap

import pytest

from spillover.infra.imports import ImportPathError
from spillover.rollout.contracts.rollout_function import RolloutResultError, flatten_rollout, load_rollout_function
from spillover.rollout.sample import Sample

USER_MODULE = """
def seed_style(args, rollout_id, data_source, evaluation=False):
    return [[rollout_id, evaluation]]

def with_kwargs(args, rollout_id, data_source, **kwargs):
    return kwargs

def no_evaluation(args, rollout_id, data_source):
    return []

def too_few(args, rollout_id):
    return []

def extra_required(args, rollout_id, data_source, tokenizer, evaluation=False):
    return []

not_callable = 3
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rollouts.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rollouts"


@pytest.mark.parametrize("name, called_with", [("seed_style", [[7, True]]), ("with_kwargs", {"evaluation": True})])
def test_fitting_functions_load_and_are_called_like_the_seed(user_module, name, called_with):
    fn = load_rollout_function(f"{user_module}.{name}", "rollout.rollout_function_path")
    assert (fn.__module__, fn.__name__) == (user_module, name)  # the user's function itself, not a stand-in
    assert fn("cfg", 7, None, evaluation=True) == called_with  # the rollout id and `evaluation` reach it


def test_the_shipped_functions_fit():
    from spillover.rollout.drivers.default_rollout import generate_rollout
    from spillover.rollout.builtin.sft import generate_sft_rollout

    for path, function in (("spillover.rollout.drivers.default_rollout.generate_rollout", generate_rollout),
                           ("spillover.rollout.builtin.sft.generate_sft_rollout", generate_sft_rollout)):
        assert load_rollout_function(path, "rollout.rollout_function_path") is function, path


@pytest.mark.parametrize("name, match", [
    ("no_evaluation", "unexpected keyword argument 'evaluation'"),
    ("too_few", "too many positional arguments"),
    ("extra_required", "missing a required argument: 'tokenizer'"),
    ("not_callable", "has no function 'not_callable'"),
    ("missing", "has no function 'missing'"),
])
def test_wrong_functions_fail_naming_setting_and_path(user_module, name, match):
    path = f"{user_module}.{name}"
    with pytest.raises(ImportPathError, match=match) as err:
        load_rollout_function(path, "rollout.eval_function_path")
    assert "rollout.eval_function_path" in str(err.value) and repr(path) in str(err.value)
    if name in ("no_evaluation", "too_few", "extra_required"):
        assert "must accept (args, rollout_id, data_source, evaluation=...)" in str(err.value)


@pytest.mark.parametrize("path, match", [
    ("no_such_module_xyz.generate", "cannot import module 'no_such_module_xyz'"),
    ("generate", "not an import path"),
    ("", "not an import path"),
])
def test_wrong_paths_fail_naming_the_path(path, match):
    with pytest.raises(ImportPathError, match=match) as err:
        load_rollout_function(path, "rollout.rollout_function_path")
    assert "rollout.rollout_function_path" in str(err.value)


def s(group, index):
    return Sample(group, index, [1, 2])


def test_groups_stay_groups():
    groups = [[s(0, 0), s(0, 1)], [s(1, 0), s(1, 1)]]
    assert flatten_rollout(groups) == groups


def test_nested_results_flatten_into_groups_in_order():
    a, b, c = [s(0, 0), s(0, 1)], [s(1, 0), s(1, 1)], [s(2, 0)]
    assert flatten_rollout([[a, b], [c]]) == [a, b, c]
    assert flatten_rollout([[[a]], [b, c]]) == [a, b, c]


def test_flat_samples_are_grouped_by_group_index():
    flat = [s(5, 0), s(3, 0), s(5, 1), s(3, 1)]
    assert flatten_rollout(flat) == [[flat[0], flat[2]], [flat[1], flat[3]]]


@pytest.mark.parametrize("bad, match", [
    (None, "returned NoneType"),
    ({"a": 1}, "returned dict"),
    ([], "empty list at result"),
    ([[s(0, 0)], []], r"empty list at result\[1\]"),
    ([[s(0, 0), [s(0, 1)]]], r"mixes samples and lists at result\[0\]"),
    ([[s(0, 0)], "x"], r"returned str at result\[1\]"),
    ([[1, 2]], r"returned int at result\[0\]\[0\]"),
])
def test_anything_else_is_refused(bad, match):
    with pytest.raises(RolloutResultError, match=match):
        flatten_rollout(bad, source="spillover.rollout.drivers.default_rollout.generate_rollout")
