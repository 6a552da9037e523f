"""Sup over inputs (nearest input): privleak.nearest against chunked torch and faiss-cpu, in one run.

    python bench/bench_nearest.py [--sizes 10000 100000] [--dims 64 256 1024] [--metrics ...]
    OMP_NUM_THREADS=1 PRIVLEAK_CPU_CAPABILITY=avx2 python bench/bench_nearest.py --threads 1 --sizes 4000

For each size N and dimension p, the same float32 data (N queries, N inputs, standard normal) go
to every library; each returns, for every query, the best input's index:

- privleak.nearest: the fused kernel (the score matrix is never formed);
- torch: queries in chunks, scores by matmul (inner product), addmm with the inputs' squared
  norms (||x||^2 - 2 <x, y>, squared L2) or cdist (L1), then max/min over the chunk's rows;
- faiss-cpu: brute-force IndexFlatIP / IndexFlatL2 / IndexFlat(METRIC_L1), search with k = 1.

GFLOP/s count 2p operations per (query, input) pair for the inner product and squared L2 (one
multiply-add per coordinate, as for GEMM) and 3p for L1 (subtract, absolute value, add). The
fraction is of this machine's sgemm rate, the better of numpy's and torch's float32 matmul on
4096 x 4096 matrices, timed in the same rounds as the libraries ("of torch sgemm": torch's alone).
The header names the CPU and privleak's CPU path (privleak.info()["cpu_capability"]: "avx512",
"avx2" or "default"; PRIVLEAK_CPU_CAPABILITY picks a lower one), and each row repeats the path.
On a GPU the same is done with CUDA tensors (fp32 and TF32 paths, against torch on the GPU) and
the fraction is of the card's peak.
Each timing is the best of --repeat runs (more for short ones, fewer past 30 s), the libraries
and sgemm taking turns, after a warm-up on a slice of the queries (the machine may be shared:
the best run is the least disturbed).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

# Three OpenMP runtimes share this process (privleak's, torch's, and the copy faiss bundles). By
# default each keeps its idle threads spinning for a while after a parallel region, taking the
# cores from whichever library runs next: on a 2-core machine that slows the next one several
# times over. Passive waiting, set before any runtime starts, lets each run on idle cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import privleak  # noqa: E402
from _measure import cpu_name, table  # noqa: E402

METRIC_NAMES = {"inner_product": "max <x,y>", "squared_l2": "min |x-y|^2", "l1": "min |x-y|_1"}
FLOPS_PER_COORDINATE = {"inner_product": 2, "squared_l2": 2, "l1": 3}
CHUNK_ELEMENTS = 2**24  # torch: scores of at most this many pairs at a time (64 MiB)
SGEMM_SIDE = 4096
# Dense peaks (TFLOP/s, FP32 and TF32 tensor cores) of common cards, from NVIDIA's data sheets,
# as (words in torch's device name, fp32, tf32); the first match wins, so "A100" precedes "A10"
# and the H100 PCIe and NVL precede the SXM (named "H100 80GB HBM3").
GPU_PEAKS = [("H100 PCIe", 51.2, 378.0), ("H100 NVL", 60.0, 417.5), ("H100", 67.0, 494.7), ("H200", 67.0, 494.7),
             ("A100", 19.5, 156.0), ("L40S", 91.6, 183.0), ("A10", 31.2, 62.5), ("L4", 30.3, 60.0)]


def best_times(runs: dict, warm_ups: dict, repeat: int, sync=lambda: None, min_seconds: float = 2.0,
               max_seconds: float = 30.0) -> tuple[dict, dict]:
    """Best wall time and last result of each of `runs`, after one call of its warm-up. The runs
    take turns, round by round, so that all meet the same load (this machine may be shared; the
    best run is the least disturbed one). Each run goes `repeat` times, more while it has run
    less than `min_seconds` in all (at most 20 times), and stops once it has run `max_seconds`."""
    for warm_up in warm_ups.values():
        warm_up()
    sync()
    best = {name: float("inf") for name in runs}
    results = {}
    spent = {name: 0.0 for name in runs}
    count = {name: 0 for name in runs}

    def wants_more(name):
        if count[name] > 0 and spent[name] >= max_seconds:
            return False
        return count[name] < repeat or (count[name] < 20 and spent[name] < min_seconds)

    while any(wants_more(name) for name in runs):
        for name, run in runs.items():
            if wants_more(name):
                start = time.perf_counter()
                results[name] = run()
                sync()
                elapsed = time.perf_counter() - start
                best[name] = min(best[name], elapsed)
                spent[name] += elapsed
                count[name] += 1
    return best, results


def sgemm_runs(torch) -> dict:
    """float32 matmul on 4096 x 4096 matrices by numpy and torch: the machine's sgemm rate is the
    better of the two, timed in the same rounds as the libraries."""
    a = np.random.default_rng(0).standard_normal((SGEMM_SIDE, SGEMM_SIDE)).astype(np.float32)
    runs = {"sgemm numpy": lambda: a @ a}
    if torch is not None:
        t = torch.from_numpy(a)
        runs["sgemm torch"] = lambda: t @ t
    return runs


def torch_nearest(torch, queries, inputs, metric):
    """Chunked torch: the reference of what people write today."""
    chunk = max(1, CHUNK_ELEMENTS // inputs.shape[0])
    input_norms = (inputs * inputs).sum(dim=1) if metric == "squared_l2" else None
    indices = []
    for start in range(0, queries.shape[0], chunk):
        block = queries[start:start + chunk]
        if metric == "inner_product":
            indices.append((block @ inputs.T).argmax(dim=1))
        elif metric == "squared_l2":
            indices.append(torch.addmm(input_norms, block, inputs.T, beta=1, alpha=-2).argmin(dim=1))
        else:
            indices.append(torch.cdist(block, inputs, p=1).argmin(dim=1))
    return torch.cat(indices)


def faiss_index(faiss, inputs, metric):
    d = inputs.shape[1]
    index = {"inner_product": lambda: faiss.IndexFlatIP(d), "squared_l2": lambda: faiss.IndexFlatL2(d),
             "l1": lambda: faiss.IndexFlat(d, faiss.METRIC_L1)}[metric]()
    index.add(inputs)
    return index


def gpu_peaks(torch):
    name = torch.cuda.get_device_name()
    for words, fp32, tf32 in GPU_PEAKS:
        if all(word in name for word in words.split()):
            return name, (fp32, tf32)
    return name, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000], help="N = number of queries = inputs")
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--metrics", nargs="+", default=list(METRIC_NAMES), choices=list(METRIC_NAMES))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=privleak.num_threads())
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        torch = None
    try:
        import faiss
    except ImportError:
        faiss = None

    privleak.set_num_threads(args.threads)
    if torch is not None:
        torch.set_num_threads(args.threads)
    if faiss is not None:
        faiss.omp_set_num_threads(args.threads)
    sgemm = sgemm_runs(torch)
    path = privleak.info()["cpu_capability"]
    print(f"privleak {privleak.__version__}, {args.threads} threads, CPU path {path}; CPU {cpu_name()}")
    print(f"torch {torch.__version__ if torch else 'not installed'}, "
          f"faiss {faiss.__version__ if faiss else 'not installed'}\n")
    cuda = torch is not None and torch.cuda.is_available() and privleak.info()["cuda_usable"]

    rows, gpu_rows = [], []
    rng = np.random.default_rng(0)
    for n in args.sizes:
        for p in args.dims:
            queries = rng.standard_normal((n, p), dtype=np.float32)
            inputs = rng.standard_normal((n, p), dtype=np.float32)
            few = queries[:256]
            for metric in args.metrics:
                flops = FLOPS_PER_COORDINATE[metric] * n * n * p
                # Each run returns its best inputs' indices, to check that the libraries agree.
                runs = {"privleak": lambda: privleak.nearest(queries, inputs, metric).index, **sgemm}
                warm_ups = {"privleak": lambda: privleak.nearest(few, inputs, metric)}
                if torch is not None:
                    tq, tx = torch.from_numpy(queries), torch.from_numpy(inputs)
                    runs["torch"] = lambda: torch_nearest(torch, tq, tx, metric).numpy()
                    warm_ups["torch"] = lambda: torch_nearest(torch, tq[:256], tx, metric)
                if faiss is not None:
                    index = faiss_index(faiss, inputs, metric)
                    runs["faiss"] = lambda: index.search(queries, 1)[1][:, 0]
                    warm_ups["faiss"] = lambda: index.search(few, 1)
                seconds, indices = best_times(runs, warm_ups, args.repeat)
                t_ours = seconds["privleak"]
                sgemm_rate = 2 * SGEMM_SIDE**3 / min(seconds[name] for name in sgemm)
                row = {"metric": METRIC_NAMES[metric], "N": n, "p": p, "path": path, "privleak s": f"{t_ours:.3f}",
                       "GFLOP/s": f"{flops / t_ours / 1e9:.1f}", "sgemm GFLOP/s": f"{sgemm_rate / 1e9:.1f}",
                       "of sgemm": f"{flops / t_ours / sgemm_rate:.0%}"}
                if "sgemm torch" in seconds:
                    torch_rate = 2 * SGEMM_SIDE**3 / seconds["sgemm torch"]
                    row["of torch sgemm"] = f"{flops / t_ours / torch_rate:.0%}"
                for name in ("torch", "faiss"):
                    if name in runs:
                        row.update({f"{name} s": f"{seconds[name]:.3f}", f"vs {name}": f"{seconds[name] / t_ours:.2f}x",
                                    f"same as {name}": f"{(indices[name] == indices['privleak']).mean():.2%}"})
                rows.append(row)
                print("  ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr, flush=True)
                if cuda:
                    gpu_rows += gpu_measurements(torch, queries, inputs, metric, flops, args.repeat)
    print("\n" + table(rows, list(dict.fromkeys(k for r in rows for k in r))))
    if gpu_rows:
        name, peaks = gpu_peaks(torch)
        print(f"\nGPU: {name}; peak FP32 / TF32 {peaks if peaks else 'unknown (not in GPU_PEAKS)'} TFLOP/s")
        print(table(gpu_rows, list(dict.fromkeys(k for r in gpu_rows for k in r))))


def gpu_measurements(torch, queries, inputs, metric, flops, repeat):
    _, peaks = gpu_peaks(torch)
    gq, gx = torch.from_numpy(queries).cuda(), torch.from_numpy(inputs).cuda()
    rows = []
    for tensor_cores in ([False, True] if metric != "l1" else [False]):
        torch.backends.cuda.matmul.allow_tf32 = tensor_cores
        seconds, _ = best_times(
            {"privleak": lambda: privleak.nearest(gq, gx, metric, tensor_cores=tensor_cores),
             "torch": lambda: torch_nearest(torch, gq, gx, metric)},
            {"privleak": lambda: privleak.nearest(gq[:256], gx, metric, tensor_cores=tensor_cores),
             "torch": lambda: torch_nearest(torch, gq[:256], gx, metric)}, repeat, torch.cuda.synchronize)
        rate = flops / seconds["privleak"]
        peak = None if peaks is None else peaks[1 if tensor_cores else 0] * 1e12
        rows.append({"metric": METRIC_NAMES[metric], "N": len(queries), "p": queries.shape[1],
                     "path": "tf32" if tensor_cores else "fp32", "privleak ms": f"{seconds['privleak'] * 1e3:.2f}",
                     "TFLOP/s": f"{rate / 1e12:.1f}", "of peak": f"{rate / peak:.0%}" if peak else "?",
                     "torch ms": f"{seconds['torch'] * 1e3:.2f}",
                     "vs torch": f"{seconds['torch'] / seconds['privleak']:.2f}x"})
    torch.backends.cuda.matmul.allow_tf32 = False
    return rows


if __name__ == "__main__":
    main()
