"""Skips that must not hide a broken CI install.

CI (``.ci/run``, with ``CI=true`` in its environment, as every CI service sets it) installs
Debian's chromium beside the Python packages: there a missing one is a broken install, and a
skip would turn it into a green run that tested nothing. Locally (no ``CI``) the same tests
skip. Python packages of the ``test`` extra are imported plainly: a missing one fails."""
from __future__ import annotations

import os
import socket

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def skip_unless_ci(reason: str) -> None:
    """pytest.skip(reason) locally; in CI, fail with it."""
    if in_ci():
        pytest.fail(f"{reason} (CI installs it: a skip here would hide a broken install)",
                    pytrace=False)
    pytest.skip(reason)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
