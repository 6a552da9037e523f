"""Per-sample convolution weight gradients: privleak's kernel against Opacus's and torch's forms,
in one run.

    python bench/bench_conv_grads.py [--batch 64] [--threads 1] [--device cpu|cuda] [--quick]

Each case is one Conv2d layer of the bench's CNNs (bench_training_step.py: the paper's CNN, the
CIFAR-style CNN) with float32 inputs x (B, C, H, W) and output gradients g, standard normal.
Sides, timed in turns (three rounds of three calls after a warm-up, each side's median round):

- privleak: ``dpsgd.conv_grads.conv_weight_grads`` (an implicit GEMM per sample, no unfolded copy);
- opacus: ``opacus.grad_sample.conv.compute_conv_grad_sample``, the per-sample gradient Opacus's
  hooks use (unfold into (B, C k^2, L) patches, one einsum);
- grouped: torch's convolution weight gradient with the batch folded into B groups (what
  torch.func's vmap of a convolution does, and privleak's book-keeping before this kernel);
- floor: torch's ordinary weight gradient, summed over the batch: the same multiply-adds, a B
  times smaller output. Not a per-sample side: what a per-sample gradient can hope to cost.

Ratios are each side's time over privleak's. ``--threads`` sets privleak's and torch's CPU threads
alike. On a GPU the same runs on CUDA tensors.
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_ghost_norm.py

import privleak  # noqa: E402
import torch  # noqa: E402
from _measure import cpu_name, seconds_interleaved, table  # noqa: E402
from opacus.grad_sample.conv import compute_conv_grad_sample  # noqa: E402
from privleak.dpsgd.conv_grads import conv_weight_grads  # noqa: E402

# (name, C, H, O, kernel, stride, padding): the layers of the paper's CNN and the CIFAR-style CNN.
LAYERS = [("paper conv1", 1, 28, 12, 5, 2, 2), ("paper conv2", 12, 14, 12, 5, 2, 2),
          ("paper conv3", 12, 7, 12, 5, 1, 2), ("cifar 3->32 @32", 3, 32, 32, 3, 1, 1),
          ("cifar 32->32 @32", 32, 32, 32, 3, 1, 1), ("cifar 32->64 @16", 32, 16, 64, 3, 1, 1),
          ("cifar 64->64 @16", 64, 16, 64, 3, 1, 1), ("cifar 64->128 @8", 64, 8, 128, 3, 1, 1),
          ("cifar 128->128 @8", 128, 8, 128, 3, 1, 1)]
QUICK = LAYERS[1:3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="two small layers: a smoke run")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of privleak and torch alike")
    args = parser.parse_args()
    privleak.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    device, batch = args.device, args.batch
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    # privleak's kernel computes in float32; torch's cuDNN convolutions default to TF32 (10-bit
    # mantissas) on Ampere and later: float32 for every side, like for like.
    torch.backends.cudnn.allow_tf32 = False
    where = f"{torch.cuda.get_device_name()}, cuDNN TF32 off" if device == "cuda" else (
        f"{cpu_name()}, privleak path {privleak.info()['cpu_capability']}, {args.threads} threads")
    print(f"privleak {privleak.__version__}, torch {torch.__version__}, {where}; B = {batch}\n")
    rows = []
    for name, channels, size, outputs, kernel, stride, padding in (QUICK if args.quick else LAYERS):
        gen = torch.Generator(device=device).manual_seed(0)
        layer = torch.nn.Conv2d(channels, outputs, kernel, stride=stride, padding=padding, device=device)
        x = torch.randn(batch, channels, size, size, device=device, generator=gen)
        g = torch.randn_like(layer(x), memory_format=torch.contiguous_format).normal_(generator=gen)
        options = ([stride] * 2, [padding] * 2, [1, 1], False, [0, 0])
        grouped_weight = torch.empty(batch * outputs, channels, kernel, kernel, device=device)

        def grouped():
            return torch.ops.aten.convolution_backward(
                g.reshape(1, -1, *g.shape[2:]), x.reshape(1, -1, size, size), grouped_weight, None, *options, batch,
                [False, True, False])[1]

        times = seconds_interleaved({
            "privleak": lambda: conv_weight_grads(x, g, kernel, stride, padding),
            "opacus": lambda: compute_conv_grad_sample(layer, [x], g)[layer.weight],
            "grouped": grouped,
            "floor": lambda: torch.ops.aten.convolution_backward(g, x, layer.weight, None, *options, 1,
                                                                 [False, True, False])[1],
        }, sync=sync)
        want = compute_conv_grad_sample(layer, [x], g)[layer.weight]
        error = (conv_weight_grads(x, g, kernel, stride, padding) - want).abs().max() / want.abs().max()
        ours = times["privleak"]
        rows.append({
            "layer": name, "privleak ms": f"{ours * 1e3:.2f}", "opacus / privleak": f"{times['opacus'] / ours:.2f}x",
            "grouped / privleak": f"{times['grouped'] / ours:.2f}x",
            "floor / privleak": f"{times['floor'] / ours:.2f}x",
            "GFLOP/s": f"{2 * want.numel() * g[0, 0].numel() / ours / 1e9:.0f}",
            "max rel. diff": f"{error.item():.1e}",
        })
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
