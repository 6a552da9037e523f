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


def seconds_by_round(fns: dict[str, Callable[[], object]], rounds: int = 3, repeat: int = 3,
                     sync: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    """Each of ``fns``'s median wall time in each of ``rounds`` rounds, the sides timed in turns
    (in reverse order every other round), so that a slow spell of a shared machine, or the state
    one side leaves behind, does not fall on one side only."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name in list(fns)[::-1 if r % 2 else 1]:
            times[name].append(seconds(fns[name], repeat, sync))
    return times


def seconds_interleaved(fns: dict[str, Callable[[], object]], rounds: int = 3, repeat: int = 3,
                        sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Median wall time of each of ``fns`` over :func:`seconds_by_round`'s rounds."""
    return {name: float(np.median(t)) for name, t in seconds_by_round(fns, rounds, repeat, sync).items()}


def ratio_by_round(times: dict[str, list[float]], side: str, base: str) -> float:
    """The median over rounds of ``side``'s time over ``base``'s in the same round: on a shared
    machine whose speed drifts, steadier than the ratio of the two medians."""
    return float(np.median(np.array(times[side]) / np.array(times[base])))


def copy_bandwidth(nbytes: int = 512 * 2**20, threads: int = 1) -> float:
    """Bytes per second moved (read + written) by a large numpy copy, split over ``threads``
    threads (numpy copies without the GIL): the memory limit of this machine for that many cores."""
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    if threads == 1:
        return 2 * src.nbytes / seconds(lambda: np.copyto(dst, src))
    from concurrent.futures import ThreadPoolExecutor

    parts = list(zip(np.array_split(dst, threads), np.array_split(src, threads)))
    with ThreadPoolExecutor(threads) as pool:
        return 2 * src.nbytes / seconds(lambda: list(pool.map(lambda p: np.copyto(*p), parts)))


def read_bandwidth(nbytes: int = 2**30, threads: int = 1, device: str = "cpu") -> float:
    """Bytes per second read by torch's sum of a large float32 tensor, on ``threads`` CPU threads
    or on the current CUDA GPU: how fast a tuned reduction streams this machine's memory."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(nbytes // 4, device=device)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        return nbytes / seconds(x.sum, sync=sync)
    finally:
        torch.set_num_threads(previous)


def cuda_copy_bandwidth(nbytes: int = 512 * 2**20) -> float:
    """copy_bandwidth of a device-to-device copy on the current CUDA GPU: the card's limit."""
    import torch

    src = torch.ones(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / seconds(lambda: dst.copy_(src), sync=torch.cuda.synchronize)


def table(rows: list[dict], columns: list[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    lines = ["  ".join(c.rjust(widths[c]) for c in columns)]
    lines += ["  ".join(str(r.get(c, "")).rjust(widths[c]) for c in columns) for r in rows]
    return "\n".join(lines)


def cpu_name() -> str:
    """The CPU's model name and its family/model numbers (Linux), else what platform says."""
    import platform

    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or platform.machine()
    return f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})"
