"""Skips that must not hide a broken CI install.

CI (``.ci/run``, with ``CI=true`` in its environment, as every CI service sets it) installs
Debian's chromium beside the Python packages: there a missing one is a broken install, and a
skip would turn it into a green run that tested nothing. Locally (no ``CI``) the same tests
skip. Python packages of the ``test`` extra are imported plainly: a missing one fails."""
from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def skip_unless_ci(reason: str) -> None:
    """pytest.skip(reason) locally; in CI, fail with it."""
    if in_ci():
        pytest.fail(f"{reason} (CI installs it: a skip here would hide a broken install)",
                    pytrace=False)
    pytest.skip(reason)
