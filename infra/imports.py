"""Load user functions by import path ("package.module.function"), failing early with a clear message."""
from __future__ import annotations

import importlib
import inspect
from typing import Callable, Sequence


class ImportPathError(ValueError):
    """An import path that does not name a usable function; the message names the path and the setting."""


def load_function(path: str, setting: str, required_params: Sequence[str] = (),
                  keyword_params: Sequence[str] = (), optional_keywords: Sequence[str] = ()) -> Callable:
    """Import `path` and check it is a callable that can be called as
    `fn(<one positional per required_params>, <each of keyword_params>=...)`, plus each of optional_keywords
    that the function names (the caller passes those only then, e.g. a reward function's `metadata`)."""
    module_name, _, attr = (path or "").rpartition(".")
    if not module_name or not attr:
        raise ImportPathError(f"{setting}={path!r} is not an import path like 'package.module.function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportPathError(f"{setting}={path!r}: cannot import module {module_name!r} ({err})") from None
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ImportPathError(f"{setting}={path!r}: module {module_name!r} has no function {attr!r}")
    if required_params or keyword_params:
        named = _parameter_names(fn)
        _check_signature(fn, path, setting, required_params, [*keyword_params,
                                                              *(k for k in optional_keywords if k in named)])
    return fn


def _parameter_names(fn: Callable) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _check_signature(fn: Callable, path: str, setting: str, required: Sequence[str],
                     keywords: Sequence[str]) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and C functions: nothing to check
    try:  # the call the caller will make: positionals in order, then keywords by name
        sig.bind(*required, **{k: None for k in keywords})
    except TypeError as err:
        wanted = ", ".join([*required, *(f"{k}=..." for k in keywords)])
        raise ImportPathError(f"{setting}={path!r}: the function takes ({', '.join(sig.parameters)}) but must "
                              f"accept ({wanted}) ({err})") from None
