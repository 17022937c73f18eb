"""The session's order and its background setup (tests/background.py), in a small pytest session of its own
(pytester): unit tests run first, then integration, then e2e, and `early` tests last; a background fixture that
fails at session start fails only the test that uses it."""
from __future__ import annotations

PLUGIN = """
import pytest

@pytest.fixture(scope="session")
def broken_background():
    raise RuntimeError("the background setup broke")

@pytest.fixture(scope="session")
def fine_background():
    return "started"
"""


def test_unit_tests_run_first_and_a_failed_background_setup_fails_only_its_test(pytester):
    pytester.makepyfile(order_probe_plugin=PLUGIN)
    pytester.syspathinsert()
    for folder, source in {
        "e2e": "def test_e2e():\n    pass\n",
        "integration": ("import pytest\n\n"
                        "@pytest.mark.early('broken_background', cpu_s=10)\n"
                        "def test_uses_broken(broken_background):\n    pass\n\n"
                        "@pytest.mark.early('fine_background')\n"
                        "def test_uses_fine(fine_background):\n    assert fine_background == 'started'\n\n"
                        "def test_integration():\n    pass\n"),
        "unit": "def test_unit():\n    pass\n",
    }.items():
        (pytester.path / folder).mkdir()
        (pytester.path / folder / f"test_{folder}_probe.py").write_text(source)
    run = pytester.inline_run("-p", "background", "-p", "order_probe_plugin", "-p", "no:cacheprovider",
                              "--import-mode=importlib")
    reports = [r for r in run.getreports("pytest_runtest_logreport") if r.when == "call" or r.failed]
    assert [r.nodeid.rsplit("::", 1)[1] for r in reports] == [
        "test_unit", "test_integration", "test_e2e", "test_uses_broken", "test_uses_fine"]
    failed = [r for r in reports if r.failed]
    assert [(r.nodeid.rsplit("::", 1)[1], r.when) for r in failed] == [("test_uses_broken", "setup")]
    assert "the background setup broke" in str(failed[0].longrepr)
    run.assertoutcome(passed=4, failed=1)
