"""Small arithmetic every layer of the package uses (base layer: stdlib only)."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers without a float round trip (exact for any size)."""
    return -(-a // b)
