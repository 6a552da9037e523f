"""Column max/argmax/min/sum: privleak against numpy (and torch), in one run.

    python bench/bench_column_stats.py [--sizes 1000 4096 10000]

numpy needs four calls (max, argmax, min, sum) where privleak makes one pass; the numpy max alone
is shown as the floor of any numpy approach. Bandwidth is the matrix bytes read per second, and
its fraction is taken of this machine's copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse

import numpy as np
import privleak
from _measure import copy_bandwidth, seconds, table


def numpy_stats(m):
    return m.max(axis=0), m.argmax(axis=0), m.min(axis=0), m.sum(axis=0, dtype=np.float64)


def torch_stats(t):
    import torch

    values, indices = torch.max(t, dim=0)
    return values, indices, torch.amin(t, dim=0), torch.sum(t, dim=0, dtype=torch.float64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 4096, 10000])
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        torch = None

    bandwidth = copy_bandwidth()
    print(f"privleak {privleak.__version__}, {privleak.num_threads()} threads; "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)\n")
    rows = []
    rng = np.random.default_rng(0)
    for n in args.sizes:
        for dtype in (np.float32, np.float64):
            m = rng.random((n, n)).astype(dtype)
            t_ours = seconds(lambda: privleak.column_stats(m))
            t_numpy = seconds(lambda: numpy_stats(m))
            t_numpy_max = seconds(lambda: m.max(axis=0))
            row = {
                "n x n": f"{n}x{n}", "dtype": np.dtype(dtype).name,
                "privleak ms": f"{t_ours * 1e3:.2f}", "numpy ms": f"{t_numpy * 1e3:.2f}",
                "vs numpy": f"{t_numpy / t_ours:.1f}x", "vs numpy max only": f"{t_numpy_max / t_ours:.2f}x",
                "GB/s": f"{m.nbytes / t_ours / 1e9:.1f}", "of copy bw": f"{m.nbytes / t_ours / bandwidth:.0%}",
            }
            if torch is not None:
                tm = torch.from_numpy(m)
                row["vs torch"] = f"{seconds(lambda: torch_stats(tm)) / t_ours:.1f}x"
                if torch.cuda.is_available() and privleak.info()["cuda_usable"]:
                    g = tm.cuda()
                    sync = torch.cuda.synchronize
                    t_gpu = seconds(lambda: privleak.column_stats(g), sync=sync)
                    row["cuda ms"] = f"{t_gpu * 1e3:.3f}"
                    row["cuda GB/s"] = f"{m.nbytes / t_gpu / 1e9:.0f}"
                    row["cuda vs torch"] = f"{seconds(lambda: torch_stats(g), sync=sync) / t_gpu:.1f}x"
            rows.append(row)
    print(table(rows, list(dict.fromkeys(k for r in rows for k in r))))


if __name__ == "__main__":
    main()
