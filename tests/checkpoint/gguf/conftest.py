"""The GGUF tests reuse the model tests' paged runner (tests/models/paged_helpers.py)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))
