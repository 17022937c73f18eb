"""SGLang 0.5.23's own classes on CPU, imported without torchvision, for the contract tests (tests/contract).

SGLang is installed by the Makefile (pyproject extra `sglang-contract` plus `[tool.spillover]
sglang-contract-no-deps`, the latter with --no-deps: sglang pins a CUDA torch). Its config modules for multimodal
models import torchvision at module level, and torchvision must stay out of the CPU venv (installing it pulls a
CUDA torch over ours). So: ask transformers first (is_torchvision_available() is then cached False), then put an
import-only stand-in under `torchvision*` in sys.modules: names resolve, any call raises. Only ever done in the
oracle subprocess (tests/contract/sglang_oracle.py), never in the pytest process: importing SGLang also patches
transformers classes and resets the root logger (prepare_server_args calls logging.basicConfig(force=True)).

As a script (the Makefile's install rule):
    python tests/contract/sglang_env.py no-deps          prints the --no-deps requirements from pyproject.toml
    python tests/contract/sglang_env.py verify SPEC      asserts torch still satisfies SPEC and SGLang's classes import
"""
from __future__ import annotations

import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCHVISION_MODULES = ("torchvision", "torchvision.io", "torchvision.transforms", "torchvision.transforms.functional",
                       "torchvision.transforms.v2", "torchvision.transforms.v2.functional")
SGLANG_VERSION = "0.5.23"
INSTALL_HINT = ("install SGLang's classes for the contract tests with `make test` (pyproject extra sglang-contract "
                "and [tool.spillover] sglang-contract-no-deps, the latter with pip --no-deps)")


def no_deps_requirements() -> list[str]:
    """[tool.spillover] sglang-contract-no-deps of pyproject.toml."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        from pip._vendor import tomli as tomllib
    with open(ROOT / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["tool"]["spillover"]["sglang-contract-no-deps"])


class _Unavailable:
    """A torchvision name: attribute access works (module-level defaults such as InterpolationMode.BICUBIC),
    calling it raises."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is not installed (an import-only stand-in for SGLang's "
                           "contract tests)")

    def __repr__(self) -> str:
        return f"<unavailable {self._name}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self.__name__}.{attr}")


def install_torchvision_stand_in() -> None:
    """Make `import torchvision...` resolve to import-only stand-ins, after transformers has decided (and cached)
    that torchvision is absent. A stand-in keeps __spec__ None on purpose: a real spec would tell find_spec-based
    probes that torchvision exists."""
    from transformers.utils.import_utils import is_torchvision_available

    if is_torchvision_available():
        return  # the real one is there: nothing to stand in for
    for name in TORCHVISION_MODULES:
        module = _StandInModule(name)
        module.__path__ = []
        sys.modules.setdefault(name, module)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, sys.modules[name])


def import_sglang() -> types.SimpleNamespace:
    """SGLang's request and flag classes: io_struct, SamplingParams, prepare_server_args, the /generate schema gate.
    Raises ImportError naming the install step when SGLang is missing or not 0.5.23."""
    try:
        from importlib.metadata import version

        installed = version("sglang")
    except Exception as err:
        raise ImportError(f"sglang is not installed: {INSTALL_HINT}") from err
    if installed != SGLANG_VERSION:
        raise ImportError(f"sglang {installed} is installed, the contract tests check against {SGLANG_VERSION}: "
                          f"{INSTALL_HINT}")
    install_torchvision_stand_in()
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers import io_struct
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import prepare_server_args

    return types.SimpleNamespace(io_struct=io_struct, SamplingParams=SamplingParams,
                                 prepare_server_args=prepare_server_args,
                                 generate_contract_error=generate_contract_error, version=installed)


def verify(torch_spec: str) -> str:
    """The install rule's last check: torch still satisfies torch_spec (nothing SGLang brought replaced it) and
    SGLang's classes import. -> one line to print."""
    from importlib.metadata import version

    from packaging.requirements import Requirement

    torch_version = version("torch")
    if not Requirement(torch_spec).specifier.contains(torch_version.split("+")[0], prereleases=True):
        raise SystemExit(f"torch {torch_version} no longer satisfies {torch_spec}: an SGLang contract package "
                         "replaced it (install those that depend on torch with --no-deps)")
    sglang = import_sglang()
    return f"SGLang {sglang.version} contract classes import on torch {torch_version}"


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "no-deps":
        print(" ".join(no_deps_requirements()))
    elif command == "verify" and len(sys.argv) == 3:
        print(verify(sys.argv[2]))
    else:
        raise SystemExit("usage: sglang_env.py no-deps | verify TORCH_SPEC")
