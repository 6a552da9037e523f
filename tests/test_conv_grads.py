"""The per-sample convolution weight-gradient kernel (privleak.dpsgd.conv_grads) against float64
references: torch's own convolution backward, one sample at a time, and unfold + einsum."""
import privleak
import pytest
import torch
import torch.nn.functional as F
from conftest import requires_cuda
from privleak import _backend
from privleak.dpsgd.conv_grads import conv_weight_grads, conv_weight_grads_reference

CPU_PATHS = ["default", "avx2", "avx512"]
CPU_BEST = _backend.core.build_info()["cpu_best_capability"]

# (batch, channels, outputs, size, kernel, stride, padding, dilation, groups) of Conv2d; size and
# kernel an int (square) or a pair. Edges: 1 x 1 kernels and outputs, one output position,
# outputs past one vector (16) and one tile (64) with remainders, channels at multiples of 16
# (xp's spread stride) and of 128, groups and depthwise, strides and dilations that skip inputs.
CONV2D = [
    (1, 1, 1, 1, 1, 1, 0, 1, 1),
    (2, 1, 12, 28, 5, 2, 2, 1, 1),
    (3, 12, 12, 7, 5, 1, 2, 1, 1),
    (2, 3, 33, 9, 3, 1, 1, 1, 1),
    (2, 16, 70, 6, 3, 2, 0, 1, 1),
    (1, 128, 130, 5, 3, 1, 1, 1, 1),
    (2, 6, 9, (9, 11), (3, 2), (2, 1), (1, 0), (2, 3), 3),
    (3, 8, 8, 10, 3, 1, 1, 1, 8),
    (2, 5, 7, 4, 4, 1, 0, 1, 1),
    (2, 4, 6, 3, 3, 3, 2, 2, 2),
]
#: layers the CUDA kernel tiles (16+ outputs, 32+ channel-kernel columns, and at least as many
#: tiles of 32 outputs x 64 columns a sample as the GPU has multiprocessors: 360 and 200 here)
CUDA_TILED = [(40, 16, 70, 6, 3, 1, 1, 1, 1), (200, 32, 16, 3, 1, 1, 0, 1, 1)]


def draw(shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    return (x * torch.rand(shape[0], 1, *shape[2:], generator=gen, dtype=torch.float64) * 3).to(dtype)


def conv_case(case, dtype=torch.float32, seed=0):
    """Inputs, output gradients and the convolution's arguments of a CONV2D entry."""
    batch, channels, outputs, size, kernel, stride, padding, dilation, groups = case
    size = (size, size) if isinstance(size, int) else size
    kernel = (kernel, kernel) if isinstance(kernel, int) else kernel
    x = draw((batch, channels, *size), dtype, seed)
    weight = torch.zeros(outputs, channels // groups, *kernel, dtype=x.dtype)
    out = F.conv2d(x.double(), weight.double(), stride=stride, padding=padding, dilation=dilation, groups=groups)
    g = draw(tuple(out.shape), dtype, seed + 1)
    return x, g, dict(kernel_size=kernel, stride=stride, padding=padding, dilation=dilation, groups=groups)


def error_bound(x, g, args):
    """The module docstring's first-order bound T u sum_t |g_t x_t| (u = 2^-24, or 2^-53 for
    float64 inputs), with room for second-order terms and the reference's own rounding."""
    unit = 2.0**-53 if x.dtype == torch.float64 else 2.0**-24
    positions = g[0, 0].numel()
    magnitude = conv_weight_grads_reference(x.double().abs(), g.double().abs(), **args)
    return (positions + 2) * unit * magnitude + 1e-300


def assert_within_bound(x, g, args):
    got = conv_weight_grads(x, g, **args)
    want = conv_weight_grads_reference(x, g, **args)
    assert got.shape == want.shape
    assert got.dtype == (torch.float64 if x.dtype == torch.float64 else torch.float32)
    assert torch.all((got.double() - want).abs() <= error_bound(x, g, args))
    return got


@pytest.mark.parametrize("case", CONV2D)
def test_conv2d_matches_the_float64_reference(case):
    x, g, args = conv_case(case, seed=1)
    assert_within_bound(x, g, args)


@pytest.mark.parametrize("case", CONV2D[:4])
def test_float64_inputs_accumulate_in_float64(case):
    x, g, args = conv_case(case, torch.float64, seed=2)
    assert_within_bound(x, g, args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CONV2D[1:5])
def test_half_inputs_are_widened_exactly_and_accumulate_in_float32(case, dtype):
    x, g, args = conv_case(case, dtype, seed=3)
    got = assert_within_bound(x, g, args)
    # Widening is exact: the half inputs give the bits of their float32 values.
    assert torch.equal(got, conv_weight_grads(x.float(), g.float(), **args))


def test_inputs_of_two_dtypes_are_promoted():
    x, g, args = conv_case(CONV2D[2], seed=4)
    assert torch.equal(conv_weight_grads(x.bfloat16(), g, **args), conv_weight_grads(x.bfloat16().float(), g, **args))


def test_the_einsum_form_agrees():
    # A second, independent formulation: unfold the input into patches, one einsum.
    x, g, args = conv_case(CONV2D[3], torch.float64, seed=5)
    patches = F.unfold(x, args["kernel_size"], dilation=args["dilation"], padding=args["padding"],
                       stride=args["stride"])
    want = torch.einsum("bol,bdl->bod", g.flatten(2), patches).reshape(conv_weight_grads(x, g, **args).shape)
    assert torch.allclose(conv_weight_grads(x, g, **args), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel,stride,padding,dilation,groups", [(1, 1, 0, 1, 1), (5, 2, 3, 1, 2), (3, 1, 2, 3, 4)])
def test_conv1d_matches_the_float64_reference(kernel, stride, padding, dilation, groups):
    x = draw((3, 8, 21), seed=6)
    out = F.conv1d(x, torch.zeros(12, 8 // groups, kernel), stride=stride, padding=padding, dilation=dilation,
                   groups=groups)
    g = draw(tuple(out.shape), seed=7)
    args = dict(kernel_size=kernel, stride=stride, padding=padding, dilation=dilation, groups=groups)
    assert conv_weight_grads(x, g, **args).shape == (3, 12, 8 // groups, kernel)
    assert_within_bound(x, g, args)


def test_each_sample_is_its_own_convolution():
    # A sample's gradient does not depend on the others, and it is the gradient torch's autograd
    # gives for the sum of that sample's outputs weighted by g.
    x, g, args = conv_case(CONV2D[6], torch.float64, seed=8)
    grads = conv_weight_grads(x, g, **args)
    weight = torch.randn(g.shape[1], x.shape[1] // args["groups"], *args["kernel_size"], dtype=torch.float64,
                         requires_grad=True)
    for i in range(x.shape[0]):
        y = F.conv2d(x[i:i + 1], weight, stride=args["stride"], padding=args["padding"], dilation=args["dilation"],
                     groups=args["groups"])
        (want,) = torch.autograd.grad((y * g[i:i + 1]).sum(), weight)
        assert torch.allclose(grads[i], want, rtol=1e-12, atol=1e-12)
        assert torch.equal(conv_weight_grads(x[i:i + 1], g[i:i + 1], **args)[0], grads[i])


def test_empty_batch():
    x, g, args = conv_case(CONV2D[2], seed=9)
    assert conv_weight_grads(x[:0], g[:0], **args).shape == (0, 12, 12, 5, 5)


def test_a_nan_stays_in_its_sample_and_finite_inputs_stay_finite():
    x, g, args = conv_case(CONV2D[3], seed=10)
    assert torch.isfinite(conv_weight_grads(x * 1e15, g * 1e15, **args)).all()  # products near 1e30, no overflow
    x[1, 0, 2, 3] = float("nan")
    grads = conv_weight_grads(x, g, **args)
    assert grads[1].isnan().any() and torch.isfinite(grads[[0]]).all()


def test_threads_do_not_change_the_bits(threads):
    x, g, args = conv_case(CONV2D[4], seed=11)
    results = []
    for n in (1, 2, 3):
        threads(n)
        results.append(conv_weight_grads(x, g, **args))
    assert all(torch.equal(r, results[0]) for r in results)


def core_conv_grads(x, g, args, capability):
    """The CPU kernel on one path, through the binding (no groups, Conv2d)."""
    (kh, kw), (oh, ow) = args["kernel_size"], g.shape[2:]
    pair = lambda v: (v, v) if isinstance(v, int) else v  # noqa: E731
    out = torch.empty(x.shape[0], g.shape[1], x.shape[1], kh, kw)
    geometry = [*x.shape, g.shape[1], oh, ow, kh, kw, *pair(args["stride"]), *pair(args["padding"]),
                *pair(args["dilation"])]
    _backend.core.conv_weight_grads(str(x.dtype).removeprefix("torch."), x.data_ptr(), g.data_ptr(), geometry,
                                    out.data_ptr(), capability)
    return out


@pytest.mark.parametrize("path", ["avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [c for c in CONV2D if c[-1] == 1])
def test_simd_paths_give_the_portable_bits(case, dtype, path):
    if CPU_PATHS.index(path) > CPU_PATHS.index(CPU_BEST):
        pytest.skip(f"this CPU has no {path} (its best path is {CPU_BEST})")
    x, g, args = conv_case(case, dtype, seed=12)
    assert torch.equal(core_conv_grads(x, g, args, path), core_conv_grads(x, g, args, "default"))


def test_the_path_privleak_reports_is_the_one_that_runs():
    x, g, args = conv_case(CONV2D[3], seed=13)
    assert torch.equal(conv_weight_grads(x, g, **args), core_conv_grads(x, g, args, privleak.info()["cpu_capability"]))


def test_an_unknown_path_or_one_the_cpu_lacks_is_refused():
    x, g, args = conv_case(CONV2D[0], seed=14)
    with pytest.raises(ValueError, match="capability must be 'default', 'avx2' or 'avx512'"):
        core_conv_grads(x, g, args, "sse9")
    if CPU_BEST != "avx512":
        with pytest.raises(ValueError, match="cannot run the avx512 path"):
            core_conv_grads(x, g, args, "avx512")


def test_the_core_refuses_a_geometry_that_is_not_a_convolution():
    x, g, args = conv_case(CONV2D[2], seed=15)
    with pytest.raises(ValueError, match="output gradient's size is not the convolution's"):
        core_conv_grads(x, g, dict(args, stride=2), "default")


def test_the_op_refuses_size_lists_that_are_not_pairs():
    # The core reads two values of each: a list of another length would shift its fields.
    x, g = torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 6, 5)
    with pytest.raises(ValueError, match="takes 2 values of kernel_size"):
        torch.ops.privleak.conv_weight_grads(x, g, [1], [2, 1], [1, 1, 1], [1, 1])


def test_a_padding_too_large_for_the_scratch_is_refused_not_allocated():
    with pytest.raises(ValueError, match="exceeds 2\\^34 elements"):
        conv_weight_grads(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 3, 3), 1, stride=10**9, padding=10**9)


def test_a_nan_result_is_the_canonical_quiet_nan():
    # An infinite output gradient meets the padding's zeros: 0 * inf is NaN, whatever payload the
    # FMA unit would pass on.
    x, g = torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2)
    g[0, 0, 0, 0] = float("inf")
    grads = conv_weight_grads(x, g, 3, padding=1)
    nan = grads.isnan()
    assert nan.any() and (grads.view(torch.int32)[nan] == 0x7FC00000).all()


@pytest.mark.parametrize("change,match", [
    (dict(inputs="x"), "inputs must be a torch tensor"),
    (dict(inputs=torch.zeros(2, 3, 5, 5, dtype=torch.int32)), "inputs"),
    (dict(inputs=torch.zeros(2, 3, 5)), "must be \\(B, C, L\\) and \\(B, O, L_out\\)"),
    (dict(output_grads=torch.zeros(3, 4, 3, 3)), "with one B"),
    (dict(output_grads=torch.zeros(2, 4, 4, 3)), "output_grads has spatial size \\(4, 3\\)"),
    (dict(kernel_size=0), "kernel_size"),
    (dict(kernel_size=(3, 3, 3)), "kernel_size must be an int or 2 ints"),
    (dict(stride=0), "stride"),
    (dict(padding=-1), "padding"),
    (dict(dilation=0), "dilation"),
    (dict(groups=2), "groups=2 must divide the input's channels \\(3\\)"),
    (dict(kernel_size=7, padding=0), "output_grads has spatial size"),
])
def test_bad_input_names_the_argument(change, match):
    args = dict(inputs=torch.zeros(2, 3, 5, 5), output_grads=torch.zeros(2, 4, 3, 3), kernel_size=3)
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        conv_weight_grads(**args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_that_underflow_sum_to_a_signed_zero(dtype):
    """Every product rounds to -0 in float32, so each chain is -0, as the float64 reference's
    sum (-9e-60 there) rounds: the sign is kept (on CUDA, past a layer's last position too: the
    next test)."""
    x, g, args = conv_case(CUDA_TILED[1], dtype)
    x, g = torch.full_like(x, 1e-30), torch.full_like(g, -1e-30)
    got = conv_weight_grads(x, g, **args)
    want = conv_weight_grads_reference(x, g, **args).to(got.dtype)
    assert (got == 0).all() and torch.equal(got.signbit(), want.signbit()) and want.signbit().all()


@requires_cuda
@pytest.mark.parametrize("tiny", [1e-30, 1e-200], ids=["float32", "float64"])
def test_cuda_keeps_the_cpu_signed_zeros(tiny):
    x, g, args = conv_case(CUDA_TILED[1], torch.float64 if tiny < 1e-100 else torch.float32)
    x, g = torch.full_like(x, tiny), torch.full_like(g, -tiny)
    cpu = conv_weight_grads(x, g, **args)
    assert torch.equal(conv_weight_grads(x.cuda(), g.cuda(), **args).cpu().signbit(), cpu.signbit())


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("case", CONV2D + CUDA_TILED)
def test_cuda_gives_the_cpu_bits(case, dtype):
    x, g, args = conv_case(case, dtype, seed=17)
    cpu = conv_weight_grads(x, g, **args)
    gpu = conv_weight_grads(x.cuda(), g.cuda(), **args)
    assert gpu.device.type == "cuda" and torch.equal(cpu, gpu.cpu())


@requires_cuda
@pytest.mark.parametrize("case", [CONV2D[3], CUDA_TILED[0]], ids=["element", "tiled"])
def test_cuda_gives_the_cpu_bits_for_nan_and_inf(case):
    x, g, args = conv_case(case, seed=19)
    g[0, 1, 0, 0], x[1, 2, 3, 3] = float("inf"), float("nan")
    cpu = conv_weight_grads(x, g, **args)
    gpu = conv_weight_grads(x.cuda(), g.cuda(), **args).cpu()
    assert cpu.isnan().any() and torch.equal(cpu.view(torch.int32), gpu.view(torch.int32))


@requires_cuda
def test_cuda_opcheck_and_empty_batch():
    x, g, args = conv_case(CONV2D[2], seed=18)
    torch.library.opcheck(torch.ops.privleak.conv_weight_grads.default,
                          (x.cuda(), g.cuda(), [5, 5], [1, 1], [2, 2], [1, 1]))
    assert conv_weight_grads(x[:0].cuda(), g[:0].cuda(), **args).shape == (0, 12, 12, 5, 5)
