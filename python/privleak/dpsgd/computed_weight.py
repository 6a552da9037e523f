"""Book-keeping of a convolution whose forward computes the weight it convolves with from its
parameters: weight standardisation (Qiao et al. 2019, "Micro-Batch Training with Batch-Channel
Normalization and Weight Standardization"), NF-Nets' scaled standardisation with a gain, a
DropConnect mask, fake quantisation. Such a module is an ``nn.Conv1d`` / ``nn.Conv2d`` subclass
with a forward of its own, ``F.conv2d(x, w, bias, ...)`` with w = phi(theta) made from its
parameters theta before the batch comes in.

The per-sample gradient of theta is the vector-Jacobian product of phi with the per-sample
gradient of the computed weight w, which is a convolution's: G_i(theta) = J_phi^T G_i(w), where
G_i(w)[o, c, k] = sum_t g_i[o, t] x_i[c, s t - p + d k] (privleak's per-sample convolution kernel).
So the rule takes the one convolution of each forward call (a torch function mode on through the
call records its input x, the w it got and its geometry), forms G_i(w) and maps it back to theta
with one batched vector-Jacobian product through phi's own graph (``is_grads_batched``), with no
replay of the forward; the clipped sum is J_phi^T of the convolution's weight gradient of x and
the output gradients scaled by the clip factors, sum_i f_i J^T G_i(w) = J^T sum_i f_i G_i(w).
The w the forward used is the one differentiated, so a mask drawn at random in the forward
(DropConnect) is the call's own, where a replay could not redraw it.

**Standardised weights.** Where w is made from one parameter v of its shape (and gains, below)
and phi acts on each output channel's row alone as a standardisation does, its per-sample norms
need no product by J_phi at all. For w_o = (v_o - mean(v_o)) / (std(v_o) + eps), in any of its
written forms (``w.std``, or ``var`` and ``rsqrt``, or ``F.batch_norm`` of the weight as timm's
StdConv2d; any eps, correction or constant factor), J_phi^T maps each row's gradient z to

    J_o^T z = r_o z_perp + lambda1_o 1 (1 . z) / n + lambdau_o u_o (u_o . z),

z_perp the part of z orthogonal to 1 and u_o, u_o the unit direction of w_o - mean(w_o), n a row's
size (with eps = 0 and the population std: r = 1 / std and lambda1 = lambdau = 0, a scaled
projection; checked against torch's Jacobian in the tests). A gain of one value an output
channel, w_o = gamma_o s_o (NF-Nets' form), has J^T z = s_o . z, a combination of 1 . z and
u_o . z. So the squared norm of J^T G_i(w) is

    sum_o r_o^2 |G_io_perp|^2 + lambda1_o^2 (1 . G_io)^2 / n + lambdau_o^2 (u_o . G_io)^2

for v, and sum_o (a_o . G_io)^2 for a gain, a_o on 1 and u_o: no batched vector-Jacobian product
(WRN-16-4 weight-standardised, B 32, one thread: that product and its copies took ~0.7 s of a
2.4 s step). Where the convolution's ghost norm pays (the mixed rule's 2 T^2 < d p, and the pixel
Gram's, as for an ``nn.Conv2d``), G_i(w) is not formed at all: sum_o r_o^2 |G_io|^2 is the ghost
norm of the output gradients scaled by r, and the parts along 1 and u_o are sums over positions
of the output gradients times a convolution of x with ones and the call's own output
(:meth:`ComputedWeightConvLayer._ghost_norms`). Elsewhere G_i(w) is formed, whole in place of the
layer's inputs and output gradients where no larger than those (its clipped sum then one pass
over it), or a few samples at a time (formed again for the sum), and reduced
(:func:`standardised_squared_norms`).

The rule does not take the form on trust: each step (not in a step a CUDA graph captures, whose
syncs it refuses) it reads r, lambda1, lambdau and the gains' a_o from J^T applied to 1, to u and
to a random Gaussian row (one product of three rows, :func:`row_standardising_jacobian`) and
takes the closed form only where J^T gives the form's value on all three to 128 float rounding
errors: in float32 a standardisation misses it by about 1e-7 of its scale, a J off the form by a
relative 1e-3 (a weight mixing its output channels by 0.1%) by about 1e-3, a weight norm,
DropConnect or a standardisation plus a rank-one term by more than 1e-2. Where it does not hold
(other parameters beside v and gains, several calls, L1 norms, half-precision weights), the step
takes the product above.

A call that does not fit takes the fallback, the replay of
:class:`~privleak.dpsgd.layers.FunctionalLayer`, as every call of that step: its forward makes no
convolution or several, returns something other than the convolution's output or changes it in
place, computes the bias, uses a parameter outside the computed weight (in the convolution's input,
or after it), or makes a weight that depends on the batch (a dynamic convolution; seen through
the inputs with grad: one computed from a first layer's input is not).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from privleak import mechanisms
from privleak.dpsgd import conv_grads, ghost_norm, graph
from privleak.dpsgd.layers import (
    ConvLayer,
    Forming,
    FunctionalLayer,
    _batch_of,
    _common,
    _input_nodes,
    _scaled,
    _zero_dropped,
    bias_rows,
    formed_sums,
    row_norms,
    samples_per_chunk,
    use_ghost_norm,
)

_CONVOLUTIONS = {torch.conv1d: 1, torch.conv2d: 2}  # torch.nn.functional's conv1d and conv2d are these
_ARGUMENTS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_VJP_VALUES = 1 << 20  # values of the per-sample gradients a vector-Jacobian product takes at a time (below)


class ConvOutput(NamedTuple):
    """A convolution's output (detached), its version then, and the bias it added (None: none)."""

    value: torch.Tensor
    version: int
    bias: Optional[torch.Tensor]


class Convolution(NamedTuple):
    """One forward call's convolution: its input (kept, detached), the weight it computed (with
    the graph back to the parameters), the bias passed (a trainable parameter of the module, or
    None), its geometry as one int per spatial dim, and its output where the standardised form's
    ghost norm would take it (:meth:`ComputedWeightConvLayer._ghost_norms`; else None)."""

    input: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    stride: list
    padding: list
    dilation: list
    groups: int
    output: Optional[ConvOutput]


class _Recorder(TorchFunctionMode):
    """On through one forward call of the module: keeps each convolution it makes (``found``)."""

    def __init__(self):
        super().__init__()
        self.found: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        if func in _CONVOLUTIONS and torch.is_grad_enabled():  # the node and version tell a later in-place op
            self.found.append((_CONVOLUTIONS[func], {**dict(zip(_ARGUMENTS, args)), **kwargs}, output,
                               output.grad_fn, output._version))
        return output


def _per_dim(value: Any, dims: int) -> list:
    """One int per spatial dim, as torch expands a number or a one-element list."""
    values = [int(v) for v in value] if isinstance(value, (tuple, list)) else [int(value)]
    return values * dims if len(values) == 1 else values


def _padding(value: Any, weight: torch.Tensor, dilation: list) -> Optional[list]:
    """Zero padding per spatial dim; None for a 'same' padding that is not symmetric."""
    dims = weight.ndim - 2
    if value == "valid":
        return [0] * dims
    if value == "same":
        totals = [d * (k - 1) for d, k in zip(dilation, weight.shape[2:])]
        return [t // 2 for t in totals] if all(t % 2 == 0 for t in totals) else None
    return _per_dim(value, dims)


def _graph_nodes(root, inputs: frozenset) -> Optional[set]:
    """The autograd nodes of the graph from node ``root`` (none for None); None where it reaches
    one of ``inputs`` (a weight computed from the batch)."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        if node in inputs:
            return None
        seen.add(node)
        stack.extend(child for child, _ in node.next_functions)
    return seen


class RowJacobian(NamedTuple):
    """J_phi^T of a weight made from one parameter of its shape and gains (parameters of one value
    an output channel), row by row (output channel o, n values a row): for the parameter,
    ``scale`` r_o on what is orthogonal to the two orthonormal rows of ``basis`` (1 / sqrt(n) and
    u_o, the module docstring; (O, 2, n)), ``basis_scales`` (lambda1_o, lambdau_o) on those (O, 2);
    for gain k, its J^T of a row z, a_ok . z with a_ok on the basis, ``gains`` (O, K, 2); float64."""

    scale: torch.Tensor
    basis: torch.Tensor
    basis_scales: torch.Tensor
    gains: torch.Tensor


_PROBE_SEED = 0x5EED  # the random rows of the check: fixed, so that a step is the same whenever it runs
# One random row z: a J^T off the form on the parameter is caught unless its error maps z along
# z_perp, whose scale r is read from it (n - 1 other directions). A gain's J^T is one number a
# row: z misses a part of it off the basis with odds ~1e-5 / that part's size, a row at a time (a
# gain off the form in every row of a layer, ~1e-5^O). A second random row took the check from
# 0.17 to 0.33 s of WRN-16-4-ws's ~1.8 s step (B 32, one thread).
_RANDOM_PROBES = 1
_ROUNDING_ERRORS = 128  # what the check allows of J^T's distance from the form, in float rounding errors
_CHECKED_VALUES = 1 << 17  # values of a probe row the check takes at a time in float64 (below)


def _split(z: torch.Tensor, basis: torch.Tensor) -> tuple:
    """(coefficients (O, B, 2), rest (O, B, n)) of rows z (B, O, n) on an orthonormal basis (O, 2, n)
    of each row's space: two batched products, the rest formed (its norm as |z|^2 less the
    coefficients' would cancel where a gradient lies mostly along 1, as it does on inputs after a
    ReLU; a product's passes are 3-4x faster than a mean, a sum of products and an addcmul's)."""
    z = z.transpose(0, 1)
    coefficients = torch.bmm(z, basis.transpose(1, 2))
    return coefficients, torch.baddbmm(z, coefficients, basis, alpha=-1)


def row_standardising_jacobian(weight: torch.Tensor, parameter: torch.Tensor,
                               gains: tuple = ()) -> Optional[RowJacobian]:
    """J^T of ``weight`` = phi(``parameter``, ``gains``) (its graph kept) in the standardising form
    of the module docstring, or None where J^T does not take that form to 128 rounding errors of
    the weight's dtype on the rows it is checked on (1, u and random Gaussian rows), or a row of
    the weight is constant (no direction u). One vector-Jacobian product of those rows, checked in
    float64 from their inner products (:func:`_checked_rows`), a block of rows at a time (whole,
    the check's float64 copies took more than the rest of the step held: WRN-16-4's 590k-weight
    convolutions)."""
    rows = weight.shape[0]
    w = weight.detach().reshape(rows, -1).double()
    basis = w.new_empty(rows, 2, w.shape[1])  # (O, 2, n): 1 / sqrt(n), u
    basis[:, 0] = w.shape[1] ** -0.5
    centred = torch.sub(w, w.mean(-1, keepdim=True), out=basis[:, 1])
    length = torch.linalg.vector_norm(centred, dim=-1, keepdim=True)
    if not bool((length > 0).all()):
        return None
    centred /= length
    # privleak's own Gaussian: torch's randn took more of the check than the product (WRN-16-4)
    random = mechanisms.gaussian_noise((_RANDOM_PROBES, *w.shape), key=_PROBE_SEED, offset=0, dtype=weight.dtype,
                                       device=w.device)
    probes = torch.cat([basis.transpose(0, 1).to(weight.dtype), random])  # (2 + P, O, n), as the product takes them
    pulled = torch.autograd.grad(weight, [parameter, *gains], probes.view(len(probes), *weight.shape),
                                 retain_graph=True, allow_unused=True, is_grads_batched=True)
    pulled = [torch.zeros(len(probes), *p.shape, dtype=weight.dtype, device=w.device) if t is None else t
              for p, t in zip([parameter, *gains], pulled)]
    main = pulled[0].reshape(len(probes), rows, -1)
    found = (torch.stack([t.reshape(len(probes), rows) for t in pulled[1:]], -1) if gains
             else main.new_zeros(len(probes), rows, 0)).double()
    eps = _ROUNDING_ERRORS * torch.finfo(weight.dtype).eps
    parts, step = [], max(1, _CHECKED_VALUES // w.shape[1])
    # one float64 block for all (fresh ones cost their page faults: ~half the check, WRN-16-4)
    stacked = w.new_empty(min(step, rows), 2 + len(probes) + _RANDOM_PROBES, w.shape[1])
    for start in range(0, rows, step):
        block = slice(start, start + step)
        within = stacked[:min(step, rows - start)]
        within[:, :2] = basis[block]
        within[:, 2:2 + len(probes)] = main[:, block].transpose(0, 1)
        within[:, 2 + len(probes):] = random[:, block].transpose(0, 1)
        part = _checked_rows(within, found[:, block], len(probes), eps)
        if part is None:
            return None
        parts.append(part)
    scale, basis_scales, on_basis = (torch.cat(column) for column in zip(*parts))
    return RowJacobian(scale, basis, basis_scales, on_basis)


def _checked_rows(stacked: torch.Tensor, found: torch.Tensor, count: int, eps: float) -> Optional[tuple]:
    """(scale, basis scales, gains on the basis) of a block of R rows from J^T of the probes: in
    ``stacked`` (R, 2 + count + P, n), float64, the basis b_k, J^T of the ``count`` probes (b_1,
    b_2, then the random ones), and the P random probes z; ``found`` (count, R, K) the gains' J^T
    of the probes. None where a probe's J^T is further from the form than ``eps`` times the
    largest scale and the probe's length.

    From the Gram matrix of those rows: the form has J^T b_k = lambda_k b_k, so |J^T b_k -
    lambda_k b_k|^2 = |J^T b_k|^2 - lambda_k^2; z = c . b + z_perp and |J^T z - r z_perp - sum_k
    lambda_k c_k b_k|^2 expands the same way. The expansions cancel where the form holds, but
    float32 values' products are exact in float64 and the sums' rounding (~n 1e-16 of |J^T z|^2)
    lies far below the threshold's square, (128 eps32)^2 ~ 2e-10. The basis rows went through J^T
    rounded to the weight's dtype: their J^T differs from lambda_k b_k by half a rounding error,
    inside the threshold."""
    probes = stacked.shape[1] - 2 - count
    gram = torch.bmm(stacked, stacked.transpose(1, 2))
    squares = gram.diagonal(dim1=1, dim2=2)
    of_main, of_random = slice(2, 2 + count), slice(2 + count, 2 + count + probes)
    basis_scales = torch.diagonal(gram[:, of_main][:, :2, :2], dim1=1, dim2=2)  # lambda_k = b_k . J^T b_k
    m, c = gram[:, of_main][:, 2:, :2], gram[:, of_random, :2]  # J^T z's and z's parts along the basis (R, P, 2)
    main_dot = torch.diagonal(gram[:, of_main][:, 2:, of_random], dim1=1, dim2=2) - (m * c).sum(-1)  # J^T z . z_perp
    perp = squares[:, of_random] - c.square().sum(-1)  # |z_perp|^2
    scale = main_dot.sum(1) / perp.sum(1)
    lambdas, r = basis_scales[:, None], scale[:, None]
    of_basis, of_z = squares[:, of_main][:, :2], squares[:, of_main][:, 2:]  # |J^T b_k|^2, |J^T z|^2
    misses = torch.cat([of_basis - basis_scales.square(),
                        of_z - 2 * r * main_dot + r.square() * perp
                        - 2 * (lambdas * c * m).sum(-1) + (lambdas * c).square().sum(-1)], 1)
    largest = torch.cat([scale.abs()[:, None], basis_scales.abs()], 1).amax(1, keepdim=True)
    lengths = torch.cat([squares[:, :2], squares[:, of_random]], 1)  # |b_k|^2 = 1, |z|^2
    if not bool((misses <= (eps * largest).square() * lengths).all()):
        return None
    on_basis = found[:2].permute(1, 2, 0)  # (R, K, 2): a_ok . (1 / sqrt(n)) and a_ok . u_o
    predicted = torch.einsum("rkj,rpj->prk", on_basis, c)  # (P, R, K)
    allowed = eps * on_basis.abs().amax(-1)[None] * squares[:, of_random].T.sqrt()[..., None]
    if not bool(((found[2:] - predicted).abs() <= allowed).all()):
        return None
    return scale, basis_scales, on_basis


def _squared_norms(jacobian: RowJacobian, rest: torch.Tensor, coefficients: torch.Tensor) -> list:
    """(B,) float64 squared norms of J^T G_i per parameter (the standardised one, then each gain),
    from r_o^2 |G_io_perp|^2 per row ``rest`` (O, B), or their sum (1, B), and the coefficients on
    the basis (O, B, 2)."""
    coefficients = coefficients.double()
    weight = rest.sum(0) + (jacobian.basis_scales.square()[:, None] * coefficients.square()).sum((0, 2))
    gains = torch.einsum("okc,obc->kbo", jacobian.gains, coefficients).square().sum(-1)
    return [weight, *gains]


def standardised_squared_norms(grads: torch.Tensor, jacobian: RowJacobian) -> list:
    """(B,) float64 |J^T G_i|^2 per parameter of per-sample weight gradients ``grads`` (B, O, ...):
    for the standardised one, sum_o r_o^2 |G_io_perp|^2 + lambda1_o^2 (1 . G_io)^2 / n + lambdau_o^2
    (u_o . G_io)^2; for gain k, sum_o (a_ok . G_io)^2; the products in the gradients' dtype (as
    :func:`~privleak.dpsgd.layers.row_norms`), the sums in float64."""
    g = grads.reshape(*grads.shape[:2], -1)
    coefficients, rest = _split(g, jacobian.basis.to(g.dtype))
    return _squared_norms(jacobian, jacobian.scale.square()[:, None] * torch.linalg.vector_norm(rest, dim=-1).double()
                          .square(), coefficients)


def _by_factors(params: list, factors: dict) -> list:
    """(factors, parameters) per distinct tensor of factors (flat clipping gives every parameter
    the same one, per-layer clipping each its own), told apart by identity, as the fallback's."""
    groups: dict = {}
    for p in params:
        groups.setdefault(id(factors[id(p)]), (factors[id(p)], []))[1].append(p)
    return list(groups.values())


class ComputedWeightConvLayer(FunctionalLayer):
    """An ``nn.Conv1d`` / ``nn.Conv2d`` subclass with a forward of its own (the module docstring):
    the fallback's recording, with each call's convolution kept, and its per-sample gradients and
    clipped sums from the convolution rule and one vector-Jacobian product through the computed
    weight where every call of the step fits."""

    intercepts_forward = True
    chunk_at_least = 8  # a chunk's per-sample gradients are one kernel call each, not a replay

    @classmethod
    def takes(cls, module: nn.Module) -> bool:
        """Any Conv1d or Conv2d subclass with a forward of its own, a parametrized one too: the
        weight its convolution gets is what the rule reads."""
        return isinstance(module, (nn.Conv1d, nn.Conv2d))

    def clear(self) -> None:
        super().clear()
        self.convolutions: list = []  # per call, its Convolution, or None where the call does not fit
        self.jacobian: Optional[RowJacobian] = None  # this step's, where the standardised form holds
        self.jacobian_checked = False
        self.formed: Optional[torch.Tensor] = None  # G_i(w), where the standardised form formed it whole
        self.formed_chunk: Optional[int] = None  # samples a chunk, where it formed G_i(w) a few samples at a time
        self.bias_rows: Optional[torch.Tensor] = None  # the bias's per-sample gradients whose norms it took

    def forward_mode(self) -> _Recorder:
        return _Recorder()

    def record(self, args: tuple, kwargs: dict, output: Any) -> list[torch.Tensor]:
        recorder, self.recorder = self.recorder, None
        outputs = super().record(args, kwargs, output)
        if outputs:
            convolution = self._fitting(recorder, tree_flatten((args, kwargs))[0], output)
            self.convolutions.append(convolution)
            if convolution is not None:  # no broadcast rule: its watched nodes would run the weight's graph in
                self.watched[-1] = []  # the step's backward, which would then free it before the norms
                self.calls[-1] = (*self.calls[-1][:4], None)
        return outputs

    def _fitting(self, recorder: Optional[_Recorder], leaves: list, output: Any) -> Optional[Convolution]:
        """The call's convolution where the call fits the rule (the module docstring), else None: its
        output is the call's, unchanged since (no in-place op); the parameters enter it only through
        the computed weight and the bias, and the weight's graph does not reach the call's inputs
        (``leaves``, its arguments as given: their autograd nodes are where the module's graph ends)."""
        if recorder is None or len(recorder.found) != 1:
            return None
        dims, bound, y, node, version = recorder.found[0]
        x, w, bias = bound.get("input"), bound.get("weight"), bound.get("bias")
        if (y is not output or y.grad_fn is not node or y._version != version or not isinstance(x, torch.Tensor)
                or x.ndim != dims + 2 or x.shape[0] != _batch_of(leaves) or not w.requires_grad
                or (bias is not None and bias.requires_grad and not any(bias is p for p in self.parameters))):
            return None
        inputs = _input_nodes(leaves)
        inside = _graph_nodes(w.grad_fn, inputs)
        if (inside is None or not any(p is not bias for p in self.parameters)
                or any(getattr(n, "variable", None) is bias for n in inside if bias is not None)):
            return None
        # Outside the weight's graph the parameters are used only as the convolution's bias and
        # (a weight used as it is) weight, and the weight's graph is entered only by the
        # convolution's weight edge (its input 1): a node shared with the input's graph (x * s and
        # w * s of one s) would count once in a count of uses.
        parents: dict = {}
        outside = graph.count_uses([node], self.parameters, stop=inputs | inside, parents=parents)
        if outside != [(p is bias) + (p is w) for p in self.parameters] or any(
                parents.get(n, []) != ([(node, 1)] if n is w.grad_fn else []) for n in inside):
            return None
        dilation = _per_dim(bound.get("dilation", 1), dims)
        padding = _padding(bound.get("padding", 0), w, dilation)
        if padding is None:
            return None
        groups = int(bound.get("groups", 1))
        positions, kernel = math.prod(y.shape[2:]), math.prod(w.shape[2:])
        # The output kept for the standardised form's ghost norm; not in bfloat16 (autocast), which
        # would lose the digits of the part along u.
        ghost = (use_ghost_norm(positions, math.prod(w.shape[1:]), w.shape[0] // groups)
                 and ghost_norm.pixel_gram_pays(math.prod(x.shape[2:]), positions, kernel)
                 and y.dtype in (torch.float32, torch.float64))
        output = ConvOutput(y.detach(), version, None if bias is None else bias.detach()) if ghost else None
        return Convolution(self.keep(x), w, bias if bias is not None and bias.requires_grad else None,
                           _per_dim(bound.get("stride", 1), dims), padding, dilation, groups, output)

    def renumber(self, new: dict) -> None:
        super().renumber(new)
        self.convolutions = [c for call, c in enumerate(self.convolutions) if call in new]

    def _fits(self) -> bool:
        return bool(self.convolutions) and all(c is not None for c in self.convolutions) and not (
            self.shared_calls or self.flattened or self.flattened_outputs)

    def _standardising(self) -> Optional[RowJacobian]:
        """This step's J^T where the weight's norms take the standardised form (the module
        docstring): one call, its weight in float32 or float64 made from one parameter of its
        shape and gains of one value an output channel, and J^T checked to take the form (a host
        read: not in a step a CUDA graph captures, on the CPU's graphed step too); None otherwise
        (checked once a step)."""
        if not self.jacobian_checked:
            self.jacobian_checked = True
            if self._fits() and len(self.convolutions) == 1 and self.may_sync:
                c = self.convolutions[0]
                parameter, *gains = self._form_parameters(c)
                rows = c.weight.shape[0]
                if (parameter.shape == c.weight.shape and c.weight.dtype in (torch.float32, torch.float64)
                        and all(p.numel() == rows and p.shape[0] == rows for p in gains)):
                    self.jacobian = row_standardising_jacobian(c.weight, parameter, tuple(gains))
        return self.jacobian

    def _form_parameters(self, c: Convolution) -> list:
        """The computed weight's parameters, the one of its shape first (the standardised form's order)."""
        params = self._weight_parameters(c)
        return sorted(params, key=lambda p: p.shape != c.weight.shape)

    def _forming(self, batch: int) -> Forming:
        """Whole where no larger than the inputs and output gradients the layer holds, else a few
        samples at a time for the norms: the second pass that then makes the clipped sum forms the
        same chunks by the convolution kernel again, not a replay, so it pays to hold less
        (WRN-16-4 weight-standardised, B 64: the 16 x 16 stage's 147k weights a sample formed
        whole held 4 x 38 MB past the non-private peak)."""
        if not self._fits():
            return super()._forming(batch)
        if self._standardising() is not None:  # norms without J^T (L1 norms: a few samples at a time)
            return Forming.NEVER
        return Forming.AFTER if self._per_sample_size() <= self._held_per_sample(batch) else Forming.NEVER

    def _held_per_sample(self, batch: int) -> int:
        """The fallback's count, and the convolutions' inputs where the forward made them (padded)."""
        leaves = {x.untyped_storage().data_ptr() for leaves, *_ in self.calls for x in leaves
                  if isinstance(x, torch.Tensor)}
        made = sum(c.input.numel() for c in self.convolutions
                   if c is not None and c.input.untyped_storage().data_ptr() not in leaves)
        return super()._held_per_sample(batch) + made // max(batch, 1)

    def _weight_parameters(self, convolution: Convolution) -> list:
        return [p for p in self.parameters if p is not convolution.bias]

    @staticmethod
    def _weight_grads(c: Convolution, g: torch.Tensor, samples) -> torch.Tensor:
        """(B, *w.shape) per-sample gradients of the computed weight w for a slice of the batch (or
        an index tensor of samples)."""
        x, g = _common(c.input[samples], g[samples])
        return conv_grads.per_sample_conv_grads(x, g, list(c.weight.shape[2:]), c.stride, c.padding, c.dilation,
                                                c.groups)

    def norms_by_parameter(self, batch: int, norm_type: int) -> dict:
        """Squared L2 norms in the standardised form (the module docstring): by the ghost norm where
        the call kept its output (:meth:`_ghost_norms`) and it is unchanged; else from G_i(w), formed
        whole in place of the call's input and output gradients, which go, and kept for the clipped
        sum (sum_i f_i G_i(w), one pass over them, in place of a weight-gradient convolution) where
        no larger than those, or a few samples at a time (formed again in the same chunks for the
        sum); otherwise the fallback's. The bias's rows are kept for its sum."""
        jacobian = self._standardising()
        if norm_type != 2 or jacobian is None:
            return super().norms_by_parameter(batch, norm_type)
        (c,), ((g,),) = self.convolutions, self.grads
        params = self._form_parameters(c)
        held, size = self._held_per_sample(batch), params[0].numel()
        bias = self.bias_rows = None if c.bias is None else bias_rows([g], channels_last=False)
        if c.output is not None and c.output.value._version == c.output.version:
            pixels = math.prod(c.input.shape[2:])
            chunk = samples_per_chunk(held, c.groups * 2 * pixels * pixels + math.prod(g.shape[1:]),
                                      at_least=self.chunk_at_least, on_gpu=g.is_cuda)
            parts = [self._ghost_norms(c, g, jacobian, slice(i, i + chunk)) for i in range(0, batch, chunk)]
        elif size <= held:
            self.formed = self._weight_grads(c, g, slice(None))
            self.convolutions[0] = c._replace(input=None, output=None)
            self.calls[0] = ([None] * len(self.calls[0][0]), *self.calls[0][1:])
            self.grads[0] = [None]
            parts = [standardised_squared_norms(self.formed, jacobian)]
        else:
            chunk = self.formed_chunk = samples_per_chunk(held, 3 * size, at_least=self.chunk_at_least,
                                                          on_gpu=g.is_cuda)
            parts = [standardised_squared_norms(self._weight_grads(c, g, slice(i, i + chunk)), jacobian)
                     for i in range(0, batch, chunk)]
        norms = {id(p): torch.cat(column) for p, column in zip(params, zip(*parts))}
        if bias is not None:
            norms[id(c.bias)] = row_norms(bias, norm_type)
        return norms

    def _ghost_norms(self, c: Convolution, output_grads: torch.Tensor, jacobian: RowJacobian,
                     samples: slice) -> list:
        """The standardised form for a slice of the batch without G_i(w): sum_o r_o^2 |G_io|^2 is
        the ghost norm of x and the output gradients scaled by r (from the pixel Gram,
        :func:`~privleak.dpsgd.ghost_norm.conv_ghost_norms`), and each row's parts along 1 and u are
        sums over positions, 1 . G_io = sum_t g_iot b_it with b = conv(x, ones) (one output channel a
        group), u_o . G_io = sum_t g_iot conv(x, u_o)_it = (sum_t g_iot (y_iot - bias_o) - m_o 1 .
        G_io) / l_o, from the call's output y, w_o = m_o + l_o u_o. Where a sample's part off 1 and u
        is under 1% of sum_o r_o^2 |G_io|^2, its difference would lose digits: that sample's norms are
        taken from its G_i(w) instead (:func:`standardised_squared_norms`)."""
        x, g = _common(c.input[samples], output_grads[samples])
        kernel, groups = list(c.weight.shape[2:]), c.groups
        scale = jacobian.scale.to(g.dtype).view(1, -1, *[1] * (g.ndim - 2))
        ghost = ghost_norm.conv_ghost_norms(x, g * scale, kernel, c.stride, c.padding, c.dilation, groups,
                                            clipping=True, may_sync=self.may_sync)
        convolve = torch.conv1d if len(kernel) == 1 else torch.conv2d
        # conv(x, ones) as a box filter of the group's channels summed: 4-6x faster than convolving
        # x with ones (WRN-16-4's 16 x 16 and 8 x 8 layers)
        box = convolve(x.unflatten(1, (groups, -1)).sum(2), x.new_ones(groups, 1, *kernel), None, c.stride, c.padding,
                       c.dilation, groups).flatten(2)
        g = g.flatten(2)  # (B, O, T)
        along_ones = torch.einsum("bgpt,bgt->bgp", g.unflatten(1, (groups, -1)), box).flatten(1).double()
        along_output = torch.einsum("bot,bot->bo", g, c.output.value[samples].flatten(2).to(g.dtype))
        if c.output.bias is not None:
            along_output = along_output - c.output.bias.to(g.dtype) * g.sum(-1)
        w = c.weight.detach().flatten(1).double()
        mean = w.mean(1)
        length = torch.linalg.vector_norm(w - mean[:, None], dim=1)
        coefficients = torch.stack([along_ones * w.shape[1] ** -0.5, (along_output.double() - mean * along_ones)
                                    / length], -1).transpose(0, 1)  # (O, B, 2)
        perp = ghost - (jacobian.scale.square()[:, None] * coefficients.square().sum(-1)).sum(0)
        norms = _squared_norms(jacobian, perp.clamp(min=0)[None], coefficients)
        lost = (perp < 0.01 * ghost).nonzero()[:, 0]
        if lost.numel():
            exact = standardised_squared_norms(self._weight_grads(c, output_grads, lost + (samples.start or 0)),
                                               jacobian)
            for column, values in zip(norms, exact):
                column[lost] = values
        return norms

    def per_sample_grads(self, batch: int, samples: slice = slice(None)) -> dict:
        """G_i(theta) = J^T G_i(w) per call, added over the calls (the module docstring); the bias's
        per-sample gradients are the output gradients summed over positions."""
        if not self._fits():
            return super().per_sample_grads(batch, samples)
        grads: dict = {}
        for c, (g,) in zip(self.convolutions, self.grads):
            per_sample = self._weight_grads(c, g, samples)
            params = self._weight_parameters(c)
            step = max(1, _VJP_VALUES // c.weight.numel())
            pulled = [torch.autograd.grad(c.weight, params, part.to(c.weight.dtype), retain_graph=True,
                                          allow_unused=True, is_grads_batched=True) for part in per_sample.split(step)]
            terms = {id(p): torch.zeros(per_sample.shape[0], *p.shape, dtype=p.dtype, device=p.device) if t[0] is None
                     else t[0] if len(t) == 1 else torch.cat(t) for p, t in zip(params, zip(*pulled))}
            if c.bias is not None:
                terms[id(c.bias)] = bias_rows([g[samples]], channels_last=False)
            for key, t in terms.items():
                grads[key] = t if key not in grads else grads[key] + t
        return grads

    def sums_by_parameter(self, factors: dict, keep: Optional[torch.Tensor], norm_type: int) -> dict:
        """J^T of the convolution's weight gradient of x and f g per call: one of each per distinct
        tensor of factors (flat clipping gives every parameter the same one, per-layer clipping each
        its own; told apart by identity, as the fallback's); where the standardised form's norms came
        from G_i(w), J^T of sum_i f_i G_i(w) of the very G_i(w) (:meth:`_formed_sums`). Where the norms
        came from the fallback's chunks (L1 norms, or a weight not standardised), the same chunks
        formed again (:func:`~privleak.dpsgd.layers.formed_sums`)."""
        if not self._fits() or (self.chunked and (norm_type != 2 or self._standardising() is None)):
            return super().sums_by_parameter(factors, keep, norm_type)
        if self.formed is not None or self.formed_chunk is not None:
            return self._formed_sums(factors, keep)
        sums: dict = {}
        for c, (g,) in zip(self.convolutions, self.grads):
            x, g = _common(_zero_dropped(c.input, keep), _zero_dropped(g, keep))
            for f, params in _by_factors(self._weight_parameters(c), factors):
                scaled, x_like = _common(_scaled(g, f), x)
                weight_grad = torch.ops.aten.convolution_backward(
                    scaled, x_like, c.weight.detach().to(x_like.dtype), None, c.stride, c.padding, c.dilation, False,
                    [0] * len(c.stride), c.groups, [False, True, False])[1]
                self._add_pulled(sums, c, params, weight_grad)
        return self._bias_sum(sums, factors, keep)

    def _formed_sums(self, factors: dict, keep: Optional[torch.Tensor]) -> dict:
        """J^T sum_i f_i G_i(w) per distinct tensor of factors, of the G_i(w) whose norms were taken:
        one pass over them where formed whole, else formed again in the same chunks
        (:func:`~privleak.dpsgd.layers.formed_sums`). A weight gradient by the convolution's backward
        beside them rounds its own way, and where a sample's G_i(w) cancels (constant pixels under
        output gradients of mean 0) its share of the update reached 1.43 times C."""
        (c,) = self.convolutions
        groups = _by_factors(self._weight_parameters(c), factors)
        by_group = {k: f for k, (f, _) in enumerate(groups)}
        if self.formed is not None:
            grads = _zero_dropped(self.formed, keep)
            weight_sums = {k: torch.tensordot(f.to(grads.dtype), grads, 1) for k, f in by_group.items()}
        else:
            (g,), = self.grads
            weight_sums = formed_sums(lambda samples: dict.fromkeys(by_group, self._weight_grads(c, g, samples)),
                                      self.formed_chunk, g.shape[0], by_group, keep)
        sums: dict = {}
        for k, (_, params) in enumerate(groups):
            self._add_pulled(sums, c, params, weight_sums[k])
        return self._bias_sum(sums, factors, keep)

    def _bias_sum(self, sums: dict, factors: dict, keep: Optional[torch.Tensor]) -> dict:
        """``sums`` with the bias's sum_i f_i rows_i, of the rows whose norms were taken: a sum of the
        scaled output gradients rounds its own way, and a sample whose output gradients cancel over
        the positions was released at 1.17 times C."""
        bias, rows = self.convolutions[0].bias, self.bias_rows
        if bias is not None:
            sums[id(bias)] = torch.tensordot(factors[id(bias)].to(rows.dtype), _zero_dropped(rows, keep), 1)
        return sums

    @staticmethod
    def _add_pulled(sums: dict, c: Convolution, params: list, weight_grad: torch.Tensor) -> None:
        """J^T of a gradient of the computed weight, added to ``sums`` per parameter."""
        pulled = torch.autograd.grad(c.weight, params, weight_grad.to(c.weight.dtype), retain_graph=True,
                                     allow_unused=True)
        for p, t in zip(params, pulled):
            t = torch.zeros_like(p) if t is None else t
            sums[id(p)] = t if id(p) not in sums else sums[id(p)] + t


ConvLayer.own_forward_rule = ComputedWeightConvLayer
