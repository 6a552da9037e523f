"""Von Mises-Fisher sampling: privleak against scipy.stats.vonmises_fisher and a numpy
Householder implementation, in one run (1000 samples, kappa = 1000 by default).

    python bench/bench_vmf.py [--dims 1000 13700] [--samples 1000] [--kappa 1000] [--skip-scipy-above 20000]

scipy builds a p x p rotation, so its time grows like p^3; privleak and the numpy baseline are O(n p).
"""
from __future__ import annotations

import argparse

import numpy as np
import privleak
import scipy.stats
import torch
from _measure import seconds, table
from privleak import mechanisms as M


def numpy_householder_vmf(mu: np.ndarray, kappa: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """What a numpy user writes: Wood's rejection step, Gaussian tangent, Householder reflection."""
    p = mu.shape[0]
    m1 = p - 1
    b = m1 / (2 * kappa + np.sqrt(4 * kappa**2 + m1**2))
    x0 = (1 - b) / (1 + b)
    c = kappa * x0 + m1 * np.log(1 - x0**2)
    w = np.empty(0)
    while w.size < n:
        z = rng.beta(m1 / 2, m1 / 2, size=n)
        cand = (1 - (1 + b) * z) / (1 - (1 - b) * z)
        accept = kappa * cand + m1 * np.log(1 - x0 * cand) - c >= np.log(rng.random(n))
        w = np.concatenate([w, cand[accept]])
    w = w[:n]
    v = rng.standard_normal((n, m1))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    y = np.concatenate([w[:, None], np.sqrt(1 - w**2)[:, None] * v], axis=1)
    u = -mu.copy()
    u[0] += 1.0  # u = e1 - mu: the reflection maps e1 to mu
    return y - np.outer(2 * (y @ u) / (u @ u), u)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[1000, 13_700])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--kappa", type=float, default=1000.0)
    parser.add_argument("--skip-scipy-above", type=int, default=20_000)
    args = parser.parse_args()
    n, kappa = args.samples, args.kappa
    cuda = torch.cuda.is_available() and privleak.info()["cuda_usable"]
    print(f"privleak {privleak.__version__}, scipy {scipy.__version__}, {privleak.num_threads()} threads; "
          f"{n} samples, kappa = {kappa:g}\n")
    rows = []
    for p in args.dims:
        rng = np.random.default_rng(0)
        mu = rng.standard_normal(p)
        mu /= np.linalg.norm(mu)
        mu64, mu32 = torch.from_numpy(mu), torch.from_numpy(mu).float()
        t64 = seconds(lambda: M.vmf_sample(mu64, kappa, n, key=1), repeat=3)
        t32 = seconds(lambda: M.vmf_sample(mu32, kappa, n, key=1), repeat=3)
        t_numpy = seconds(lambda: numpy_householder_vmf(mu, kappa, n, rng), repeat=3)
        row = {"p": p, "privleak f64 ms": f"{t64 * 1e3:.1f}", "privleak f32 ms": f"{t32 * 1e3:.1f}",
               "numpy ms": f"{t_numpy * 1e3:.1f}", "vs numpy (f64)": f"{t_numpy / t64:.1f}x"}
        if p <= args.skip_scipy_above:
            dist = scipy.stats.vonmises_fisher(mu, kappa)
            t_scipy = seconds(lambda: dist.rvs(n, random_state=rng), repeat=1)
            row.update({"scipy ms": f"{t_scipy * 1e3:.0f}", "vs scipy (f64)": f"{t_scipy / t64:.0f}x"})
        if cuda:
            g = mu32.cuda()
            t_gpu = seconds(lambda: M.vmf_sample(g, kappa, n, key=1), sync=torch.cuda.synchronize)
            row["cuda f32 ms"] = f"{t_gpu * 1e3:.2f}"
        rows.append(row)
    print(table(rows, list(dict.fromkeys(k for r in rows for k in r))))


if __name__ == "__main__":
    main()
