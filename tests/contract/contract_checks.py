"""Shared by the contract tests: the recorded-contract fallback and the assertion that SGLang accepted a body."""
from __future__ import annotations

import sglang_contract as recorded


class RecordedContract:
    """The oracle's interface over the recorded contract: key names only (no types, no values)."""

    version = None

    @staticmethod
    def _outcome(check, *args) -> dict:
        try:
            check(*args)
        except AssertionError as err:
            return {"ok": False, "stage": "recorded contract", "error": str(err)}
        return {"ok": True, "dropped": [], "sampling": None, "parsed": None, "fields": None}

    def generate(self, body: dict, vocab_size: int, context_len: int) -> dict:
        def check(body):
            recorded.check_payload("/generate", body)
            recorded.check_sampling_params(body.get("sampling_params") or {})
        return self._outcome(check, body)

    def route(self, cls: str, body: dict) -> dict:
        paths = [r["path"] for r in recorded.record("http_routes.json")["routes"] if r.get("request") == cls]
        assert paths, f"{cls} is the request type of no recorded route"
        return self._outcome(recorded.check_payload, paths[0], body)

    def server_args(self, argv: list[str]) -> dict:
        return self._outcome(recorded.check_server_flags, argv)


def accepted(answer: dict, what: str) -> dict:
    """Assert SGLang accepted a body; the failure names what was sent and SGLang's own words."""
    assert answer["ok"], f"SGLang 0.5.23 refuses {what} ({answer.get('stage')}): {answer.get('error')}"
    return answer
