import os
import sys

# mlx_train must be imported before mlx.core so that the optimized BLAS is loaded first.
import mlx_train  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.join(ROOT, "tests") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
