"""Gaussian and Laplace noise: privleak's counter-based ops against torch's generators, in one run.

    python bench/bench_noise.py [--sizes 1000000 10000000]

Pairs compare like with like: a new tensor (privleak.gaussian_noise vs torch.randn) and noise
written into an existing tensor (privleak add in place vs torch's normal_ / exponential_). GB/s is
output bytes written per second; its fraction is of the copy bandwidth measured in this run.
The header and every row name privleak's CPU path (privleak.info()["cpu_capability"]: avx512,
avx2 or default; PRIVLEAK_CPU_CAPABILITY=avx2 lowers it) and the header names the CPU.
"""
from __future__ import annotations

import argparse

import privleak
import torch
from _measure import copy_bandwidth, cpu_name, seconds, table
from privleak import mechanisms as M


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10**6, 10**7])
    args = parser.parse_args()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and privleak.info()["cuda_usable"] else [])
    bandwidth = copy_bandwidth()
    path = privleak.info()["cpu_capability"]
    print(f"privleak {privleak.__version__}, torch {torch.__version__}, {privleak.num_threads()} privleak threads, "
          f"{torch.get_num_threads()} torch threads; CPU path {path}; CPU {cpu_name()}; "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)\n")
    rows = []
    for device in devices:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        for n in args.sizes:
            for dtype in (torch.float32, torch.float64):
                x = torch.zeros(n, dtype=dtype, device=device)
                cases = {
                    "gaussian new": (lambda: M.gaussian_noise(n, key=1, dtype=dtype, device=device),
                                     lambda: torch.randn(n, dtype=dtype, device=device)),
                    "gaussian in place": (lambda: M.add_gaussian_noise_(x, 1.0, key=1), lambda: x.normal_()),
                    "laplace in place": (lambda: M.add_laplace_noise_(x, 1.0, key=1),
                                         lambda: x.exponential_()),  # torch has no in-place Laplace; Exp is its half
                }
                for name, (ours, theirs) in cases.items():
                    t_ours, t_torch = seconds(ours, sync=sync), seconds(theirs, sync=sync)
                    nbytes = n * x.element_size()
                    rows.append({
                        "device": device, "path": path if device == "cpu" else "", "n": f"{n:.0e}",
                        "dtype": str(dtype).removeprefix("torch."), "op": name,
                        "privleak ms": f"{t_ours * 1e3:.2f}", "torch ms": f"{t_torch * 1e3:.2f}",
                        "speed-up": f"{t_torch / t_ours:.2f}x", "GB/s": f"{nbytes / t_ours / 1e9:.1f}",
                        "of copy bw": f"{nbytes / t_ours / bandwidth:.0%}" if device == "cpu" else "",
                    })
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
