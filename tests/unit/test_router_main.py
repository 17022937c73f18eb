"""rollout/fleet/router_main.py: the router starts from the router's own argument classes without importing SGLang."""
import subprocess
import sys

from spillover.rollout.fleet.router_main import parse_router_args


def test_the_launch_flags_parse_as_the_routers_own_arguments():
    args = parse_router_args(["--host", "127.0.0.1", "--port", "30001", "--policy", "round_robin",
                              "--prometheus-host", "127.0.0.1", "--prometheus-port", "30002",
                              "--request-timeout-secs", "3600", "--log-level", "warn",
                              "--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2"])
    assert (args.host, args.port, args.policy, args.prometheus_port) == ("127.0.0.1", 30001, "round_robin", 30002)
    assert args.worker_urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"] and args.request_timeout_secs == 3600


def test_starting_the_router_imports_no_sglang():
    """sglang_router.launch_router imports all of SGLang where it is installed (as here, for tests/contract)."""
    code = "import sys, spillover.rollout.fleet.router_main; print(sorted(m for m in sys.modules if m.startswith('sglang.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]
