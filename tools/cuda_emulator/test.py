#!/usr/bin/env python3
"""Compares privleak's CUDA kernels, run by the emulator's driver, with privleak's CPU ops, bit for bit.

  python3 test.py --driver build/plain/driver [--only ghost_single,noise,...] [--quick]

Prints one line per comparison (PASS/FAIL) and a summary; exit status 1 on any failure.
"""
import argparse
import itertools
import os
import subprocess
import sys
import tempfile

import numpy as np
import privleak  # noqa: F401  (registers the ops)
import privleak.dpsgd  # noqa: F401
import privleak.mechanisms as mech
import torch
from privleak import _arrays

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
NAMES = {v: k for k, v in DTYPES.items()}

results = []


def raw(t):
    t = t.contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def from_raw(b, like):
    if like.dtype in (torch.bfloat16, torch.float16):
        if not b:
            return like.new_empty(like.shape)
        return torch.frombuffer(bytearray(b), dtype=torch.int16).view(like.dtype).reshape(like.shape)
    return torch.frombuffer(bytearray(b), dtype=like.dtype).reshape(like.shape) if b else like.new_empty(like.shape)


class Case:
    def __init__(self, workdir):
        self.dir = workdir
        self.n = 0
        self.lines = []

    def file(self, data=None):
        self.n += 1
        path = os.path.join(self.dir, f"f{self.n}.bin")
        if data is not None:
            with open(path, "wb") as f:
                f.write(data)
        return path


def run_driver(args, manifest_lines, workdir, label, env=None):
    manifest = os.path.join(workdir, "manifest.txt")
    with open(manifest, "w") as f:
        f.write("\n".join(manifest_lines) + "\n")
    p = subprocess.run([args.driver, manifest], capture_output=True, text=True, env={**os.environ, **(env or {})})
    out = p.stdout + p.stderr
    bad = [line for line in out.splitlines()
           if "FAIL" in line or "EMU ERROR" in line or "ERROR" in line or "runtime error" in line]
    if p.returncode != 0 or bad:
        print(f"  driver [{label}] rc={p.returncode}")
        print("  " + "\n  ".join(out.strip().splitlines()[-40:]))
        results.append((f"{label}: driver", False, f"rc={p.returncode}"))
    return p.returncode


def compare(name, ref, got, describe=None):
    ok = ref.tobytes() == got.tobytes()
    detail = ""
    if not ok:
        detail = describe() if describe else ""
    results.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'} {name}" + (f"\n    {detail}" if detail else ""), flush=True)
    return ok


def f64_diff(ref, got, index_names):
    ref, got = np.asarray(ref, dtype=np.float64), np.asarray(got, dtype=np.float64)
    diff = np.flatnonzero(ref.view(np.uint64).ravel() != got.view(np.uint64).ravel())
    lines = [f"{len(diff)} of {ref.size} differ"]
    for i in diff[:8]:
        idx = np.unravel_index(i, ref.shape)
        r, g = ref.ravel()[i], got.ravel()[i]
        ulps = int(abs(int(ref.view(np.int64).ravel()[i]) - int(got.view(np.int64).ravel()[i])))
        where = dict(zip(index_names, map(int, idx)))
        lines.append(f"{where}: cpu {r!r} ({r.hex()}) emu {g!r} ({g.hex()}) ulps {ulps}")
    return "\n    ".join(lines)


# ---------------------------------------------------------------- ghost norms
def make_layer(gen, batch, t, d, p, dtype, special=None):
    a = torch.randn(batch, t, d, generator=gen, dtype=torch.float64)
    g = torch.randn(batch, t, p, generator=gen, dtype=torch.float64)
    if special == "nan" and a.numel():
        a.view(-1)[a.numel() // 2] = float("nan")
    if special == "inf" and g.numel():
        g.view(-1)[0] = float("inf")
    if special == "big" and a.numel():
        a *= 1e20
    return a.to(dtype), g.to(dtype)


def ghost_case(args, label, layers, batch):
    """layers: list of (a, g). One driver call with all layers; compare with the CPU op."""
    ref = torch.ops.privleak.ghost_norm([a for a, _ in layers], [g for _, g in layers])
    with tempfile.TemporaryDirectory(dir=args.workdir) as wd:
        c = Case(wd)
        out = c.file()
        lines = [f"ghost {batch} {len(layers)} {out}"]
        for a, g in layers:
            lines.append(f"L {NAMES[a.dtype]} {a.shape[1]} {a.shape[2]} {g.shape[2]} {c.file(raw(a))} {c.file(raw(g))}")
        rc = run_driver(args, lines, wd, label)
        if rc != 0 and not os.path.exists(out):
            results.append((label, False, "no output"))
            print(f"FAIL {label}: no output")
            return
        got = np.frombuffer(open(out, "rb").read(), dtype=np.float64).reshape(len(layers), batch)
    refn = ref.numpy()
    compare(label, refn, got, lambda: f64_diff(refn, got, ["layer", "sample"]))


def ghost_single(args):
    gen = torch.Generator().manual_seed(1)
    shapes = [(1, 1, 1, 1), (3, 33, 129, 3), (2, 65, 257, 255), (2, 130, 64, 300)]
    for (b, t, d, p) in shapes:
        for dt in (["float32", "float64", "bfloat16", "float16"] if not args.quick else ["float32", "float64"]):
            a, g = make_layer(gen, b, t, d, p, DTYPES[dt])
            ghost_case(args, f"ghost single B{b} T{t} d{d} p{p} {dt}", [(a, g)], b)


def ghost_extra(args):
    """Tile and chunk boundaries: T = 64, 128, 192; d, p = 128 (one chunk), 129, 16, 8, 256."""
    gen = torch.Generator().manual_seed(9)
    shapes = [(2, 64, 128, 16), (1, 128, 129, 8), (2, 192, 256, 128), (3, 63, 16, 257), (1, 127, 8, 1)]
    for (b, t, d, p) in shapes:
        for dt in ["float32", "float64", "bfloat16", "float16"]:
            a, g = make_layer(gen, b, t, d, p, DTYPES[dt])
            ghost_case(args, f"ghost extra B{b} T{t} d{d} p{p} {dt}", [(a, g)], b)


def ghost_mixed(args):
    gen = torch.Generator().manual_seed(2)
    batch = 3
    # 36 float32 layers (past the 32-layer cap), then runs of other dtypes, a T = 0 layer, d = 0 and
    # p = 0 layers, NaN / inf / huge inputs.
    plan = ["float32"] * 36 + ["float64"] * 3 + ["bfloat16"] * 2 + ["float32"] + ["float16"] * 2 + ["float64"] * 2
    layers = []
    for i, dt in enumerate(plan):
        t = int(torch.randint(0, 80, (1,), generator=gen))
        d = int(torch.randint(1, 40, (1,), generator=gen))
        p = int(torch.randint(1, 40, (1,), generator=gen))
        special = None
        if i == 5:
            t = 0
        if i == 7:
            d = 0
        if i == 8:
            p = 0
        if i == 10:
            special = "nan"
        if i == 11:
            special = "inf"
        if i == 12:
            special = "big"
        if i == 37:
            t = 0
        layers.append(make_layer(gen, batch, t, d, p, DTYPES[dt], special))
    ghost_case(args, f"ghost mixed {len(layers)} layers (dtype runs, 32-cap, T=0, d=0, p=0, nan/inf/huge)", layers,
               batch)
    # All layers empty: a zero-byte workspace, no tile launches.
    layers = [make_layer(gen, 2, 0, 3, 4, torch.float32), make_layer(gen, 2, 0, 1, 1, torch.float32)]
    ghost_case(args, "ghost all layers T=0", layers, 2)
    # A T = 0 layer alone in its dtype group between others.
    layers = [make_layer(gen, 2, 5, 3, 4, torch.float32), make_layer(gen, 2, 0, 3, 4, torch.float64),
              make_layer(gen, 2, 70, 3, 4, torch.float32)]
    ghost_case(args, "ghost T=0 layer alone in a group", layers, 2)


def ghost_long(args):
    gen = torch.Generator().manual_seed(3)
    layers = [make_layer(gen, 4, 2048, 3, 2, torch.float32) for _ in range(8)]
    ghost_case(args, "ghost long: 8 x (B4 T2048 d3 p2) float32 (16 MiB split)", layers, 4)
    if not args.quick:
        layers = [make_layer(gen, 2, 1500, 5, 3, [torch.float64, torch.bfloat16][i % 2 if i > 3 else 0])
                  for i in range(6)]
        ghost_case(args, "ghost long: 6 x (B2 T1500) float64/bfloat16", layers, 2)


def ghost_bigbatch(args):
    gen = torch.Generator().manual_seed(4)
    b = 65537
    layers = [make_layer(gen, b, 1, 2, 1, torch.float32), make_layer(gen, b, 2, 1, 2, torch.float64)]
    ghost_case(args, "ghost batch 65537 (gridDim.y loop)", layers, b)


def run_fields(args, label, fields, env=None):
    """Runs the driver line of ``fields`` (each tensor written to a file and named by its path),
    then its output's path; returns the output's bytes (None for no output)."""
    with tempfile.TemporaryDirectory(dir=args.workdir) as wd:
        c = Case(wd)
        line = " ".join(c.file(raw(f)) if isinstance(f, torch.Tensor) else str(f) for f in fields)
        out = c.file()
        run_driver(args, [f"{line} {out}"], wd, label, env=env)
        return open(out, "rb").read() if os.path.exists(out) else None


def per_sample_case(args, label, ref, fields):
    """The driver line of ``fields``, whose output is (B,) float64, compared with ref."""
    got = np.frombuffer(run_fields(args, label, fields) or b"", dtype=np.float64)
    compare(label, ref, got, lambda: f64_diff(ref, got, ["sample"]) if got.size == ref.size else "size")


CONV_CASES = [((2, 3, 9, 9), 4, (3, 3), (1, 1), (1, 1), (1, 1)),
              ((1, 2, 11, 7), 3, (2, 3), (2, 1), (0, 2), (2, 1)),
              ((3, 5, 1, 150), 2, (1, 5), (1, 2), (0, 2), (1, 1)),
              ((1, 1, 1, 1), 1, (1, 1), (1, 1), (0, 0), (1, 1)),
              ((2, 4, 14, 13), 3, (3, 2), (1, 1), (2, 1), (1, 2))]
#: layers the tiled per-sample gradient kernel takes (16+ outputs, 32+ columns) where its tiles are
#: as many as the multiprocessors (EMU_SMS 1; at 132 these take the element kernel): partial
#: output, column and position tiles, exact tiles, strides, asymmetric padding, dilation, a Conv1d
CONV_TILED_CASES = [((2, 8, 9, 9), 33, (3, 3), (1, 1), (1, 1), (1, 1)),
                    ((1, 15, 6, 7), 70, (3, 3), (2, 1), (1, 0), (1, 1)),
                    ((3, 16, 1, 40), 16, (1, 3), (1, 2), (0, 1), (1, 2)),
                    ((2, 16, 5, 5), 32, (2, 2), (1, 1), (0, 0), (1, 1))]


def conv_inputs(gen, cases=CONV_CASES):
    """(dtype name, x, g, kernel, stride, padding, dilation, geometry) for every dtype and case."""
    for dt in ["float32", "float64", "bfloat16", "float16"]:
        for (shape, o, k, s, pad, dil) in cases:
            x = torch.randn(*shape, generator=gen, dtype=torch.float64).to(DTYPES[dt])
            ho = (shape[2] + 2 * pad[0] - dil[0] * (k[0] - 1) - 1) // s[0] + 1
            wo = (shape[3] + 2 * pad[1] - dil[1] * (k[1] - 1) - 1) // s[1] + 1
            g = torch.randn(shape[0], o, ho, wo, generator=gen, dtype=torch.float64).to(DTYPES[dt])
            geometry = [*shape, o, ho, wo, *k, *s, *pad, *dil]
            yield dt, x, g, list(k), list(s), list(pad), list(dil), geometry


def conv(args):
    gen = torch.Generator().manual_seed(5)
    for dt, x, g, k, s, pad, dil, geometry in conv_inputs(gen):
        ref = torch.ops.privleak.conv_ghost_norm(x, g, k, s, pad, dil).numpy()
        label = f"conv {dt} x{tuple(x.shape)} O{g.shape[1]} k{k} s{s} p{pad} d{dil}"
        per_sample_case(args, label, ref, ["conv", dt, x, g, *geometry])


def embedding(args):
    gen = torch.Generator().manual_seed(6)
    for dt in ["float32", "float64", "bfloat16", "float16"]:
        for (b, t, p, vocab) in [(3, 50, 70, 7), (2, 1, 1, 1), (2, 40, 33, 1000), (1, 0, 5, 3)]:
            ids = torch.randint(0, vocab, (b, t), generator=gen, dtype=torch.int64)
            g = torch.randn(b, t, p, generator=gen, dtype=torch.float64).to(DTYPES[dt])
            ref = torch.ops.privleak.embedding_ghost_norm(ids, g).numpy()
            label = f"embedding {dt} B{b} T{t} p{p} vocab{vocab}"
            per_sample_case(args, label, ref, ["emb", dt, ids, g, b, t, p])


# ---------------------------------------------------------------- noise
def noise_tensors(gen, quick):
    sizes = [k * 37 % 11 for k in range(150)] + [100003 if not quick else 5003]
    tensors = []
    for k, n in enumerate(sizes):
        if k < 70:
            dt = "float32"  # a run of 70 arrays: past the 64 arrays of one launch
        else:
            dt = ["float64", "bfloat16", "float32", "float16"][(k // 5) % 4]
        if k == len(sizes) - 1:
            dt = "bfloat16"
        tensors.append(torch.randn(n, generator=gen, dtype=torch.float64).mul(3).to(DTYPES[dt]))
    # a 2-d tensor and a trailing float64 one
    tensors.append(torch.randn(7, 9, generator=gen, dtype=torch.float64).to(torch.float64))
    return tensors


def noise_case(args, label, distribution, scale, words, offset, grid, tensors):
    ref = [t.clone() for t in tensors]
    torch.ops.privleak.add_noise_many_(ref, distribution, scale, words, offset, grid)
    with tempfile.TemporaryDirectory(dir=args.workdir) as wd:
        c = Case(wd)
        lines, outs = [], []
        off = offset
        # As privleak.mechanisms._add_into / _apply: one kernel call per run of one dtype.
        for dt, run in itertools.groupby(tensors, key=lambda x: x.dtype):
            run = list(run)
            arrays = []
            for t in run:
                out = c.file()
                outs.append(out)
                arrays.append(f"A {t.numel()} {c.file(raw(t))} {out}")
            if distribution.startswith("discrete_"):
                d = distribution.removeprefix("discrete_")
                words_text = " ".join(map(str, words))
                lines.append(f"secure {d} {NAMES[dt]} {words_text} {off} {int(scale)} {grid} 1 {len(run)}")
            else:
                key = words[0] | (words[1] << 32)
                lines.append(f"noise {distribution} {NAMES[dt]} {key} {off} {float(scale).hex()} 1 {len(run)}")
            lines += arrays
            off += sum(t.numel() for t in run)
        run_driver(args, lines, wd, label)
        got = [from_raw(open(o, "rb").read(), t) if os.path.exists(o) else None for o, t in zip(outs, tensors)]
    bad = []
    for i, (r, g) in enumerate(zip(ref, got)):
        if g is None or raw(r) != raw(g):
            if g is None:
                bad.append(f"tensor {i}: no output")
                continue
            rb, gb = r.double().view(-1), g.double().view(-1)
            diff = [j for j in range(r.numel()) if raw(r.view(-1)[j:j + 1]) != raw(g.view(-1)[j:j + 1])]
            bad.append(f"tensor {i} ({NAMES[r.dtype]}, n={r.numel()}): {len(diff)} elements differ, first "
                       f"{diff[:3]}: cpu {[float(rb[j]) for j in diff[:3]]} emu {[float(gb[j]) for j in diff[:3]]}")
    ok = not bad
    results.append((label, ok, "; ".join(bad[:5])))
    print(f"{'PASS' if ok else 'FAIL'} {label}" + ("" if ok else "\n    " + "\n    ".join(bad[:8])), flush=True)


def noise(args):
    gen = torch.Generator().manual_seed(7)
    tensors = noise_tensors(gen, args.quick)
    n = sum(t.numel() for t in tensors)
    words = [0x9E3779B9, 0x7F4A7C15]
    for dist, scale in [("gaussian", 0.7), ("laplace", 1.3)]:
        for offset in [0, 12345, 2**40 + 3]:
            noise_case(args, f"noise {dist} scale {scale} offset {offset} ({len(tensors)} tensors, {n} elements)",
                       dist, scale, words, offset, 0, tensors)


def secure(args):
    gen = torch.Generator().manual_seed(8)
    tensors = noise_tensors(gen, args.quick)
    n = sum(t.numel() for t in tensors)
    words = [0x01234567, 0x89ABCDEF, 0xDEADBEEF, 0x0BADF00D, 0x13579BDF, 0x2468ACE0, 0xFFFFFFFF, 0x00000001]
    for dist, sigma in [("gaussian", 0.8), ("laplace", 0.5)]:
        scale, grid = mech._discrete_parameters(dist, sigma)
        for offset in [0, 999]:
            noise_case(args, f"secure discrete_{dist} scale {int(scale)} grid {grid} offset {offset} "
                             f"({len(tensors)} tensors, {n} elements)", "discrete_" + dist, scale, words, offset, grid,
                       tensors)
    # the brief's parameters: integer scale 2^41, grid -20
    noise_case(args, f"secure discrete_gaussian scale 2^41 grid -20 ({n} elements)", "discrete_gaussian", 2.0**41,
               words, 5, -20, tensors)


# ---------------------------------------------------------------- clipping
def read_like(path, like):
    return from_raw(open(path, "rb").read(), like) if os.path.exists(path) else None


def compare_tensors(label, refs, gots):
    """refs, gots: lists of tensors (a None got: no output). One result line."""
    bad = []
    for i, (r, g) in enumerate(zip(refs, gots)):
        if g is None:
            bad.append(f"output {i}: missing")
        elif raw(r) != raw(g):
            diff = (r.view(-1).double() != g.view(-1).double()) | (r.view(-1).isnan() != g.view(-1).isnan())
            where = torch.nonzero(diff).view(-1)[:3].tolist()
            cpu, emu = [float(r.view(-1)[j]) for j in where], [float(g.view(-1)[j]) for j in where]
            bad.append(f"output {i} ({NAMES.get(r.dtype, r.dtype)}, n={r.numel()}): {int(diff.sum())} differ, first "
                       f"{where}: cpu {cpu} emu {emu}")
    ok = not bad
    results.append((label, ok, "; ".join(bad[:5])))
    print(f"{'PASS' if ok else 'FAIL'} {label}" + ("" if ok else "\n    " + "\n    ".join(bad[:8])), flush=True)


def one_output_case(args, label, ref, fields, env=None):
    """The driver line of ``fields``, whose one output is like ref, compared with ref."""
    data = run_fields(args, label, fields, env)
    compare_tensors(label, [ref], [None if data is None else from_raw(data, ref)])


def clip_case(args, label, grads, clip_norms, per_layer, norm_type, noise_std, words, offset, scale, other_sums=None):
    ref = torch.ops.privleak.clip_accumulate(grads, clip_norms, per_layer, noise_std, words, offset, scale, norm_type,
                                             other_sums)
    batch, columns = ref[-2].shape
    sums_in = torch.full((batch, columns), float("nan"), dtype=torch.float64)
    if other_sums is not None:
        sums_in[:, len(grads):] = other_sums
    with tempfile.TemporaryDirectory(dir=args.workdir) as wd:
        c = Case(wd)
        outs = [c.file() for _ in grads]
        sums_out, factors_out = c.file(), c.file()
        key = words[0] | (words[1] << 32)
        lines = [f"clip {NAMES[grads[0].dtype]} {batch} {columns} {int(per_layer)} {norm_type} "
                 f"{float(noise_std).hex()} {key} {offset} {float(scale).hex()} {c.file(raw(clip_norms))} "
                 f"{c.file(raw(sums_in))} {sums_out} {factors_out} {len(grads)}"]
        lines += [f"A {g[0].numel()} {c.file(raw(g))} {o}" for g, o in zip(grads, outs)]
        run_driver(args, lines, wd, label)
        got = [read_like(o, r) for o, r in zip(outs + [sums_out, factors_out], ref)]
    compare_tensors(label, ref, got)


def clip(args):
    gen = torch.Generator().manual_seed(10)
    words = [0x9E3779B9, 0x7F4A7C15]
    numels = [1, 4095, 4096, 4097, 0, 9000, 37]
    for dt in ["float32", "bfloat16", "float16"]:
        for batch in [1, 3]:
            grads = [torch.randn(batch, n, generator=gen, dtype=torch.float64).mul(0.05).to(DTYPES[dt])
                     for n in numels]
            for per_layer, norm_type, std in [(False, 2, 0.0), (True, 2, 0.9), (False, 1, 1.5), (True, 1, 0.0)]:
                clip_norms = torch.rand(len(numels) if per_layer else 1, generator=gen, dtype=torch.float64) + 0.5
                clip_case(args, f"clip {dt} B{batch} numels {numels} per_layer={per_layer} L{norm_type} std {std}",
                          grads, clip_norms, per_layer, norm_type, std, words, 12345, 0.25)
    # 50 tensors (two launches of the 48-tensor groups), book-keeping's extra norm columns, a sample
    # with a NaN and one with an inf gradient (factors 0), and a group whose tensors are all empty.
    batch = 4
    sizes = [int(n) for n in torch.randint(0, 300, (50,), generator=gen)]
    sizes[48:] = [0, 0]
    grads = [torch.randn(batch, n, generator=gen, dtype=torch.float64).to(torch.float32) for n in sizes]
    grads[3][1, 0] = float("nan")
    grads[7][2, -1] = float("inf")
    other = torch.rand(batch, 5, generator=gen, dtype=torch.float64) * 10
    for per_layer in [False, True]:
        clip_norms = torch.rand(55 if per_layer else 1, generator=gen, dtype=torch.float64) * 5 + 1
        clip_case(args, f"clip 50 tensors + 5 other norm columns, NaN/inf samples, per_layer={per_layer}", grads,
                  clip_norms, per_layer, 2, 0.7, words, 2**40 + 5, 1 / 3, other)


def factors(args):
    gen = torch.Generator().manual_seed(11)
    for batch, columns in [(1, 1), (5, 3), (300, 7)]:
        sums = torch.rand(batch, columns, generator=gen, dtype=torch.float64) * 20
        if batch > 1:
            sums[1, 0] = float("inf")
            sums[-1, -1] = float("nan")
        for per_layer in [False, True]:
            for norm_type in [1, 2]:
                clip_norms = torch.rand(columns if per_layer else 1, generator=gen, dtype=torch.float64) * 3 + 0.1
                ref = torch.ops.privleak.clip_factors(sums, clip_norms, per_layer, norm_type)
                one_output_case(args, f"clip_factors B{batch} C{columns} per_layer={per_layer} L{norm_type}", ref,
                                ["factors", batch, columns, int(per_layer), norm_type, sums, clip_norms])


# ---------------------------------------------------------------- per-sample convolution gradients
def conv_grads(args):
    gen = torch.Generator().manual_seed(12)
    tiled = {(shape, o) for shape, o, *_ in CONV_TILED_CASES}
    for dt, x, g, k, s, pad, dil, geometry in conv_inputs(gen, CONV_CASES + CONV_TILED_CASES):
        # an inf and a NaN; products that underflow to -0 (a chain's -0 kept past the last position)
        kinds = ["plain", "inf and NaN", "-0"] if x.shape[1] == 8 else ["plain"]
        for kind in kinds:
            if kind == "inf and NaN":
                x, g = x.clone(), g.clone()
                g[0, 1, 0, 0], x[1, 2, 3, 3] = float("inf"), float("nan")
            elif kind == "-0" and dt != "float16":  # float16 has no products that small
                tiny = 1e-200 if dt == "float64" else 1e-30
                x, g = torch.full_like(x, tiny), torch.full_like(g, -tiny)
            elif kind == "-0":
                continue
            ref = torch.ops.privleak.conv_weight_grads(x, g, k, s, pad, dil)
            for sms in ["1", "132"] if (tuple(x.shape), g.shape[1]) in tiled else ["132"]:
                one_output_case(args, f"conv_weight_grads {dt} x{tuple(x.shape)} O{g.shape[1]} k{k} s{s} p{pad} "
                                f"d{dil} {kind} SMs {sms}", ref, ["convgrad", dt, x, g, *geometry], {"EMU_SMS": sms})


# ---------------------------------------------------------------- VMF
def vmf(args):
    gen = torch.Generator().manual_seed(13)
    words = [0x01234567, 0x89ABCDEF]
    key = words[0] | (words[1] << 32)
    # p: one tangent chunk, its edges (256 coordinates a chunk), several chunks; offsets across the
    # 2^32 sample boundary of the counter space.
    for dt in ["float32", "float64"]:
        for p, n, kappa, offset in [(2, 5, 1.0, 0), (3, 4, 50.0, 7), (257, 3, 1e3, 2**32 - 2), (258, 2, 0.01, 11),
                                    (1000, 3, 300.0, 2**40), (5, 1, 1e30, 3)]:
            mu = torch.randn(p, generator=gen, dtype=torch.float64)
            mu = (mu / mu.norm()).to(DTYPES[dt])
            ref = torch.ops.privleak.vmf_sample(mu, kappa, n, words, offset)
            one_output_case(args, f"vmf {dt} p{p} n{n} kappa {kappa} offset {offset}", ref,
                            ["vmf", dt, p, n, float(kappa).hex(), key, offset, mu])


# ---------------------------------------------------------------- column statistics and nearest inputs
STAT_SETS = [("max",), ("max", "argmax"), ("min", "sum"), ("max", "argmax", "min", "sum")]


def column_stats(args):
    rng = np.random.default_rng(14)
    # rows: one chunk (256 rows), several (1000: 4 chunks of 256), many (70000: 1024 chunks); a row
    # stride wider than the columns; NaN and tied columns.
    for dt in ["float32", "float64"]:
        for rows, cols, stride in [(1, 1, 1), (300, 5, 9), (1000, 300, 300)] + ([] if args.quick else [(70000, 3, 4)]):
            full = rng.standard_normal((rows, stride)).astype(dt)
            if cols > 2:
                full[rows // 2, 1] = np.nan
                full[:, 2] = 1.5  # a tie in every row: the first row's index wins
            matrix = full[:, :cols]
            for stats in STAT_SETS:
                for weighted in ([False, True] if rows < 70000 else [True]):
                    weights = rng.random(rows) + 0.5 if weighted else None
                    ref = privleak.column_stats(matrix, weights, stats=stats)
                    wanted = set(stats)
                    mask = sum({"max": 1, "argmax": 2, "min": 4, "sum": 8}[s] for s in wanted)
                    label = f"column_stats {dt} rows {rows} cols {cols} stride {stride} {'+'.join(stats)}" + \
                        (" weighted" if weighted else "")
                    with tempfile.TemporaryDirectory(dir=args.workdir) as wd:
                        c = Case(wd)
                        outs = {s: c.file() if s in wanted else "-" for s in ("max", "argmax", "min", "sum")}
                        wfile = c.file(weights.astype(dt).tobytes()) if weighted else "-"
                        run_driver(args, [f"colstats {dt} {mask} {rows} {cols} {stride} {c.file(full.tobytes())} "
                                          f"{wfile} {outs['max']} {outs['argmax']} {outs['min']} {outs['sum']}"],
                                   wd, label)
                        refs, gots = [], []
                        for name in ("max", "argmax", "min", "sum"):
                            if name in wanted:
                                r = torch.from_numpy(np.ascontiguousarray(getattr(ref, name)))
                                refs.append(r)
                                gots.append(read_like(outs[name], r))
                    compare_tensors(label, refs, gots)


def nearest(args):
    rng = np.random.default_rng(15)
    # Queries past one 128- (float32) or 64-row (float64) tile, inputs in several ranges, p past the
    # 8-coordinate depth; the multiprocessor count changes how inputs split into ranges, never the result.
    for dt in ["float32", "float64"]:
        shapes = [(1, 1, 1, 1), (130, 700, 11, 13), (0, 4, 2, 2)] + ([] if args.quick else [(5, 3000, 3, 3)])
        for n_queries, n_inputs, p, stride in shapes:
            q_full = rng.standard_normal((n_queries, stride)).astype(dt)
            x_full = rng.standard_normal((n_inputs, stride)).astype(dt)
            if n_inputs > 10:
                x_full[10] = x_full[3]  # an exact tie: the lower index wins
            q, x = q_full[:, :p], x_full[:, :p]
            for metric in ["inner_product", "squared_l2", "l1"]:
                ref = privleak.nearest(q, x, metric)
                center = None
                if metric == "squared_l2":  # as privleak.nearest computes it
                    center = _arrays.quotient(privleak.column_stats(x, stats=("sum",)).sum, n_inputs).astype(dt)
                for sms in ["1"] if args.quick else ["1", "132"]:
                    label = (f"nearest {dt} {metric} queries {n_queries} inputs {n_inputs} p {p} stride {stride} "
                             f"SMs {sms}")
                    with tempfile.TemporaryDirectory(dir=args.workdir) as wd:
                        c = Case(wd)
                        value, index = c.file(), c.file()
                        cfile = c.file(center.tobytes()) if center is not None else "-"
                        files = f"{c.file(q_full.tobytes())} {c.file(x_full.tobytes())} {cfile} {value} {index}"
                        command = f"nearest {dt} {metric} {n_queries} {stride} {n_inputs} {stride} {p} {files}"
                        run_driver(args, [command], wd, label, env={"EMU_SMS": sms})
                        refs = [torch.from_numpy(ref.value), torch.from_numpy(ref.index)]
                        gots = [read_like(value, refs[0]), read_like(index, refs[1])]
                    compare_tensors(label, refs, gots)


SUITES = {"ghost_single": ghost_single, "ghost_extra": ghost_extra, "ghost_mixed": ghost_mixed,
          "ghost_long": ghost_long, "ghost_bigbatch": ghost_bigbatch, "conv": conv, "embedding": embedding,
          "noise": noise, "secure": secure, "clip": clip,
          "factors": factors, "conv_grads": conv_grads, "vmf": vmf, "column_stats": column_stats, "nearest": nearest}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--driver", required=True)
    ap.add_argument("--only", default=",".join(SUITES))
    ap.add_argument("--quick", action="store_true", help="smaller cases (for slow sanitizer builds)")
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    for name in args.only.split(","):
        SUITES[name](args)
    failed = [r for r in results if not r[1]]
    print(f"SUMMARY: {len(results) - len(failed)} passed, {len(failed)} failed")
    for name, _, _detail in failed:
        print(f"  FAILED: {name}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
