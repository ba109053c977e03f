"""The benchmarks live in the top-level benchmarks/ folder of the checkout, not in the package:
put the repository root on sys.path so ``import benchmarks`` finds them however pytest is run."""
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
