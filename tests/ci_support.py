"""Skips that must not hide a broken CI install.

CI (``.ci/run``, with ``CI=true`` in its environment, as every CI service sets it) installs
every optional test dependency (``.[test,serve,bench]``) and Debian's chromium: there a missing
package is a broken install, and a skip would turn it into a green run that tested nothing.
Locally (no ``CI``) the same tests skip, so a partial venv still runs the rest."""
from __future__ import annotations

import os
from types import ModuleType

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def skip_unless_ci(reason: str) -> None:
    """pytest.skip(reason) locally; in CI, fail with it."""
    if in_ci():
        pytest.fail(f"{reason} (CI installs it: a skip here would hide a broken install)",
                    pytrace=False)
    pytest.skip(reason)


def importorskip(name: str) -> ModuleType:
    """pytest.importorskip(name) locally; in CI, a missing or broken package fails the test."""
    if in_ci():
        try:
            return __import__(name, fromlist=["_"])
        except ImportError as e:
            pytest.fail(f"{name} does not import in CI, where it is installed: {e}", pytrace=False)
    return pytest.importorskip(name)
