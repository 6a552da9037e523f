"""What the loss's autograd graph shows book-keeping (:class:`privleak.dpsgd.BookKeeping`) beyond
its hooks: how often each parameter is used (a use the hooks did not see would escape clipping),
which uses of a parameter or of a layer's output only broadcast it over the batch (added,
multiplied, expanded or selected into it: each sample's gradient is that op's output gradient for
the sample), and whether a tensor holds the batch flattened with its positions.

Everything here reads autograd nodes of the forward pass (their types, next_functions, saved
tensors and input metadata) and runs no forward or backward of the model. A node kind is the
class of the node an op makes on a small tensor (:func:`node_type`), so the walk follows torch's
own classes, whatever their names in a torch version.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils.checkpoint import CheckpointFunction
from torch.utils.checkpoint import _Holder as _CheckpointHolder


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (never on a CPU-only build): no host
    read of a device tensor may wait for the device then."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def checkpointed(node: Any, name: str) -> bool:
    """Whether autograd ``node``'s saved tensor ``name`` (``"_saved_other"``) was saved by
    non-reentrant activation checkpointing, which lets it be unpacked once in a backward pass, by
    the node's own backward (a read besides it failed: CheckpointError): its packed form is the
    checkpoint's holder. Told without unpacking it, where the node was made (a module may
    checkpoint inside its own forward, and its forward hook run outside); one saved through
    other hooks (``save_on_cpu``) may be read again."""
    raw = getattr(node, "_raw" + name, None)
    return raw is not None and isinstance(raw.data, _CheckpointHolder)


def node_type(op) -> type:
    """The autograd node class of ``op`` applied to a 2 x 2 tensor that requires grad."""
    return type(op(torch.zeros(2, 2, requires_grad=True)).grad_fn)


_ADD, _SUB, _EXPAND = node_type(lambda x: x + x), node_type(lambda x: x - x), node_type(lambda x: x[:1].expand(3, 2))
_MUL, _CAST, _CLONE = node_type(lambda x: x * x), node_type(lambda x: x.double()), node_type(lambda x: x.clone())
_WHERE, _DIV = node_type(lambda x: torch.where(x > 0, x, x)), node_type(lambda x: x / x)
_REPEAT = node_type(lambda x: x.repeat(2, 1))
_LOOKUP = node_type(lambda x: F.embedding(torch.zeros(1, dtype=torch.long), x))
#: Views: each element of their output is one element of their input (p[:, :T], p[None], p.view(...)).
_VIEWS = frozenset(node_type(view) for view in (
    lambda x: x[1:], torch.ops.aten.alias, lambda x: x.view(4), lambda x: x.unsqueeze(0), lambda x: x[0],
    lambda x: x[:1].squeeze(), lambda x: x[:1].squeeze(0), lambda x: x.t(), lambda x: x.transpose(0, 1),
    lambda x: x.permute(1, 0), lambda x: x[:, :1].reshape(2)))  # the last: a reshape aliasing a strided view


#: The node kinds through which :func:`_uses_from` finds uses (:func:`_passed_on`,
#: :func:`_broadcast_use`, views); a consumer of any other kind makes a use of another kind.
_USE_KINDS = frozenset((_ADD, _SUB, _EXPAND, _MUL, _CAST, _CLONE, _WHERE, _DIV, _REPEAT, *_VIEWS))


class _Use(NamedTuple):
    """A use of a parameter broadcast over the batch: the node whose output gradient it takes; the
    factor of that gradient (alpha, negated for a subtrahend); the shape of the operand broadcast
    (the parameter's, or a view's of it); the views between the parameter and the use, the
    parameter's first (their positions are found only for uses that are all broadcast:
    :func:`_resolved`); the tensors that multiply the gradient, as (node, saved attribute,
    transform) triples (a product's other factor; a where's condition, or its complement for its
    second operand; a quotient's divisor, its reciprocal); for a view, the parameter's flat
    positions of the view's elements, in order (else None); the tensors that multiply the
    per-sample gradient in the parameter's shape (ops on the parameter itself that pass the
    gradient on, a view after them: DoRA's magnitude divided by its weights' norms, then viewed
    as a row)."""

    node: Any
    factor: float
    shape: tuple
    views: tuple = ()
    multipliers: tuple = ()
    positions: Optional[torch.Tensor] = None
    scales: tuple = ()
    tiled: bool = False  # a repeat tiling the operand along dim 0, once per sample (:func:`_tiles_dim_0`)
    tables: frozenset = frozenset()  # nodes that count as computed from parameters (:func:`_from_parameters`)

    def broadcasts_over(self, batch: int, out: Optional[tuple] = None) -> bool:
        """Whether the node's output (of shape ``out``; None: the node's, from the graph) has the
        batch in dim 0, or the batch flattened there (:func:`flattened_batch`: Swin's attention
        scores (B nW, heads, N, N), to which its relative-position bias is added), and the operand
        is broadcast along it (it has fewer dims, or a dim 0 of 1). A tiling repeat's output is
        the operand once per sample, sample after sample, where it repeats dim 0 B times."""
        out = tuple(self.node._input_metadata[0].shape) if out is None else out
        if self.tiled:
            return batch > 0 and out[0] == batch * self.shape[0]
        aligned = (1,) * (len(out) - len(self.shape)) + self.shape
        return len(out) >= len(self.shape) and aligned[0] == 1 and \
            (out[0] == batch or (batch > 0 and out[0] % batch == 0
                                 and flattened_batch(self.node, out[0], batch, self.tables)))


def _broadcast_use(node, position: int, shape: tuple, views: tuple) -> Optional[_Use]:
    """The use of an operand of ``shape`` as input ``position`` of ``node``, if it is an add, a
    subtraction, an expand, a repeat that only expands (of dims of size 1: peft's prompt tuning
    repeats its virtual tokens' embeddings over the batch) or tiles dim 0 (:func:`_tiles_dim_0`), a
    product or a where (T5's position bias under a mask); else None."""
    if type(node) is _EXPAND or (type(node) is _REPEAT and _expands(node._saved_repeats, shape)):
        return _Use(node, 1.0, shape, views)
    if type(node) is _REPEAT and _tiles_dim_0(node._saved_repeats, shape):
        return _Use(node, 1.0, shape, views, tiled=True)
    if type(node) is _MUL:  # d(w x)/dw = x: the other factor, which the node saves for its backward
        return _Use(node, 1.0, shape, views, ((node, "_saved_other" if position == 0 else "_saved_self", None),))
    if type(node) is _WHERE:  # where(c, w, y): the gradient where c holds (w), where it does not (y)
        return _Use(node, 1.0, shape, views,
                    ((node, "_saved_condition", torch.logical_not if position == 1 else None),))
    if type(node) in (_ADD, _SUB):
        alpha = float(node._saved_alpha) if position == 1 else 1.0
        return _Use(node, -alpha if type(node) is _SUB and position == 1 else alpha, shape, views)
    return None


def _expands(repeats: tuple, shape: tuple) -> bool:
    """Whether ``x.repeat(*repeats)`` of an ``x`` of ``shape`` is an expand: each dim repeated more
    than once has size 1 (or is new), so no element is tiled beside others."""
    aligned = (1,) * (len(repeats) - len(shape)) + tuple(shape)
    return all(r == 1 or size == 1 for r, size in zip(repeats, aligned))


def _tiles_dim_0(repeats: tuple, shape: tuple) -> bool:
    """Whether ``x.repeat(*repeats)`` of an ``x`` of ``shape`` tiles x whole along dim 0 and only
    expands the others: (H, N, d) repeated (R, 1, 1) is (R H, N, d), copy r in rows r H .. r H +
    H - 1. At R = B, a tensor the batch shares laid out as the batch flattened with its heads
    (DeBERTa's relative position keys, ``pos_key.repeat(B, 1, 1)`` beside queries (B H, T, d)):
    copy i's rows are sample i's (:meth:`_Use.broadcasts_over` checks R against the batch)."""
    return len(repeats) == len(shape) > 0 and repeats[0] > 1 and _expands(repeats[1:], shape[1:])


def _multiplier(node, attribute: str, transform, dtype: torch.dtype) -> torch.Tensor:
    """A multiplier of a use (:class:`_Use`): the tensor ``node`` saved as ``attribute`` for its
    backward, transformed (None: as it is), in ``dtype``."""
    saved = getattr(node, attribute)
    return (saved if transform is None else transform(saved)).to(dtype)


def _passed_on(node, position: int, shape: tuple) -> Optional[tuple[float, tuple]]:
    """(factor, multipliers) by which ``node`` hands its output gradient, unchanged in shape, to its
    input ``position`` of ``shape``: a dtype cast or a copy (1: ``.contiguous()``, scaled
    dot-product attention's copy of its mask, T5's position bias), an add or subtraction whose
    output has the operand's shape (alpha, negated for a subtrahend: Gemma's 1 + w; a sum of
    parameters of one shape), a where or a product whose output has the operand's shape (its
    condition: a causal mask over T5's position bias; the other factor), the dividend of a
    quotient of the operand's shape (the divisor's reciprocal: DoRA's magnitude over its weights'
    norms); else None."""
    if type(node) in (_CAST, _CLONE):
        return 1.0, ()
    if type(node) in (_ADD, _SUB) and node.next_functions[1 - position][0] is None:
        return _broadcast_use(node, position, shape, ()).factor, ()  # plus a constant: its uses are the operand's
    if tuple(node._input_metadata[0].shape) != shape:
        return None
    if type(node) in (_ADD, _SUB, _WHERE, _MUL):
        use = _broadcast_use(node, position, shape, ())
        return use.factor, use.multipliers
    if type(node) is _DIV and position == 0:  # d(w / y)/dw = 1 / y
        return 1.0, ((node, "_saved_other", torch.reciprocal),)
    return None


def _view_positions(node, device) -> Optional[torch.Tensor]:
    """For a view ``node``, the flat position in its input of each element of its output, in order,
    on ``device``: the view's backward applied to 1, 2, ..., n (exact in float64, on the CPU)
    places each where it came from; None unless each lands once. Kept by the view's kind, shapes
    and arguments (:func:`_view_key`): a later step's view, the same, finds them on the device,
    with no copy to it and no read of a tensor on the host, which a CUDA graph's capture refuses
    (:meth:`BookKeeping.graphed <privleak.dpsgd.BookKeeping.graphed>`)."""
    key = _view_key(node)
    if key is not None and (key, device) in _VIEW_POSITIONS:
        return _VIEW_POSITIONS[key, device]
    shape = tuple(node._input_metadata[0].shape)
    count = math.prod(shape)
    placed = node(torch.arange(1, count + 1, dtype=torch.float64).view(shape)).flatten()
    positions = placed.nonzero().flatten()
    ordered = None
    if len(positions) == count:
        ordered = torch.empty_like(positions)
        ordered[placed[positions].long() - 1] = positions
        ordered = ordered.to(device)
    if key is not None:
        if len(_VIEW_POSITIONS) >= _VIEW_POSITIONS_KEPT:  # shapes that vary from step to step: the oldest go
            del _VIEW_POSITIONS[next(iter(_VIEW_POSITIONS))]
        _VIEW_POSITIONS[key, device] = ordered
    return ordered


#: (view key, device): the view's positions (:func:`_view_positions`), the most recent kept
_VIEW_POSITIONS: dict = {}
_VIEW_POSITIONS_KEPT = 1024
_SAVED_NAMES: dict = {}  # node type: the names of its saved attributes


def kept_view_positions() -> list:
    """The views' positions kept now (:func:`_view_positions`): a CUDA graph that read them must
    hold them, or a later eviction would free memory its replays read."""
    return [positions for positions in _VIEW_POSITIONS.values() if positions is not None]


def _view_key(node) -> Optional[tuple]:
    """What a view's placement depends on: its kind, its input's shape and its saved arguments
    (dims, start, end, step, index, sizes); None if an argument is not plain integers."""
    kind = type(node)
    names = _SAVED_NAMES.get(kind)
    if names is None:
        names = _SAVED_NAMES[kind] = tuple(name for name in dir(node) if name.startswith("_saved_"))
    saved = tuple(getattr(node, name) for name in names)
    plain = all(v is None or type(v) is int or (type(v) is tuple and all(type(i) is int for i in v)) for v in saved)
    return (kind, tuple(node._input_metadata[0].shape), saved) if plain else None


def _uses_from(node, position: int, shape: tuple, views: tuple, parents: dict) -> Optional[list]:
    """The broadcast uses (:class:`_Use`) an operand of ``shape`` (reached through ``views``) gets
    as input ``position`` of ``node``: the node's own, or through views and ops that pass the
    gradient on (:func:`_passed_on`), those of their outputs; None if any use is of another kind
    (found from the graph's shapes alone: a layer output of the batch's size meets another kind
    at once, and no view's positions are computed for it). A node that could pass the gradient
    on but whose output is not used so is itself the use (an add of the batch of 1)."""
    above = parents.get(node, [])
    passed = _passed_on(node, position, shape)
    if passed is not None and above:
        (factor, multipliers), found = passed, _uses_above(above, shape, views, parents)
        if found is not None and tuple(node._input_metadata[0].shape) != shape \
                and any(use.views != views for use in found):
            found = None  # broadcast by a constant: a view after it places elements of the sum, not of the operand
        # a multiplier is in the shape of the node's output: the uses' operand, unless a view came between;
        # the parameter's, where none came before
        if found is not None and (not multipliers or all(use.views == views for use in found)):
            return [use._replace(factor=use.factor * factor, multipliers=use.multipliers + multipliers)
                    for use in found]
        if found is not None and not views:
            return [use._replace(factor=use.factor * factor, scales=use.scales + multipliers) for use in found]
    use = _broadcast_use(node, position, shape, views)
    if use is not None:
        return None if _broadcast_again(node, parents) else [use]
    if type(node) not in _VIEWS or not above:
        return None
    return _uses_above(above, tuple(node._input_metadata[0].shape), views + (node,), parents)


def _broadcast_again(node, parents: dict) -> bool:
    """Whether the output of ``node`` (a use) is shown to hold no batch: an elementwise op above it
    (through such ops of its shape, and views: ``[None]``, ``unsqueeze(0)``) broadcasts it along
    new leading dims or its leading dim of 1, where the batch is. Its dim 0 is then positions, not
    samples: a (T, d) position table made from a parameter, added to (B, T, d) inputs, had its rows
    read as samples at T = B, and a sample's share of the update reached T times C (a review's
    repros; replayed at T != B). Such a use is of another kind (the module is replayed), as it
    was at every other T; one of a batch broadcast over further dims is replayed too. The walk
    goes through any op whose output has its input's shape, listed or not (a table through a
    reciprocal, clamp_min or atan had stopped it: a sample's share 3 C with the first sample's
    check off, a review's repro)."""
    stack, seen = [(node, tuple(node._input_metadata[0].shape))], set()
    while stack:
        below, shape = stack.pop()
        for parent, _ in parents.get(below, []):
            if parent in seen or not parent._input_metadata:
                continue
            out = tuple(parent._input_metadata[0].shape)
            if type(parent) not in _SAME_DIMS and type(parent) not in _VIEWS and out != shape:
                continue
            seen.add(parent)
            if type(parent) in _VIEWS:
                stack.append((parent, out))
            elif len(out) > len(shape) or (shape and shape[0] == 1 and out[0] != 1):
                return True
            elif out == shape:
                stack.append((parent, out))
    return False


def _uses_above(above: list, shape: tuple, views: tuple, parents: dict) -> Optional[list]:
    """The uses of an output of ``shape`` by its consumers ``above`` (:func:`_uses_from`), stopping
    at the first that is not broadcast."""
    if any(type(parent) not in _USE_KINDS for parent, _ in above):
        return None  # a consumer of no kind that _uses_from follows: found before any walk up the others
    found: list = []
    for parent, at in above:
        uses = _uses_from(parent, at, shape, views, parents)
        if uses is None:
            return None
        found += uses
    return found


def _resolved(uses: list, device) -> Optional[list]:
    """The uses with the positions of their views (a view of a view: composed) on ``device``; None
    if a view does not place each element once."""
    resolved = []
    for use in uses:
        positions = None
        for view in use.views:
            placed = _view_positions(view, device)
            if placed is None:
                return None
            positions = placed if positions is None else positions[placed]
        resolved.append(use if positions is None else use._replace(positions=positions))
    return resolved


class Broadcasts:
    """A call's parameters whose every use is broadcast over the batch
    (:class:`~privleak.dpsgd.layers.FunctionalLayer`), or a layer output shared by the batch
    (:func:`shared_output_uses`): per operand its uses (:class:`_Use`), and the per-sample
    gradients taken so far."""

    def __init__(self, operands: list, uses: list, batch: int):
        self.operands = operands  # the tensors broadcast (parameters, a stand-in for a shared output): shape, dtype
        self.uses = uses  # per operand, its _Use list
        self.batch = batch
        self.taken: dict = {}  # parameter index: (B, *shape) float32 at least
        self.valid = True

    @classmethod
    def of(cls, consumers: list, parents: dict, parameters: list, batch: int) -> Optional["Broadcasts"]:
        """From each parameter's (node, input index) uses and the walk's parents of each node; None
        if a use is of another kind. A view of a parameter (a slice, p[None], a reshape, or views
        of views) whose own uses are all broadcast counts as such uses of the parameter."""
        uses: list = []
        for weight, edges in zip(parameters, consumers):
            found = _uses_above(edges, tuple(weight.shape), (), parents)
            found = None if found is None else _resolved(found, weight.device)
            if found is None:
                return None
            uses.append(found)
        return cls(parameters, uses, batch)

    def factors_checkpointed(self) -> bool:
        """Whether a tensor the uses read from their nodes (a product's other factor) was saved by
        activation checkpointing (:func:`checkpointed`): the node's own backward could not unpack it
        after the node hook had (CheckpointError: Llama's RMSNorm under transformers' gradient
        checkpointing, a review's repro)."""
        return any(checkpointed(node, name) for uses in self.uses for use in uses
                   for node, name, _ in (*use.multipliers, *use.scales))

    def nodes(self) -> list:
        """((parameter, use), node) for every use."""
        return [((i, j), use.node) for i, uses in enumerate(self.uses) for j, use in enumerate(uses)]

    def take(self, parameter: int, use: int, grad: torch.Tensor) -> None:
        """The output gradient of a use's node: the use's per-sample gradients (times the other
        factor of a product), summed over the dims its operand is broadcast along, where the
        output has the batch in dim 0 and the operand is broadcast along it (a view's then placed
        in the parameter's shape); else the call takes the replay."""
        found, batch, weight = self.uses[parameter][use], self.batch, self.operands[parameter]
        if not found.broadcasts_over(batch, tuple(grad.shape)):
            self.valid = False
            return
        shape = found.shape
        if found.tiled:  # (B R, ...) as (B, R, ...): the operand broadcast along a new dim 0
            grad, shape = grad.unflatten(0, (batch, -1)), (1, *shape)
        aligned = (1,) * (grad.ndim - len(shape)) + shape
        dtype = torch.promote_types(grad.dtype, torch.float32)
        grad = grad.to(dtype)
        for multiplier in found.multipliers:
            grad = grad * _multiplier(*multiplier, dtype)
        rows = grad.sum_to_size((grad.shape[0], *aligned[1:])).reshape(batch, -1, math.prod(aligned[1:])).sum(1)
        rows = rows * found.factor
        if found.positions is not None:
            placed = rows.new_zeros(batch, weight.numel())
            placed[:, found.positions] = rows
            rows = placed
        rows = rows.reshape(batch, *weight.shape)
        for multiplier in found.scales:
            rows = rows * _multiplier(*multiplier, dtype)
        self.taken[parameter] = rows if parameter not in self.taken else self.taken[parameter] + rows

    def rows(self, parameter: int) -> torch.Tensor:
        """(B, *shape): the parameter's per-sample gradients in this call (zeros where no use's
        gradient came)."""
        if parameter in self.taken:
            return self.taken[parameter]
        weight = self.operands[parameter]
        return torch.zeros(self.batch, *weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                           device=weight.device)


#: elementwise ops of one operand (constants aside): activations, and a router's softplus, sqrt, clamp and
#: shifts by a constant (DeepSeek-V4's, MiniMax-M3's: its tokens (B T, d) were not told as the batch flattened)
_ROW_BY_ROW = frozenset((_CLONE, _CAST, *(node_type(op) for op in (
    torch.relu, torch.tanh, torch.sigmoid, F.gelu, F.silu, F.mish, F.softplus, F.leaky_relu, F.elu, F.hardtanh,
    lambda x: F.dropout(x, 0.5), lambda x: torch.ops.aten.mul.Scalar(x, 0.5), torch.exp, torch.log, torch.sqrt,
    torch.rsqrt, torch.neg, torch.abs, torch.erf, torch.sin, torch.cos, lambda x: x ** 2, lambda x: 1.0 - x,
    lambda x: x.clamp(-1.0, 1.0), lambda x: x.clamp_min(1e-12)))))  # the last: F.normalize's (Swin v2's cosine)
#: elementwise with broadcasting (a scalar operand, or dropout's mask, is an operand without grad)
_ELEMENTWISE = frozenset((_ADD, _SUB, _MUL, node_type(lambda x: x / x)))
#: ops whose output's trailing dims are their operands' trailing dims, aligned (broadcasting adds leading dims)
_SAME_DIMS = _ELEMENTWISE | _ROW_BY_ROW | {_WHERE}
#: ops along dims that they name, each output row from the same input row where dim 0 is not one
#: of them (a router's softmax, its top-k weights, taken or gathered from the scores, and their sum; DeepSeek-V2's
#: topk was not told so)
_ALONG_DIMS = frozenset(node_type(op) for op in (
    lambda x: x.softmax(-1), lambda x: torch.ops.aten._safe_softmax(x, -1), lambda x: x.log_softmax(-1),
    lambda x: x.sum(-1), lambda x: x.gather(1, torch.zeros(2, 1, dtype=torch.long)), lambda x: x.topk(1, -1)[0],
    lambda x: x.sort(-1)[0], lambda x: x.max(-1)[0], lambda x: x.mean(-1), lambda x: x.cumsum(-1),
    lambda x: torch.linalg.vector_norm(x, dim=-1)))
_MASKED_FILL = node_type(lambda x: x.masked_fill(torch.ones(2, 2, dtype=torch.bool), 0.0))
_LAYER_NORM = node_type(lambda x: F.layer_norm(x, (2,)))
_ADDMM, _MM = node_type(lambda x: torch.addmm(x[0], x, x)), node_type(lambda x: x @ x)
_BMM = node_type(lambda x: torch.bmm(x[None], x[None]))
_RESHAPES = frozenset(node_type(op) for op in (  # a view; a copy's view; an alias of a strided view
    lambda x: x.view(4), lambda x: x.t().reshape(4), lambda x: x[:, :1].reshape(2)))
_TRANSPOSE, _TRANSPOSE_DIMS = node_type(lambda x: x.t()), node_type(lambda x: x.transpose(0, 1))
_PERMUTE = node_type(lambda x: x.permute(1, 0))


#: the autograd nodes of ops whose backward does not read their result (addmm saves its operands, batch
#: norm its input and statistics), by name: cuDNN's batch norm node exists only where CUDA runs
_RESULT_UNSAVED = frozenset(("AddmmBackward0", "NativeBatchNormBackward0", "CudnnBatchNormBackward0"))


def unviewed(output: Any) -> Any:
    """``output`` as a non-view alias of the result it views whole, in order, where the op that made
    that result does not save it for its backward (F.linear with a bias on more than two dims views
    its addmm's result, instance_norm its batch norm's); else ``output`` itself. An in-place op on
    a view (``h += x``, ``ReLU(inplace=True)``) moves the view's autograd history onto its base, and
    the view's node, where a layer took its output's gradient, leaves the graph; on the alias
    (matmul's ``_unsafe_view``, as F.linear without a bias returns) it keeps its node. Only for a
    forward that holds the result nowhere else, before anything but the forward saw the view: the
    alias has a version counter of its own, so a tensor saved from the view would not be seen
    changed."""
    base = output._base if isinstance(output, torch.Tensor) and output.requires_grad else None
    if (base is None or base.grad_fn is None or base.grad_fn.name() not in _RESULT_UNSAVED
            or base.numel() != output.numel() or base.storage_offset() != output.storage_offset()
            or not (base.is_contiguous() and output.is_contiguous())):
        return output
    return torch.ops.aten._unsafe_view(base, output.shape)


def _written_through_view(x: torch.Tensor) -> torch.Tensor:
    y = x * 1
    y[0].mul_(2)
    return y


_COPY_SLICES = node_type(_written_through_view)


def changed_in_place(edge, parents: dict) -> bool:
    """Whether the tensor of a recorded output's gradient edge ``edge``, a view, was changed in
    place after it was made (through itself or another view of its base), as the loss's graph
    (``parents``, :func:`count_uses`'s) shows: the base's node then has a CopySlices above it,
    which takes the gradient of every use after the change around the view's node (out of the
    graph, or holding the uses before the change alone)."""
    node = edge.node
    if type(node) not in _VIEWS and type(node) not in _RESHAPES:
        return False
    while type(node) in _VIEWS or type(node) in _RESHAPES:
        node = node.next_functions[0][0]
    return any(type(parent) is _COPY_SLICES for parent, _ in parents.get(node, ()))


def _a_weight(child) -> bool:
    """Whether a node's input edge comes from a parameter, or its transpose (nn.Linear's W^T), or a
    cast of either (a router's ``weight.type(torch.float32)`` in a bfloat16 model)."""
    node = child[0]
    for kind in (_TRANSPOSE, _CAST):
        if type(node) is kind:
            node = node.next_functions[0][0]
    return node is None or hasattr(node, "variable")


def _signed(saved: int) -> int:
    """An int an autograd node saved: a negative one comes unsigned (-1 as 2^64 - 1)."""
    return saved - 2**64 if saved >= 2**63 else saved


def _dim(saved: int, ndim: int) -> int:
    """A dim an autograd node saved, in 0 .. ndim - 1 (-1 comes as 2^64 - 1, which modulo 3 is 0,
    not 2)."""
    return _signed(saved) % max(ndim, 1)


def _along_later_dims(node) -> bool:
    """Whether a node of :data:`_ALONG_DIMS` works along dims after dim 0 only."""
    sizes = getattr(node, "_saved_self_sym_sizes", None)  # a sum's input; the others' output has its dims
    dims = node._saved_dim if isinstance(node._saved_dim, tuple) else (node._saved_dim,)
    # a norm's output (keepdim=False) has its dims less those reduced
    ndim = len(sizes if sizes is not None else node._input_metadata[0].shape) + \
        (len(dims) if getattr(node, "_saved_keepdim", True) is False else 0)
    return all(_dim(dim, ndim) != 0 for dim in dims)


def _moved_from_dim_0(node) -> Optional[int]:
    """The size of the dim that ``node`` (past a copy: ``.contiguous()``, a reshape's) moved out
    of dim 0 when it moved another dim in (a transpose or permute), else None."""
    if type(node) is _CLONE:
        node = node.next_functions[0][0]
    if type(node) not in (_TRANSPOSE, _TRANSPOSE_DIMS, _PERMUTE):
        return None
    out = node._input_metadata[0].shape
    below = _dim_below(node, 0, len(out))
    return None if below == 0 else out[next(d for d in range(len(out)) if _dim_below(node, d, len(out)) == 0)]


def _dim_below(node, dim: int, ndim: int) -> int:
    """The dim of the input of ``node`` that its output's ``dim`` (of ``ndim`` dims) is: moved by a
    transpose or permute, shifted by a select (``h_n[-1]``) or a view that adds or drops dims of 1
    (``h_n.squeeze(0)``), else the same."""
    kind = type(node)
    if kind is _TRANSPOSE:
        return 1 - dim if dim < 2 else dim
    if kind in (_TRANSPOSE_DIMS, _TRANSPOSE_IN_PLACE):
        swapped = (_dim(node._saved_dim0, ndim), _dim(node._saved_dim1, ndim))
        return swapped[1] if dim == swapped[0] else swapped[0] if dim == swapped[1] else dim
    if kind is _PERMUTE:
        return _dim(node._saved_dims[dim], ndim)
    if kind is _SELECT:
        return dim + 1 if dim >= _dim(node._saved_dim, ndim + 1) else dim
    if (kind in _VIEWS or kind in _RESHAPES) and dim < ndim and _adds_or_drops_ones(node):
        into, out = _forward_shape(*node.next_functions[0]), tuple(node._input_metadata[0].shape)
        if out[dim] != 1:
            return [k for k, size in enumerate(into) if size != 1][sum(1 for size in out[:dim] if size != 1)]
    return dim


def _dims_below(node, output_nr: int, piece: tuple) -> list:
    """(child, its output_nr, its piece) for each input of ``node`` that holds the piece ``piece``
    of the node's output ``output_nr``: (dim, outer, size), the factor of ``size`` after an outer
    factor ``outer`` of that dim (a whole dim: (dim, 1, its size); the batch merged with the
    positions, (B T, d), holds B as (0, 1, B) and T as (0, B, T)). Through transposes, permutes,
    selects and views of dims of 1 (:func:`_dim_below`), reductions and unbind (the dims they
    drop), stacks (the dim they add), other views (the input dim the piece lies in, by the
    elements before it), and any other op aligned from the right, as broadcasting aligns (an
    input without that dim has none)."""
    dim, outer, size = piece
    out = tuple(node._input_metadata[output_nr].shape) if output_nr < len(node._input_metadata) else ()
    kind, below, mapped = type(node), dim, True
    if kind is _UNBIND:
        below = dim + 1 if dim >= _dim(node._saved_dim, len(out) + 1) else dim
    elif kind in _REDUCTIONS and not node._saved_keepdim:
        sizes = getattr(node, "_saved_self_sym_sizes", None)
        ndim = len(sizes) if sizes is not None else node._saved_self.ndim
        for d in sorted(_dim(d, ndim) for d in (node._saved_dim if isinstance(node._saved_dim, tuple)
                                                  else (node._saved_dim,))):
            below += below >= d
    elif kind in _RESHAPES and not _adds_or_drops_ones(node) and dim < len(out):
        into = _forward_shape(*node.next_functions[0])
        start = math.prod(out[:dim]) * outer  # elements before the piece's first, in the order of a reshape
        for k in range(len(into)):
            first = math.prod(into[:k])
            if first <= start and start * size <= first * into[k] and start % first == 0:
                return [(node.next_functions[0][0], node.next_functions[0][1], (k, start // first, size))]
        return []
    elif kind in (_TRANSPOSE, _TRANSPOSE_DIMS, _TRANSPOSE_IN_PLACE, _PERMUTE, _SELECT) or kind in _VIEWS:
        below = _dim_below(node, dim, len(out))
    elif kind is _STACK:  # its inputs have no dim of the stacked; those after it one to the left
        stacked = _dim(node._saved_dim, len(out))
        if dim == stacked:
            return []
        below = dim - (dim > stacked)
    else:
        mapped = False
    children = []
    for child, nr in node.next_functions:
        if child is None:
            continue
        ndim = len(_forward_shape(child, nr))
        aligned = below if mapped else below - (len(out) - ndim)
        if 0 <= aligned < ndim:
            children.append((child, nr, (aligned, outer, size)))
    return children


def _forward_shape(child, output_nr: int) -> tuple:
    """The shape of the tensor an input edge of a node carries: its producer's output."""
    variable = getattr(child, "variable", None)
    return tuple(variable.shape if variable is not None else child._input_metadata[output_nr].shape)


def flattened_batch(node, rows: int, batch: int, tables: frozenset = frozenset()) -> bool:
    """Whether the tensor of dim 0 ``rows`` that autograd ``node`` made holds each sample's rows
    together, sample after sample (rows i k .. i k + k - 1 sample i's, k = rows / B): it comes
    from reshapes of a tensor with the batch in dim 0 (OPT's decoder layers take their hidden
    states (B, T, d) as (B T, d) for the MLP; Swin's windows, (B, H, W, C) split into windows
    (B nW, ws ws, C), and its attention's (B nW heads, N, N)), through ops that make each row from
    the same row alone (:func:`_row_inputs`: elementwise ops, adds of such tensors, LayerNorm
    over the last dims, a Linear, transposes and expands keeping dim 0, a batched product of two
    such tensors). A reshape keeps the logical order whatever the memory layout, so a tensor's
    samples, each a block of that order, stay whole rows in order in any reshape whose dim 0 is a
    multiple of B. False where that cannot be told (a leaf, another op, an operand without grad).
    ``tables``: nodes that count as computed from parameters (:func:`_from_parameters`)."""
    stack, seen = [(node, rows)], set()
    while stack:
        node, rows = stack.pop()
        if node is None:
            return False
        if node in seen:
            continue
        seen.add(node)
        kind, children = type(node), node.next_functions
        if kind in _RESHAPES:
            sizes = tuple(node._saved_self_sym_sizes)
            if sizes and sizes[0] == batch:
                # A transpose into batch-first (a batch-first nn.MultiheadAttention's output) is
                # the batch, unless the dim it moved out had the batch's size too: then it may as
                # well have turned a batch-first tensor sequence-first, at T = B.
                if _moved_from_dim_0(children[0][0]) == batch:
                    return False
                continue  # the batch reshaped, its samples whole rows in order
            if not sizes or sizes[0] % batch:
                return False
            stack.append((children[0][0], sizes[0]))
        elif (inputs := _row_inputs(node, rows)) is not None and _broadcast_from_parameters(node, rows, tables):
            stack.extend((child, rows) for child in inputs)
        else:
            return False
    return True


def _broadcast_from_parameters(node, rows: int, tables: frozenset = frozenset()) -> bool:
    """Whether the operands with grad that an elementwise ``node`` broadcasts along dim 0 (of
    ``rows``) come from parameters alone: one holding the batch in a later dim, ``h.reshape(1,
    -1)``, would mix every sample into every row."""
    return type(node) not in _ELEMENTWISE or all(
        _all_rows(child, nr, node, rows) or _from_parameters(child, tables=tables) for child, nr in node.next_functions
        if child is not None)


def _row_inputs(node, rows: int) -> Optional[list]:
    """The nodes whose rows make the rows of the tensor (of dim 0 ``rows``) that autograd ``node``
    made, each row from the same rows alone: an elementwise op (dropout too; of its operands with
    all the rows, the others broadcast along them), masked_fill, an op along later dims, LayerNorm
    over the last dims, a Linear (its weight and bias parameters), a transpose, permute or expand
    keeping dim 0, a batched matrix product (both operands, each product from the same row of
    both); None for any other op, or one whose rows cannot be told (an operand without grad has
    none)."""
    kind, children = type(node), node.next_functions
    if kind in _ROW_BY_ROW or kind is _MASKED_FILL or (kind in _ALONG_DIMS and _along_later_dims(node)) \
            or _keeps_dim_0(node):
        return [children[0][0]]
    if kind in _ELEMENTWISE:
        full = [child for child, nr in children if child is not None and _all_rows(child, nr, node, rows)
                and not _shared_rows(child, rows)]
        return full or None
    if kind is _LAYER_NORM and len(node._saved_normalized_shape) < len(node._input_metadata[0].shape):
        return [children[0][0]] if all(_a_weight(child) for child in children[1:]) else None
    if kind in (_ADDMM, _MM):  # the rows are those of mat1; the bias and mat2 must be weights
        rows_from = 1 if kind is _ADDMM else 0
        if all(_a_weight(child) for i, child in enumerate(children) if i != rows_from):
            return [children[rows_from][0]]
    if kind is _BMM and all(child is not None and _forward_shape(child, nr)[:1] == (rows,) for child, nr in children):
        return [child for child, _ in children]
    return None


def _all_rows(child, output_nr: int, node, rows: int) -> bool:
    """Whether the operand of an elementwise ``node`` that ``child``'s output ``output_nr`` is has
    all ``rows`` rows of its output (it is not broadcast along dim 0)."""
    shape = _forward_shape(child, output_nr)
    return len(shape) == len(node._input_metadata[0].shape) and shape[0] == rows


def _shared_rows(node, rows: int) -> bool:
    """Whether the rows (``rows`` of them) of the tensor autograd ``node`` made hold nothing of the
    batch: an elementwise op (past casts and copies: bfloat16 autocast's) whose operands with grad
    are all broadcast along dim 0 and computed from parameters alone (Swin's relative-position
    bias (1, heads, N, N) plus its shifted windows' mask (B nW, 1, N, N), a constant; not the
    batch flattened into a later dim, ``h.reshape(1, -1)``)."""
    while type(node) in (_CAST, _CLONE):
        node = node.next_functions[0][0]
    operands = [(child, nr) for child, nr in node.next_functions if child is not None]
    return type(node) in _ELEMENTWISE and all(not _all_rows(child, nr, node, rows) and _from_parameters(child)
                                              for child, nr in operands)


def _from_parameters(node, budget: int = 64, tables: frozenset = frozenset(), stop: frozenset = frozenset()) -> bool:
    """Whether the tensor autograd ``node`` made comes from the model's parameters alone, and
    constants (Swin's relative-position bias, a table indexed; a table times a buffer): down to
    accumulators of parameters only (an input leaf with grad is data), through nodes whose inputs
    all have grad but for an elementwise op's operand without grad, taken for a constant. The
    graph does not show what such an operand is: batch data without grad multiplied in there
    (``x.reshape(1, -1) * p``) is not seen (the first sample's check and ``check_every_step``
    see its mixing); elsewhere an input without grad is taken for data, so a table made by a
    product with a buffer (an MLP of coordinates) is refused. False past ``budget`` nodes: a
    table takes a few ops, and a longer graph is taken for one that holds the batch. The nodes in
    ``tables`` count as such tables, whatever their inputs without grad (the outputs of layer calls
    on inputs without the batch: Swin v2's MLP of its buffer of coordinates); those in ``stop``
    do not (other layers' outputs: an Embedding's lookup shows no batch, its ids having no grad)."""
    stack, seen = [node], set()
    while stack:
        node = stack.pop()
        if node in seen or node in tables:
            continue
        if node in stop:
            return False
        seen.add(node)
        variable = getattr(node, "variable", None)
        if len(seen) > budget or (variable is not None and not isinstance(variable, torch.nn.Parameter)):
            return False
        if type(node) not in _ELEMENTWISE and any(child is None for child, _ in node.next_functions):
            return False
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return True


def _keeps_dim_0(node) -> bool:
    """Whether ``node`` is a transpose or permute of dims after dim 0, an expand of them, or a
    select, slice or split along one (``h[:, -1]``, ``qkv.chunk(3, -1)``): each row of its output
    is the same row of its input."""
    kind = type(node)
    if kind in (_SELECT, _SLICE, _SPLIT, _SPLIT_WITH_SIZES):
        return _dim(node._saved_dim, len(node._saved_self_sym_sizes)) != 0
    if kind is _TRANSPOSE_DIMS:
        ndim = len(node._input_metadata[0].shape)
        return _dim(node._saved_dim0, ndim) != 0 and _dim(node._saved_dim1, ndim) != 0
    if kind is _PERMUTE:
        return _dim(node._saved_dims[0], len(node._saved_dims)) == 0
    if kind is _EXPAND:
        into, out = tuple(node._saved_self_sym_sizes), tuple(node._input_metadata[0].shape)
        return len(into) == len(out) and into[:1] == out[:1]
    return False


_INDEX = node_type(lambda x: x[torch.tensor([0])])
_INDEX_SELECT = node_type(lambda x: x.index_select(0, torch.tensor([0])))
_MASKED_SELECT = node_type(lambda x: x.masked_select(torch.ones(2, 2, dtype=torch.bool)))
_GATHER = node_type(lambda x: x.gather(0, torch.zeros(1, 2, dtype=torch.long)))
_SELECTIONS = frozenset((_INDEX, _INDEX_SELECT, _GATHER))  # a masked_select's rows: at the view after it


def _write_type(op) -> type:
    """The autograd node class of ``op(zeros, rows, x)``, writing a 2 x 2 tensor ``x`` that requires
    grad into zeros at the rows ``rows``."""
    rows = torch.tensor([1, 0])
    return node_type(lambda x: op(torch.zeros(2, 2), rows, x))


_INDEX_PUT = _write_type(lambda zeros, rows, x: zeros.index_put((rows,), x))
#: writes of a source's rows at the positions an index names (``new[order] = h``, index_copy,
#: scatter, and their sums): the source's row j goes to, and takes the gradient of, the row named
_WRITES = frozenset((_INDEX_PUT, *(_write_type(op) for op in (
    lambda zeros, rows, x: zeros.index_copy(0, rows, x), lambda zeros, rows, x: zeros.index_add(0, rows, x),
    lambda zeros, rows, x: zeros.scatter(0, rows[:, None].expand(2, 2), x),
    lambda zeros, rows, x: zeros.scatter_add(0, rows[:, None].expand(2, 2), x)))))
_SELECT, _SLICE = node_type(lambda x: x[:, 0]), node_type(lambda x: x[:, 1:])
_SPLIT, _SPLIT_WITH_SIZES = node_type(lambda x: x.split(1)[0]), node_type(lambda x: x.split([1, 1])[0])
#: rows combined in order of their pieces (``torch.stack`` of ``h[i]``, ``torch.cat`` of slices, masks, splits)
_STACK, _CAT = node_type(lambda x: torch.stack([x[1], x[0]])), node_type(lambda x: torch.cat([x[1:], x[:1]]))
_REORDERS = _SELECTIONS | _WRITES | {_STACK, _CAT}
_PACK = node_type(lambda x: torch._pack_padded_sequence(x, torch.tensor([2, 1]), True)[0])
_UNBIND = node_type(lambda x: x.unbind(0)[0])
_TRANSPOSE_IN_PLACE = node_type(lambda x: x.clone().transpose_(0, 1))
#: reductions along dims they name (dropped where keepdim is False)
_REDUCTIONS = frozenset(node_type(op) for op in (lambda x: x.sum(0), lambda x: x.mean(0), lambda x: x.amax(0)))


def _adds_or_drops_ones(node) -> bool:
    """Whether autograd ``node`` is a view that only adds or drops dims of size 1 (``[None]``, a
    reshape of (1, n, d) to (n, d)): its rows are its input's."""
    if type(node) not in _VIEWS and type(node) not in _RESHAPES:
        return False
    child, output_nr = node.next_functions[0]
    if child is None:
        return False
    into, out = _forward_shape(child, output_nr), tuple(node._input_metadata[0].shape)
    return [size for size in into if size != 1] == [size for size in out if size != 1]


def selected_tokens(node, batch: int, cleared: Optional[set] = None) -> bool:
    """Whether the tensor autograd ``node`` made (through ops that keep its rows: elementwise ops,
    dropout, normalisations, views of the same rows) is rows selected from the batch, other than
    each sample's one row in order (the last token's, pooled): rows chosen along dim 0
    (``h[keep]``, ``h[index]``, ``index_select``, ``gather``, ``masked_select`` then a view,
    transformers 4's ``h[None, index]``) of the batch flattened with its positions
    (:func:`flattened_batch`), or along the batch's dim and the positions' (``h[keep]`` with a
    (B, T) mask, ``h[sample, position]``, ``masked_select``) of a tensor with the batch's size in
    dim 0 (:func:`_per_sample_rows`). Where their count is the batch's, a layer would read row j
    as sample j (a mixture's experts on the tokens that are not padding released a sample at 1.75
    times C; a ModuleList's experts on the tokens routed to each, 2.21 times; a (B, T) mask's
    tokens, 1.49 times, also through dropout). The rows chosen are read on the host; in a CUDA
    graph's capture, which may not, any selection is. ``cleared``: nodes a walk before found no
    such selection below, skipped, and this walk's added where it finds none (the layers' walks
    down one residual stream take each node once a step)."""
    cleared = set() if cleared is None else cleared
    stack, seen = [node], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen or node in cleared:
            continue
        seen.add(node)
        shape = tuple(node._input_metadata[0].shape)
        child, output_nr = node.next_functions[0] if node.next_functions else (None, 0)
        below = _forward_shape(child, output_nr) if child is not None else ()
        if type(node) in _SELECTIONS or (type(node) in _RESHAPES and len(below) == 1 and shape
                                         and type(child) is _MASKED_SELECT):
            if _selected_out_of_order(node, batch, shape):
                return True
        else:
            stack.extend(_same_rows_below(node) or ())
    cleared |= seen
    return False


def _same_rows_below(node) -> Optional[list]:
    """The nodes whose rows make, each alone, the rows of the tensor autograd ``node`` made: the
    input of a view of the same rows (dims of 1 added or dropped, ``h[:, -1]``, a reshape keeping
    dim 0), else :func:`_row_inputs`'s; None for any other op."""
    shape = tuple(node._input_metadata[0].shape)
    child, output_nr = node.next_functions[0] if node.next_functions else (None, 0)
    below = _forward_shape(child, output_nr) if child is not None else ()
    if _adds_or_drops_ones(node) or (type(node) in _RESHAPES and shape and below[:1] == shape[:1]):
        return [child]
    return _row_inputs(node, shape[0]) if shape else None


def _per_sample_rows(source, shape: tuple, batch: int, with_positions: bool) -> Optional[int]:
    """The rows of each sample in dim 0 of the tensor of ``shape`` that autograd node ``source``
    made, chosen from: 1 where it has the batch's size in dim 0 and the choice spans the positions
    too (``with_positions``; not a parameter, whose dim 0 is no batch), T where it is the batch
    flattened with its positions (:func:`flattened_batch`); None where neither is shown. Rows
    chosen along dim 0 alone of a tensor with the batch's size there are no tokens: a table of
    as many rows indexed by labels, or the batch permuted, as pad_packed_sequence puts back the
    order that packing sorted (:func:`reordered_rows` finds the batch's rows in another order)."""
    if not shape or source is None:
        return None
    if shape[0] == batch and with_positions and getattr(source, "variable", None) is None:
        return 1
    if shape[0] != batch and shape[0] % batch == 0 and flattened_batch(source, shape[0], batch):
        return shape[0] // batch
    return None


def _selected_out_of_order(node, batch: int, out: tuple) -> bool:
    """:func:`selected_tokens` for a selection's node ``node`` (or the reshape of a masked_select's
    elements into rows), whose output is of shape ``out``."""
    picked = _picked_rows(node, out)
    if picked is None:
        return False
    selection, with_positions, rows_of = picked
    source, output_nr = selection.next_functions[0]
    while _adds_or_drops_ones(source):
        source, output_nr = source.next_functions[0]
    shape = _forward_shape(source, output_nr) if source is not None else ()
    per_sample = _per_sample_rows(source, shape, batch, with_positions)
    if per_sample is None:
        return False
    if capturing():
        return True
    rows = rows_of(shape)
    if rows is None or rows.ndim == 0:
        return False  # one row, its dims the layer's rows
    samples = rows // per_sample
    order = torch.arange(samples.shape[0], device=samples.device).view(-1, *(1,) * (samples.ndim - 1))
    return not torch.equal(samples, order.expand(samples.shape))


def _picked_rows(node, out: tuple) -> Optional[tuple]:
    """(the selection's node, whether it chooses along the positions too, a function of the source's
    shape giving each output element's row of the source, its dim 0 the output's) of a selection
    along dim 0, or None."""
    if type(node) in _RESHAPES:  # h.masked_select(keep).view(n, d): each element's row of h
        selection = node.next_functions[0][0]

        def masked_rows(shape: tuple) -> Optional[torch.Tensor]:
            mask = selection._saved_mask
            if mask.dim() > len(shape) or (mask := mask.expand(shape)).sum() != math.prod(out):
                return None
            return mask.nonzero()[:, 0].view(out[0], -1)
        return selection, True, masked_rows
    if type(node) is _GATHER:
        return (node, False, lambda shape: node._saved_index) if _chooses_along_dim_0(node) else None
    if type(node) is _INDEX:
        entries = list(node._saved_indices)
        ones = next((k for k, entry in enumerate(entries) if entry is not None), len(entries))
        if any(size != 1 for size in tuple(node._saved_self_sym_sizes)[:ones]):
            return None  # dim 0 is not one of those chosen from
        entries = entries[ones:]
    elif type(node) is _INDEX_SELECT and _chooses_along_dim_0(node):
        entries = [node._saved_index]
    else:
        return None
    if not entries:
        return None
    first = entries[0]
    with_positions = (first.dtype == torch.bool and first.ndim > 1) or (len(entries) > 1 and entries[1] is not None)

    def indexed_rows(shape: tuple) -> torch.Tensor:  # read on the host: not in a capture
        chosen = [column for entry in entries if entry is not None
                  for column in (entry.nonzero().unbind(1) if entry.dtype == torch.bool else (entry,))]
        return torch.broadcast_tensors(*chosen)[0]
    return node, with_positions, indexed_rows


def reordered_rows(parents: dict, batch: int, outputs: dict, packings: list, inner: set) -> Optional[Any]:
    """The first layer under rows that the loss's graph (``parents``: :func:`count_uses`'s) takes
    along the batch's dim alone, as many as the batch's ``batch``, in another order (``h[order]``,
    ``index_select``, ``gather``, or the rows written in another order: ``new[order] = h``,
    ``index_copy``, ``scatter``, ``index_add``: the batch sorted, mixed with itself, or put back in
    order after a sort that the graph does not show); None if there is none. ``outputs`` maps (autograd node,
    output_nr) of each of the step's layer calls' outputs to (its layer, the dim that holds the
    batch there: 0, 1 for a sequence-first one, None for a packed sequence's rows, which hold it in
    any order, -1 for rows that are not the batch's alone).

    Book-keeping reads row i of every layer as sample i: where the layers' rows hold the samples in
    k different orders, a sample's share of the update reaches up to sqrt(k) times the clip norm
    (each order's part at most C; 1.41 times in reviews' repros: two Linears, the second on the
    hidden states sorted; the idiom of sorting a batch by length for an RNN, with
    pack_padded_sequence(enforce_sorted=True), the outputs or final states put back in order,
    batch first or sequence first as InferSent's encoder), silently where the first batch was in
    order or its first sample stayed in place.

    Rows taken along dim 0 or 1 are followed down to the layer outputs with the batch in that dim
    (:func:`_dims_below`): at T = B a sequence-first tensor's positions reversed by an index are
    no batch. Passed over: rows that depend on no layer call (a table, a parameter or computed
    from parameters alone, indexed by labels); a sort that only pack_padded_sequence reads (through
    a slice of the sequences not empty), unless a recorded RNN read a sequence packed without
    torch's sort (``packings``: the recorded RNN calls' (sorted_indices, unsorted_indices), None
    for such), where it must be torch's own; rows taken in the order of one of ``packings`` or the
    inverse of such a sort (pad_packed_sequence's restoring index_select) where no layer output is
    found above the sort or a packed sequence's rows (AllenNLP's sort around a frozen encoder; a
    trained layer between them is found); and selections in ``inner``, a layer call's own forward
    whose rows its rule reads by itself (transformers' grouped_mm experts sort the tokens by
    expert: at T = 1 and top-1 routing, the batch's rows). In a CUDA graph's capture, which may not
    read the rows taken, any such selection of rows that depend on a layer call is found."""
    by_hand = any(order is None for order, _ in packings)
    restoring = [order for packing in packings for order in packing if order is not None]
    found, sorts, free = [], set(), set()
    for node in parents:
        taken = _taken_along(node, batch) if type(node) in _REORDERS and node not in inner else None
        if taken is None:
            continue
        dim, below, rows_of, (source, output_nr) = taken
        rows = None if capturing() else rows_of()
        if _packed(node, parents):
            sorted_by_torch = rows is not None and any(torch.equal(rows, order.to(rows.device)) for order in restoring)
            if not by_hand or sorted_by_torch:
                sorts.add(node)
                restoring += [] if rows is None or rows.ndim != 1 else [torch.argsort(rows)]
                continue
        found.append((dim, below, rows, source, output_nr))
    for dim, below, rows, source, output_nr in found:
        restores = False
        if rows is not None:
            in_order = torch.arange(batch, device=rows.device).view(-1, *(1,) * (rows.ndim - 1 - dim))
            if torch.equal(rows, in_order.expand(rows.shape)):
                continue
            restores = any(rows.shape == back.shape and torch.equal(rows, back.to(rows.device)) for back in restoring)
        layer = _layer_below(source, output_nr, below, batch, outputs, set() if restores else free,
                             sorts if restores else None)
        if layer is not None:
            return layer
    return None


def _taken_along(node, batch: int) -> Optional[tuple]:
    """(dim, the dim of the source it is, a function giving the rows taken along it, read on the
    host, the source's edge) for a selection ``node`` (index, index_select, gather) along dim 0 or
    1 alone, after any dims of 1 (``h[None, order]``, ``h_n[:, order]`` of one layer), whose source
    and output have the batch's size there; else None. An index may be (B, 1, ...)
    (``h[order[:, None]]``). A write of :data:`_WRITES` of a source of its output's shape, its
    positions a permutation, is the selection of the inverse permutation's rows."""
    kind, out = type(node), tuple(node._input_metadata[0].shape)
    if kind in (_STACK, _CAT):
        return _combined(node, batch)
    edge = node.next_functions[1 if kind in _WRITES else 0]
    if edge[0] is None:
        return None  # a write of rows that take no gradient
    into = tuple(node._saved_self_sym_sizes) if kind in (_INDEX, _INDEX_SELECT) else _forward_shape(*edge)
    if kind in _WRITES and into != out:
        return None  # a broadcast source, or rows written into a larger tensor: a part of it
    if kind in (_INDEX, _INDEX_PUT):
        entries = list(node._saved_indices)
        chosen = [k for k, entry in enumerate(entries) if entry is not None]
        if len(chosen) != 1:
            return None  # several dims at once: selected_tokens' to find
        below, entry = chosen[0], entries[chosen[0]]
        if entry.ndim != 1 and not (entry.dtype != torch.bool and entry.shape[0] == entry.numel()):
            return None
        ones = next((k for k, size in enumerate(into[:below]) if size != 1), below)
        dim, into, out = below - ones, into[ones:], out[ones:]
        index = (lambda: entry.nonzero().flatten()) if entry.dtype == torch.bool else (lambda: entry.flatten())
    else:
        below = dim = _dim(node._saved_dim, len(into))
        index = lambda: node._saved_index  # noqa: E731
    if dim > 1 or len(into) <= dim or len(out) <= dim or into[dim] != batch or out[dim] != batch:
        return None
    return dim, below, (lambda: _read_rows(index(), dim)) if kind in _WRITES else index, edge


def _keeps_shape(node) -> bool:
    """Whether autograd ``node`` has one input with grad, of its output's shape (an elementwise op
    of one operand among them), listed in :data:`_ROW_BY_ROW` or not (a reciprocal, an atan: rows rotated by
    ``torch.cat([f(h[1:]), f(h[:1])])`` passed the check of the batch's order, a sample's share
    1.41 C with the first sample's check off, a review's repro); the walk that looks for a
    reorder goes through it."""
    inputs = [(child, nr) for child, nr in node.next_functions if child is not None]
    return (len(inputs) == 1 and bool(node._input_metadata)
            and tuple(node._input_metadata[0].shape) == _forward_shape(*inputs[0]))


def _combined(node, batch: int) -> Optional[tuple]:
    """:func:`_taken_along` for a stack or cat ``node`` along dim 0 or 1 whose inputs are all
    pieces of one source along that dim (:func:`_piece`), the batch's rows in all: the rows of the
    pieces, in the order combined (``torch.stack([h[i] for i in order])``,
    ``torch.cat([h[keep], h[~keep]])``, ``torch.cat(h.split(k)[::-1])``), each through ops of
    its rows alone and views adding or dropping dims of 1 (``torch.cat([h[i][None] ...])``,
    ``torch.vstack``)."""
    out = tuple(node._input_metadata[0].shape)
    dim = _dim(node._saved_dim, len(out))
    if dim > 1 or len(out) <= dim or out[dim] != batch:
        return None
    source, below, pieces = None, None, []
    for child, output_nr in node.next_functions:
        at, selected = dim, type(node) is _STACK
        while child is not None and ((row_by_row := type(child) in _ROW_BY_ROW or _keeps_shape(child))
                                     or _adds_or_drops_ones(child)):
            if not row_by_row:
                shape, into = tuple(child._input_metadata[0].shape), _forward_shape(*child.next_functions[0])
                if not selected and len(into) < len(shape) and shape[at] == 1:
                    selected = True  # the dim of 1 added where the pieces are combined: one row, selected
                elif selected and len(into) > len(shape) and into[at] == 1:
                    selected = False  # the dim of 1 dropped where a stack adds it back: a slice's one row
                elif selected:
                    return None
                else:
                    at = _dim_below(child, at, len(shape))
            child, output_nr = child.next_functions[0]
        piece = _piece(child, output_nr, at, selected)
        if piece is None or (source is not None and (piece[0][0] is not source[0] or piece[0][1] != source[1]
                                                     or at != below)):
            return None
        source, below = piece[0], at
        pieces.append(piece[1])
    shape = _forward_shape(*source)
    if len(shape) <= below or shape[below] != batch:
        return None

    def rows_of() -> torch.Tensor:
        device = next((rows.device for rows in pieces if isinstance(rows, torch.Tensor)), None)
        return torch.cat([rows.nonzero().flatten() if isinstance(rows, torch.Tensor) and rows.dtype == torch.bool
                          else torch.as_tensor(rows, dtype=torch.long, device=device) for rows in pieces])
    return dim, below, rows_of, source


def _piece(node, output_nr: int, dim: int, selected: bool) -> Optional[tuple]:
    """(its source's edge, the rows along ``dim`` it holds: a range, a list, or an index on the
    device) for a piece of a tensor along ``dim``: one row (``selected``: a select or unbind, as
    stacked), or rows (a slice, split, chunk, index_select, or an index along that dim alone, of
    rows or a mask); through slices along the dim above the source (``h[1:][:2]``)."""
    kind = type(node)
    if node is None or kind not in (_SELECT, _UNBIND, _SLICE, _SPLIT, _SPLIT_WITH_SIZES, _INDEX, _INDEX_SELECT):
        return None
    source = node.next_functions[0]
    if kind is _INDEX_SELECT:
        ndim = len(node._saved_self_sym_sizes)
        return (source, node._saved_index) if not selected and _dim(node._saved_dim, ndim) == dim else None
    if kind is _INDEX:
        entries = list(node._saved_indices)
        if selected or len(entries) <= dim or any(entry is not None for k, entry in enumerate(entries) if k != dim) \
                or entries[dim] is None or entries[dim].ndim != 1:
            return None
        return source, entries[dim]
    shape = _forward_shape(*source)
    if _dim(node._saved_dim, len(shape)) != dim or (kind in (_SELECT, _UNBIND)) != selected:
        return None
    size = shape[dim]
    if kind is _SELECT:
        rows = [_dim(node._saved_index, size)]
    elif kind is _UNBIND:
        rows = [output_nr]
    elif kind is _SLICE:
        rows = range(*slice(_signed(node._saved_start), _signed(node._saved_end), node._saved_step).indices(size))
    else:
        sizes = [node._saved_split_size] * -(-size // node._saved_split_size) if kind is _SPLIT else \
            list(node._saved_split_sizes)
        start = sum(sizes[:output_nr])
        rows = range(start, min(start + sizes[output_nr], size))
    outer = _piece(*source, dim, False) if type(source[0]) is _SLICE else None
    return (source, rows) if outer is None else (outer[0], [outer[1][row] for row in rows])


def _read_rows(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """The rows a write to ``positions`` along ``dim`` takes (``new[positions] = h`` is
    ``h[positions.argsort()]``) where they are a permutation along it; else the positions, in
    order only where they are."""
    along = dim if positions.ndim > dim else 0
    in_order = torch.arange(positions.shape[along], device=positions.device)
    in_order = in_order.view(-1, *(1,) * (positions.ndim - 1 - along)).expand(positions.shape)
    return positions.argsort(dim=along) if torch.equal(positions.sort(dim=along).values, in_order) else positions


def _packed(node, parents: dict) -> bool:
    """Whether the output of ``node`` is read by pack_padded_sequence's op alone, directly or
    through slices (AllenNLP packs the sorted batch's sequences that are not empty,
    ``sorted[:num_valid]``)."""
    readers = parents.get(node, ())
    return bool(readers) and all(type(reader) is _PACK or (type(reader) is _SLICE and _packed(reader, parents))
                                 for reader, _ in readers)


def _layer_below(node, output_nr: int, dim: int, batch: int, outputs: dict, free: set,
                 sorts: Optional[set] = None) -> Optional[Any]:
    """The layer of ``outputs`` (:func:`reordered_rows`) whose output, in the graph under output
    ``output_nr`` of ``node``, holds the batch (of ``batch``) in the dim that its ``dim`` is there,
    whole (:func:`_dims_below`), if any. ``sorts`` (for rows put back in a restoring order): the walk
    stops at these selections (packing's sorts) and at packed sequences' rows, whose order the
    restoring puts back. ``free``: (node, output_nr, piece) with none under them, skipped, and
    this walk's added where it finds none."""
    shape = tuple(node._input_metadata[output_nr].shape) if node is not None else ()
    stack, seen = [(node, output_nr, (dim, 1, shape[dim] if dim < len(shape) else batch))], set()
    while stack:
        at = stack.pop()
        node, output_nr, piece = at
        if node is None or at in seen or at in free or (sorts is not None and node in sorts):
            continue
        seen.add(at)
        layer, holds = outputs.get((node, output_nr), (None, -1))
        if holds is None and sorts is not None:
            continue  # a packed sequence's rows, in the order the restoring puts back
        shape = tuple(node._input_metadata[output_nr].shape) if output_nr < len(node._input_metadata) else ()
        dim, outer, size = piece
        whole = outer == 1 and dim < len(shape) and shape[dim] == size == batch
        if layer is not None and (holds is None or (holds == dim and whole)):
            return layer
        stack.extend(_dims_below(node, output_nr, piece))
    free |= seen
    return None


def _chooses_along_dim_0(node) -> bool:
    """Whether an index_select's or gather's ``node`` chooses along dim 0 (dim=-n of n dims too)."""
    return _dim(node._saved_dim, len(getattr(node, "_saved_self_sym_sizes", None) or node._saved_index.shape)) == 0


def flattened_outputs(edges: list, batch: int) -> list[int]:
    """The indices of the gradient edges ``edges`` (a call's outputs) whose tensors hold the batch
    of ``batch`` flattened with its positions, (B T, ...) by :func:`flattened_batch`: the outputs
    of a DeepSeek-style router, which flattens its input (B, T, d) itself."""
    found = []
    for k, edge in enumerate(edges):
        shape = _forward_shape(edge.node, edge.output_nr)
        if (shape and shape[0] != batch and batch and shape[0] % batch == 0
                and flattened_batch(edge.node, shape[0], batch)):
            found.append(k)
    return found


def shared_output_uses(edge, parents: dict, batch: int, tables: frozenset = frozenset()) -> Optional[Broadcasts]:
    """The uses of a layer call's output, the gradient edge ``edge``, if the output is one shared
    by the batch's ``batch`` samples: computed from inputs without the batch (GPT-2's position ids
    (1, T), T5's relative position buckets (T, T)), and used only added to, subtracted from,
    multiplied into or expanded over the batch, directly or through views. Found from the loss's
    autograd graph (``parents``: :func:`count_uses`'s), as broadcast parameters'
    (:class:`Broadcasts`, one operand); None if any use is of another kind or does not broadcast
    the output along the batch in dim 0 (a layer's ordinary output, which has the batch there,
    whatever its inputs' dim 0 looked like), or if there is none. ``tables``: nodes that count as
    computed from parameters (:func:`_from_parameters`), where a use meets the batch flattened."""
    # a node of several outputs (an RNN's output and final states) has its parents for all of them
    consumers = [(parent, k) for parent, k in parents.get(edge.node, [])
                 if parent.next_functions[k][1] == edge.output_nr]
    meta = edge.node._input_metadata[edge.output_nr]
    uses = _uses_above(consumers, tuple(meta.shape), (), parents) if consumers else None
    uses = uses and [use._replace(tables=tables) for use in uses]
    if not uses or not all(use.broadcasts_over(batch) for use in uses):
        return None
    uses = _resolved(uses, meta.device)
    output = torch.empty((), dtype=meta.dtype, device=meta.device).expand(tuple(meta.shape))  # its shape, no storage
    return None if uses is None else Broadcasts([output], [uses], batch)


def consumers_of(edge, parents: dict) -> list:
    """The nodes of the loss's graph (``parents``: :func:`count_uses`'s) that take the gradient
    edge ``edge``'s tensor."""
    return [parent for parent, k in parents.get(edge.node, []) if parent.next_functions[k][1] == edge.output_nr]


def input_from_parameters(edge, own: list, budget: int = 8) -> bool:
    """Whether a layer call whose output is the gradient edge ``edge`` ran on an input with grad
    computed from parameters alone within ``budget`` nodes (:func:`_from_parameters`), the layer's
    ``own`` parameters aside: a table of B rows (DeBERTa's relative positions, LayerNormed at B =
    2k) looks like a batch, and a few nodes tell it from one (a layer input's history holds the
    batch; an Embedding's ids have no grad, its output no input edge but its weight's; a Linear's
    weight enters through its transpose)."""
    inputs = _inputs_with_grad(edge, own)
    return bool(inputs) and all(_from_parameters(child, budget) for child in inputs)


def may_be_a_table(edge, own: list, tables: frozenset = frozenset(), budget: int = 8) -> bool:
    """Whether a layer call whose output is the gradient edge ``edge``, of dim 0 the batch's size,
    may have run on a table rather than the batch: its input has grad and comes from parameters
    (:func:`input_from_parameters`), or it has no input with grad at all (position ids made from
    T, a buffer: at B = T only the output's uses tell them from the batch's ids or data); the
    nodes in ``tables`` count as computed from parameters."""
    inputs = _inputs_with_grad(edge, own)
    return not inputs or all(_from_parameters(child, budget, tables) for child in inputs)


def _inputs_with_grad(edge, own: list) -> list:
    """The nodes of the inputs with grad of the layer call whose output is ``edge``, the layer's
    ``own`` parameters aside (a weight, its transpose)."""
    mine = {id(p) for p in own}
    return [child for child, _ in edge.node.next_functions if child is not None and not _own_only(child, mine)]


def _own_only(node, mine: set, budget: int = 8) -> bool:
    """Whether the tensor autograd ``node`` made is computed from the parameters whose ids are in
    ``mine`` alone, within ``budget`` nodes (a weight, its transpose)."""
    stack, seen = [node], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if len(seen) > budget or (variable is not None and id(variable) not in mine) or \
                (variable is None and not any(child is not None for child, _ in node.next_functions)):
            return False
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return True


class RegionWalk(NamedTuple):
    """What :func:`shared_region_boundary` walks by: the loss's graph (``parents``: each node's
    parents, :func:`count_uses`'s), the shared layer calls' outputs (``boundary``: node to its
    gradient edges), the batch's size, the nodes that count as computed from parameters
    (``tables``: layer calls on the model's buffers) and those that do not (``layers``: the other
    layer calls' outputs, shared ones too, whose gradients the step's backward takes: it would run,
    and free, a region above one)."""

    parents: dict
    boundary: dict
    batch: int
    tables: frozenset = frozenset()
    layers: frozenset = frozenset()


def shared_region_boundary(consumers: list, walk: RegionWalk, bounds: dict, discover: bool = True) -> Optional[list]:
    """The output edges of the shared layer calls (``walk.boundary``) that a tensor taken by the
    nodes ``consumers`` (a layer call's output, a parameter) reaches, if it reaches the batch only
    through them: every op between is computed from parameters alone (:func:`_from_parameters`),
    so no sample enters before a boundary call, whose per-sample output gradients the step knows
    (:func:`shared_output_uses`). DeBERTa's relative position embeddings, a LayerNorm of a table
    projected by each layer's query and key Linears, are such a region (the table and the
    LayerNorm), bounded by the projections. An op of the region whose output is only broadcast
    over the batch bounds it too (``bounds``: node to (edge, :class:`Broadcasts`), those found so
    far; with ``discover``, others are added): Swin v2's position bias, an MLP of a buffer of
    coordinates, indexed, 16 sigmoid(.), added to every window's scores; its attention's logit
    scale, clamped and exponentiated, multiplying them; not one whose broadcast reads a factor
    saved in an activation checkpoint (:meth:`Broadcasts.factors_checkpointed`). None if a path
    meets an op with the batch in it first, or no boundary."""
    stack = list(consumers)
    reached, seen = [], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in walk.boundary or node in bounds:
            reached += walk.boundary[node] if node in walk.boundary else [bounds[node][0]]
            continue
        above = walk.parents.get(node)
        if not above or not _from_parameters(node, tables=walk.tables, stop=walk.layers):
            return None
        if discover and len(node._input_metadata) == 1:
            edge = GradientEdge(node, 0)
            uses = shared_output_uses(edge, walk.parents, walk.batch, walk.tables)
            if uses is not None and not uses.factors_checkpointed():
                bounds[node] = (edge, uses)
                reached.append(edge)
                continue
        stack.extend(parent for parent, _ in above)
    return reached or None


def count_uses(roots: list, parameters: list, stop: frozenset = frozenset(), graph: str = "the loss",
               consumers: Optional[list] = None, parents: Optional[dict] = None) -> list[int]:
    """How many autograd edges of the graph under the nodes ``roots`` reach each of ``parameters``
    (each use of a parameter in the forward is one edge into its AccumulateGrad node); the walk
    does not go below the nodes in ``stop`` (a call's inputs). With ``consumers`` (one list per
    parameter), each use's (node, input index) is appended to its parameter's list; with
    ``parents``, each node's (parent, input index) edges in the walk (a root's: none), so that
    the nodes of the graph are its keys.

    Raises on reentrant activation checkpointing in the graph (named ``graph`` in the message): its
    node hides the parameters it uses (they are no edges of the graph) and its forward runs without
    grad, so the hooks record nothing, and the parameters would get the noise alone. Raises on code
    compiled by torch.compile too (:func:`refuse_compiled`)."""
    wanted = {id(p): i for i, p in enumerate(parameters)}
    counts = [0] * len(parameters)
    seen, stack = set(stop), [n for n in roots if n is not None]
    if parents is not None:
        for root in stack:
            parents.setdefault(root, [])
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        forward = getattr(node, "_forward_cls", None)  # an autograd.Function's node (few: the others skip both checks)
        if forward is CheckpointFunction:
            raise ValueError(f"the graph of {graph} has reentrant activation checkpointing (torch.utils.checkpoint "
                             "with use_reentrant=True), whose forward runs without grad, out of the book-keeping "
                             "hooks' sight: its parameters would get no clipped gradient; use use_reentrant=False")
        if forward is not None:
            refuse_compiled(node, graph)
        for position, (child, _) in enumerate(node.next_functions):
            if child is None:
                continue
            variable = getattr(child, "variable", None)  # AccumulateGrad: the leaf it accumulates into
            if variable is not None:
                index = wanted.get(id(variable))
                if index is not None:
                    counts[index] += 1
                    if consumers is not None:
                        consumers[index].append((node, position))
                continue
            if parents is not None:
                parents.setdefault(child, []).append((node, position))
            if child not in seen:
                stack.append(child)
    return counts


def refuse_compiled(node: Any, graph: str) -> None:
    """Raise if the autograd node ``node`` (in the graph of ``graph``, for the message) is
    AOTAutograd's: torch.compile's backends but "eager" (inductor, the default, and "aot_eager")
    put the ops of a compiled region in one such node. Under it, shared-output and flattened-batch
    uses were misread (loud errors) and, silently, nn.MultiheadAttention's projections and T5's
    relative position buckets' table went unrecorded or wrongly recorded (their clipped sums off by
    20-100%): the compiled ops never run as the torch functions that the layer rules intercept, nor
    show in the graph as the nodes that the walks read."""
    forward = getattr(node, "_forward_cls", None)
    if (forward is not None and getattr(forward, "__name__", "") == "CompiledFunction"
            and getattr(forward, "__module__", "").startswith("torch._functorch")):
        raise ValueError(f"the graph of {graph} has code compiled by torch.compile (its autograd node "
                         f"{type(node).__name__}), which hides from book-keeping the ops and parameter uses it reads "
                         "in the graph and in each layer's forward call (a compiled nn.MultiheadAttention's "
                         "projections went unseen, their update the noise alone): run that forward uncompiled (on a "
                         "GPU, BookKeeping.graphed replays the step's host work from a CUDA graph)")


def fed_outputs(outputs: list, stop: frozenset) -> list[int]:
    """The indices of ``outputs`` (tensors with grad) from which another of them is computed, in
    the graph above the nodes ``stop`` (a call's inputs): a router's logits, returned beside the
    routing weights made from them. A tensor hook on such an output sees its whole gradient, the
    part that comes through the other output included."""
    parents: dict = {}
    count_uses([x.grad_fn for x in outputs], [], stop=stop, parents=parents)
    edges = [get_gradient_edge(x) for x in outputs]
    return [k for k, edge in enumerate(edges) if any(parent.next_functions[position][1] == edge.output_nr
                                                      for parent, position in parents.get(edge.node, ()))]


def embedding_lookup(output: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[int]]:
    """(weight, ids, padding index) of an embedding lookup, ``output`` = F.embedding(ids, weight,
    padding_idx) as autograd made it (the weight: the leaf it accumulates into; the padding index
    None where it has none); (None, None, None) if ``output`` is not one."""
    node = output.grad_fn
    if type(node) is not _LOOKUP:
        return None, None, None
    padding = _signed(node._saved_padding_idx)
    return getattr(node.next_functions[0][0], "variable", None), node._saved_indices, None if padding < 0 else padding


def taken_rows(output: torch.Tensor, weight: torch.Tensor) -> Optional[torch.Tensor]:
    """The ids of the rows of ``weight`` that ``output`` is where it takes them by a slice
    (``weight[a:b]``, Whisper's decoder position embedding) or by an index (``weight[ids]``, a
    negative id counting from the end, as Python's), as an embedding lookup of those ids without a
    padding index would; else None."""
    node = output.grad_fn
    if type(node) not in (_SLICE, _INDEX) or getattr(node.next_functions[0][0], "variable", None) is not weight:
        return None
    rows = weight.shape[0]
    if type(node) is _INDEX:
        indices = node._saved_indices
        ids = indices[0] if len(indices) == 1 else None
        if ids is None or ids.is_floating_point() or ids.dtype == torch.bool:
            return None
        return torch.where(ids < 0, ids + rows, ids)
    if _dim(node._saved_dim, weight.ndim) != 0:
        return None
    start, end = (min(max(_signed(v) + rows * (_signed(v) < 0), 0), rows)
                  for v in (node._saved_start or 0, rows if node._saved_end is None else node._saved_end))
    return torch.arange(start, end, node._saved_step, device=weight.device)
