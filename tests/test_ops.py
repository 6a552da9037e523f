"""Every torch.ops.privleak op passes torch.library.opcheck (schema, fake kernel, autograd
registration, torch.compile's tracing), and behaves as torch's own ops do under autograd."""
import privleak.dpsgd  # noqa: F401  (defines the ops of the dpsgd modules)
import pytest
import torch
from conftest import requires_cuda
from privleak import _ops


def cases(device: str) -> dict:
    """Arguments for each op, on ``device``: at least one call per op, some with inputs that
    require grad (opcheck then checks the autograd registration too)."""
    generator = torch.Generator().manual_seed(3)

    def draw(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=generator).to(device, dtype)

    def ids(*shape):
        return torch.randint(0, 4, shape, generator=generator).to(device)

    a, g = draw(3, 7, 5), draw(3, 7, 4)
    mu = draw(6)
    def norms(*values):
        return torch.tensor(values, dtype=torch.float64, device=device)

    one = norms(1.0)
    return {
        "noise": [([4, 3], "gaussian", 1.0, [9, 0], 0, 0, torch.float32, torch.device(device))],
        "add_noise": [(draw(5, 3).requires_grad_(), "gaussian", 0.5, [5, 7], 3, 0)],
        "add_noise_": [(draw(5, 3), "laplace", 0.5, [0, 2**30], 3, 0)],
        "add_noise_many_": [([draw(5, 3), draw(4)], "gaussian", 0.5, [5, 7], 3, 0)],
        "vmf_sample": [(mu / mu.norm(), 2.0, 3, [1, 2], 0)],
        "clip_accumulate": [([draw(4, 3, 2), draw(4, 5)], one, False, 0.5, [1, 2], 0, 0.25, 2),
                            ([draw(4, 3, 2), draw(4, 5)], norms(1.0, 0.5), True, 0.0, [0, 0], 0, 1.0, 1),
                            ([draw(4, 3, 2)], norms(1.0, 0.5, 2.0), True, 0.0, [0, 0], 0, 1.0, 2,
                             draw(4, 2, dtype=torch.float64).abs())],
        "clip_factors": [(draw(4, 2, dtype=torch.float64).abs(), one, False, 2),
                         (draw(5, 3, dtype=torch.float64).abs(), norms(0.5, 1.0, 2.0), True, 2)],
        "conv_ghost_norm": [(draw(2, 3, 6, 6).requires_grad_(), draw(2, 4, 3, 3), [3, 3], [2, 2], [1, 1], [1, 1]),
                            (draw(2, 2, 9, 8, dtype=torch.bfloat16), draw(2, 3, 4, 5, dtype=torch.bfloat16), [3, 2],
                             [2, 1], [1, 0], [2, 3])],
        "conv_weight_grads": [(draw(2, 3, 6, 6).requires_grad_(), draw(2, 4, 3, 3), [3, 3], [2, 2], [1, 1], [1, 1]),
                              (draw(2, 2, 9, 8), draw(2, 3, 4, 5), [3, 2], [2, 1], [1, 0], [2, 3])],
        "ghost_norm": [([a.clone().requires_grad_()], [g]),
                       ([a.to(torch.bfloat16), draw(3, 2, 6)], [g.to(torch.bfloat16), draw(3, 2, 1)])],
        "embedding_ghost_norm": [(ids(3, 7), g.clone().requires_grad_())],
    }


def test_every_op_has_cases():
    assert set(cases("cpu")) == set(_ops.OPERATORS)


@pytest.mark.parametrize("name", sorted(cases("cpu")))
def test_ops_pass_opcheck(name):
    for args in cases("cpu")[name]:
        torch.library.opcheck(_ops.OPERATORS[name].default, args)


@requires_cuda
@pytest.mark.parametrize("name", sorted(cases("cpu")))
def test_cuda_ops_pass_opcheck(name):
    for args in cases("cuda")[name]:
        torch.library.opcheck(_ops.OPERATORS[name].default, args)


def test_an_op_that_writes_bumps_the_version_so_autograd_sees_the_write():
    x = torch.ones(3, requires_grad=True)
    y = x.exp()  # exp saves its output for the backward
    before = y._version
    torch.ops.privleak.add_noise_(y, "gaussian", 1.0, [1, 2], 0, 0)
    assert y._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    z = x.exp()
    torch.ops.privleak.add_noise_many_([z], "gaussian", 1.0, [1, 2], 0, 0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_ops_without_a_backward_give_outputs_that_do_not_require_grad():
    a = torch.randn(2, 3, 4, requires_grad=True)
    out = torch.ops.privleak.ghost_norm([a], [torch.randn(2, 3, 5)])
    assert not out.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.sum().backward()


def test_add_noise_passes_the_gradient_through():
    x = torch.randn(4, 3, requires_grad=True)
    weights = torch.randn(4, 3)
    (torch.ops.privleak.add_noise(x, "gaussian", 0.5, [5, 7], 0, 0) * weights).sum().backward()
    assert torch.equal(x.grad, weights)
