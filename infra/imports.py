"""Load user functions by import path ("package.module.function"), failing early with a clear message."""
from __future__ import annotations

import importlib
import inspect
from typing import Callable, Sequence


class ImportPathError(ValueError):
    """An import path that does not name a usable function; the message names the path and the setting."""


def load_function(path: str, setting: str, required_params: Sequence[str] = ()) -> Callable:
    """Import `path` and check it is a callable accepting `required_params` (by name or position)."""
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
    if required_params:
        _check_signature(fn, path, setting, required_params)
    return fn


def _check_signature(fn: Callable, path: str, setting: str, required: Sequence[str]) -> None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return  # builtins and C functions: nothing to check
    kinds = [p.kind for p in params.values()]
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return
    positional = [p for p in params.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < len(required):
        names = ", ".join(params)
        raise ImportPathError(f"{setting}={path!r}: the function takes ({names}) but must accept "
                              f"({', '.join(required)})")
