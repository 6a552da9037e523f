"""Bayes capacity and LDP epsilon of random channels: privleak against numpy and qif, in one run.

    python bench/bench_channels.py [--sizes 500 1000 2000 4000 8000] [--qif-ldp-max 1000]

privleak checks its input (entries finite and non-negative, rows summing to 1) and then reads
the column maxima (and minima) with the column_stats kernel: two passes over the matrix, the
kernel's and a matrix-vector product for the row sums. Two numpy baselines are timed: the bare
formula (C.max(0).sum(), one pass, no checks) and the same formula with the same checks.
qif (pip install qif) is the QIF library users reach for: qif.measure.bayes_vuln.mult_capacity
and qif.measure.d_privacy.smallest_epsilon with the discrete metric. The latter compares every
pair of rows (n^2 m work), so it is timed only up to --qif-ldp-max secrets, once per size, and
shown as "not run" above. Bandwidth is matrix bytes per second of one call, as a fraction of
this machine's copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import math

import numpy as np
import privleak
from _measure import copy_bandwidth, seconds, table
from privleak import channels


def numpy_capacity(c):
    return c.max(axis=0).sum()


def numpy_ldp(c):
    return np.log(c.max(axis=0) / c.min(axis=0)).max()


def numpy_checked(formula, tolerance):
    """numpy with the checks privleak makes: finite, non-negative, rows sum to 1."""
    def run(c):
        if not (np.isfinite(c.max()) and c.min() >= 0 and np.abs(c.sum(axis=1) - 1).max() <= tolerance):
            raise ValueError("not a channel")
        return formula(c)
    return run


def ms(t: float) -> str:
    return f"{t * 1e3:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 1000, 2000, 4000, 8000])
    parser.add_argument("--qif-ldp-max", type=int, default=1000,
                        help="largest n for which qif's smallest_epsilon is timed (it takes minutes beyond)")
    args = parser.parse_args()
    try:
        import qif
    except ImportError:
        qif = None
        print("qif is not installed (pip install qif): its columns stay empty\n")

    bandwidth = copy_bandwidth()
    print(f"privleak {privleak.__version__}, {privleak.num_threads()} threads; "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)\n")
    rng = np.random.default_rng(0)
    capacity_rows, ldp_rows = [], []
    for n in args.sizes:
        for dtype in (np.float32, np.float64):
            c = rng.random((n, n)).astype(dtype)
            c /= c.sum(axis=1, keepdims=True)
            tolerance = channels.ROW_SUM_TOLERANCE[np.dtype(dtype)]
            assert math.isclose(channels.bayes_capacity(c), numpy_capacity(c), rel_tol=1e-5)
            assert math.isclose(channels.ldp_epsilon(c), numpy_ldp(c), rel_tol=1e-5)
            size = {"n x n": f"{n}x{n}", "dtype": np.dtype(dtype).name}

            ours = seconds(lambda: channels.bayes_capacity(c))
            bare = seconds(lambda: numpy_capacity(c))
            checked = seconds(lambda: numpy_checked(numpy_capacity, tolerance)(c))
            row = {**size, "privleak ms": ms(ours), "numpy ms": ms(bare), "vs numpy": f"{bare / ours:.2f}x",
                   "numpy+checks ms": ms(checked), "vs numpy+checks": f"{checked / ours:.2f}x",
                   "GB/s": f"{c.nbytes / ours / 1e9:.1f}", "of copy bw": f"{c.nbytes / ours / bandwidth:.0%}"}
            if qif is not None and dtype == np.float64:
                theirs = seconds(lambda: qif.measure.bayes_vuln.mult_capacity(c), repeat=3)
                row |= {"qif ms": ms(theirs), "vs qif": f"{theirs / ours:.1f}x"}
            capacity_rows.append(row)

            ours = seconds(lambda: channels.ldp_epsilon(c))
            bare = seconds(lambda: numpy_ldp(c))
            checked = seconds(lambda: numpy_checked(numpy_ldp, tolerance)(c))
            row = {**size, "privleak ms": ms(ours), "numpy ms": ms(bare), "vs numpy": f"{bare / ours:.2f}x",
                   "numpy+checks ms": ms(checked), "vs numpy+checks": f"{checked / ours:.2f}x"}
            if qif is not None and dtype == np.float64:
                if n <= args.qif_ldp_max:
                    theirs = seconds(lambda: qif.measure.d_privacy.smallest_epsilon(c, qif.metric.discrete()), repeat=1)
                    row |= {"qif ms": ms(theirs), "vs qif": f"{theirs / ours:.0f}x"}
                else:
                    row |= {"qif ms": "not run", "vs qif": ""}
            ldp_rows.append(row)

    columns = ["n x n", "dtype", "privleak ms", "numpy ms", "vs numpy", "numpy+checks ms", "vs numpy+checks"]
    print("Bayes capacity (sum of column maxima)")
    print(table(capacity_rows, columns + ["GB/s", "of copy bw", "qif ms", "vs qif"]))
    print("\nLDP epsilon (max over columns of log(max / min))")
    print(table(ldp_rows, columns + ["qif ms", "vs qif"]))
    print("\nratios above 1 mean privleak is faster; qif takes float64 only, and its smallest_epsilon "
          f"is timed once per size up to n = {args.qif_ldp_max}")


if __name__ == "__main__":
    main()
