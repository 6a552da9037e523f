"""Per-layer rules of book-keeping DP-SGD (:class:`privleak.dpsgd.BookKeeping`): what a layer
records in the forward pass, and how it turns its inputs and output gradients into per-sample
norms and the clipped sum of its parameters' gradients.

One class per layer kind, found through one table (:func:`layer_for`): a module's type, or the
nearest base class in the table whose ``forward`` the module does not override. A module with
trainable parameters and no entry in the table takes the fallback, :class:`FunctionalLayer`.

Notation: sample i of a batch of B, positions t = 1..T (tokens, output pixels, or 1), a layer
input a_{i,t} in R^d and the gradient of the summed loss by the layer output, g_{i,t} in R^p.
Every rule returns, per parameter tensor, each sample's squared L2 norm (``norm_type`` 2) or L1
norm (``norm_type`` 1) of its per-sample gradient, then the sum of per-sample gradients weighted
by clip factors f_i (book-keeping: Bu et al., "Differentially Private Optimization on Large Model
at Small Cost", ICML 2023), one GEMM per layer with the output gradients scaled by f_i.
"""
from __future__ import annotations

import contextlib
import enum
import fnmatch
import functools
import math
import threading
import warnings
from typing import Any, ClassVar, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import _SpectralNorm
from torch.nn.utils.spectral_norm import SpectralNorm as _HookSpectralNorm
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from privleak.dpsgd import buffers, conv_grads, direct_reads, ghost_norm, graph
from privleak.dpsgd.stateless import functional_call
from privleak.dpsgd.tied import Factors


def use_ghost_norm(positions: int, inputs: int, outputs: int) -> bool:
    """The mixed rule of Bu et al.: the ghost norm sum_{t,s} (a_t . a_s)(g_t . g_s) costs about
    2 T^2 (d + p) per sample and two T x T Gram matrices, the per-sample gradient T d p and a
    p x d matrix; take the ghost norm when 2 T^2 < d p."""
    return 2 * positions * positions < inputs * outputs


class Forming(enum.Enum):
    """When a layer on the per-sample side of the mixed rule forms its per-sample gradients."""

    DURING = "in the backward pass, in place of its inputs and output gradients, which are freed"
    AFTER = "after the backward pass, from the inputs and output gradients it kept"
    NEVER = ("never whole: norms a few samples at a time (the per-sample gradients' formed again in the same chunks "
             "for the clipped sum; ghost norms' sum by one weight-gradient pass)")


def when_to_form(per_sample: int, held: int) -> Forming:
    """When a layer forms its per-sample gradients (``per_sample`` values a sample), given the
    inputs and output gradients it holds (``held`` values a sample). No larger than those: during
    the backward pass, where forming them frees more than it takes. Up to 4 times larger: after
    it, once the backward has freed the activations, so that they do not add to the backward's
    peak (paper CNN, B 256: two 12-channel convolutions' 7 MiB of them did, 1.30x the non-private
    step's peak RSS). Larger still (a 128-channel 3 x 3 convolution at 8 x 8 holds 9 times more):
    never whole, at the price of forming them twice, for the norms and again for the clipped sum
    (:func:`formed_sums`; paper CNN, B 64: the step 1.6x -> 2.1x of non-private when all took a
    second pass). Values, not bytes: per-sample gradients are
    float32, so beside bfloat16 activations the bounds are twice as large in bytes."""
    if per_sample <= held:
        return Forming.DURING
    return Forming.AFTER if per_sample <= 4 * held else Forming.NEVER


#: Values (4 bytes each) a chunk's transient may reach on a GPU, whatever the layer holds: a chunk
#: is a few kernel launches, and a GPU runs one block a sample (and tile) at once. With chunks of 8
#: samples, the CIFAR CNN's 8 x 8 convolutions' ghost norms took 1.4 ms of its step's 5.6 ms of
#: GPU time (B 128, H200: 32 launches of 8 blocks on 132 multiprocessors).
GPU_CHUNK_VALUES = 2**23


def samples_per_chunk(held: int, transient: int, at_least: int = 8, on_gpu: bool = False) -> int:
    """How many samples a layer takes at a time through a step that forms ``transient`` values
    per sample while it holds ``held`` per sample (a convolution's patches for its ghost norm):
    about as many as keep the transient within what the layer holds, and at least ``at_least``,
    so that the calls stay few (CIFAR CNN, B 64: peak memory 1.34x -> 1.05x of non-private). A
    replayed module's call is a forward and backward of it, large enough alone: at least 1 (the
    bench Mixtral's experts when they were replayed, B 8: 8 samples a call -> 1, peak RSS 1134 -> 924
    MB, and faster). ``on_gpu``: at least as many as keep it within :data:`GPU_CHUNK_VALUES` too."""
    fits = held // max(transient, 1)
    if on_gpu:
        fits = max(fits, GPU_CHUNK_VALUES // max(transient, 1))
    return max(at_least, fits)


#: Values of a row that :func:`row_norms` adds in float32, as the fused clip kernel adds each of
#: its float lanes (kClipChunk / kClipLanes = 4096 / 16, csrc/common/clip.h).
ROW_BLOCK = 256


def row_norms(rows: torch.Tensor, norm_type: int) -> torch.Tensor:
    """(N,) float64: squared L2 (norm_type 2) or L1 norm of each row of an (N, ...) tensor, to the
    fused clip kernel's precision: ``ROW_BLOCK`` values added in float32 (at least), the blocks in
    float64, as the kernel adds its lanes. torch's vector norm reduces without a temporary of the
    rows' size (squares then a sum wrote one: 1.5 ms for the CIFAR CNN's 64 x 37k per-sample
    gradients, against 0.16 ms), but in float32 over a whole row it erred by up to 3.5e-4 of an L1
    norm at 2.4M values (4e-5 of an L2 norm), under, and the very gradients it clipped were
    released at up to 1 + 4e-4 times C (a Conv2d of 512 channels under L1; 1 + 1e-5 under L2, a
    review's repros); in blocks, by 1e-8 to 1e-9 there, as the kernel's. 1.2-1.6x the time of
    the one reduction under L2, 1.5-1.7x under L1."""
    rows = rows.reshape(rows.shape[0], -1)
    dtype = torch.promote_types(rows.dtype, torch.float32)
    values = rows.shape[1]
    whole = values - values % ROW_BLOCK
    parts = [torch.linalg.vector_norm(rows[:, whole:], ord=norm_type, dim=1, keepdim=True, dtype=dtype)]
    if whole:
        parts.append(torch.linalg.vector_norm(rows[:, :whole].reshape(rows.shape[0], -1, ROW_BLOCK), ord=norm_type,
                                              dim=2, dtype=dtype))
    blocks = torch.cat(parts, 1).double()
    return blocks.square().sum(1) if norm_type == 2 else blocks.sum(1)


def factor_norms(rows: torch.Tensor, norm_type: int, may_sync: bool) -> torch.Tensor:
    """:func:`row_norms` of one factor of a rank-one gradient (a or g of g a^T), whose product
    with the other's is the gradient's norm: the rows whose float32 norms leave the range where
    float32 computes them to its rounding (squared L2 or L1 norms in [2^-80, 2^120]) computed
    again in float64. A gradient's own elements are its size, but a factor can be far from it:
    a sample's input of 1e-24 under output gradients of 1e18 had a norm of 0 (its squares
    underflowed), its gradient of norm 1e-6 going out unclipped at 13 times C = 1e-7, and an
    input of 1e20 overflowed to a norm of inf, a gradient of norm 1e10 refused as not finite.
    On a GPU, or without ``may_sync`` (no host read of the rows may wait for the device), all
    rows are taken in float64 too and the out-of-range ones chosen: a host read of which rows are
    would wait for the device at every such layer of every step."""
    norms = row_norms(rows, norm_type)
    outside = ~((norms >= 2.0**-80) & (norms <= 2.0**120))
    if rows.is_cuda or not may_sync:
        return torch.where(outside, row_norms(rows.double(), norm_type), norms)
    if len(again := outside.nonzero()[:, 0]):
        norms = norms.index_put((again,), row_norms(rows[again].double(), norm_type))
    return norms


def formed_norms(form, step: int, batch: int, norm_type: int) -> dict:
    """By key, the :func:`row_norms` of per-sample gradients that ``form(samples)`` forms, a dict
    of (n, ...) by key, ``step`` samples at a time."""
    columns: dict = {}
    for start in range(0, max(batch, 1), step):
        for key, rows in form(slice(start, start + step)).items():
            columns.setdefault(key, []).append(row_norms(rows, norm_type))
    return {key: torch.cat(column) for key, column in columns.items()}


def formed_sums(form, step: int, batch: int, factors: dict, keep: Optional[torch.Tensor],
                into: Optional[tuple] = None) -> dict:
    """By key of ``factors``, sum_i f_i G_i of the per-sample gradients that :func:`formed_norms`
    took the norms of, formed again by the same calls in the same chunks: the sum adds the very
    vectors whose norms the factors clip, as the materialised path's kernel does. A sum by another
    route (one GEMM over (i, t), a convolution's weight gradient) rounds its own way, and where a
    sample's gradient cancels, sum_t g_t a_t^T far under sum_t |g_t| |a_t|, the two roundings are
    unalike: a sample's share of the update reached 1.75 times C (L2) and 2.19 times (L1) on a
    Linear with inputs of 1e4 to 1.7e7 and output gradients that cancel over them. Each chunk's
    sum is one matrix-vector product, float32 at least (autocast off: under it the product would
    run in bfloat16). With ``into`` = (index, n), sample i's term goes to row index[i] of n sums
    (a mixture's (sample, expert) groups into their experts' weights)."""
    sums: dict = {}
    for start in range(0, max(batch, 1), step):
        samples = slice(start, start + step)
        for key, rows in form(samples).items():
            if key in factors:
                dtype = torch.promote_types(rows.dtype, torch.float32)
                rows = _zero_dropped(rows, None if keep is None else keep[samples])
                f = factors[key][samples].to(dtype)
                with torch.autocast(rows.device.type, enabled=False):
                    if into is None:
                        part = torch.tensordot(f, rows.to(dtype), 1)
                    else:
                        index, size = into
                        part = torch.zeros(size, *rows.shape[1:], dtype=dtype, device=rows.device).index_add_(
                            0, index[samples], rows.to(dtype) * f.view(-1, *[1] * (rows.ndim - 1)))
                sums[key] = part if key not in sums else sums[key].add_(part)
    return sums


def total(terms) -> torch.Tensor:
    """The sum of an iterable of tensors (one term per forward call), no copy for one term."""
    return functools.reduce(torch.add, terms)


def _zero_dropped(x: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
    """x with the samples of dropped (non-finite) gradients zeroed: 0 * NaN would reach the sum."""
    if keep is None:
        return x
    return torch.where(keep.view(-1, *[1] * (x.ndim - 1)), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _common(*tensors: torch.Tensor) -> tuple:
    """The tensors in one dtype, the widest of theirs: under autocast a layer's input and its output
    gradient can differ (float32 and bfloat16)."""
    if all(t.dtype == tensors[0].dtype for t in tensors):
        return tensors
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    return tuple(t.to(dtype) for t in tensors)


@contextlib.contextmanager
def ieee_float32():
    """float32 matrix products and convolutions computed in float32 while a step's norms and
    clipped sums are formed after its backward pass, whatever the user chose for speed elsewhere:
    cuDNN's convolutions take TF32 by default, and ``torch.set_float32_matmul_precision("high")``
    sends cuBLAS's GEMMs there, which round the inputs to 10 bits (2^-11 of each sample's share),
    or oneDNN's to bfloat16. A norm from the ghost-norm kernel and a sum rounded so far would
    release a sample past C.

    Each backend's ``fp32_precision`` is set to "ieee", and torch's legacy flags (the matmul
    precision, cuDNN's ``allow_tf32``) to the same where the user's could be read: torch's legacy
    getters raise where the two APIs disagree, and a module replayed by the sums may read them.
    Where they could not be read (the user set a mix through the new API) they are left alone:
    inside, their getters read the IEEE flags or still raise.

    The flags are the process's: steps in several threads (one a GPU) share one setting, made by
    the first to enter and put back by the last to leave, so that none clips under another's
    restored TF32 and the user's flags come back as they were."""
    with _IEEE_FLOAT32.lock:
        if _IEEE_FLOAT32.entered == 0:
            _IEEE_FLOAT32.saved = _precision_flags()
            for flag in _IEEE_FLOAT32.saved:
                flag.set(flag.ieee)
        _IEEE_FLOAT32.entered += 1
    try:
        yield
    finally:
        with _IEEE_FLOAT32.lock:
            _IEEE_FLOAT32.entered -= 1
            if _IEEE_FLOAT32.entered == 0:
                for flag in _IEEE_FLOAT32.saved:
                    flag.set(flag.value)


class _PrecisionFlag(NamedTuple):
    """One of torch's float32 precision flags: its setter, its value (None where its getter
    refuses to read a mix of the APIs: then it is left alone) and its IEEE float32 value."""

    setter: Any
    value: Any
    ieee: Any

    def set(self, value: Any) -> None:
        if self.value is not None:
            self.setter(value)


def _legacy_flag(getter) -> Any:
    try:
        return getter()
    except RuntimeError:  # the new API's flags set to a mix the legacy flag cannot say
        return None


def _precision_flags() -> list:
    """torch's float32 precision flags, the legacy ones first: setting those sets the backends'
    flags too, which come after."""
    backends = (torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn,
                torch.backends.mkldnn.matmul, torch.backends.mkldnn.conv, torch.backends.mkldnn.rnn)
    return [_PrecisionFlag(torch.set_float32_matmul_precision, _legacy_flag(torch.get_float32_matmul_precision),
                           "highest"),
            _PrecisionFlag(functools.partial(setattr, torch.backends.cudnn, "allow_tf32"),
                           _legacy_flag(lambda: torch.backends.cudnn.allow_tf32), False),
            *(_PrecisionFlag(functools.partial(setattr, backend, "fp32_precision"), backend.fp32_precision, "ieee")
              for backend in backends)]


class _SharedFlags:
    """The process's :func:`ieee_float32` state: how many steps are inside it, and the flags to put back."""

    def __init__(self):
        self.lock, self.entered, self.saved = threading.Lock(), 0, []


_IEEE_FLOAT32 = _SharedFlags()


def _scaled(g: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """g_i f_i for each sample i (dim 0), in float32 at least, as every clipped sum is formed: a
    bfloat16 product rounds each sample's share by up to 2^-9 of itself, and a Linear's clipped
    sum in bfloat16 released a sample at 1.0044 times C (1.0004 in float16)."""
    dtype = torch.promote_types(g.dtype, factors.dtype)
    return g.to(dtype) * factors.to(dtype).view(-1, *[1] * (g.ndim - 1))


class Layer:
    """One hooked module's share of a step. ``record`` runs in the module's forward hook and names
    the outputs whose gradients the layer needs; ``take_grad`` gets each of them during the
    backward pass, and once a call's are all in, ``reduce`` may replace that call's input and
    output gradients by its per-sample gradients, where those are smaller, so they are freed as
    the backward goes on (as an ordinary backward frees its activations); ``finish`` ends the
    backward (a layer may form its per-sample gradients there instead, :meth:`replace`);
    ``rows`` hands the per-sample gradients formed to the clip kernel (BookKeeping), which forms
    their norms and f-weighted sums; ``norms`` and ``clipped_sums`` give those of the other
    parameters (none by default).

    ``uses_per_call``: how often one forward call uses each parameter in the autograd graph, for
    the check that no parameter is used where the hooks cannot see; None: counted per call.
    """

    uses_per_call: ClassVar[Optional[int]] = 1
    #: the rule for a subclass of the module type that overrides its forward (None: the table goes on to the
    #: next base class, else the fallback)
    own_forward_rule: ClassVar[Optional[type]] = None
    #: the methods of the module type that make its forward: one overridden is a forward of its own
    forward_methods: ClassVar[tuple] = ("forward",)
    claims_children: ClassVar[bool] = False  #: the layer accounts for its children's parameters too
    #: children whose parameters the module may read outside their forwards, to be settled at its first call with
    #: grad (:class:`FunctionalLayer`)
    unsettled: tuple = ()
    hook_without_parameters: ClassVar[bool] = False  #: hooked even without trainable parameters (to refuse a mode)
    #: a call on an input without the batch whose output the batch shares may take per-sample output gradients
    #: (:meth:`broadcast`)
    broadcast_calls: ClassVar[bool] = False
    #: a call on the batch flattened with its positions (dim 0 of B T, as OPT's MLP reshapes its hidden states) may
    #: be read as (B, T, ...) (:meth:`unflatten`)
    flattened_batch_calls: ClassVar[bool] = False
    #: a call on the batch whose outputs have it flattened with their positions (B T, ...: a DeepSeek-style router
    #: flattens its input itself) may read their gradients as (B, T, ...) (:meth:`unflatten_outputs`)
    flattened_output_calls: ClassVar[bool] = False
    #: the layer computes what a forward call of its module computes, through :meth:`enter_forward` and
    #: :meth:`exit_forward` around it (nn.MultiheadAttention's functional projections, :mod:`~privleak.dpsgd.attention`)
    intercepts_forward: ClassVar[bool] = False
    #: each row of a call's output (dim 0) is one sample's, as the rule reads its input's: the first sample's check
    #: (BookKeeping) finds that sample's loss with no gradient in the other rows
    rows_are_samples: ClassVar[bool] = False
    #: the module's forward is torch's own and may return a view of a result that nothing else holds (F.linear with
    #: a bias on more than two dims, instance_norm): handed on as an alias that an in-place op leaves in the graph
    #: (:func:`~privleak.dpsgd.graph.unviewed`)
    returns_own_view: ClassVar[bool] = False

    def __init__(self, name: str, module: nn.Module):
        self.name, self.module = name, module
        self.parameters = self.parameters_of(module)
        #: the layer's rule may read a tensor on the host this step: not in a step a CUDA graph
        #: captures (BookKeeping sets it each step)
        self.may_sync = True
        self.clear()

    def parameters_of(self, module: nn.Module) -> list:
        """The trainable parameters the rule answers for: the module's own (with
        :attr:`claims_children`, its descendants' too)."""
        return [p for p in module.parameters(recurse=self.claims_children) if p.requires_grad]

    @classmethod
    def takes(cls, module: nn.Module) -> bool:
        """Whether the rule fits ``module``: one registered by a name pattern may not fit every class
        the pattern names, and the table then goes on (to the next base class, else the fallback).
        A rule reads a layer's weight and bias as parameters, so none fits a module that computes
        them as it runs (:func:`computes_parameters`): such a module is replayed."""
        return not computes_parameters(module)

    def claimed_modules(self) -> list:
        """The submodules whose parameters the layer answers for, which get no layer of their own:
        all of them with :attr:`claims_children`; else those of the module's parametrizations (the
        originals they compute its weight from are its parameters, :func:`fallback_parameters`)."""
        if self.claims_children:
            return list(self.module.modules())
        return list(self.module.parametrizations.modules()) if parametrize.is_parametrized(self.module) else []

    def describe(self) -> str:
        return f"module '{self.name}' ({type(self.module).__name__})"

    def clear(self) -> None:
        self.calls: list = []  # what record() keeps per forward call; None once reduced
        self.edges: list = []  # gradient edges of the recorded outputs, in call order
        self.uses: list[list[int]] = []  # per call, the uses of each parameter in its graph
        self.grads: list = []  # per call, the gradients of its recorded outputs (None until they come)
        self.reduced = 0  # calls that reduce() replaced by per-sample gradients
        self.per_sample: dict = {}  # per parameter id, the (B, *shape) per-sample gradients formed
        self.lost: dict = {}  # per ghost norm, the rows computed again in float64 (weight_norms' lost)
        self.versions: list = []  # (recorded input, its version counter then), to find in-place changes
        self.sources: list = []  # per call, the autograd node that made the recorded input (None: a leaf)
        self.flattened: dict = {}  # call: batch size, for calls whose input was the batch flattened with its positions
        self.exit_forward()
        self.recorder: Optional[TorchFunctionMode] = None  # the forward mode of the call under way
        self.recording = False  # the recorder's mode is on

    def forward_mode(self) -> TorchFunctionMode:
        """The torch function mode an :attr:`intercepts_forward` layer puts on through a forward call."""
        raise NotImplementedError

    def refusal(self) -> Optional[str]:
        """Why a forward call of the module with grad is refused in its present state, or None:
        asked before the call runs, so that a refused call changes nothing (a layer that
        overrides it gets a forward pre-hook, which also calls :meth:`before_call`)."""
        return None

    def before_call(self) -> None:
        """Before a recorded forward call of the module (a layer that overrides it gets a forward
        pre-hook): what :meth:`record` compares the call's effects with."""

    def enter_forward(self) -> None:
        """Before a forward call of the module with grad (:attr:`intercepts_forward` layers): a new
        :meth:`forward_mode` on, as :attr:`recorder` (a mode an interrupted forward left on taken off
        first: a KeyboardInterrupt runs no forward hook)."""
        self.exit_forward()
        self.recorder = self.forward_mode()
        self.recorder.__enter__()
        self.recording = True

    def exit_forward(self) -> None:
        """After that call, also one that raised: the mode off; :meth:`record` takes :attr:`recorder`."""
        if getattr(self, "recording", False):
            self.recording = False
            self.recorder.__exit__(None, None, None)

    def trains(self, parameter: Optional[torch.Tensor]) -> bool:
        return parameter is not None and parameter.requires_grad

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        """x detached (its storage, not a copy) for the step, noting its version."""
        kept = x.detach()
        self.versions.append((kept, kept._version))
        return kept

    def check_inputs(self) -> None:
        """Raise if a recorded input was changed in place since its forward call (autograd raises
        for the tensors it saves; book-keeping reads its own in the step). Called before the
        backward pass, which changes none: the list then lets the inputs go, so that a layer
        reducing a call in the backward frees its input (held here too, CIFAR's B 64 step kept
        8 MB more at its peak)."""
        versions, self.versions = self.versions, []
        for x, version in versions:
            if x._version != version:
                raise ValueError(f"an input of {self.describe()} was modified in place after its forward call "
                                 "(e.g. `x += layer(x)`), and book-keeping reads it in step(): write `x = x + "
                                 "layer(x)`")

    def separated(self, args: tuple, kwargs: dict, output: Any) -> Any:
        """The output the forward call returns, before :meth:`record` sees it: ``output`` itself
        (:class:`FunctionalLayer` puts a view in place of an output that another is computed from)."""
        return output

    def record(self, args: tuple, kwargs: dict, output: Any) -> list[torch.Tensor]:
        """Keep the input of one forward call and the gradient edge of its output; returns the
        outputs whose gradients :meth:`take_grad` wants, in order."""
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return []  # run without grad (evaluation): nothing to train
        x = self.recorded_input(args, kwargs, output)
        self.calls.append(self.keep(x))
        self.sources.append(x.grad_fn)
        self.edges.append(get_gradient_edge(output))
        self.grads.append([None])
        self.uses.append([self.uses_per_call] * len(self.parameters))
        return [output]

    def recorded_input(self, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
        """The input of a forward call that the rule reads: the first argument."""
        return args[0] if args else next(iter(kwargs.values()))

    def batch_sizes(self) -> list[int]:
        return [x.shape[0] if x.ndim else 0 for x in self.calls]

    def call_edges(self, call: int) -> list:
        """The gradient edges of call ``call``'s recorded outputs."""
        return [self.edges[call]]

    def broadcast(self, call: int, output_grads: list, norm_type: int) -> None:
        """Call ``call`` ran on an input without the batch (position ids of shape (1, T) or (T,))
        and its output was added to, multiplied into or expanded over the batch of B: the input
        counts as each sample's, a batch dim put in front, with ``output_grads`` [(B, *output
        shape)] the per-sample gradients of its output (for :attr:`broadcast_calls` layers, which
        read the dims after the first as positions; after the backward pass: the output's tensor
        hook saw their sum only)."""
        (output_grad,) = output_grads
        x = self.calls[call]
        self.calls[call] = x.unsqueeze(0).expand(output_grad.shape[0], *x.shape)
        self.grads[call] = [None]
        self.take_grad(call, 0, output_grad, norm_type)

    def unflatten(self, call: int, batch: int) -> None:
        """Call ``call``'s input was the batch flattened with its positions, sample after sample
        (:func:`flattened_batch`): read it, and its output gradient, as (B, positions, ...)."""
        self.calls[call] = self.calls[call].unflatten(0, (batch, -1))
        self.flattened[call] = batch

    def can_tie(self, parameter: torch.Tensor) -> bool:
        """Whether ``parameter`` may be shared with other layers' (tied weights): the layer gives
        its per-sample gradient's :meth:`factors` (:mod:`privleak.dpsgd.tied`)."""
        return False

    def factors(self, parameter: torch.Tensor) -> Optional[Factors]:
        """The per-sample gradient of a tied ``parameter`` as :class:`~privleak.dpsgd.tied.Factors`,
        of the recorded calls (None: none recorded)."""
        return None

    def nodes(self, call: int) -> list:
        """(key, autograd node) pairs of call ``call`` whose output gradients :meth:`take_node_grad`
        wants in the backward pass (none by default)."""
        return []

    def sample_row_nodes(self, call: int, batch: int) -> list:
        """(parameter, autograd node) pairs of call ``call``'s ops whose output rows the layer reads
        as the ``batch`` samples' (a broadcast parameter's ops, :class:`FunctionalLayer`; none by
        default): the first sample's check reads them as it reads a layer's outputs."""
        return []

    def packings(self) -> list:
        """(sorted_indices, unsorted_indices) of each packed sequence the step's calls read (either
        None for one packed without torch's sort, enforce_sorted=True), where the layer reads the
        batch in the packed sequence's order (none by default)."""
        return []

    def inner_nodes(self) -> set:
        """Autograd nodes of the step's calls' forwards whose rows the rule reads by itself, not as
        the batch's (a mixture of experts sorts its tokens by expert), which the check of rows
        taken out of order passes over (none by default)."""
        return set()

    def batch_dims(self, call: int) -> list[Optional[int]]:
        """Per recorded output of call ``call`` (in :meth:`call_edges`' order), the dim that holds
        the batch (None: a packed sequence's rows, which hold it in any order; -1: rows that are
        no batch's alone; default: dim 0)."""
        return [0] * len(self.call_edges(call))

    def batch_first(self, call: int, output: int, grad: torch.Tensor, batch: int) -> Optional[torch.Tensor]:
        """The gradient ``grad`` of recorded output ``output`` of call ``call`` with the samples in
        dim 0, as the layer reads its rows (the batch of ``batch`` flattened with other dims: whole
        rows, sample after sample), or None where its rows are not read as samples: by
        :meth:`batch_dims` (dim 0 or 1)."""
        dim = self.batch_dims(call)[output]
        return grad.movedim(dim, 0) if dim in (0, 1) and grad.ndim > dim else None

    def forced_inputs(self) -> list:
        """Tensors the backward pass must reach, so that the nodes of :meth:`nodes` run."""
        return []

    def take_node_grad(self, key: tuple, grad: Optional[torch.Tensor]) -> None:
        """The output gradient of the node of :meth:`nodes` named ``key``, during the backward pass."""

    @property
    def acts_in_backward(self) -> bool:
        """Whether the layer acts on its output gradients as the backward pass brings them (a
        :meth:`reduce` or :meth:`take_grad` of its own). Else it may take them once the backward
        is over, as results of it, without a tensor hook per output (a Python call each in the
        backward, and the hook's registration in the forward)."""
        cls = type(self)
        return cls.reduce is not Layer.reduce or cls.take_grad is not Layer.take_grad

    def take_grad(self, call: int, output: int, grad: torch.Tensor, norm_type: int) -> None:
        """The gradient of recorded output ``output`` of call ``call``, during the backward pass
        (after it, for a layer that does not :attr:`acts_in_backward`)."""
        if call in self.flattened:
            grad = grad.unflatten(0, (self.flattened[call], -1))
        grads = self.grads[call]
        grads[output] = grad
        if all(g is not None for g in grads):
            self.replace(call, self.reduce(call, norm_type))

    def replace(self, call: int, rows: Optional[dict]) -> None:
        """Replace call ``call``'s input and output gradients by its per-sample gradients ``rows``
        (per parameter id; None: keep them)."""
        if rows is not None:
            for key, r in rows.items():
                self.per_sample[key] = r if key not in self.per_sample else self.per_sample[key] + r
            self.calls[call] = self.grads[call] = None
            self.reduced += 1

    def reduce(self, call: int, norm_type: int) -> Optional[dict]:
        """During the backward pass, once call ``call``'s output gradients are all in: its
        per-sample gradients per parameter id if the layer keeps those instead of the call's
        input and output gradients, else None."""
        return None

    def finish(self) -> None:
        """After the backward pass: keep the calls not reduced whose outputs the loss uses, each
        with its output gradient (a list for a call of several outputs), renumbered
        (:meth:`renumber`)."""
        kept = [call for call, (x, grads) in enumerate(zip(self.calls, self.grads))
                if x is not None and any(g is not None for g in grads)]
        self.renumber({old: new for new, old in enumerate(kept)})
        self.calls = [self.calls[call] for call in kept]
        self.grads = [self.grads[call] if len(self.grads[call]) > 1 else self.grads[call][0] for call in kept]

    def renumber(self, new: dict) -> None:
        """What the layer keeps by call index follows the calls :meth:`finish` keeps to their new
        indices ``new`` (old: new); the others' is dropped."""
        self.flattened = {new[call]: batch for call, batch in self.flattened.items() if call in new}

    def rows(self, batch: int) -> dict:
        """The per-sample gradients (B, *shape) the layer has formed, by parameter id: the clip
        kernel reads them, for their norms and clipped sums both."""
        return self.per_sample

    def norms(self, batch: int, norm_type: int) -> dict:
        """(B,) float64 per parameter without :meth:`rows`, by id: each sample's squared L2 norm
        (norm_type 2) or L1 norm; or a ghost norm's :class:`~privleak.dpsgd.ghost_norm.GhostNormInputs`,
        which the caller computes with the other layers' in one kernel call."""
        if not self.calls and not self.reduced:
            return {id(p): torch.zeros(batch, dtype=torch.float64, device=p.device) for p in self.parameters}
        return self.norms_by_parameter(batch, norm_type)

    def clipped_sums(self, factors: dict, keep: Optional[torch.Tensor], norm_type: int) -> dict:
        """The float32 sum_i f_i G_i per parameter of :meth:`norms`, by id, for ``factors`` (B,)
        float32 by id; ``keep`` (B,) bool marks the samples kept (None: all)."""
        if not self.calls and not self.reduced:
            return {id(p): torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in self.parameters}
        return {key: total.float() for key, total in self.sums_by_parameter(factors, keep, norm_type).items()}

    def norms_by_parameter(self, batch: int, norm_type: int) -> dict:
        """:meth:`norms` of the recorded calls (at least one); none where all are :meth:`rows`."""
        return {}

    def sums_by_parameter(self, factors: dict, keep: Optional[torch.Tensor], norm_type: int) -> dict:
        """:meth:`clipped_sums` of the recorded calls; runs after :meth:`norms_by_parameter`."""
        return {}


_LAYERS: dict = {}  # module type, or the dotted name of one in a package privleak does not import: rule


def layer_kind(*module_types):
    """Class decorator: the rule for modules of ``module_types`` (types, or dotted names of types
    of other packages, "package.module.Class", where a name may hold the wildcards of
    :func:`fnmatch.fnmatchcase`)."""
    def register(cls: type) -> type:
        for module_type in module_types:
            _LAYERS[module_type] = cls
        return cls
    return register


def layer_for(name: str, module: nn.Module) -> Optional[Layer]:
    """The rule for ``module``: the table's entry for its type or nearest base class whose
    forward it keeps (or that entry's :attr:`~Layer.own_forward_rule`, for one whose forward, or a
    method of :attr:`~Layer.forward_methods`, it overrides); else :class:`FunctionalLayer` if it has
    trainable parameters of its own, or its code reads a child's (:mod:`~privleak.dpsgd.direct_reads`:
    its first call settles whether it does, outside the child's forward)."""
    for base in type(module).__mro__:
        rule = _LAYERS.get(base) or _named_rule(f"{base.__module__}.{base.__qualname__}")
        if rule is not None and any(getattr(type(module), method) is not getattr(base, method)
                                    for method in rule.forward_methods):
            rule = rule.own_forward_rule
        if rule is not None and rule.takes(module):
            layer = rule(name, module)
            return layer if layer.parameters or layer.hook_without_parameters else None
    if not isinstance(module, _HOLDERS) and (fallback_parameters(module)
                                             or direct_reads.children_read_directly(module)):
        return FunctionalLayer(name, module)
    return None


#: modules that hold parameters for the module they are in and have no forward
_HOLDERS = (nn.ParameterList, nn.ParameterDict)


def check_no_embedding_max_norm(model: nn.Module) -> None:
    """Refuse an ``nn.Embedding`` or ``nn.EmbeddingBag`` with ``max_norm``, frozen or trained:
    its forward renormalises in place the rows its ids look up, so which rows change, and how, is
    the batch's tokens, outside the noise (a row looked up by one sample alone went from norm
    4.71 to 1.02 with that sample in the batch, stayed at 4.70 without it: the weights show which
    tokens a batch held)."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
            raise ValueError(_max_norm_refusal(f"module {name!r} ({type(module).__name__})", module.max_norm))


def _max_norm_refusal(what: str, max_norm: float) -> str:
    return (f"{what} has max_norm={max_norm}: its forward renormalises in place the weight rows the batch's ids "
            "look up, so the weights change by the data outside the noise; leave max_norm None and scale the rows "
            "looked up instead (e * (max_norm / e.norm(dim=-1, keepdim=True)).clamp(max=1))")


def computes_parameters(module: nn.Module) -> bool:
    """Whether ``module`` computes its weight or bias from other parameters as it runs: a
    parametrization on it (``torch.nn.utils.parametrizations.weight_norm``, ``spectral_norm``,
    ``orthogonal`` or the user's), or the deprecated ``torch.nn.utils.weight_norm``, whose forward
    pre-hook sets a plain tensor. Read from the instance's ``__dict__``: a parametrized weight is
    a property that would run the parametrization."""
    return parametrize.is_parametrized(module) or any(
        isinstance(x, torch.Tensor) and not isinstance(x, nn.Parameter)
        for x in (module.__dict__.get("weight"), module.__dict__.get("bias")))


def fallback_parameters(module: nn.Module, claims_children: bool = False,
                        children: tuple = ()) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of the trainable parameters that :class:`FunctionalLayer` answers for
    in ``module``: its own, those of its ParameterList and ParameterDict children (peft's LoRA
    embedding keeps its A and B in ParameterDicts; the replay takes any parameter, a rule only
    those it knows), of its parametrizations (``parametrizations.weight.original``, which
    ``functional_call`` takes by that name and passes through the parametrization) and of the
    children named in ``children`` (whose parameters its own code reads,
    :mod:`~privleak.dpsgd.direct_reads`), or with ``claims_children`` all of its descendants'.
    Otherwise a parameter of its own that a descendant registers too is the descendant's (BERT's
    masked-LM head holds the bias that its decoder Linear adds, ``decoder.bias = self.bias``; as
    the head's too, it was refused as tied): a use of it in the module's own forward, outside the
    descendant's, is then one no hook recorded, refused at the step."""
    named = list(module.named_parameters(recurse=claims_children))
    if not claims_children and named:
        below = {id(p) for sub in module.modules() if sub is not module and not isinstance(sub, _HOLDERS)
                 for p in sub._parameters.values() if p is not None}
        named = [(name, p) for name, p in named if id(p) not in below]
    if not claims_children:
        named += [(f"{child_name}.{name}", p) for child_name, child in module.named_children()
                  if isinstance(child, _HOLDERS) or child_name in children for name, p in child.named_parameters()]
        if parametrize.is_parametrized(module):
            named += list(module.parametrizations.named_parameters(prefix="parametrizations"))
    first = {id(p): name for name, p in reversed(named)}  # the first name of a parameter a read child shares
    return [(name, p) for name, p in named if p.requires_grad and first[id(p)] == name]


def _named_rule(name: str) -> Optional[type]:
    rule = _LAYERS.get(name)
    if rule is None:
        rule = next((r for key, r in _LAYERS.items() if isinstance(key, str) and fnmatch.fnmatchcase(name, key)), None)
    return rule


def forms_weight_grads(positions: int, d: int, p: int, norm_type: int) -> bool:
    """Whether :func:`weight_norms` forms the per-sample gradients of a weight sum_t g_t a_t^T
    (a (T, d), g (T, p)): not at T = 1, whose norm factors, nor where the ghost norm pays
    (:func:`use_ghost_norm`; L1 norms need the gradient)."""
    return positions > 1 and not (norm_type == 2 and use_ghost_norm(positions, d, p))


def _formed_weight_grads(a: torch.Tensor, g: torch.Tensor):
    """:func:`formed_norms`' ``form`` and its step for the per-sample gradients sum_t g_t a_t^T
    (p, d) of a (N, T, d) and g (N, T, p), a chunk of them as large as a and g."""
    step = samples_per_chunk(a.shape[1] * (a.shape[2] + g.shape[2]), a.shape[2] * g.shape[2], on_gpu=a.is_cuda)
    return (lambda samples: {None: torch.bmm(g[samples].transpose(1, 2), a[samples])}), step


def weight_norms(a: torch.Tensor, g: torch.Tensor, norm_type: int, *, deferred: bool = False, may_sync: bool = True,
                 lost: Optional[list] = None):
    """(N,) norms of the per-sample gradient sum_t g_t a_t^T for a (N, T, d), g (N, T, p): the
    ghost norm or the per-sample gradient, whichever :func:`forms_weight_grads` says; the clipped
    sum, :func:`clipped_weight_sum`, follows the same rule. At T = 1 the gradient g a^T has rank
    one and both norms factor: |g a^T|_F^2 = |g|_2^2 |a|_2^2 and |g a^T|_1 = |g|_1 |a|_1 (the
    ghost-norm kernel, whose panels are 8 or 16 positions, was 10-30x slower there: B 64, d 512,
    p 32). With ``deferred``, a ghost norm is returned as its inputs
    (:class:`~privleak.dpsgd.ghost_norm.GhostNormInputs`), for the caller to compute with other
    layers' in one kernel call; ``may_sync``: as :func:`~privleak.dpsgd.ghost_norm.ghost_norms`'s;
    ``lost``: where a ghost norm's samples are computed again in float64, their rows are appended
    to it (:class:`~privleak.dpsgd.ghost_norm.GhostNormInputs`), for :func:`clipped_weight_sum`."""
    if a.shape[1] == 1:
        return factor_norms(a, norm_type, may_sync) * factor_norms(g, norm_type, may_sync)
    if not forms_weight_grads(a.shape[1], a.shape[2], g.shape[2], norm_type):
        # A layer's own a and g (one dtype, as bmm below needs too) go to the kernel's op
        # unchecked: ghost_norm_squared's checks cost twice the kernel on a small layer.
        inputs = ghost_norm.GhostNormInputs(a, g, lost)
        return inputs if deferred else ghost_norm.ghost_norms([inputs], clipping=True, may_sync=may_sync)[0]
    return formed_norms(*_formed_weight_grads(a, g), a.shape[0], norm_type)[None]


def clipped_weight_sum(a: torch.Tensor, g: torch.Tensor, factors: torch.Tensor, keep: Optional[torch.Tensor],
                       norm_type: int, *, transposed: bool = False, lost: Optional[list] = None) -> torch.Tensor:
    """sum_i f_i sum_t g_{i,t} a_{i,t}^T, (p, d) ((d, p) ``transposed``), for a (B, T, d), g (B, T, p)
    whose norms :func:`weight_norms` gave: where it formed the per-sample gradients, the sum of
    the same ones (:func:`formed_sums`); else one GEMM (:func:`clipped_product`), the samples in
    ``lost`` (those whose ghost norms were computed again in float64) added apart by a float64 one.
    A float32 sum's error is relative to sum_t |a_t| |g_t|, like the ghost norm's: where that
    passed the norm, the sample's share came out of the GEMM rounded as much as its norm."""
    if forms_weight_grads(a.shape[1], a.shape[2], g.shape[2], norm_type):
        total = formed_sums(*_formed_weight_grads(a, g), a.shape[0], {None: factors}, keep)[None]
        return total.T.contiguous() if transposed else total  # .grad as a GEMM leaves it, contiguous
    def product(a, g, factors, keep):
        return clipped_product(*((a, g) if transposed else (g, a)), factors, keep)

    if not lost:
        return product(a, g, factors, keep)
    rest, rows = _taken_apart(lost, keep, a.shape[0])
    total = product(a, g, factors, rest)
    return total + product(a[rows].double(), g[rows].double(), factors[rows].double(), None).to(total.dtype)


def _taken_apart(lost: list, keep: Optional[torch.Tensor], batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) bool, the samples a float32 clipped sum keeps, and the rows it leaves to a float64 one:
    those in ``lost`` (row tensors, a row possibly in several), both within ``keep``."""
    rows = torch.cat(lost).unique()
    apart = torch.zeros(batch, dtype=torch.bool, device=rows.device).index_fill_(0, rows, True)
    return (~apart if keep is None else keep & ~apart), (rows if keep is None else rows[keep[rows]])


def clipped_product(left: torch.Tensor, right: torch.Tensor, factors: torch.Tensor,
                    keep: Optional[torch.Tensor]) -> torch.Tensor:
    """sum_i f_i sum_t L_{i,t} R_{i,t}^T for L (B, T, p), R (B, T, d): a weight's clipped sum as
    one GEMM over (i, t), the factors scaling the narrower side (book-keeping); the samples not
    kept zeroed."""
    left, right = _zero_dropped(left, keep), _zero_dropped(right, keep)
    if right.shape[-1] < left.shape[-1]:
        right = _scaled(right, factors)
    else:
        left = _scaled(left, factors)
    left, right = _common(left, right)
    return left.reshape(-1, left.shape[-1]).T @ right.reshape(-1, right.shape[-1])


def bias_rows(grads: list, channels_last: bool) -> torch.Tensor:
    """(B, p): a bias's per-sample gradients, each sample's output gradients summed over its
    positions and the calls, from output gradients (B, ..., p) (channels_last) or (B, p, ...).
    They are as small as one position's output gradient, so every layer forms them and the clip
    kernel clips and sums them with the other per-sample gradients."""
    def rows(g: torch.Tensor) -> torch.Tensor:  # half-precision sums would round: float32 at least
        dtype = torch.promote_types(g.dtype, torch.float32)
        if channels_last:
            return g.reshape(g.shape[0], -1, g.shape[-1]).sum(1, dtype=dtype)
        return g.flatten(2).sum(2, dtype=dtype)

    return total(rows(g) for g in grads)


@layer_kind(nn.Linear, "transformers.models.falcon.modeling_falcon.FalconLinear")
class LinearLayer(Layer):
    """nn.Linear over inputs of any leading shape (B, ..., d); the middle dims are positions.
    Per-sample weight gradient G_i = sum_t g_{i,t} a_{i,t}^T: its norm from a and g, the clipped
    sum one GEMM, (f g)^T a over all (i, t). The bias's per-sample gradients sum_t g_{i,t} are
    formed (:func:`bias_rows`). Falcon's ``FalconLinear`` (``x @ W.T + b``, an nn.Linear with its
    forward written out) has the same rule, registered by name."""

    rows_are_samples = broadcast_calls = flattened_batch_calls = returns_own_view = True
    transposed: ClassVar[bool] = False  #: the weight is stored (d, p), as y = a W + b

    def finish(self) -> None:
        """The calls become one, a (B, T, d) and g (B, T, p), their positions laid end to end,
        which the norms and the sums both read. g is made contiguous here, once: the ghost-norm
        kernel and the clipped sum's GEMM read it as (B T, p) rows (a transformer head's logit
        gradient comes transposed from a cross-entropy over dim 1; the bench transformer's head
        norm and sum, B 32: 21 -> 18 ms)."""
        super().finish()
        if not self.calls:
            return
        batch = self.calls[0].shape[0]
        a = [x.reshape(batch, -1, x.shape[-1]) for x in self.calls]
        g = [y.reshape(batch, -1, y.shape[-1]) for y in self.grads]
        one = len(a) == 1
        self.calls, self.grads = [a[0] if one else torch.cat(a, 1)], [g[0].contiguous() if one else torch.cat(g, 1)]
        if self.trains(self.module.bias):
            self.per_sample[id(self.module.bias)] = bias_rows(self.grads, channels_last=True)

    def _sites(self) -> tuple[torch.Tensor, torch.Tensor]:
        """a (B, T, d) and g (B, T, p) of the calls (:meth:`finish`), in one dtype."""
        return _common(self.calls[0], self.grads[0])

    def can_tie(self, parameter: torch.Tensor) -> bool:
        return parameter is self.module.weight

    def factors(self, parameter: torch.Tensor) -> Optional[Factors]:
        """The weight's per-sample gradient sum_t L_t R_t^T: (p, d), L = g, R = a; (d, p) ``transposed``."""
        if not self.calls:
            return None
        a, g = self._sites()
        return Factors(a, g) if self.transposed else Factors(g, a)

    def norms_by_parameter(self, batch: int, norm_type: int) -> dict:
        if not self.trains(self.module.weight):
            return {}
        key = id(self.module.weight)
        return {key: weight_norms(*self._sites(), norm_type, deferred=True, may_sync=self.may_sync,
                                  lost=self.lost.setdefault(key, []))}

    def sums_by_parameter(self, factors: dict, keep: Optional[torch.Tensor], norm_type: int) -> dict:
        key = id(self.module.weight)
        return {key: clipped_weight_sum(*self._sites(), factors[key], keep, norm_type, transposed=self.transposed,
                                        lost=self.lost.get(key))}


@layer_kind("transformers.pytorch_utils.Conv1D")
class TransposedLinearLayer(LinearLayer):
    """Hugging Face's ``Conv1D`` (GPT-2's attention and MLP projections): a Linear layer whose
    weight is stored transposed, (d, p), y = a W + b. Registered by name, so privleak needs no
    transformers to import; the rule is nn.Linear's with the factors' roles swapped."""

    transposed = True


def _conv_padding(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """(input, padding) such that the convolution of ``input`` with ``padding`` zeros on both
    sides of each dim is the module's: non-zero padding modes and asymmetric 'same' padding are
    applied to the input first."""
    dims = x.ndim - 2
    if module.padding_mode != "zeros":
        return F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode), [0] * dims
    if module.padding == "valid":
        return x, [0] * dims
    if module.padding == "same":
        totals = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size)]
        if all(t % 2 == 0 for t in totals):
            return x, [t // 2 for t in totals]
        pad = []
        for t in reversed(totals):  # F.pad lists the last dim first; the odd one goes on the right
            pad += [t // 2, t - t // 2]
        return F.pad(x, pad), [0] * dims
    return x, list(module.padding)


@layer_kind(nn.Conv1d, nn.Conv2d)
class ConvLayer(Layer):
    """nn.Conv1d / nn.Conv2d (any padding, stride, dilation, groups). Per group, the input unfolded
    into patches (L positions of d = C/G k values) is a Linear layer's input: the ghost norm of
    patches and output gradients when 2 L^2 < d p; else the per-sample weight gradients, from
    privleak's kernel (:mod:`privleak.dpsgd.conv_grads`: as many multiply-adds as the ordinary
    weight gradient).

    On the per-sample side, :func:`when_to_form` says when the per-sample gradients are formed:
    during the backward pass in place of the inputs and output gradients, which are freed, or after
    it, clipped and summed then by the fused clip kernel; or never whole, the layer keeping its inputs
    and output gradients, forming them a few samples at a time for the norms and again for the
    clipped sum (:func:`formed_sums`). On the ghost side the clipped sum is the convolution's own
    weight gradient of the scaled output gradients."""

    #: a subclass may convolve its own way in ``_conv_forward`` (a weight computed there, padding
    #: done by hand): read with the module's padding and its parameter as the weight, its update
    #: was wrong (1.28 of the true one, relative), so it takes the computed weight's rule
    forward_methods = ("forward", "_conv_forward")

    rows_are_samples = True

    def clear(self) -> None:
        super().clear()
        self._output_sizes: list = []  # per call, the output's shape
        self._forming: Optional[Forming] = None  # this step's rule, chosen at the first reduce()

    def record(self, args: tuple, kwargs: dict, output: Any) -> list[torch.Tensor]:
        self._check_batched(args, kwargs, output)
        outputs = super().record(args, kwargs, output)
        self._output_sizes += [y.shape for y in outputs]
        return outputs

    def _check_batched(self, args: tuple, kwargs: dict, output: Any) -> None:
        """Refuse an input without a batch, which torch convolves as one sample: with as many
        channels as the batch has samples, its rows had reached the kernels as samples."""
        x = self.recorded_input(args, kwargs, output)
        if isinstance(output, torch.Tensor) and output.requires_grad and x.ndim != self.module.weight.ndim:
            raise ValueError(f"{self.describe()} got an input of shape {tuple(x.shape)}, without a batch (torch "
                             "convolves it as one sample): book-keeping splits its input by sample")

    def _outputs_per_group(self) -> int:
        """p, the outputs of one group: those of one input channel's weights."""
        return self.module.weight.shape[0] // self.module.groups

    def _bias_grads(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """The module's output gradient, of a call's input x and output gradient g as the rule reads them."""
        return g

    def renumber(self, new: dict) -> None:
        super().renumber(new)
        self._output_sizes = [size for call, size in enumerate(self._output_sizes) if call in new]

    def _positions(self) -> int:
        """Output positions of the recorded calls, laid end to end."""
        return sum(math.prod(shape[2:]) for shape in self._output_sizes)

    def _held_per_sample(self) -> int:
        """Values of the recorded inputs and output gradients per sample."""
        return sum(math.prod(x.shape[1:]) + math.prod(shape[1:]) for x, shape in zip(self.calls, self._output_sizes))

    def _patch_size(self) -> int:
        """d, the values of a patch: those of one output channel's weights (``weight[0]`` would be an op)."""
        return math.prod(self.module.weight.shape[1:])

    def _ghost(self, norm_type: int) -> bool:
        return norm_type == 2 and use_ghost_norm(self._positions(), self._patch_size(), self._outputs_per_group())

    def _choose(self, norm_type: int) -> Forming:
        m = self.module
        if not self.trains(m.weight):  # the bias alone: (B, O) per-sample gradients
            return Forming.DURING
        if self._ghost(norm_type):
            return Forming.NEVER
        return when_to_form(m.weight.numel(), self._held_per_sample())

    def reduce(self, call: int, norm_type: int) -> Optional[dict]:
        if self._forming is None:
            self._forming = self._choose(norm_type)
        return self._rows(self.calls[call], self.grads[call][0]) if self._forming is Forming.DURING else None

    def finish(self) -> None:
        super().finish()
        if self._forming is Forming.AFTER:  # the activations are freed now
            for call, (x, g) in enumerate(zip(self.calls, self.grads)):
                self.replace(call, self._rows(x, g))
            self.calls, self.grads = [], []
        elif self.calls and self.trains(self.module.bias):  # NEVER: the weight's norms and sums come later
            self.per_sample[id(self.module.bias)] = bias_rows(
                [self._bias_grads(x, g) for x, g in zip(self.calls, self.grads)], channels_last=False)

    def _rows(self, x: torch.Tensor, g: torch.Tensor) -> dict:
        """The per-sample gradients of one call, input x and output gradient g, per parameter id."""
        m, rows = self.module, {}
        if self.trains(m.weight):
            rows[id(m.weight)] = self._per_sample_weight_grads(x, g)
        if self.trains(m.bias):
            rows[id(m.bias)] = bias_rows([self._bias_grads(x, g)], channels_last=False)
        return rows

    def _patches(self, x: torch.Tensor) -> torch.Tensor:
        """(B G, L, d) patches of ``x`` as the convolution sees them, each patch's d values in the
        order (kernel offsets, channels): any fixed order gives the same dot products, and this
        one gathers contiguous runs of channels (F.unfold's order needs a slow transposed copy) from
        the padded input, padded into a channels-last copy (gathering from the channels-first input
        took twice as long: 2.4 -> 1.3 ms for a 128-channel 3 x 3 convolution at 8 x 8, B 64)."""
        m, batch = self.module, x.shape[0]
        x, padding = _conv_padding(m, x)
        patches = F.pad(x.movedim(1, -1), [0, 0] + [p for p in reversed(padding) for _ in range(2)])  # (B, *space, C)
        for dim, (k, stride, dilation) in enumerate(zip(m.kernel_size, m.stride, m.dilation)):
            patches = patches.unfold(1 + dim, dilation * (k - 1) + 1, stride)[..., ::dilation]
        dims = len(m.kernel_size)  # patches: (B, *out, C, *kernel)
        patches = patches.movedim(1 + dims, -1).unflatten(-1, (m.groups, -1)).movedim(-2, 1)
        return patches.reshape(batch * m.groups, math.prod(patches.shape[2:2 + dims]), -1)

    def _per_sample_weight_grads(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """(B, *weight.shape): privleak's per-sample convolution kernel
        (:func:`~privleak.dpsgd.conv_grads.conv_weight_grads`)."""
        m = self.module
        x, padding = _conv_padding(m, x)
        return conv_grads.per_sample_conv_grads(x, g, list(m.kernel_size), list(m.stride), padding, list(m.dilation),
                                                m.groups)

    def _weight_grad(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """The convolution's weight gradient for input x and output gradient g."""
        m = self.module
        x, padding = _conv_padding(m, x)
        x, g, weight = _common(x, g, m.weight)
        return torch.ops.aten.convolution_backward(g, x, weight, None, list(m.stride), padding, list(m.dilation),
                                                   False, [0] * (x.ndim - 2), m.groups, [False, True, False])[1]

    def norms_by_parameter(self, batch: int, norm_type: int) -> dict:
        m = self.module
        if self.reduced or not self.trains(m.weight):  # all formed: rows()
            return {}
        if not self._ghost(norm_type):
            return formed_norms(self._formed_weight_grads, self._formed_step(), batch, norm_type)
        pixels = self._pixels()
        # What a sample takes while its norm is made: the pixel Grams (G N^2 doubles) or the
        # patches (G L d), and g made contiguous.
        if pixels:
            norms, transient = self._pixel_ghost_norms, m.groups * 2 * pixels * pixels
        else:
            norms, transient = self._ghost_norms, m.groups * self._positions() * self._patch_size()
        transient += self._positions() * self._outputs_per_group() * m.groups
        step = samples_per_chunk(self._held_per_sample(), transient, on_gpu=m.weight.is_cuda)
        return {id(m.weight): torch.cat([norms(slice(i, i + step)) for i in range(0, batch, step)])}

    def _pixels(self) -> int:
        """N, the input pixels a channel, when the ghost norms come from the input's pixel Gram
        (:func:`~privleak.dpsgd.ghost_norm.pixel_gram_pays`; one call: the pixel Gram of two
        calls' inputs would be needed for their cross terms); else 0."""
        if len(self.calls) != 1:
            return 0
        m = self.module
        pixels = math.prod(_conv_padding(m, self.calls[0][:1])[0].shape[2:])
        pays = ghost_norm.pixel_gram_pays(pixels, self._positions(), math.prod(m.kernel_size))
        return pixels if pays else 0

    def _pixel_ghost_norms(self, samples: slice) -> torch.Tensor:
        """Ghost norms of the weight for a slice of the batch, from the pixel Gram
        (:func:`~privleak.dpsgd.ghost_norm.conv_ghost_norms`)."""
        m, lost = self.module, []
        x, padding = _conv_padding(m, self.calls[0][samples])
        norms = ghost_norm.conv_ghost_norms(x, self.grads[0][samples], list(m.kernel_size), list(m.stride), padding,
                                            list(m.dilation), m.groups, clipping=True, may_sync=self.may_sync,
                                            lost=lost)
        self._lose(lost, samples)
        return norms

    def _lose(self, lost: list, samples: slice) -> None:
        """Keeps for :meth:`sums_by_parameter` the samples of a chunk whose groups' ghost norms were
        computed again in float64 (``lost``: rows (sample, group) of the chunk, sample-major)."""
        self.lost.setdefault(id(self.module.weight), []).extend(
            rows // self.module.groups + samples.start for rows in lost)

    def _ghost_norms(self, samples: slice) -> torch.Tensor:
        """Ghost norms of the weight for a slice of the batch, from the patches."""
        m = self.module
        outputs = self._outputs_per_group()
        a = [self._patches(x[samples]) for x in self.calls]
        g = [y[samples].reshape(-1, outputs, math.prod(y.shape[2:])).transpose(1, 2) for y in self.grads]
        a, g = _common(*((a[0], g[0]) if len(a) == 1 else (torch.cat(a, 1), torch.cat(g, 1))))
        lost: list = []
        norms = ghost_norm.ghost_norms([ghost_norm.GhostNormInputs(a, g, lost)], clipping=True,
                                       may_sync=self.may_sync)
        self._lose(lost, samples)
        return ghost_norm.group_totals(norms[0], m.groups)

    def _formed_step(self) -> int:
        """Samples a chunk of per-sample weight gradients (:meth:`_formed_weight_grads`) holds."""
        return samples_per_chunk(self._held_per_sample(), self.module.weight.numel(), on_gpu=self.module.weight.is_cuda)

    def _formed_weight_grads(self, samples: slice) -> dict:
        """The weight's per-sample gradients for a slice of the batch, by id."""
        return {id(self.module.weight): total(self._per_sample_weight_grads(x[samples], y[samples])
                                              for x, y in zip(self.calls, self.grads))}

    def sums_by_parameter(self, factors: dict, keep: Optional[torch.Tensor], norm_type: int) -> dict:
        """The weight, never formed whole: on the ghost side the convolution's weight gradient of
        the scaled output gradients, the samples whose norms were computed again in float64 by a
        float64 one (:func:`clipped_weight_sum`'s reason); else the per-sample gradients whose
        norms were taken, formed again in the same chunks (:func:`formed_sums`)."""
        if not self._ghost(norm_type):
            return formed_sums(self._formed_weight_grads, self._formed_step(), len(self.calls[0]), factors, keep)
        key, f = id(self.module.weight), factors[id(self.module.weight)]
        lost = self.lost.get(key)
        rest, rows = _taken_apart(lost, keep, len(f)) if lost else (keep, None)
        sums = total(self._weight_grad(_zero_dropped(x, rest), _scaled(_zero_dropped(y, rest), f))
                     for x, y in zip(self.calls, self.grads))
        if rows is not None:  # the samples whose norms were computed again in float64: their sum so too
            sums = sums + total(self._weight_grad(x[rows].double(), _scaled(y[rows].double(), f[rows].double()))
                                for x, y in zip(self.calls, self.grads)).to(sums.dtype)
        return {key: sums}


@layer_kind(nn.ConvTranspose1d, nn.ConvTranspose2d)
class TransposedConvLayer(ConvLayer):
    """nn.ConvTranspose1d / nn.ConvTranspose2d (stride, padding, output padding, dilation, groups).
    The weight gradient of y = conv_transpose(x, W) is that of the convolution of g = dL/dy with
    the same stride, padding, dilation and groups whose output is x: dL/dW[i, o, k] = sum_t
    x[i, t] g[o, s t - p + d k], a convolution's weight gradient with g as its input and x as its
    output gradient, of weight shape (C_in, C_out / G, *k), the transposed convolution's own. So
    the convolution rule runs with the two swapped as the output gradient comes in (its ghost
    norms, per-sample kernel and clipped sum alike); the bias's per-sample gradients are g summed
    over positions, as a convolution's."""

    def record(self, args: tuple, kwargs: dict, output: Any) -> list[torch.Tensor]:
        self._check_batched(args, kwargs, output)
        outputs = Layer.record(self, args, kwargs, output)
        if outputs:
            m, x = self.module, self.calls[-1]
            for size, out, k, stride, pad, dilation in zip(x.shape[2:], outputs[0].shape[2:], m.kernel_size, m.stride,
                                                           m.padding, m.dilation):
                if out - ((size - 1) * stride - 2 * pad + dilation * (k - 1) + 1) >= stride:
                    raise ValueError(f"{self.describe()} has an output padding of at least its stride (possible with "
                                     "a dilation above the stride): the convolution of its output gradient would "
                                     "not give its input's size; use an output padding below the stride")
            self._output_sizes.append(x.shape)  # the swapped convolution's output: x
        return outputs

    def take_grad(self, call: int, output: int, grad: torch.Tensor, norm_type: int) -> None:
        x, self.calls[call] = self.calls[call], grad
        super().take_grad(call, output, x, norm_type)

    def _bias_grads(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return x  # swapped: the convolution's input is the module's output gradient


@layer_kind(nn.Embedding)
class EmbeddingLayer(Layer):
    """nn.Embedding: the input is one-hot, so a sample's gradient has one row per token it holds,
    the sum of that token's output gradients. Those rows are formed, each at its token's first
    position (:meth:`_token_rows`: as large as the output gradients, held beside them until the
    sum), and the norm and the clipped sum both come from them: the clipped sum, the Embedding's weight gradient
    of the rows scaled by f, adds the very vectors whose norms were clipped. The ghost norm from
    token equality (:func:`~privleak.dpsgd.ghost_norm.embedding_ghost_norm_squared`) took each
    row's sum in float64, the clipped sum in float32 over the batch: on a token repeated with
    output gradients that cancel (entries up to 1.7e7), a sample's share reached 4.1 times C.
    Positions at ``padding_idx`` get no gradient."""

    rows_are_samples = broadcast_calls = True

    def __init__(self, name: str, module: nn.Module):
        super().__init__(name, module)
        if module.scale_grad_by_freq and self.parameters:  # frozen, it has no gradient to divide
            raise ValueError(f"{self.describe()} has scale_grad_by_freq=True: its gradient divides by token counts "
                             "over the whole batch, so a sample's gradient depends on the others and cannot be clipped")

    def refusal(self) -> Optional[str]:
        """max_norm set since BookKeeping was built (:func:`check_no_embedding_max_norm` refused it then)."""
        return None if self.module.max_norm is None else _max_norm_refusal(self.describe(), self.module.max_norm)

    def clear(self) -> None:
        super().clear()
        self._rows: Optional[torch.Tensor] = None  # the per-sample rows whose norms were taken (_token_rows)

    def _sites(self) -> tuple[torch.Tensor, torch.Tensor]:
        """ids (B, T) and g (B, T, p), positions at a call's padding index zeroed, the calls laid
        end to end."""
        batch = self.calls[0].shape[0]
        g = [y.reshape(batch, -1, y.shape[-1]) for y in self.grads]
        g = [y if (pad := self.padding(call)) is None else y * (ids.reshape(batch, -1) != pad).unsqueeze(-1).to(y.dtype)
             for call, (ids, y) in enumerate(zip(self.calls, g))]
        return self._ids(), g[0] if len(g) == 1 else torch.cat(g, 1)

    def padding(self, call: int) -> Optional[int]:
        """The padding index whose positions call ``call`` gives no gradient: the module's."""
        return self.module.padding_idx

    def _ids(self) -> torch.Tensor:
        """ids (B, T), the calls laid end to end."""
        ids = [i.reshape(self.calls[0].shape[0], -1) for i in self.calls]
        return ids[0] if len(ids) == 1 else torch.cat(ids, 1)

    def can_tie(self, parameter: torch.Tensor) -> bool:
        return parameter is self.module.weight

    def factors(self, parameter: torch.Tensor) -> Optional[Factors]:
        """The weight's per-sample gradient sum_t e_{id_t} g_t^T: L = the ids (one-hot), R = g."""
        return Factors(*self._sites()) if self.calls else None

    def norms_by_parameter(self, batch: int, norm_type: int) -> dict:
        ids, g = self._sites()
        self._rows = self._token_rows(ids, g)
        return {id(self.module.weight): row_norms(self._rows, norm_type)}

    @staticmethod
    def _token_rows(ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """(B, T, p), float32 at least: each sample's rows of its gradient, the output gradients of
        equal tokens added at the position of the token's first occurrence (0 elsewhere). The first
        occurrences come from a stable sort of each sample's ids, whose shapes are fixed (a CUDA
        graph can capture it; comparing every pair of positions took B T^2 bytes)."""
        batch, length = ids.shape
        ordered, order = ids.sort(dim=1, stable=True)
        starts = torch.ones_like(ordered, dtype=torch.bool)
        starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
        places = torch.arange(length, device=ids.device).expand(batch, length)
        first = order.gather(1, torch.where(starts, places, 0).cummax(1).values)  # in sorted order
        first = torch.empty_like(first).scatter_(1, order, first)
        first += torch.arange(batch, device=ids.device).unsqueeze(1) * length
        return _rows_added(g, first, batch * length).view(batch, length, g.shape[-1])

    def sums_by_parameter(self, factors: dict, keep: Optional[torch.Tensor], norm_type: int) -> dict:
        """The Embedding's weight gradient of the rows whose norms were taken, scaled by f."""
        weight, ids = self.module.weight, self._ids()
        rows, self._rows = self._rows, None
        scaled = _scaled(_zero_dropped(rows, keep), factors[id(weight)])
        return {id(weight): _rows_added(scaled.to(torch.promote_types(scaled.dtype, weight.dtype)), ids,
                                        weight.shape[0])}


class LookupEmbeddingLayer(EmbeddingLayer):
    """An nn.Embedding subclass with a forward of its own that makes its ids and returns
    nn.Embedding's lookup of them (BART's and OPT's learned position embeddings: position ids from
    the input's shape or its attention mask, offset by 2). The ids are the lookup's own, read from
    its autograd node, and the rule is nn.Embedding's, with the lookup's own padding index (a
    forward calling F.embedding without the module's had its padding row's gradient dropped: a
    review's repro). A forward that returns rows of its weight by a slice or an index (Whisper's
    decoder position embedding, ``self.weight[a:b]``, which the batch shares: it was refused) is
    read as the lookup of those rows' ids, without a padding index; one that returns it beside
    values without grad (ProphetNet's, its position ids too) as returning it; one that returns
    anything else is refused, naming the module."""

    def clear(self) -> None:
        super().clear()
        self.paddings: list = []  # per call, the padding index its lookup zeroes (None: none)

    def renumber(self, new: dict) -> None:
        super().renumber(new)
        self.paddings = [padding for call, padding in enumerate(self.paddings) if call in new]

    def padding(self, call: int) -> Optional[int]:
        return self.paddings[call]

    def before_call(self) -> None:
        self._weight_version = self.module.weight._version

    def record(self, args: tuple, kwargs: dict, output: Any) -> list[torch.Tensor]:
        """A forward that returns its lookup beside values without grad (ProphetNet's, the lookup
        and its position ids) is read as returning the lookup."""
        if isinstance(output, (tuple, list)):
            lookups = [x for x in output if isinstance(x, torch.Tensor) and x.requires_grad]
            output = lookups[0] if len(lookups) == 1 else output
        return super().record(args, kwargs, output)

    def recorded_input(self, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
        graph.refuse_compiled(output.grad_fn, f"the output of {self.describe()}")
        if getattr(self, "_weight_version", self.module.weight._version) != self.module.weight._version:
            # F.embedding(ids, self.weight, max_norm=...) in the forward, with the module's max_norm None (a
            # review's repro: which rows were renormalised told whether the batch held a token)
            raise ValueError(f"{self.describe()} changed its weight in its forward call (F.embedding with max_norm "
                             "renormalises in place the rows the batch's ids look up, so the weights change by the "
                             "data outside the noise); scale the rows looked up instead "
                             "(e * (max_norm / e.norm(dim=-1, keepdim=True)).clamp(max=1))")
        weight, ids, padding = graph.embedding_lookup(output)
        if weight is not self.module.weight:
            ids, padding = graph.taken_rows(output, self.module.weight), None
        self.paddings.append(padding)
        if ids is None:
            raise ValueError(f"{self.describe()} is an nn.Embedding with a forward of its own that returns something "
                             "other than its lookup (nn.Embedding.forward of the ids it makes): book-keeping reads "
                             "the ids from the lookup; return that lookup, and do the rest outside the module")
        return ids


EmbeddingLayer.own_forward_rule = LookupEmbeddingLayer


@layer_kind("transformers.models.*.modeling_*.*ScaledWordEmbedding")
class ScaledEmbeddingLayer(EmbeddingLayer):
    """Hugging Face's scaled word embeddings (Gemma's, BART's, ...: an nn.Embedding whose forward
    multiplies the lookup by ``embed_scale``, a constant): an Embedding rule whose output gradient
    is the module's times that constant, so it can be tied to the head as an nn.Embedding can. A
    constant kept as a tensor (Gemma's buffer) multiplies as the forward's does, in the weight's
    dtype, and is not read on the host (a sync on a GPU, which a CUDA graph's capture refuses)."""

    def _sites(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids, g = super()._sites()
        scale = self.module.embed_scale
        return ids, g * (scale.to(self.module.weight.dtype) if isinstance(scale, torch.Tensor) else scale)


@layer_kind(nn.EmbeddingBag)
class EmbeddingBagLayer(EmbeddingLayer):
    """nn.EmbeddingBag, one bag a sample, in mode "sum" or "mean": bag i's output is sum_t c_t
    W[id_t] over its tokens, c_t = 1 (sum), the token's ``per_sample_weights`` entry (sum), or
    1 / n_i (mean, n_i its tokens not at ``padding_idx``), and 0 at ``padding_idx``. So its
    per-sample gradient is an Embedding's whose output gradient at token t is c_t g_i, g_i the
    bag's output gradient: the bags are laid out as rows of ids (B, L), padded with coefficient 0,
    and the Embedding's rule takes them. The bags come as rows of a 2-D input, or as a 1-D input
    cut by ``offsets`` (torchtext's text classifier, each sample's tokens laid end to end), read
    on the host for the longest bag (not in a CUDA graph's capture). Mode "max" (each dimension
    from its own token) goes to the fallback."""

    broadcast_calls = False
    own_forward_rule = None

    @classmethod
    def takes(cls, module: nn.Module) -> bool:
        return super().takes(module) and module.mode in ("sum", "mean")

    def refusal(self) -> Optional[str]:
        if self.module.mode not in ("sum", "mean"):
            return (f"{self.describe()} has mode={self.module.mode!r}, set since BookKeeping was built with mode "
                    "'sum' or 'mean' (whose rule it took): build BookKeeping after setting the mode")
        return super().refusal()

    def clear(self) -> None:
        super().clear()
        self.coefficients: list = []  # per call, c (B, L) of the ids it keeps (B, L)

    @staticmethod
    def _arguments(args: tuple, kwargs: dict) -> tuple:
        """(input, offsets, per_sample_weights) of a forward call."""
        names = ("input", "offsets", "per_sample_weights")
        given = {**dict(zip(names, args)), **kwargs}
        return tuple(given.get(name) for name in names)

    def recorded_input(self, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
        return self._arguments(args, kwargs)[0]

    def record(self, args: tuple, kwargs: dict, output: Any) -> list[torch.Tensor]:
        """Layer's record, the call's input (kept for its version) then replaced by the bags' ids."""
        outputs = super().record(args, kwargs, output)
        if outputs:
            text, offsets, weights = self._arguments(args, kwargs)
            self.calls[-1], coefficients = self._bags(text, offsets, None if weights is None else weights.detach())
            self.coefficients.append(coefficients)
        return outputs

    def _bags(self, text: torch.Tensor, offsets: Optional[torch.Tensor],
              weights: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, c), both (bags, longest bag), from the call's input, offsets and per-sample weights."""
        coefficients = torch.ones(text.shape, dtype=torch.float32, device=text.device) if weights is None else \
            weights.to(torch.promote_types(weights.dtype, torch.float32))
        if text.ndim == 1:
            if graph.capturing():
                raise ValueError(f"{self.describe()} took a 1-D input cut by offsets in a CUDA graph's capture, "
                                 "where book-keeping cannot read the bags' lengths: pass the bags as a 2-D input")
            bounds = offsets[:-1] if self.module.include_last_offset else offsets
            if self.module.include_last_offset and offsets.numel() and int(offsets[-1]) != text.shape[0]:
                raise ValueError(f"{self.describe()} has include_last_offset=True and got {text.shape[0]} tokens, "
                                 f"but its last offset is {int(offsets[-1])}: the tokens after it are in no bag "
                                 "(torch's backward writes undefined values into their rows); pass the tokens of "
                                 "the bags alone")
            lengths = torch.diff(bounds, append=bounds.new_tensor([text.shape[0]]))
            longest = int(lengths.max()) if lengths.numel() else 0
            bag = torch.repeat_interleave(torch.arange(bounds.shape[0], device=text.device), lengths)
            place = torch.arange(text.shape[0], device=text.device) - bounds[bag]
            ids = text.new_zeros(bounds.shape[0], longest).index_put_((bag, place), text)
            coefficients = coefficients.new_zeros(ids.shape).index_put_((bag, place), coefficients)
            present = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device).index_put_(
                (bag, place), torch.ones_like(text, dtype=torch.bool))
        else:
            ids, present = text, torch.ones(text.shape, dtype=torch.bool, device=text.device)
        if self.module.padding_idx is not None:
            present &= ids != self.module.padding_idx
        coefficients = coefficients * present
        if self.module.mode == "mean":
            counts = present.sum(1, keepdim=True)
            coefficients = coefficients / counts.clamp(min=1)
        return ids, coefficients

    def renumber(self, new: dict) -> None:
        super().renumber(new)
        self.coefficients = [self.coefficients[old] for old in sorted(new, key=new.get)]

    def _sites(self) -> tuple[torch.Tensor, torch.Tensor]:
        """ids (B, L) and the output gradient at each token, c_t g_i (B, L, p), the calls laid end to end."""
        g = [c.unsqueeze(-1) * y.to(torch.promote_types(y.dtype, torch.float32)).unsqueeze(1)
             for c, y in zip(self.coefficients, self.grads)]
        return self._ids(), g[0] if len(g) == 1 else torch.cat(g, 1)


def _rows_added(values: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows, p), float32 at least: out[r] = the sum of the rows of ``values`` (..., p) whose
    ``index`` is r, by torch's Embedding weight gradient, deterministic on CUDA (index_add_ and
    scatter_add_ add with float atomics there, in an order that varies from run to run) and faster
    than index_add_ on the CPU (docs/benchmarks.md). It adds in the values' dtype: half types are
    widened first, or each add would round to 8 or 11 bits."""
    values = values.to(torch.promote_types(values.dtype, torch.float32))
    return torch.ops.aten.embedding_dense_backward(values.reshape(-1, values.shape[-1]), index.reshape(-1), rows,
                                                   -1, False)


class _AffineNorm(Layer):
    """A normalisation y = x_hat w + b: per-sample gradients are the sums over positions of x_hat g
    (weight) and g (bias), x_hat recomputed from the recorded input without the affine part; they
    are one value per channel, formed during the backward pass."""

    rows_are_samples = True

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def channels(self, y: torch.Tensor) -> torch.Tensor:
        """y (B, ...) as (B, positions, channels), channels in the parameters' layout."""
        raise NotImplementedError

    def weight_rows(self, call: int, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """(B, channels): the weight's per-sample gradients of call ``call``."""
        return self.channels(self.normalized(x) * g).sum(1)

    def reduce(self, call: int, norm_type: int) -> Optional[dict]:
        m = self.module
        x, (g,) = self.calls[call], self.grads[call]
        rows = {}
        if self.trains(m.weight):
            rows[id(m.weight)] = self.weight_rows(call, x, g).reshape(x.shape[0], *m.weight.shape)
        if self.trains(getattr(m, "bias", None)):  # nn.RMSNorm has none
            rows[id(m.bias)] = self.channels(g).sum(1).reshape(x.shape[0], *m.bias.shape)
        return rows


@layer_kind(nn.LayerNorm)
class LayerNormLayer(_AffineNorm):
    """nn.LayerNorm over the last dims of inputs of any leading shape."""

    broadcast_calls = flattened_batch_calls = True

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.module.normalized_shape, eps=self.module.eps)

    def channels(self, y: torch.Tensor) -> torch.Tensor:
        return y.reshape(y.shape[0], -1, math.prod(self.module.normalized_shape))


@layer_kind("torch.nn.modules.normalization.RMSNorm")  # by name: torch 2.4 added it
class RMSNormLayer(LayerNormLayer):
    """nn.RMSNorm (LLaMA-style models): x_hat = x / sqrt(mean(x^2) + eps) over the last dims, a
    weight and no bias."""

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.module.normalized_shape, eps=self.module.eps)


@layer_kind(nn.GroupNorm)
class GroupNormLayer(_AffineNorm):
    """nn.GroupNorm on (B, C, ...) inputs: one weight and bias per channel. The weight's per-sample
    gradient is sum_t (x_t - mu) g_t / sigma per channel, with the group's mean mu and 1 / sigma
    the forward pass saved for its backward (re-normalising x instead took as long as the forward's
    group norm: 5.5 -> 3.8 ms a step on the CIFAR CNN, B 64), in float32 at least. Not torch's
    own backward formula, (sum_t x_t g_t - mu sum_t g_t) / sigma, one sample at a time: its two
    sums cancel where a group is nearly constant (a blank image's), and 1 / sigma, up to
    1 / sqrt(eps), magnifies what is left (in bfloat16, 0.08 for a gradient of 0). The centred
    copy of x costs 1.6% of the CIFAR CNN's step at B 64 and 2.1% of WRN-16-4's (alternating with
    torch's formula in one process). Under activation checkpointing x is normalised again: reading
    the saved statistics in the forward recomputed the checkpointed region (a block with two
    GroupNorms ran 5 times)."""

    saved_statistics: ClassVar[tuple] = ("_saved_result1", "_saved_result2")  #: native_group_norm's backward node's

    def clear(self) -> None:
        super().clear()
        self.statistics: list = []  # per call, the forward's (mean, 1 / sigma), each (B, groups), or None

    def record(self, args: tuple, kwargs: dict, output: Any) -> list[torch.Tensor]:
        outputs = super().record(args, kwargs, output)
        if outputs and any(graph.checkpointed(output.grad_fn, name) for name in self.saved_statistics):
            self.statistics.append(None)  # reading them would recompute the checkpointed region now
        elif outputs:
            saved = [getattr(output.grad_fn, name, None) for name in self.saved_statistics]
            self.statistics.append(saved if all(isinstance(s, torch.Tensor) for s in saved) else None)
        return outputs

    def weight_rows(self, call: int, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        statistics = self.statistics[call]
        if statistics is None:  # a forward other than native_group_norm's: normalise x again
            return super().weight_rows(call, x, g)
        dtype = functools.reduce(torch.promote_types, (x.dtype, g.dtype, torch.float32))
        mean, inverse_sigma = (s.to(dtype).view(*s.shape, 1, 1) for s in statistics)  # (B, groups, 1, 1)
        x = x.reshape(*mean.shape[:2], -1, math.prod(x.shape[2:]))  # (B, groups, channels of a group, positions)
        centred = torch.linalg.vecdot(x - mean, g.reshape(x.shape).to(dtype))
        return (centred * inverse_sigma.squeeze(3)).flatten(1)

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        return F.group_norm(x, self.module.num_groups, eps=self.module.eps)

    def channels(self, y: torch.Tensor) -> torch.Tensor:
        return y.reshape(y.shape[0], y.shape[1], -1).transpose(1, 2)


class _Replay(NamedTuple):
    """What a replay of a forward call reproduces of it: the autocast it ran under, and the
    module's buffers (its children's too, which its replay runs), by name under the module.

    Those of its parametrizations as the call left them: a training call of ``spectral_norm``
    first updates its power-iteration vectors in place, then divides by the norm they give (the
    replay runs it in eval mode, :meth:`context`). The others as the call found them, each replay
    on fresh copies of the small ones (:data:`buffers.COPIED_SIZE` elements at most), so that a
    replay changes neither the model nor the next replay (each sample's replay wrote the live
    buffers again and computed with them as written: a review's repro, a counter at 5 after a step
    of 4 samples, gradients 5-77% off with the first sample's check off); one the call made
    (registered as None before: a lazy cache) is made again. A large one the call did not write is
    the module's own, which must not change until the step (:meth:`state`).

    A buffer the call changed is refused at the call, replayed or not, with grad or without, where
    the change may depend on the batch (:meth:`buffers.Snapshot.check`: a running average of the batch,
    released outside the noise as BatchNorm's running statistics would be; a LayerScale keeping
    one took the broadcast rule and trained before it was refused). One that does not (a counter,
    Phi-3's longrope ``inv_freq.copy_`` switching its factors at a sequence length) is replayed
    from its value before the call, so that each replay writes and reads it as the call did."""

    device: str
    autocast: bool
    dtype: torch.dtype
    buffers: dict  # name: (tensor, its version then, or None for a copy); None for one made again
    what: str  # the module, for messages
    #: the modules as the call found them, which each replay finds too (their attributes also: a dynamic RoPE's
    #: cached length decides whether it makes its frequencies again), and leaves so (a replay's write of an
    #: attribute, Phi-3's longrope's ``self.long_inv_freq = ...``, left a vmap's tensor in the model)
    found: Optional[buffers.Snapshot] = None

    @classmethod
    def of(cls, module: nn.Module, device: str, parametrization_buffers: list, before: Optional[buffers.Snapshot],
           what: str) -> "_Replay":
        """The replay of a call of ``module``, whose buffers ``before`` holds as the call found them
        (None where no call was seen before: grad turned on inside the forward)."""
        state = {name: (module.get_buffer(name).detach().clone(), None) for name in parametrization_buffers}
        if before is None:  # no call was seen before (grad turned on inside the forward)
            for name, now in module.named_buffers():
                if name not in state:
                    small = now.numel() <= buffers.COPIED_SIZE
                    state[name] = (now.detach().clone(), None) if small else (now, now._version)
            return cls(device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device), state, what)
        for name, found in before.buffers.items():
            state[name] = None if found is None else (found.copy, None) if found.copy is not None \
                else (found.tensor, found.version)
        return cls(device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device), state, what, before)

    def half(self) -> bool:
        """Whether the call ran under a 16-bit autocast."""
        return self.autocast and self.dtype in (torch.float16, torch.bfloat16)

    def state(self) -> dict:
        """The buffers for one replay: fresh copies of the small ones, the module's own large ones,
        which must be as the call saw them."""
        state = {}
        for name, entry in self.buffers.items():
            if entry is None:
                state[name] = None
                continue
            tensor, version = entry
            if version is not None and tensor._version != version:
                raise ValueError(f"the buffer '{name}' of {self.what} was changed after a forward call and before the "
                                 "step (by a later call of the module, or in place by other code): book-keeping "
                                 "replays that call for the module's per-sample gradients, from its buffers as the "
                                 "call saw them; change the buffer after the step")
            state[name] = tensor if version is not None else tensor.clone()
        return state

    @contextlib.contextmanager
    def context(self, spectral_norms: list):
        """The call's autocast, the modules as the call found them (:attr:`found`), and the
        module's spectral norms in eval mode: they divide by the norm that the vectors given
        (:attr:`buffers`) estimate without updating them, so the replay computes the call's
        weights."""
        spectral = [m for m in spectral_norms if m.training]
        with self.found.restored() if self.found is not None else contextlib.nullcontext():
            try:
                for m in spectral:
                    m.training = False
                with torch.autocast(self.device, dtype=self.dtype, enabled=self.autocast):
                    yield
            finally:
                for m in spectral:
                    m.training = True


class FunctionalLayer(Layer):
    """The fallback for a module with trainable parameters and no rule: per-sample gradients of its
    own parameters by ``torch.func`` (vmap over samples of the gradient of its forward, recomputed
    on each sample's recorded input, weighted by the recorded output gradients). It costs another
    forward and backward of that module and B times its parameters in memory, for it alone.

    Tensor arguments whose first dim is the batch size are split by sample, the others shared;
    a call on the batch flattened with its positions, (B T, ...) as the graph shows it (a mixture
    of experts' router and experts), gives each sample its T rows; a call on the batch whose
    outputs have it so flattened (DeepSeek-V3's router flattens its (B, T, d) input itself) takes
    each sample's T output rows as their cotangent. The forward must treat samples
    independently and be deterministic (it is replayed from its buffers as the call saw them,
    :class:`_Replay`): one that draws random numbers (dropout in training mode)
    could not be replayed and is refused at the step (vmap says it drew them); a dropout module
    it holds but does not run (peft's LoRA embedding) is no matter. A forward that torch.func
    cannot transform (shapes that depend on the data; a parametrization registered in it) is
    replayed one sample at a time by ordinary backward passes. Where the per-sample gradients
    would be more than 4 times what the replay reads (:func:`when_to_form`), they are formed a
    few samples at a time for the norms alone, and the clipped sum is one backward pass of the
    module with its output gradients scaled by the clip factors.

    **Broadcast parameters.** Where every use of the module's own parameters in a call adds one
    to (or subtracts it from) the batch, multiplies the batch by it, or expands it over the batch,
    directly or through views (a ViT's class token, ``cls.expand(B, -1, -1)``, and position
    embedding, ``x + pos`` or ``x + pos[:, :T]``, on the model itself; Hugging Face's RMSNorm
    modules, ``weight * x_hat``; a LayerScale, ``x * gamma``), each sample's gradient is that op's
    output gradient for the sample, times the other factor of a product (which the op's node
    saves for its backward), summed over the dims the operand is broadcast along (times the op's
    alpha, negated for a subtrahend; a view's placed back where it came from): the layer takes it
    from a hook on the op's autograd node in the backward pass, with no replay. As a layer's
    input must, such an op's output must have the batch in dim 0; an op whose output turns out not
    to (another dim 0) and any other use take the replay, and a module whose op's output once had
    another dim 0 is replayed from then on: its dim 0 was positions (a sequence-first (T, B, d)
    output times a layer scale), which at T = B would look like the batch (a review's repro: a
    sample's share 3.2 times C, at a Poisson batch of B = T after a first of B != T; at a first
    batch of B = T, the first sample's check refuses it).

    **Shared outputs.** A call whose outputs the batch shares (BART's learned position embedding
    makes its own position ids (1, T); BookKeeping finds such calls from their outputs' uses) is
    replayed once with its inputs whole, vmapped over each sample's output gradients.

    The replay runs the module's whole forward, children included: for a module whose parameters
    of its own sit beside layers, that is another forward and backward of those layers per step
    (the bench transformer with its position embedding a parameter of the model, B 32: 479-494 ms
    a step replayed, 296-300 ms by the broadcast rule, as with an nn.Embedding). Such a replay
    warns, saying to put those parameters in a small module of their own.
    """

    uses_per_call = None
    broadcast_calls = flattened_batch_calls = flattened_output_calls = True
    chunk_at_least = 1  #: samples a chunk takes at least, where the norms come in chunks (a replay is large alone)

    def __init__(self, name: str, module: nn.Module):
        self._replay_warned = False
        self._one_at_a_time = False  # its forward is replayed by a loop over samples, not by vmap
        self._replayed_for_dim_0 = False  # an op of its broadcast rule had another dim 0 than the batch
        #: its parameters are used in a region of the step's graph without the batch, bounded by shared layer calls
        #: (BookKeeping's _chain_shared gives their per-sample gradients: :meth:`take_region_rows`)
        self.in_region = False
        # a parametrized nn.Linear (weight_norm, spectral_norm) runs nn.Linear's forward on the weight it computes
        self.returns_own_view = type(self).returns_own_view or type(module).forward is nn.Linear.forward
        #: the children whose parameters its class's code reads (:mod:`~privleak.dpsgd.direct_reads`), until its first
        #: call with grad shows which of them it reads outside their forwards (BookKeeping's settle)
        self.unsettled = () if self.claims_children else tuple(direct_reads.children_read_directly(module))
        self.unsettled_parameters = {name: [p for p in module.get_submodule(name).parameters() if p.requires_grad]
                                     for name in self.unsettled}
        self.read_children: tuple = ()  # those it does (a Mamba mixer's conv1d): replayed with it
        super().__init__(name, module)
        self._parametrization_buffers = [name for name, _ in module.named_buffers()
                                         if name.startswith("parametrizations.") or ".parametrizations." in name]
        self._spectral_norms = [m for m in module.modules() if isinstance(m, _SpectralNorm)]
        if any(isinstance(hook, _HookSpectralNorm) for m in [module, *self.claimed_modules()]
               for hook in m._forward_pre_hooks.values()):
            raise ValueError(f"{self.describe()} has the deprecated torch.nn.utils.spectral_norm, whose forward "
                             "pre-hook updates its vectors in place at every call in training mode, so that a replay "
                             "would not compute the call's weight: use torch.nn.utils.parametrizations.spectral_norm")

    @classmethod
    def takes(cls, module: nn.Module) -> bool:
        return True

    def parameters_of(self, module: nn.Module) -> list:
        return [p for _, p in fallback_parameters(module, self.claims_children, self.read_children)]

    def claimed_modules(self) -> list:
        return [*super().claimed_modules(), *(sub for child in self.read_children
                                              for sub in self.module.get_submodule(child).modules())]

    def claim(self, children: list) -> None:
        """Answer for the parameters of ``children`` too (in the module's order), which the module's
        forward reads outside theirs (found once, before the layer recorded a call). They are the
        ones the module held when the layer was made: a forward under ``torch.func.functional_call``
        holds others."""
        self.read_children = tuple(children)
        own = {id(p) for p in self.parameters}
        self.parameters += [p for name in self.read_children for p in self.unsettled_parameters[name]
                            if id(p) not in own]

    def before_call(self) -> None:
        """The module's buffers as the call finds them (:class:`_Replay`), the entries the last
        call left reused where valid."""
        self._buffers_before = buffers.Snapshot(list(self.module.named_modules()),
                                                skip=frozenset(self._parametrization_buffers),
                                                known=getattr(self, "_buffers_known", None))

    def clear(self) -> None:
        super().clear()
        self.watched: list = []  # per call, (key, autograd node) pairs whose output gradients it takes
        self.shared_calls: set = set()  # calls whose outputs the batch shares (broadcast)
        self.chunked = False  # the replay gives norms a few samples at a time, and the clipped sum by the same again
        self.flattened_outputs: dict = {}  # call: {recorded output: batch size} for outputs of the batch flattened
        self.untraced: dict = {}  # call: its arguments without autograd history among several of the batch's dim 0
        self.shared_arguments: dict = {}  # call: those of them found shared by the batch, for chunked replays

    def broadcast(self, call: int, output_grads: list, norm_type: int) -> None:
        """A call whose outputs the batch shares (BART's learned position embedding, which makes its
        own position ids (1, T)): the replay takes its inputs whole, each sample's output gradients
        from ``output_grads``."""
        self.shared_calls.add(call)
        self.grads[call] = list(output_grads)

    def separated(self, args: tuple, kwargs: dict, output: Any) -> Any:
        """``output`` with a view in place of each output that another output is computed from (a
        router's logits, returned beside the routing weights made from them): the view's gradient
        is the loss's use of that output alone, which the replay needs as its cotangent (the
        gradient through the other output comes from the other's)."""
        flat, spec = tree_flatten(output)
        live = [k for k, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if len(live) < 2:
            return output
        fed = graph.fed_outputs([flat[k] for k in live], _input_nodes(tree_flatten((args, kwargs))[0]))
        if not fed:
            return output
        for k in fed:
            flat[live[k]] = flat[live[k]].view_as(flat[live[k]])
        return tree_unflatten(flat, spec)

    def output_tensors(self, output: Any) -> list[torch.Tensor]:
        """The tensors of a call's output, in the order :meth:`_outputs` returns them for a replay."""
        return [x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor)]

    def replayed_call(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments a call's replay takes (:meth:`_outputs`), each tensor with the batch in dim
        0 or shared by the batch: the call's own."""
        return args, kwargs

    def record(self, args: tuple, kwargs: dict, output: Any) -> list[torch.Tensor]:
        before, self._buffers_before = getattr(self, "_buffers_before", None), None
        if before is not None:  # also a call without grad (a target pass) may write a statistic of the batch
            before.check(self.module, args, kwargs, self.describe())
            self._buffers_known = before.left()
        outputs = self.output_tensors(output)
        live = [i for i, x in enumerate(outputs) if x.requires_grad]
        if not live:
            return []
        inputs = _input_nodes(tree_flatten((args, kwargs))[0])
        leaves, spec = tree_flatten(self.replayed_call(args, kwargs))
        consumers, parents = [[] for _ in self.parameters], {}
        self.uses.append(graph.count_uses([outputs[i].grad_fn for i in live], self.parameters, stop=inputs,
                                    graph=f"the output of {self.describe()}", consumers=consumers, parents=parents))
        broadcasts = graph.Broadcasts.of(consumers, parents, self.parameters, _batch_of(leaves))
        # Under activation checkpointing the broadcast rule's factors, saved tensors that the backward
        # recomputes, can be unpacked once only (the op's own backward could not): replayed then
        if broadcasts is not None and broadcasts.factors_checkpointed():
            broadcasts = None
        call = len(self.calls)
        replay = _Replay.of(self.module, outputs[live[0]].device.type, self._parametrization_buffers, before,
                            self.describe())
        self.calls.append(([self.keep(x) if isinstance(x, torch.Tensor) else x for x in leaves], spec, live, replay,
                           broadcasts))
        if untraced := _untraced_arguments(leaves, _batch_of(leaves)):
            self.untraced[call] = untraced
        batched = _batched_leaf(leaves)
        self.sources.append(None if batched is None else batched.grad_fn)
        self.watched.append([] if broadcasts is None else [((call, *key), node) for key, node in broadcasts.nodes()])
        self.edges.extend(get_gradient_edge(outputs[i]) for i in live)
        self.grads.append([None] * len(live))
        return [outputs[i] for i in live]

    def renumber(self, new: dict) -> None:
        super().renumber(new)
        self.shared_calls = {new[call] for call in self.shared_calls if call in new}
        self.flattened_outputs = {new[call]: outputs for call, outputs in self.flattened_outputs.items() if call in new}
        self.untraced = {new[call]: untraced for call, untraced in self.untraced.items() if call in new}
        self.shared_arguments = {new[call]: shared for call, shared in self.shared_arguments.items() if call in new}

    def unflatten(self, call: int, batch: int) -> None:
        """A call on the batch flattened with its positions (a mixture of experts' router and
        experts take the tokens (B T, d)): the replay gives each sample its T rows, whole."""
        self.flattened[call] = batch

    def unflatten_outputs(self, call: int, batch: int, outputs: list[int]) -> None:
        """Recorded outputs ``outputs`` of call ``call``, on the batch of ``batch``, hold it flattened
        with its positions, sample after sample (a DeepSeek-style router makes its logits and routing
        weights (B T, ...) of the hidden states (B, T, d)): their gradients are read as (B, T, ...),
        and the replay of each sample takes its T rows as the cotangent of its output's rows."""
        self.flattened_outputs[call] = dict.fromkeys(outputs, batch)

    def take_grad(self, call: int, output: int, grad: torch.Tensor, norm_type: int) -> None:
        batch = self.flattened.get(call, self.flattened_outputs.get(call, {}).get(output))
        if batch is not None and grad.ndim and grad.shape[0] % batch == 0:  # else refused by the replay
            grad = grad.unflatten(0, (batch, -1))
        self.grads[call][output] = grad

    def call_edges(self, call: int) -> list:
        start = sum(len(live) for _, _, live, *_ in self.calls[:call])
        return self.edges[start:start + len(self.calls[call][2])]

    def nodes(self, call: int) -> list:
        return self.watched[call]

    def sample_row_nodes(self, call: int, batch: int) -> list:
        broadcasts = self.calls[call][4]
        if broadcasts is None or self.flattened or self._replayed_for_dim_0:
            return []  # replayed: their rows are not read
        return [
            (self.parameters[i], use.node) for i, uses in enumerate(broadcasts.uses) for use in uses
            if use.broadcasts_over(batch)]  # an op with the positions or heads in dim 0 is replayed, not read so

    def forced_inputs(self) -> list:  # in a region, whose graph the step's backward must not run
        return self.parameters if any(self.watched) and not self.in_region else []

    def take_node_grad(self, key: tuple, grad: Optional[torch.Tensor]) -> None:
        call, parameter, use = key
        if grad is not None:
            self.calls[call][4].take(parameter, use, grad)

    def random_replay(self) -> str:
        """Why the module cannot be replayed: its forward drew random numbers (vmap refuses them),
        naming the dropout modules in training mode that it holds."""
        dropouts = [f"'{name}'" for name, sub in self.module.named_modules(prefix=self.name)
                    if sub.training and isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0]
        held = f" (dropout {', '.join(dropouts)} in training mode)" if dropouts else ""
        return (f"{self.describe()} is recomputed per sample (no book-keeping rule fits it) and draws random numbers "
                f"in its forward{held}, which cannot be replayed: set their p to 0 or call .eval() on them")

    def batch_sizes(self) -> list[int]:
        return [_batch_of(leaves) for leaves, *_ in self.calls]

    def finish(self) -> None:
        super().finish()
        self.grads = [g if isinstance(g, list) else [g] for g in self.grads]

    def take_region_rows(self, rows: dict, batch: int) -> None:
        """The per-sample gradients ``rows`` ((B, *shape) by parameter id; None: unused) of its
        parameters, used in a region of the graph that holds no batch (BookKeeping's chained
        shared calls), in place of a replay."""
        self.in_region = False
        self.per_sample = {id(p): torch.zeros(batch, *p.shape, dtype=torch.promote_types(p.dtype, torch.float32),
                                              device=p.device) if rows[id(p)] is None
                           else rows[id(p)].to(torch.promote_types(p.dtype, torch.float32))
                           for p in self.parameters}

    def rows(self, batch: int) -> dict:
        if self.calls and not self.per_sample and not self.chunked:
            broadcasts = [call[4] for call in self.calls]
            self._replayed_for_dim_0 |= any(b is not None and not b.valid for b in broadcasts)
            # a call whose batch is flattened with its positions has their rows, B T of them: replayed
            if not (self.flattened or self._replayed_for_dim_0) and all(b is not None and b.valid
                                                                        for b in broadcasts):
                self.per_sample = {id(p): total(b.rows(i) for b in broadcasts)
                                   for i, p in enumerate(self.parameters)}
                return self.per_sample
            if batch > 1:  # one sample's replay may stand for a rule that needs two (DeBERTa's region)
                self.warn_of_replayed_layers()
            if self._forming(batch) is Forming.NEVER:
                self.chunked = True
            else:
                self.per_sample = self.per_sample_grads(batch)
        return self.per_sample

    def _forming(self, batch: int) -> Forming:
        """Whether the per-sample gradients are formed whole or (NEVER) a few samples at a time for
        the norms, and again for the clipped sum (:func:`when_to_form`)."""
        return when_to_form(self._per_sample_size(), self._held_per_sample(batch))

    def _per_sample_size(self) -> int:
        return sum(p.numel() for p in self.parameters)

    def _held_per_sample(self, batch: int) -> int:
        """Values a sample of the recorded inputs and output gradients that the replay reads."""
        held = sum(x.numel() for leaves, *_ in self.calls for x in leaves if isinstance(x, torch.Tensor))
        held += sum(g.numel() for grads in self.grads for g in grads if g is not None)
        return held // max(batch, 1)

    def norms_by_parameter(self, batch: int, norm_type: int) -> dict:
        """A module whose per-sample gradients would be more than 4 times what its replay reads
        (:func:`when_to_form`; experts under LoRA on their parameters) is replayed a few samples at a
        time, for its norms; :meth:`sums_by_parameter` replays the same chunks again."""
        if not self.chunked:
            return {}
        vmapped = not self._one_at_a_time
        norms = formed_norms(functools.partial(self.per_sample_grads, batch), self._chunk_step(batch), batch, norm_type)
        if vmapped and self._one_at_a_time:  # vmap failed past the first chunk: all by the route the sums will take
            norms = formed_norms(functools.partial(self.per_sample_grads, batch), self._chunk_step(batch), batch,
                                 norm_type)
        return norms

    def sums_by_parameter(self, factors: dict, keep: Optional[torch.Tensor], norm_type: int) -> dict:
        """sum_i f_i G_i of the per-sample gradients whose norms were taken, replayed again in the same
        chunks (:func:`formed_sums`)."""
        batch = len(next(iter(factors.values())))
        return formed_sums(functools.partial(self.per_sample_grads, batch), self._chunk_step(batch), batch, factors,
                           keep)

    def _chunk_step(self, batch: int) -> int:
        return samples_per_chunk(self._held_per_sample(batch), self._per_sample_size(), at_least=self.chunk_at_least,
                                 on_gpu=any(p.is_cuda for p in self.parameters))

    def _parameter_names(self) -> dict:
        """The name under the module of each of its parameters, by id (for ``functional_call``)."""
        return {id(p): n for n, p in fallback_parameters(self.module, self.claims_children, self.read_children)}

    def _outputs(self, params: dict, values: list, spec) -> list[torch.Tensor]:
        """The tensor outputs of the module's forward on the call arguments ``values`` (flattened
        by ``spec``) with ``params`` in place of its parameters."""
        args, kwargs = tree_unflatten(values, spec)
        return [x for x in tree_flatten(functional_call(self.module, params, args, kwargs))[0]
                if isinstance(x, torch.Tensor)]

    def warn_of_replayed_layers(self) -> None:
        claimed = {id(sub) for sub in self.claimed_modules()}  # a parametrization's originals are the module's
        layers = [child for child, sub in self.module.named_children() if not isinstance(sub, _HOLDERS)
                  and id(sub) not in claimed and any(p.requires_grad for p in sub.parameters())]
        if layers and not self.claims_children and not self._replay_warned:
            self._replay_warned = True
            own = [n for n, _ in fallback_parameters(self.module)]
            what = (f"has trainable parameters of its own ({', '.join(own)}) used other than added to, multiplied "
                    "into or expanded over the batch" if own else
                    f"reads the parameters of {', '.join(self.read_children)} outside their forwards")
            warnings.warn(f"{self.describe()} {what}: their per-sample gradients replay its whole forward per sample, "
                          f"its layers ({', '.join(layers[:3])}{', ...' if len(layers) > 3 else ''}) included"
                          + ("; put those parameters in a small module of their own (positions in an nn.Embedding, "
                             "or a module that adds or prepends them), so that only it is replayed" if own else ""),
                          stacklevel=7)

    def per_sample_grads(self, batch: int, samples: slice = slice(None)) -> dict:
        """The per-sample gradients (B, *shape) of the module's parameters, by id, of the samples
        ``samples`` (all by default): vmap over them of the gradient of the replayed forward."""
        names = self._parameter_names()
        params = {names[id(p)]: p.detach() for p in self.parameters}
        totals: dict = {}
        for call, ((leaves, spec, live, replay, _), output_grads) in enumerate(zip(self.calls, self.grads)):
            rows = _batch_of(leaves)  # B, or B T for a flattened call
            flattened = call in self.flattened
            split = [] if call in self.shared_calls else [
                i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.ndim and x.shape[0] == rows]
            flat = self.flattened_outputs.get(call, {})  # outputs whose rows a sample's replay gives as they are
            pairs = [(i, g) for i, g in zip(live, output_grads) if g is not None]
            unsqueezed = [not flattened and k not in flat for k, g in enumerate(output_grads) if g is not None]
            for _, g in pairs:
                if g.ndim == 0 or g.shape[0] != batch:
                    raise ValueError(f"{self.describe()} returned an output of shape {tuple(g.shape)}, without the "
                                     f"batch of {batch} in dim 0 (a position embedding that makes its own position "
                                     "ids of shape (1, T)), or flattened with its positions by ops its graph does not "
                                     "show to keep the samples apart, and no book-keeping rule fits it: its "
                                     "per-sample gradients cannot be replayed; give it inputs whose batch its output "
                                     "keeps")

            untraced = self.untraced.get(call, frozenset())
            checked = untraced and not (flattened or flat or call in self.shared_calls)
            if checked and samples == slice(None):
                grads = self._checked_replay(params, replay, leaves, spec, split, pairs, unsqueezed, batch, untraced)
            else:
                if checked:  # a few samples at a time: the arguments found shared on the whole batch first
                    if call not in self.shared_arguments:
                        self.shared_arguments[call] = self._shared_arguments(params, replay, leaves, spec, split,
                                                                             pairs, unsqueezed, batch, untraced)
                    split = [i for i in split if i not in self.shared_arguments[call]]
                try:
                    grads = self._replayed(params, replay, leaves, spec, split, pairs, unsqueezed, flattened, batch,
                                           samples)
                except RuntimeError as error:  # torch's, from inside the module's forward
                    if graph.capturing():
                        raise
                    raise ValueError(f"{self.describe()} is replayed per sample (no book-keeping rule fits it), and "
                                     f"its replay failed ({error}): its forward depends on something other than its "
                                     "parameters, buffers and arguments (a state kept from the call before, as "
                                     "RecurrentGemma's recurrent block keeps its state, or a cache passed in: call a "
                                     "Hugging Face model with use_cache=False to train it), or an argument has the "
                                     "batch elsewhere than in dim 0") from error
            for p in self.parameters:
                g = grads[names[id(p)]]
                totals[id(p)] = g if id(p) not in totals else totals[id(p)] + g
        return totals

    def _replayed(self, params: dict, replay, leaves: list, spec, split: list, pairs: list, unsqueezed: list,
                  flattened: bool, batch: int, samples: slice) -> dict:
        """The per-sample gradients by name of one call's replay, the arguments ``split`` taken
        per sample, the others whole."""
        from torch.func import grad, vmap

        loss_of_one = self._loss_of_one(replay, leaves, spec, split, pairs, unsqueezed, flattened)
        inputs = [(leaves[i].unflatten(0, (batch, -1)) if flattened else leaves[i])[samples] for i in split]
        cotangents = [g[samples] for _, g in pairs]
        with warnings.catch_warnings(), replay.context(self._spectral_norms):
            # torch's note that an op has no batching rule: the cost the docstring states
            warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet")
            if not self._one_at_a_time:
                try:
                    return vmap(grad(loss_of_one), in_dims=(None, 0, 0))(params, inputs, cotangents)
                except RuntimeError as error:  # a dropout that ran, not one the module holds unused (peft's)
                    if "randomness" in str(error):
                        raise ValueError(self.random_replay()) from None
                    if graph.capturing():  # the capture's own error (the warm-up ran vmap eagerly first)
                        raise
                    self._one_at_a_time = True  # a forward torch.func cannot transform
            return self._one_at_a_time_grads(loss_of_one, params, inputs, cotangents)

    def _loss_of_one(self, replay, leaves: list, spec, split: list, pairs: list, unsqueezed: list,
                     flattened: bool = False):
        """One sample's loss of a call's replay as a function of (parameters, the sample's
        arguments ``split``, its output gradients): its outputs times those. A flattened call's
        sample takes its rows whole; another's gets its batch dim back."""
        def loss_of_one(params, chosen, cotangents):
            values = list(leaves)
            for i, x in zip(split, chosen):
                values[i] = x if flattened else x.unsqueeze(0)
            outputs = self._outputs({**params, **replay.state()}, values, spec)
            return sum((outputs[i] * (g.unsqueeze(0) if one else g)).sum()
                       for (i, _), g, one in zip(pairs, cotangents, unsqueezed))

        return loss_of_one

    def _checked_replay(self, params: dict, replay, leaves: list, spec, split: list, pairs: list, unsqueezed: list,
                        batch: int, untraced: frozenset) -> dict:
        """:meth:`_replayed` for a call with arguments of the batch's dim 0 and no autograd history
        among several of that dim 0 (:func:`_untraced_arguments`): one the batch shares (a mask, a
        position table, at B = T), cut per sample, makes each sample's replay another function of
        the parameters, whose gradients do not add up to the call's, or fails (a review's repros:
        Funnel's and a Swin-style block's relative-position parameters 2-7 times off, with no
        sign). The arguments taken per sample are all of them, else each of those without history
        shared alone, else all of those, the first whose gradients add up to the call's. Where the
        replay goes a few samples at a time, :meth:`_shared_arguments` decides the same, once."""
        whole = self._batch_grads(params, replay, leaves, spec, pairs)
        for shared in _shared_candidates(untraced):
            one_at_a_time = self._one_at_a_time
            try:
                grads = self._replayed(params, replay, leaves, spec, [i for i in split if i not in shared], pairs,
                                       unsqueezed, False, batch, slice(None))
            except RuntimeError:  # a cut mask whose shape the forward cannot take
                self._one_at_a_time = one_at_a_time
                continue
            if _adds_up(grads, whole, replay.half()):
                return grads
        raise ValueError(self._not_adding_up())

    def _shared_arguments(self, params: dict, replay, leaves: list, spec, split: list, pairs: list,
                          unsqueezed: list, batch: int, untraced: frozenset) -> frozenset:
        """:meth:`_checked_replay`'s choice for a call whose replay goes a few samples at a time,
        where the per-sample gradients of the whole batch would not fit: the sum of the per-sample
        gradients is taken by one backward pass through the vmapped replay (or a loop adding them
        up, for a forward torch.func cannot transform), not formed sample by sample. There the
        arguments of the batch's dim 0 were taken as the batch's, unchecked: Funnel's class mask
        (T', T), at a batch of T' samples (its pooled length), was cut per sample, its attention's
        relative-position parameters 2-6 x 10^-3 off (a review's repro; each sample still clipped
        to C)."""
        whole = self._batch_grads(params, replay, leaves, spec, pairs)
        for shared in _shared_candidates(untraced):
            try:
                summed = self._summed_grads(params, replay, leaves, spec, [i for i in split if i not in shared],
                                            pairs, unsqueezed)
            except RuntimeError:  # a cut mask whose shape the forward cannot take
                continue
            if _adds_up({name: g.unsqueeze(0) for name, g in summed.items()}, whole, replay.half()):
                return shared
        raise ValueError(self._not_adding_up())

    def _not_adding_up(self) -> str:
        return (f"{self.describe()} is replayed per sample (no book-keeping rule fits it), but the per-sample "
                "gradients of its replay do not add up to its call's gradient, with the tensor arguments of the "
                "batch's size in dim 0 taken as the batch's, or some of those without autograd history as shared by "
                "it: an argument has the batch elsewhere than in dim 0, or its forward depends on something other "
                "than its parameters, buffers and arguments (a state kept from a call before)")

    def _summed_grads(self, params: dict, replay, leaves: list, spec, split: list, pairs: list,
                      unsqueezed: list) -> dict:
        """The sum over the batch of one call's replayed per-sample gradients (the arguments
        ``split`` taken per sample), by name: the gradient of the vmapped replay's summed loss."""
        from torch.func import grad, vmap

        loss_of_one = self._loss_of_one(replay, leaves, spec, split, pairs, unsqueezed)

        def summed_loss(params):
            return vmap(loss_of_one, in_dims=(None, 0, 0))(params, inputs, cotangents).sum()

        inputs, cotangents = [leaves[i] for i in split], [g for _, g in pairs]
        with replay.context(self._spectral_norms):
            if not self._one_at_a_time:
                try:
                    return grad(summed_loss)(params)
                except RuntimeError as error:
                    if "randomness" in str(error):
                        raise ValueError(self.random_replay()) from None
            return self._one_at_a_time_grads(loss_of_one, params, inputs, cotangents, summed=True)

    def _batch_grads(self, params: dict, replay, leaves: list, spec, pairs: list) -> dict:
        """The gradients by name of one call replayed on the whole batch with its recorded output
        gradients: what its per-sample gradients add up to."""
        leaves_of = {name: p.detach().requires_grad_() for name, p in params.items()}
        with torch.enable_grad(), replay.context(self._spectral_norms):
            outputs = self._outputs({**leaves_of, **replay.state()}, list(leaves), spec)
            loss = sum((outputs[i] * g).sum() for i, g in pairs)
            found = torch.autograd.grad(loss, list(leaves_of.values()), allow_unused=True)
        return {name: torch.zeros_like(p) if g is None else g for (name, p), g in zip(leaves_of.items(), found)}

    def _one_at_a_time_grads(self, loss_of_one, params: dict, samples: list, cotangents: list,
                             summed: bool = False) -> dict:
        """The replay's per-sample gradients by one ordinary backward pass per sample, for a
        forward that ``torch.func`` cannot transform (a parametrization it registers, as peft's
        LoRA on a parameter does; data-dependent shapes): the same gradients, B passes instead of
        one vmapped (``summed``: their sum, by name). Random numbers drawn in them are refused as
        vmap refuses them (the default generators' states are compared, except in a CUDA graph's
        capture, which may not read a generator's state: its warm-up ran the same replay eagerly
        and checked it)."""
        leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
        device = next(iter(leaves.values())).device
        checked = not graph.capturing()
        before = _generator_states(device) if checked else []
        rows = []
        with torch.enable_grad():
            for i in range(len(cotangents[0])):
                loss = loss_of_one(leaves, [x[i] for x in samples], [g[i] for g in cotangents])
                found = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
                rows.append([torch.zeros_like(p) if g is None else g for p, g in zip(leaves.values(), found)])
        if checked and any(not torch.equal(a, b) for a, b in zip(before, _generator_states(device))):
            raise ValueError(self.random_replay())
        combine = (lambda column: sum(column[1:], column[0])) if summed else torch.stack
        return {name: combine(column) for name, column in zip(leaves, zip(*rows))}


def _untraced_arguments(leaves: list, rows: int) -> frozenset:
    """The tensor arguments of a call with the batch's size ``rows`` in dim 0 but no autograd
    history, where there are several of that size: a mask or a table the batch shares (Swin's
    shifted windows' mask, Funnel's (T, T) class mask, at B = T) as much as the batch's own (an
    attention mask, the model's inputs); only the replay's gradients, added up, tell them apart
    (:func:`_adds_up`)."""
    sized = [(i, x) for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.ndim and x.shape[0] == rows]
    untraced = frozenset(i for i, x in sized if x.grad_fn is None and not x.requires_grad)
    return untraced if len(sized) > 1 else frozenset()


def _shared_candidates(untraced: frozenset) -> list[frozenset]:
    """The sets of untraced arguments (:func:`_untraced_arguments`) tried as shared by the batch, in
    turn: none, each alone, all of them."""
    return [frozenset()] + [frozenset([i]) for i in sorted(untraced)] + [untraced] * (len(untraced) > 1)


def _adds_up(per_sample: dict, whole: dict, half: bool = False) -> bool:
    """Whether per-sample gradients (B, *shape) by name add up to the call's gradients ``whole``:
    per parameter within 2^-10 of the sum of the samples' norms (rounding; 2^-5 in half
    precision, or where ``half``: the call ran under 16-bit autocast, where torch.func's
    gradients and autograd's differed by 1.8e-3, and a replay was refused: a review's repro),
    where a replay with a shared mask cut per sample is another function."""
    for name, total in whole.items():
        rows = per_sample[name].to(total.dtype)
        tolerance = 2.0**-5 if half or total.element_size() < 4 else 2.0**-10
        scale = rows.flatten(1).double().norm(dim=1).sum()
        if float((rows.sum(0) - total).double().norm()) > tolerance * float(scale) + 1e-30:
            return False
    return True


def _generator_states(device: torch.device) -> list[torch.Tensor]:
    """The states of the default random generators a forward on ``device`` may draw from."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


@layer_kind("peft.tuners.lora.layer.ParamWrapper")
class ParameterAdapterLayer(FunctionalLayer):
    """peft's LoRA on a parameter (``LoraConfig(target_parameters=...)``, and what ``all-linear``
    puts on a mixture of experts' router): its forward adds B A to the wrapped module's parameter
    by a parametrization, so its A and B (``nn.Linear`` modules never called) are used out of
    their own hooks' sight. The wrapper is replayed per sample, children included."""

    claims_children = True


class _RunningStatisticsLayer(FunctionalLayer):
    """A normalisation with running statistics: hooked with or without parameters, for its
    :meth:`refusal` in training mode; its affine parameters through the fallback."""

    hook_without_parameters = True

    def record(self, args: tuple, kwargs: dict, output: Any) -> list[torch.Tensor]:
        return super().record(args, kwargs, output) if self.parameters else []


@layer_kind(nn.modules.batchnorm._BatchNorm)
class BatchNormLayer(_RunningStatisticsLayer):
    """BatchNorm: in training mode it normalises with the batch's statistics, so no sample has a
    gradient of its own; it is refused (use GroupNorm or LayerNorm). So it does in eval mode
    without running statistics (``track_running_stats=False``: torch normalises by the batch then
    too; a review's repro, with the first sample's check off, moved the clipped sum by 1.34 C for
    one sample removed). In eval mode with its running statistics it is a fixed affine map per
    channel, through the fallback."""

    def refusal(self) -> Optional[str]:
        module = self.module  # a training forward is refused; evaluation under no_grad is fine
        if module.training or (module.running_mean is None and module.running_var is None):
            mode = "in training mode" if module.training else "without running statistics (track_running_stats=False)"
            return (f"{self.describe()} is {mode}: it normalises with statistics of the whole batch, so "
                    "per-sample gradients (and their clipping) are undefined; use GroupNorm or LayerNorm, or call "
                    ".eval() on a BatchNorm that tracks running statistics")
        return None


@layer_kind(nn.modules.instancenorm._InstanceNorm)
class InstanceNormLayer(_RunningStatisticsLayer):
    """InstanceNorm normalises each sample by its own statistics (its affine parameters through the
    fallback), but with ``track_running_stats=True`` its training forward also adds the batch's
    statistics into its running buffers, which ship with the model without noise (a review's
    repro: one sample scaled by 100 moved running_mean by 0.56): refused then, as Opacus's
    validator refuses it."""

    returns_own_view = True

    def refusal(self) -> Optional[str]:
        if self.module.training and self.module.track_running_stats:
            return (f"{self.describe()} is in training mode with track_running_stats=True: its forward writes the "
                    "batch's statistics into running_mean and running_var, outside the noise; build it with "
                    "track_running_stats=False (the default), or call .eval() on it")
        return None


def _input_nodes(leaves: list) -> frozenset:
    """The autograd nodes that made a call's tensor arguments: where the module's graph ends."""
    return frozenset(x.grad_fn for x in leaves if isinstance(x, torch.Tensor) and x.grad_fn is not None)


def _batched_leaf(leaves: list) -> Optional[torch.Tensor]:
    """The tensor argument of a call whose dim 0 is its batch: the first that has dims."""
    return next((x for x in leaves if isinstance(x, torch.Tensor) and x.ndim), None)


def _batch_of(leaves: list) -> int:
    """A call's batch size: dim 0 of :func:`_batched_leaf` (0 if no argument has dims)."""
    batched = _batched_leaf(leaves)
    return 0 if batched is None else batched.shape[0]
