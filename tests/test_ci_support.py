"""tests/ci_support.py: locally a missing system tool skips, in CI it fails."""
from __future__ import annotations

import ci_support
import pytest


def test_missing_tool_skips_locally_and_fails_in_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception):
        ci_support.skip_unless_ci("no chromium")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no chromium"):
        ci_support.skip_unless_ci("no chromium")
