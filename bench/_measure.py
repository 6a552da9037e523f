"""Timing and machine limits shared by the benchmarks (see DESIGN.md, "Performance method")."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np


def seconds(fn: Callable[[], object], repeat: int = 5, sync: Callable[[], None] = lambda: None) -> float:
    """Median wall time of ``fn`` after one warm-up call."""
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def copy_bandwidth(nbytes: int = 512 * 2**20) -> float:
    """Bytes per second moved (read + written) by a large numpy copy: the memory limit of this machine."""
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    return 2 * src.nbytes / seconds(lambda: np.copyto(dst, src))


def table(rows: list[dict], columns: list[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    lines = ["  ".join(c.rjust(widths[c]) for c in columns)]
    lines += ["  ".join(str(r.get(c, "")).rjust(widths[c]) for c in columns) for r in rows]
    return "\n".join(lines)
