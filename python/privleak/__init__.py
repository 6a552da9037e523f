"""privleak: differential-privacy noise ops and leakage metrics with a C++/CUDA core.

``import privleak`` needs neither torch nor CUDA; torch-facing modules import torch themselves.
"""
__version__ = "0.1.0"

from privleak._backend import info, num_threads, set_num_threads
from privleak.reductions import ColumnStats, Nearest, column_stats, nearest

__all__ = ["__version__", "info", "num_threads", "set_num_threads", "column_stats", "ColumnStats", "nearest", "Nearest"]
