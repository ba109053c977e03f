"""tests/ci_support.py: locally a missing package skips, in CI it fails."""
from __future__ import annotations

import pytest

import ci_support


def test_missing_package_skips_locally_and_fails_in_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception):
        ci_support.importorskip("no_such_package_for_this_test")
    with pytest.raises(pytest.skip.Exception):
        ci_support.skip_unless_ci("no chromium")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no_such_package_for_this_test"):
        ci_support.importorskip("no_such_package_for_this_test")
    with pytest.raises(pytest.fail.Exception, match="no chromium"):
        ci_support.skip_unless_ci("no chromium")


def test_present_package_is_returned_in_both(monkeypatch):
    for ci in ("", "true"):
        monkeypatch.setenv("CI", ci)
        assert ci_support.importorskip("json.decoder").__name__ == "json.decoder"
