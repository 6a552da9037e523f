"""Fused per-sample clipping + noise: privleak against Opacus and plain torch, in one run.

    python bench/bench_clip.py [--batches 64 256] [--params 100000 1000000 10000000] [--max-gb 4]
                               [--device cpu|cuda]

Each case has 4 parameter tensors holding P values in all, fp32 per-sample gradients (B x P),
clip norm 1, noise multiplier 1. Opacus is its DPOptimizer's clip_and_accumulate + add_noise +
scale_grad; plain torch is the same math written directly. All three read the per-sample
gradients twice (norms, then the clipped sum). "grads GB/s" counts the gradients once; "of copy
bw" is the two reads over the copy bandwidth (read + write) measured in this run: a memcpy on as
many threads as privleak's on the CPU, a device copy on a GPU. On the CPU privleak's second read
of short rows comes from cache, so that fraction can pass 100%. "reads GB/s" is privleak's two
reads per second; "2x opacus needs" is the rate at which a kernel twice as fast as Opacus would
have to read the gradients twice, to set against the read bandwidth of a large torch sum printed
above the table (rows too long for the cache must be read twice from memory: a clip factor
depends on its whole row). The sides are timed in turns (three rounds of three calls,
after a warm-up) and each reports its median round. "L1 ms" is privleak clipping the same
gradients in the L1 norm (norm_type=1, Laplace DP-SGD), timed in the same turns: neither Opacus
nor the torch line clips in L1.
"""
from __future__ import annotations

import argparse

import privleak
import torch
from _measure import copy_bandwidth, cuda_copy_bandwidth, read_bandwidth, seconds_interleaved, table
from opacus.optimizers import DPOptimizer
from privleak.dpsgd.clip import clip_and_accumulate

CLIP, SIGMA = 1.0, 1.0


def split(total: int) -> list[int]:
    sizes = [total // 2, total // 4, total // 8]
    return sizes + [total - sum(sizes)]


def opacus_runner(grads: list[torch.Tensor], batch: int):
    params = [torch.nn.Parameter(torch.zeros(g.shape[1:], device=g.device)) for g in grads]
    optimizer = DPOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=SIGMA, max_grad_norm=CLIP,
                            expected_batch_size=batch)

    def run():
        for p, g in zip(params, grads):
            g.__dict__.pop("_processed", None)  # Opacus marks a grad_sample as used
            p.grad_sample, p.summed_grad, p.grad = g, None, None
        optimizer.clip_and_accumulate()
        optimizer.add_noise()
        optimizer.scale_grad()

    return run


def torch_clip(grads: list[torch.Tensor], batch: int):
    norms = torch.stack([g.reshape(batch, -1).norm(dim=1) for g in grads], dim=1).norm(dim=1)
    factors = (CLIP / (norms + 1e-6)).clamp(max=1.0)
    return [(torch.einsum("i,i...", factors, g) + torch.normal(0.0, CLIP * SIGMA, g.shape[1:], device=g.device)) / batch
            for g in grads]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--params", type=int, nargs="+", default=[10**5, 10**6, 10**7])
    parser.add_argument("--max-gb", type=float, default=4.0, help="skip cases whose per-sample gradients exceed this")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    device = args.device
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    bandwidth = cuda_copy_bandwidth() if device == "cuda" else copy_bandwidth(threads=privleak.num_threads())
    reading = read_bandwidth(threads=privleak.num_threads(), device=device)
    where = (torch.cuda.get_device_name() if device == "cuda" else
             f"{privleak.num_threads()} privleak threads, {torch.get_num_threads()} torch threads")
    print(f"privleak {privleak.__version__}, torch {torch.__version__}, {where}; "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write), "
          f"read bandwidth {reading / 1e9:.1f} GB/s (torch sum)\n")
    def measure(batch: int, total: int) -> dict:
        """One (B, P) setting, timed on the three sides; its gradients are freed on return."""
        nbytes = batch * total * 4
        grads = [torch.randn(batch, n, device=device) for n in split(total)]
        times = seconds_interleaved({
            "privleak": lambda: clip_and_accumulate(grads, CLIP, noise_std=CLIP * SIGMA, key=1, batch_size=batch),
            "privleak L1": lambda: clip_and_accumulate(grads, CLIP, noise_std=CLIP * SIGMA, key=1, batch_size=batch,
                                                       norm_type=1),
            "opacus": opacus_runner(grads, batch),
            "torch": lambda: torch_clip(grads, batch),
        }, sync=sync)
        t_ours, t_opacus, t_torch = times["privleak"], times["opacus"], times["torch"]
        return {
            "B": batch, "P": f"{total:.0e}", "privleak ms": f"{t_ours * 1e3:.1f}",
            "opacus ms": f"{t_opacus * 1e3:.1f}", "torch ms": f"{t_torch * 1e3:.1f}",
            "L1 ms": f"{times['privleak L1'] * 1e3:.1f}",
            "vs opacus": f"{t_opacus / t_ours:.2f}x", "vs torch": f"{t_torch / t_ours:.2f}x",
            "grads GB/s": f"{nbytes / t_ours / 1e9:.1f}", "of copy bw": f"{2 * nbytes / t_ours / bandwidth:.0%}",
            "reads GB/s": f"{2 * nbytes / t_ours / 1e9:.1f}", "2x opacus needs": f"{4 * nbytes / t_opacus / 1e9:.1f}",
        }

    rows = []
    for batch in args.batches:
        for total in args.params:
            nbytes = batch * total * 4
            if nbytes > args.max_gb * 1e9:
                print(f"skipped B={batch}, P={total:.0e}: {nbytes / 1e9:.1f} GB of per-sample gradients > --max-gb")
                continue
            rows.append(measure(batch, total))
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
