"""Ghost norms: privleak's kernels against Opacus's torch formulas, in one run.

    python bench/bench_ghost_norm.py [--shapes 16,128,768,768 ...] [--threads N] [--device cpu|cuda]
                                     [--models ...] [--quick]

Each case is a batch of B samples of T positions with float32 activations a (B, T, d) and output
gradients g (B, T, p), standard normal. Sides, timed in turns (three rounds of three calls after a
warm-up, each side's median round):

- privleak: ``dpsgd.ghost_norm.ghost_norm_squared`` (the tiled kernel: lower triangle only, no
  T x T matrix in memory);
- opacus: ``opacus.grad_sample.linear.compute_linear_norm_sample``, the per-sample norm Opacus's
  ghost clipping uses for a Linear layer over sequences: two batched Gram matrices (einsum, i.e.
  bmm), their elementwise product summed, a square root.

"GEMM-equiv GFLOP/s" counts the 2 B T^2 (d + p) operations of the two full Gram matrices, so that
both sides are measured in the same unit; privleak computes about half of them. "of sgemm" is that
rate over this machine's float32 matmul (torch, 2048 x 2048, timed in the same turns); privleak
can pass 100%. "T x T MiB" is what Opacus's two Gram matrices hold. The Embedding rows (`--vocab`)
compare ``embedding_ghost_norm_squared`` with Opacus's ``compute_embedding_norm_sample`` (unique +
index_add) on random ids. The convolution rows (`--convs`; B,C,H,O,k,stride: C -> O channels, k x k
kernel, padding k // 2, H x H input) compare ``conv_ghost_norm_squared`` (the pixel Gram) with
privleak's patches fed to ``ghost_norm_squared`` (book-keeping's path where the pixel Gram does not
pay) and with what Opacus's ghost clipping does for a convolution (it has no norm sampler for
them): ``compute_conv_grad_sample``'s per-sample gradients, then their squared norms.
The model rows (`--models`) take every Linear layer of a bench_training_step.py transformer (its
blocks' qkv, proj, fc1, fc2 and the head) at once, as book-keeping does a step: privleak's one
call of ``privleak::ghost_norm`` on the list, the same kernel called layer by layer, and Opacus's
norm layer by layer (on a GPU one call shares its launches among the layers, so that a small
batch's layers fill the GPU together).
``--threads`` sets privleak's and torch's CPU threads alike (on a
machine shared with other work, 1 gives the steadiest ratios). On a GPU the same runs on CUDA
tensors (Opacus's einsum in float32: torch's default leaves TF32 off for matmul).
"""
from __future__ import annotations

import argparse
import os

# privleak's OpenMP threads and torch's would otherwise spin after their parallel regions and
# take the cores from the side that runs next (see bench_nearest.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import privleak  # noqa: E402
import torch  # noqa: E402
from _measure import cpu_name, seconds_interleaved, table  # noqa: E402
from opacus.grad_sample.conv import compute_conv_grad_sample  # noqa: E402
from opacus.grad_sample.embedding_norm_sample import compute_embedding_norm_sample  # noqa: E402
from opacus.grad_sample.linear import compute_linear_norm_sample  # noqa: E402
from privleak.dpsgd.ghost_norm import (  # noqa: E402
    conv_ghost_norm_squared,
    embedding_ghost_norm_squared,
    ghost_norm_squared,
)

# (B, T, d, p): short to long sequences at the widths of small to base-size transformers.
SHAPES = [(64, 16, 256, 256), (64, 64, 256, 256), (32, 64, 512, 512), (32, 128, 512, 512), (16, 128, 768, 768),
          (16, 256, 768, 768), (8, 256, 1024, 1024), (8, 512, 1024, 1024), (16, 128, 64, 64), (8, 512, 64, 256)]
QUICK = [(16, 64, 256, 256), (8, 128, 512, 512)]
# (B, C, H, O, k, stride): the CIFAR CNN's two ghost-norm layers (bench_training_step.py) at B 128,
# ResNet-style stages at 8 x 8 and 4 x 4, a strided 3 x 3 and a 1 x 1 of stride 2 (where the pixel
# Gram does 16 times the patches' multiply-adds and book-keeping takes the patches).
CONVS = [(128, 64, 8, 128, 3, 1), (128, 128, 8, 128, 3, 1), (64, 256, 8, 256, 3, 1), (64, 512, 4, 512, 3, 1),
         (64, 128, 8, 256, 3, 2), (64, 128, 16, 256, 1, 2)]
QUICK_CONVS = [(16, 32, 8, 64, 3, 1)]
# name: (B, T, width, blocks, vocab) of bench_training_step.py's transformers.
MODELS = {"transformer": (32, 64, 256, 2, 1500), "large": (8, 128, 768, 8, 8000)}
QUICK_MODELS = {"transformer": (8, 64, 256, 2, 1500)}
SGEMM_SIDE = 2048


def parse_shape(text: str) -> tuple[int, int, int, int]:
    parts = tuple(int(x) for x in text.split(","))
    if len(parts) != 4 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"a shape is B,T,d,p with positive integers, got {text!r}")
    return parts


def parse_conv(text: str) -> tuple[int, ...]:
    parts = tuple(int(x) for x in text.split(","))
    if len(parts) != 6 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"a convolution is B,C,H,O,k,stride with positive integers, got {text!r}")
    return parts


def conv_rows(convs, device: str, sync) -> list[dict]:
    rows = []
    for batch, channels, size, outputs, kernel, stride in convs:
        gen = torch.Generator(device=device).manual_seed(0)
        conv = torch.nn.Conv2d(channels, outputs, kernel, stride, kernel // 2, device=device)
        x = torch.randn(batch, channels, size, size, device=device, generator=gen)
        g = torch.randn(conv(x).shape, device=device, generator=gen)
        positions = g.shape[2] * g.shape[3]
        g_rows = g.flatten(2).transpose(1, 2)

        def patches():
            a = torch.nn.functional.unfold(x, kernel, padding=kernel // 2, stride=stride).transpose(1, 2)
            return ghost_norm_squared(a, g_rows)

        def opacus():
            return compute_conv_grad_sample(conv, [x], g)[conv.weight].flatten(1).square().sum(1)

        times = seconds_interleaved({
            "pixel": lambda: conv_ghost_norm_squared(x, g, kernel, stride, kernel // 2),
            "patches": patches,
            "opacus": opacus,
        }, sync=sync)
        rows.append({
            "B": batch, "C": channels, "H": size, "O": outputs, "k": kernel, "stride": stride,
            "N^2 / T^2 k": f"{size**4 / (positions**2 * kernel**2):.2f}",
            "pixel ms": f"{times['pixel'] * 1e3:.2f}", "patches ms": f"{times['patches'] * 1e3:.2f}",
            "opacus ms": f"{times['opacus'] * 1e3:.2f}",
            "patches / pixel": f"{times['patches'] / times['pixel']:.2f}x",
            "opacus / pixel": f"{times['opacus'] / times['pixel']:.2f}x",
        })
    return rows


def model_rows(models: dict, device: str, sync) -> list[dict]:
    rows = []
    for name, (batch, length, width, blocks, vocab) in models.items():
        gen = torch.Generator(device=device).manual_seed(0)
        shapes = [(width, 3 * width), (width, width), (width, 4 * width), (4 * width, width)] * blocks
        shapes.append((width, vocab))
        layers = [(torch.randn(batch, length, d, device=device, generator=gen),
                   torch.randn(batch, length, p, device=device, generator=gen)) for d, p in shapes]
        linears = [torch.nn.Linear(d, p, bias=False, device=device) for d, p in shapes]
        times = seconds_interleaved({
            "one call": lambda: torch.ops.privleak.ghost_norm([a for a, _ in layers], [g for _, g in layers]),
            "by layer": lambda: [ghost_norm_squared(a, g) for a, g in layers],
            "opacus": lambda: [compute_linear_norm_sample(linear, [a], g) for linear, (a, g) in zip(linears, layers)],
        }, sync=sync)
        ours = times["one call"]
        rows.append({
            "model": name, "layers": len(layers), "B": batch, "T": length, "one call ms": f"{ours * 1e3:.2f}",
            "by layer ms": f"{times['by layer'] * 1e3:.2f}", "opacus ms": f"{times['opacus'] * 1e3:.2f}",
            "by layer / one call": f"{times['by layer'] / ours:.2f}x",
            "opacus / one call": f"{times['opacus'] / ours:.2f}x",
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=None, help="B,T,d,p ...")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--vocab", type=int, default=1000, help="ids for the Embedding rows are drawn from this many")
    parser.add_argument("--convs", type=parse_conv, nargs="+", default=None, help="B,C,H,O,k,stride ...")
    parser.add_argument("--models", nargs="*", choices=sorted(MODELS), default=None,
                        help="transformers whose Linear layers' norms to time at once (default: all)")
    parser.add_argument("--quick", action="store_true", help="two small shapes: a smoke run")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads of privleak and torch alike")
    args = parser.parse_args()
    if args.threads is not None:
        privleak.set_num_threads(args.threads)
        torch.set_num_threads(args.threads)
    shapes = args.shapes or (QUICK if args.quick else SHAPES)
    device = args.device
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        where = torch.cuda.get_device_name()
    else:
        where = (f"{cpu_name()}, privleak path {privleak.info()['cpu_capability']}, {privleak.num_threads()} "
                 f"privleak threads, {torch.get_num_threads()} torch threads")
    print(f"privleak {privleak.__version__}, torch {torch.__version__}, {where}\n")
    gemm_a = torch.randn(SGEMM_SIDE, SGEMM_SIDE, device=device)
    gemm_b = torch.randn(SGEMM_SIDE, SGEMM_SIDE, device=device)

    rows, embedding_rows = [], []
    for batch, length, d, p in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(batch, length, d, device=device, generator=gen)
        g = torch.randn(batch, length, p, device=device, generator=gen)
        ids = torch.randint(0, args.vocab, (batch, length), device=device, generator=gen)
        linear = torch.nn.Linear(d, p, bias=False, device=device)
        embedding = torch.nn.Embedding(args.vocab, p, device=device)
        times = seconds_interleaved({
            "privleak": lambda: ghost_norm_squared(a, g),
            "opacus": lambda: compute_linear_norm_sample(linear, [a], g),
            "privleak emb": lambda: embedding_ghost_norm_squared(ids, g),
            "opacus emb": lambda: compute_embedding_norm_sample(embedding, [ids], g),
            "sgemm": lambda: torch.mm(gemm_a, gemm_b),
        }, sync=sync)
        sgemm = 2 * SGEMM_SIDE**3 / times["sgemm"]
        flops = 2 * batch * length**2 * (d + p)
        ours, theirs = times["privleak"], times["opacus"]
        rows.append({
            "B": batch, "T": length, "d": d, "p": p, "privleak ms": f"{ours * 1e3:.2f}",
            "opacus ms": f"{theirs * 1e3:.2f}", "opacus / privleak": f"{theirs / ours:.2f}x",
            "GEMM-equiv GFLOP/s": f"{flops / ours / 1e9:.0f}", "of sgemm": f"{flops / ours / sgemm:.0%}",
            "opacus of sgemm": f"{flops / theirs / sgemm:.0%}",
            "T x T MiB": f"{2 * batch * length**2 * 4 / 2**20:.1f}",
        })
        ours, theirs = times["privleak emb"], times["opacus emb"]
        embedding_rows.append({
            "B": batch, "T": length, "p": p, "privleak ms": f"{ours * 1e3:.3f}", "opacus ms": f"{theirs * 1e3:.3f}",
            "opacus / privleak": f"{theirs / ours:.2f}x",
            "grads GB/s": f"{g.numel() * g.element_size() / ours / 1e9:.1f}",
        })
    print("Linear over sequences: sum_{t,s} (a_t . a_s)(g_t . g_s)")
    print(table(rows, list(rows[0])))
    print(f"\nEmbedding (ids from {args.vocab}): sum_v |sum_(t: id_t = v) g_t|^2")
    print(table(embedding_rows, list(embedding_rows[0])))
    conv = conv_rows(args.convs or (QUICK_CONVS if args.quick else CONVS), device, sync)
    print("\nConv2d, the weight's squared per-sample norms (N input pixels, T output positions)")
    print(table(conv, list(conv[0])))
    models = QUICK_MODELS if args.quick else {name: MODELS[name] for name in (args.models or MODELS)}
    if models:
        model = model_rows(models, device, sync)
        print("\nA transformer's Linear layers at once (book-keeping's step), float32")
        print(table(model, list(model[0])))


if __name__ == "__main__":
    main()
