"""rollout.overlap's config: refused outside async mode (the sync driver's rounds end with every request)."""
from __future__ import annotations

import pytest

from spillover.infra.config.rollout import RolloutConfig


def test_overlap_needs_async_mode():
    with pytest.raises(ValueError, match="rollout.overlap.*rollout.mode=async"):
        RolloutConfig(mode="sync", overlap=True)
    assert RolloutConfig(mode="async", overlap=True).overlap
