"""DP-SGD without per-sample gradients: ghost norms and book-keeping (Bu et al., "Differentially
Private Optimization on Large Model at Small Cost", ICML 2023), as a drop-in for a training loop.

:class:`BookKeeping` hooks every layer of a model. In the forward pass each layer records its
input a; :meth:`BookKeeping.step` takes the per-sample losses, runs one backward pass to the
layers' outputs only (the ordinary parameter gradients are never computed), and per layer
(:mod:`privleak.dpsgd.layers`):

0. the layer takes its output gradient g from a tensor hook as the backward reaches it (a layer
   that keeps g to the end anyway, Linear or Embedding, takes it as a result of the backward). Where
   its per-sample gradients are no larger than a and g (GroupNorm, LayerNorm, convolutions with
   few weights) it forms them there, so a and g are freed as the backward goes on, as an
   ordinary backward frees its activations; a convolution whose per-sample gradients are up to
   4 times larger forms them once the backward is over (they would add to its peak); the others
   keep a and g to the end. A bias's per-sample gradients (sum_t g_t: one position's size) are
   always formed;

1. each sample's norm of the layer's gradient: for a Linear-like layer over T positions
   |sum_t g_t a_t^T|_F^2 = sum_{t,s} (a_t . a_s)(g_t . g_s), the ghost norm, when 2 T^2 < d p,
   else from that layer's per-sample gradient (the mixed rule);
2. with every layer's norms, the clip factors f_i = min(1, c / |g_i|) (flat: one norm over all
   tensors; per layer: one per tensor), by the materialised path's fused clip kernel: the
   per-sample gradients the layers formed go through it as they would there (their norms,
   factors and weighted sums in one call), the other layers' norms enter its factors as given
   columns;
3. for the weights not formed, the clipped sum sum_i f_i sum_t g_{i,t} a_{i,t}^T, one GEMM
   over (i, t) with g scaled by f_i.

The clipped sum goes to the mechanism as the materialised path's does: divided by the expected
batch size L (the clip factors scaled by 1/L), the noise's scale divided by L too
(``mechanism.noise(sum / L, clipping, L, generator)``); secure noise is added to the sum itself,
on its grid, and the result divided after it; VMF releases the direction, no division. So the
update equals :func:`~privleak.dpsgd.privatize` of the materialised per-sample gradients for the
same config and the same noise stream, up to float32 rounding.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import math
import warnings
import weakref
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn
from torch.ao.quantization import FakeQuantizeBase
from torch.autograd.graph import GradientEdge
from torch.nn.modules.module import _global_forward_hooks
from torch.nn.utils import parametrize
from torch.utils._pytree import tree_flatten

from privleak import validation
from privleak.dpsgd import attention, computed_weight, distributed, experts, recurrent, tied  # noqa: F401 (the rules' modules register them)
from privleak.dpsgd.buffers import Snapshot
from privleak.dpsgd.clip import kernel_rows, non_finite_error
from privleak.dpsgd.ghost_norm import GhostNormInputs, ghost_norms
from privleak.dpsgd.graph import (
    RegionWalk,
    capturing,
    changed_in_place,
    consumers_of,
    count_uses,
    flattened_batch,
    flattened_outputs,
    input_from_parameters,
    may_be_a_table,
    reordered_rows,
    selected_tokens,
    shared_output_uses,
    shared_region_boundary,
    unviewed,
)
from privleak.dpsgd.layers import FunctionalLayer, Layer, check_no_embedding_max_norm, ieee_float32, layer_for, total
from privleak.dpsgd.row_check import RowCheck
from privleak.dpsgd.training import DPOptimizer, PrivacyReport
from privleak.mechanisms import SecureNoiseGenerator

if TYPE_CHECKING:
    from privleak.dpsgd.graphed import GraphedStep


class BookKeeping:
    """DP-SGD by book-keeping: one backward pass, no per-sample gradients (module docstring).

    Use it in an ordinary loop::

        bk = BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.1), DPSGDConfig(1.0, noise_multiplier=1.1),
                         expected_batch_size=256)
        for x, y in batches:                       # Poisson batches (dpsgd.sample_batch), possibly empty
            losses = F.cross_entropy(model(x), y, reduction="none")   # (B,) one loss per sample
            update = bk.step(losses)               # what the server sees; the optimizer has stepped

    Args:
        model: the module whose forward computes the losses (or it wrapped in
            DistributedDataParallel, below). Its trainable parameters must be the optimizer's.
            Each supported layer (nn.Linear, nn.Conv1d/2d, nn.ConvTranspose1d/2d, nn.Embedding,
            nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, transformers' Conv1D, nn.MultiheadAttention's
            projections, :mod:`privleak.dpsgd.attention`) gets book-keeping;
            any other module with trainable parameters of its own gets per-sample gradients of that
            module alone (``torch.func``; :class:`~privleak.dpsgd.layers.FunctionalLayer`), or, for
            parameters only added to, multiplied into or expanded over the batch (a ViT's class token
            and position embedding, an RMSNorm module's weight), their ops' output gradients (times the
            other factor of a product). Such a module whose forward reads a child's parameters outside
            the child's forward (a Mamba or gated-delta-net mixer's ``self.conv1d.weight``) answers for
            that child's parameters too (:mod:`privleak.dpsgd.direct_reads`), as does one without
            parameters of its own that reads its child's. Every layer input has the batch in dim 0; or
            is one shared by the batch (GPT-2's position ids (1, T), T5's relative position buckets (T, T)) whose output
            is used only so (any layer but a convolution or GroupNorm); or, for a Linear or LayerNorm,
            is the batch flattened with its positions (OPT's (B T, d)), as the autograd graph shows. An
            nn.Embedding subclass whose forward returns its lookup of ids it makes (BART's and OPT's
            position embeddings) gets the Embedding rule. An nn.Conv1d/2d subclass whose forward
            convolves with a weight computed from its parameters (weight standardisation, a gain,
            DropConnect) gets the convolution rule on that weight, mapped back to the parameters
            (:mod:`privleak.dpsgd.computed_weight`); a standardised one its norms in closed form,
            by the ghost norm where the convolution's pays. Any other module that computes its weight as it
            runs (a parametrization such as weight_norm, spectral_norm or orthogonal) takes the
            fallback on its parametrization's originals. nn.LSTM, nn.GRU and nn.RNN get book-keeping over their
            steps run again after the backward pass, packed sequences included
            (:mod:`privleak.dpsgd.recurrent`). A weight tied between nn.Linear, nn.Embedding (or a
            scaled word embedding) and Conv1D layers (a language model's head and token embedding) is
            clipped as one parameter, its norm exact (:mod:`privleak.dpsgd.tied`).
        optimizer: any torch optimizer over the model's trainable parameters.
        config: :class:`~privleak.dpsgd.DPSGDConfig`; per-layer clip norms follow the optimizer's
            parameter order. An L1 mechanism (Laplace) gets its norms from each layer's
            per-sample gradient (ghost norms are L2 only), one layer at a time.
        expected_batch_size, generator, sampling: as :class:`~privleak.dpsgd.DPOptimizer`.
        check_first_sample: check the first batch's first sample by the backward pass of its loss
            alone (below), once; it costs the first step one backward pass (run without oneDNN,
            whose convolution workspaces took the CIFAR CNN's first-step peak RSS to 1.43x the
            non-private step's, where it is now 1.20x, against 1.19x without the check; a
            transformer's 1.01-1.03x). On a GPU, a check that runs out of memory is skipped with
            a warning.
        check_every_step: check at every step that every layer's rows are its samples' (row i
            of each layer output's gradient sample i's alone), by one more backward pass, of the
            losses weighted at random (:mod:`privleak.dpsgd.row_check`): moving or mixing the
            samples' rows between a layer and the losses is refused whatever its form, unless
            the samples moved drew the same weight that step (1 pair in 17), where the checks
            of the graph refuse the forms they know and the first sample's check what the first
            batch shows. Not for float16 models (their small gradients round). Off by default:
            the step takes 1.17-1.46x as long (docs/dpsgd.md). Not in a CUDA graph
            (:meth:`graphed`).

    Refused with an error naming the module or parameter: any other parameter shared by two
    modules; a tied parameter under an L1 mechanism (Laplace); a parameter used outside its
    module's forward (the hooks cannot see that use; checked every step on the autograd graph);
    BatchNorm in training mode; an Embedding or EmbeddingBag with ``max_norm`` (it renormalises
    its weights in place by the batch's ids); a layer on tokens selected from the batch flattened
    with its positions; dropout inside a module that must be recomputed per sample (an
    RNN's between its layers too); the
    deprecated hook-based ``torch.nn.utils.spectral_norm`` (the parametrization is replayed exactly);
    reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``: its
    forward runs without grad, out of the hooks' sight); a layer input changed in place after the
    layer's call (``h += layer(h)``); torch's nn.TransformerEncoderLayer and
    nn.TransformerDecoderLayer with ``batch_first=False`` (their Linear layers would read the
    positions as samples); a forward compiled by ``torch.compile`` (its ops hidden in one autograd
    node); a DistributedDataParallel built with ``static_graph=True``; parameters sharded over
    processes (FSDP, DTensors); a TorchScript module (``torch.jit.script`` or ``trace``: no hooks
    run in its forward). What no shape or graph test sees is checked at the first batch: the first
    sample's loss alone is run backward once; it must have no gradient in the other samples' rows
    of a Linear's, convolution's, Embedding's or normalisation's output, and each parameter's norm
    from the layer rules must match its gradient's (5%; not for half-precision parameters), or
    the step raises naming the module or parameter: a layer reading positions as samples (a
    sequence-first input at T = B), or a model whose losses depend on other samples
    (:meth:`_check_first_sample`).
    Non-reentrant checkpointing works, but the inputs the layers record stay alive until the
    step: it saves only the memory of the other activations.

    A logical batch too large for memory goes through in physical batches, the noise added once::

        for logical in batches:                    # one Poisson sample of the dataset each
            for x, y in zip(logical[0].split(16), logical[1].split(16)):
                bk.accumulate(F.cross_entropy(model(x), y, reduction="none"))
            update = bk.step()                     # noise once; an empty logical batch: the noise alone

    Every forward pass with grad since the previous step() or accumulate() belongs to the
    per-sample losses given next.

    Across processes, pass the model wrapped in ``nn.parallel.DistributedDataParallel`` and
    ``expected_batch_size`` of the logical batch of all the processes together; each process
    takes its share of one Poisson sample of the whole dataset, drawn alike on every process::

        batch = sample_batch(N, L, generator=shared)   # a generator seeded alike on every process
        batch = batch[batch % world_size == rank]

    The processes' settings are compared when it is built (a difference is refused on every
    process). The processes' clipped sums are reduced to the group's first process, which adds
    the noise once with its generator and broadcasts the update
    (:mod:`privleak.dpsgd.distributed`): the update of one process taking the whole logical
    batch, the same on every process. Every process calls step() once a step; an error of any
    process's batch raises at step() on every process, and the step is taken on none.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config, *, expected_batch_size: float,
                 generator=None, sampling: str = "poisson", check_first_sample: bool = True,
                 check_every_step: bool = False):
        if not isinstance(model, nn.Module):
            raise validation.ArgumentTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(model, torch.jit.ScriptModule):
            raise ValueError(f"model is a TorchScript module ({type(model).__name__}, from torch.jit.script or trace), "
                             "whose forward runs as TorchScript, out of the book-keeping hooks' sight: pass the Python "
                             "module")
        distributed.refuse_sharded(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("model has no trainable parameters (none with requires_grad): there is nothing to train")
        self._dp = DPOptimizer(optimizer, config, expected_batch_size, generator, sampling)
        params = self._dp.params
        if {id(p) for p in params} != {id(p) for p in trainable} or len(params) != len(trainable):
            raise ValueError(f"optimizer must hold exactly the model's {len(trainable)} trainable parameters (those "
                             f"with requires_grad), each once; it holds {len(params)} trainable tensors, not the same "
                             "ones")
        self.model = model
        replicated = isinstance(model, nn.parallel.DistributedDataParallel)
        self._module = model.module if replicated else model  # whose names errors quote
        check_no_embedding_max_norm(self._module)
        self.layers, self._tied = _layers_of(self._module)
        if self._tied and self.config.mechanism.clip_norm_type != 2:
            names = {id(p): name for name, p in self._module.named_parameters()}
            raise ValueError(f"config: the {type(self.config.mechanism).__name__} mechanism clips L1 norms, which do "
                             "not split over the layers sharing a tied parameter "
                             f"({', '.join(names[key] for key in self._tied)}); untie it or use an L2 mechanism")
        self._slots = {id(p): i for i, p in enumerate(params)}
        self._recording = True
        self._collecting = False
        self._shared = frozenset()  # (id(layer), call) of this backward's shared outputs (_shared_outputs)
        self._chained: list = []  # (layer, call) of this backward's shared outputs inside a shared region
        self._in_region: list = []  # the fallback layers whose parameters are used in a shared region alone
        self._bounds: list = []  # (edge, Broadcasts) of the ops bounding such a region, broadcast over the batch
        self._consumers: list = []  # per slot, the uses of the parameter in the last step's graph (_check_uses)
        self._clip_norm_cache = None  # ((column order, config id, device), clip norms) of the last step
        # whether a batch's first sample was checked by its own backward pass (or is not to be)
        self._checked = not validation.boolean(check_first_sample, "check_first_sample")
        # the random loss weights of the check at every step (they need not be secret: a reorder does not know them)
        self._row_weights = torch.Generator().manual_seed(0x5EED) \
            if validation.boolean(check_every_step, "check_every_step") else None
        self._accumulated = None  # the clipped sums of the physical batches since the last step
        self._failure = None  # across processes: the error of this process's batch, raised at the step
        # the last of the checks, as it turns DDP's all-reduce off
        self._replicas = distributed.Replicas(model, self._agreed()) if replicated else None
        self._claim_modules()
        self._layer_hooks = {id(layer): self._hooks_of(layer) for layer in self.layers}
        self._hooks = [hook for hooks in self._layer_hooks.values() for hook in hooks] + self._buffer_hooks()
        self._hooked = [layer.module for layer in self.layers]
        # one dropped without remove() takes its hooks with it (they hold it weakly), not recording on
        self._unhook = weakref.finalize(self, _remove_hooks, self._hooks, self._hooked, self._this)

    def _agreed(self) -> dict:
        """What every process's step must share for the first process's noise to be calibrated to
        every process's clipped sums (:class:`distributed.Replicas` compares them)."""
        config = self.config
        return {"config.mechanism": config.mechanism, "config.clip_norm": config.clip_norm,
                "config.per_layer": config.per_layer, "config.non_finite": config.non_finite,
                "expected_batch_size": self._dp.expected_batch_size, "sampling": self._dp.sampling,
                "a secure noise generator": isinstance(self._dp.generator, SecureNoiseGenerator),
                "the trainable parameters' shapes": [tuple(p.shape) for p in self.params]}

    # The DP-SGD state lives in the DPOptimizer this wraps: one place for its checks and report.
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._dp.optimizer

    @property
    def config(self):
        return self._dp.config

    @property
    def params(self) -> list:
        return self._dp.params

    @property
    def steps(self) -> int:
        return self._dp.steps

    def privacy_report(self, dataset_size: int, delta: float) -> PrivacyReport:
        """:func:`~privleak.dpsgd.privacy_report` for the steps taken so far."""
        return self._dp.privacy_report(dataset_size, delta)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._dp.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        """:meth:`DPOptimizer.state_dict <privleak.dpsgd.DPOptimizer.state_dict>`: the steps, the
        noise generator's state and the settings the accounting depends on, to save with the
        model's and the optimizer's. Taken between
        steps: physical batches accumulated since the last step are not in it."""
        if self._accumulated is not None:
            raise ValueError("state_dict(): physical batches have been accumulated since the last step; take the "
                             "state after step()")
        return self._dp.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s state (the steps, the seeded generator's key and offset); one
        saved under another mechanism, expected batch size or sampling is refused."""
        self._dp.load_state_dict(state)

    def remove(self) -> None:
        """Take the hooks off the model."""
        self._unhook()
        self._hooks = []
        self._clear()
        self._accumulated = self._failure = None
        if self._replicas is not None:
            self._replicas.detach()

    def _claim_modules(self) -> None:
        """Refuse modules that another BookKeeping's hooks are on (built on this model and neither
        removed nor dropped): both would record every forward pass, and only the last one's
        recorder saw nn.MultiheadAttention's projections, whose update the first then released as
        0 (a review's repro); then mark them as this one's."""
        def held() -> list:
            return [layer for layer in self.layers if (owner := _HOOKED.get(layer.module)) is not None
                    and owner() is not None and owner() is not self]

        taken = held()
        if taken:
            gc.collect()  # one dropped without remove() may wait in a reference cycle
            taken = held()
        if taken:
            raise ValueError(f"{taken[0].describe()} has the hooks of another BookKeeping, built on this model before "
                             "and not removed: call remove() on it first (two would each record every forward pass)")
        self._this = weakref.ref(self)
        for layer in self.layers:
            _HOOKED[layer.module] = self._this

    def _hooks_of(self, layer: Layer) -> list:
        """The layer's hooks on its module, holding this weakly. The recording forward hook goes
        before the hooks already there: one that changes the output (o * 3) had run first, and the
        layer's output gradient was taken at the changed output, its per-sample gradients a third
        of the true ones."""
        module, this = layer.module, self._this

        def recording() -> bool:
            bk = this()
            return bk is not None and bk._recording and torch.is_grad_enabled()

        hooks = [module.register_forward_hook(self._hook(layer, this), with_kwargs=True, prepend=True)]
        if type(layer).refusal is not Layer.refusal or type(layer).before_call is not Layer.before_call:
            def refuse(_module, _args):
                if recording() and (why := layer.refusal()) is not None:
                    raise ValueError(why)
                bk = this()
                if bk is not None and bk._recording:  # also without grad: a forward may turn it on inside
                    layer.before_call()

            hooks.append(module.register_forward_pre_hook(refuse, prepend=True))
        if layer.intercepts_forward:
            def enter(_module, _args):
                if recording():
                    layer.enter_forward()

            hooks += [module.register_forward_pre_hook(enter),
                      module.register_forward_hook(lambda *_: layer.exit_forward(), prepend=True, always_call=True)]
        return hooks

    def _buffer_hooks(self) -> list:
        """Hooks on each module with buffers of its own, but the replayed layers' modules (whose
        record checks their buffers and their children's, :class:`~privleak.dpsgd.layers._Replay`)
        and parametrizations (spectral norm's power iteration reads the weight alone): a recorded
        call, with grad or without, whose forward changes one in a way that may depend on the
        batch is refused (:mod:`privleak.dpsgd.buffers`). A module without parameters has no
        layer: a running standardiser before the first Linear trained, and one sample's removal
        moved the clipped sum by 1.21 C (a review's repro); a quantization observer that a replayed
        Linear calls from its forward hook wrote after that layer's record. A snapshot holds the
        module's children's buffers too (a fake-quantization module writes its observer's), so that
        its run again starts from them as the call found them. The snapshot is taken
        after the module's other forward pre-hooks, and checked before its forward hooks: what
        the forward itself writes. Not while a CUDA graph captures: its warm-up ran the same
        forward eagerly."""
        # (a module that may read its children's parameters, without its own, is watched: it may lose its layer)
        replayed = {id(layer.module) for layer in self.layers
                    if isinstance(layer, FunctionalLayer) and not (layer.unsettled and not layer.parameters)}
        parametrizations = {id(m) for module in self._module.modules() if parametrize.is_parametrized(module)
                            for m in module.parametrizations.modules()}
        this, hooks = self._this, []
        for name, module in self._module.named_modules():
            if not module._buffers or id(module) in replayed or id(module) in parametrizations:
                continue
            found: list = []  # a stack of snapshots, one per call under way (a module may call itself)
            known: dict = {}  # the buffers as the last call left them, their copies reused while unchanged

            def before(module, _args, found=found, known=known):
                bk = this()
                if bk is not None and bk._recording and not capturing():
                    found.append(Snapshot(list(module.named_modules()), known=known,
                                          by_value=isinstance(module, FakeQuantizeBase)))

            def after(module, args, kwargs, _output, found=found, known=known, name=name):
                bk = this()
                if not found or bk is None or not bk._recording:
                    return
                snapshot = found.pop()
                bk._recording = False  # the layers inside run again without recording
                try:
                    snapshot.check(module, args, kwargs, f"module '{name}' ({type(module).__name__})")
                finally:
                    bk._recording = True
                known.clear()
                known.update(snapshot.left())

            hooks += [module.register_forward_pre_hook(before),
                      module.register_forward_hook(after, with_kwargs=True, prepend=True)]
        return hooks

    @staticmethod
    def _hook(layer: Layer, this: weakref.ref):
        def record(module, args, kwargs, output):
            bk = this()
            if bk is None or not bk._recording:
                return None
            if layer.unsettled and not bk._settle(layer, args, kwargs, output):
                return None  # a module without parameters of its own that reads none of its children's: no layer
            output = layer.separated(args, kwargs, output)
            # only where no hook saw the view before this one (a global one, one prepended since)
            if (layer.returns_own_view and not _global_forward_hooks
                    and next(iter(module._forward_hooks.values())) is itself()):
                output = unviewed(output)
            # reading a saved tensor may recompute a checkpointed region now: its calls are not the step's
            bk._recording = False
            try:
                outputs = layer.record(args, kwargs, output)
            finally:
                bk._recording = True
            call = len(layer.calls) - 1
            if layer.acts_in_backward:  # else the backward hands the gradients over as its results
                for index, y in enumerate(outputs):
                    y.register_hook(functools.partial(bk._take_grad, layer, call, index))
            for key, node in layer.nodes(call) if outputs else ():
                node.register_prehook(functools.partial(bk._take_node_grad, layer, key))
            return output
        itself = weakref.ref(record)  # not the function itself: a cycle would hold the layer until a collection
        return record

    def _settle(self, layer: FunctionalLayer, args: tuple, kwargs: dict, output) -> bool:
        """At the first call with grad of a module whose class's code reads its children's
        parameters (:mod:`~privleak.dpsgd.direct_reads`: a Mamba mixer passes ``self.conv1d.weight``
        to a causal convolution of its own), the children whose parameters the call's graph uses
        other than through their layers' recorded calls: the module answers for their parameters
        from then on, replayed with it, and their layers are dropped (their records of the call with
        them). The others keep their rules (CLIP's vision embeddings read their position embedding's
        weight only to interpolate it). A module without parameters of its own that reads none
        (T5's feed-forward block tests its output layer's weight's type) loses its layer: False. A
        child's read in a later call alone is refused at the step as any use the hooks cannot see; a
        tied child's parameter is left so."""
        outputs = [x.grad_fn for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor) and x.grad_fn is not None]
        if not outputs:
            return True  # a call without grad (evaluation) reads nothing into a graph: the next one settles it
        inputs = frozenset(x.grad_fn for x in tree_flatten((args, kwargs))[0]
                           if isinstance(x, torch.Tensor) and x.grad_fn is not None)
        theirs = {}  # per candidate child, the layers in its subtree
        for name in layer.unsettled:
            inside = {id(sub) for sub in layer.module.get_submodule(name).modules()}
            theirs[name] = [other for other in self.layers if id(other.module) in inside]
        candidates = [p for name in layer.unsettled for p in layer.unsettled_parameters[name]]
        own, parents = len(layer.parameters), {}
        uses = count_uses(outputs, layer.parameters + candidates, stop=inputs, parents=parents,
                          graph=f"the call of {layer.describe()}")
        if own and not any(uses[:own]):
            return True  # its own parameters unused: a call on others' (torch.func.functional_call) or a branch
        unseen = dict(zip(map(id, candidates), uses[own:]))  # less the uses the children's layers recorded in it
        for others in theirs.values():
            for other in others:
                for call, counts in enumerate(other.uses):
                    if any(edge.node in parents for edge in other.call_edges(call)):
                        for p, count in zip(other.parameters, counts):
                            unseen[id(p)] = unseen.get(id(p), 0) - count
        read = [name for name in layer.unsettled if any(unseen[id(p)] > 0 for p in layer.unsettled_parameters[name])
                and not any(id(p) in self._tied for p in layer.unsettled_parameters[name])]
        layer.unsettled = ()
        layer.claim(read)
        self._drop([other for name in read for other in theirs[name]] + ([] if layer.parameters else [layer]))
        return bool(layer.parameters)

    def _drop(self, layers: list) -> None:
        """Take ``layers`` off the model: their hooks, and the mark of this BookKeeping."""
        for layer in layers:
            self.layers.remove(layer)
            self._hooked.remove(layer.module)
            for hook in self._layer_hooks.pop(id(layer)):
                hook.remove()
                self._hooks.remove(hook)
            if _HOOKED.get(layer.module) is self._this:
                del _HOOKED[layer.module]

    def _take_grad(self, layer: Layer, call: int, output: int, grad: torch.Tensor) -> None:
        """A tensor hook on a recorded output: hand its gradient to the layer, in step()'s backward
        only (a backward the user runs is none of ours)."""
        if self._collecting and (id(layer), call) not in self._shared:  # a shared output's: the batch's sum
            layer.take_grad(call, output, grad, self.config.mechanism.clip_norm_type)

    def _take_node_grad(self, layer: Layer, key: tuple, grad_outputs: tuple) -> None:
        """A pre-hook on an autograd node a layer named: its output gradient, in step()'s backward
        only."""
        if self._collecting:
            layer.take_node_grad(key, grad_outputs[0])

    def _clear(self) -> None:
        for layer in self.layers:
            layer.clear()

    def accumulate(self, per_sample_losses: torch.Tensor) -> None:
        """Clip the per-sample gradients of one physical batch, whose per-sample losses (B,) are
        given, and add their clipped sum to the step's; :meth:`step` adds the noise once, to the
        sum over every physical batch since the last step. A logical batch too large for memory
        (a Poisson sample of the dataset) is so taken a few samples at a time, as Opacus's
        BatchMemoryManager does: each sample's clip factor needs only its own gradient, so the
        update is the one of the whole batch at once (float32 rounding aside), and the privacy
        accounting is the logical batch's. Holds one float32 sum per parameter between calls.
        Across processes, an error here waits for the step (:meth:`step`)."""
        with self._failure_deferred():
            self._accumulate(per_sample_losses)

    def _accumulate(self, per_sample_losses: torch.Tensor) -> None:
        losses = check_losses(per_sample_losses)
        so_far, averaged, samples = self._accumulated or (None, self._averages_in_clip(), 0)
        samples += losses.shape[0]
        clipped = self._clipped_batch(losses, averaged, samples)
        if clipped is None:
            return
        sums, norm_sums = clipped
        # Raising for a non-finite sample waits (a host sync on a GPU) until the sums are queued,
        # so the GPU runs the backward pass meanwhile.
        self._check_finite(norm_sums, losses.shape[0])
        if so_far is not None:
            sums = [total.add_(s) for total, s in zip(so_far, sums)]
        self._accumulated = (sums, averaged, samples)

    def _clipped_batch(self, losses: torch.Tensor, averaged: bool, samples: int, *,
                       synced: bool = True) -> Optional[tuple]:
        """:meth:`_clipped_sums` of the batch recorded since the last step, its sums divided by L
        if ``averaged``; the layers' records let go after. ``samples``: how many the step's
        release will have summed with these (refused where their release could overflow float32,
        as the materialised path refuses it)."""
        self._recording = False  # the fallback's per-sample recomputation runs the hooked modules again
        try:
            self._check_model()
            self.config.mechanism.check_release_range(samples, self.config.clipping(len(self.params)),
                                                      self._dp.expected_batch_size, self._dp.generator)
            return self._clipped_sums(losses, 1.0 / self._dp.expected_batch_size if averaged else 1.0, synced=synced)
        finally:
            self._recording = True
            self._clear()

    def _averages_in_clip(self) -> bool:
        """Whether the clipped sums come divided by the expected batch size L (the clip factors
        scaled by 1/L, which costs nothing, where a division of the sum would be a pass over the
        model's size), and the noise then has its scale divided by L too, as the materialised
        path's kernel scales its sum. Not for secure noise, which is discretised on the sum's
        grid and so divided after it, nor for a release of the direction (VMF), which is not
        divided at all."""
        return not (self.config.mechanism.releases_direction or isinstance(self._dp.generator, SecureNoiseGenerator))

    def step(self, per_sample_losses: Optional[torch.Tensor] = None) -> list:
        """Privatise the batch and step the optimizer with the update as the parameters' ``.grad``
        (reset to None after the step, so the next forward pass does not hold it); returns the
        update (what the server sees), one float32 tensor per parameter in the optimizer's order.

        The batch is the one whose per-sample losses (B,) are given, with the physical batches
        given to :meth:`accumulate` since the last step; without losses, those alone (none: an
        empty batch, the update is the noise alone).

        Across processes, every process calls step() once a step, whatever its share (an empty
        one: step() with no forward pass, or the losses of an empty batch). An error of any
        process's batch (a non-finite sample, bad losses, a failure of its backward pass) raises
        at step() on every process, its own error on that process: the step is taken on none, and
        the next step pairs up as before."""
        with self._failure_deferred():
            if per_sample_losses is not None:
                self._accumulate(per_sample_losses)
            elif any(layer.calls for layer in self.layers):
                self._clear()
                raise ValueError("step() got no per_sample_losses, but the model ran a forward pass with grad since "
                                 "the last step or accumulate(): pass that batch's per-sample losses (run an "
                                 "evaluation under torch.no_grad())")
        accumulated, self._accumulated = self._accumulated, None
        self._check_batch_size(0 if accumulated is None else accumulated[2])
        if accumulated is None:  # an empty batch
            self._check_model()
            return self._release([torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in self.params],
                                 self._averages_in_clip(), 0)
        return self._release(*accumulated)

    def graphed(self, loss_fn, *example_inputs: torch.Tensor, max_batch: Optional[int] = None,
                warmup: int = 2) -> "GraphedStep":
        """This step for ``per_sample_losses = loss_fn(*inputs)``, its forward, backward and clip
        captured once in a CUDA graph and replayed each call; the noise, the optimizer step and the
        accounting run eagerly after each replay, as :meth:`step` runs them
        (:mod:`privleak.dpsgd.graphed`)::

            step = bk.graphed(lambda x, y: F.cross_entropy(model(x), y, reduction="none"), x0, y0,
                              max_batch=300)
            for x, y in batches:                   # Poisson batches of up to max_batch samples
                update = step(x, y)                # = bk.step(loss_fn(x, y)), float32 rounding aside

        The graph is captured for ``max_batch`` samples (default: the example's), a smaller batch
        padded with copies of its first sample whose losses are multiplied by 0; an empty batch or a
        larger one takes the eager step. With Poisson sampling, a ``max_batch`` that more than 1% of
        batches exceed is warned of, naming one that fits all but 1 in 10^4. ``warmup`` runs of the
        captured part on the example precede the capture (they change nothing). The model's forward
        must be capturable: no host syncs or data-dependent shapes (a mixture of experts' routing is
        neither); a capture that meets one fails with torch's error. A replay reads the parameters
        and buffers where the capture found them: after ``model.to()``, a parameter's ``.data``
        reassigned or a ``load_state_dict(assign=True)``, the step raises (make a new one). On a CPU
        there is no graph, and the returned step runs the padded step eagerly."""
        from privleak.dpsgd.graphed import GraphedStep

        if self._row_weights is not None and any(x.is_cuda for x in example_inputs if isinstance(x, torch.Tensor)):
            raise ValueError("check_every_step compares each step's rows on the host, which a CUDA graph cannot: "
                             "build the BookKeeping without it for graphed()")
        return GraphedStep(self, loss_fn, example_inputs, max_batch=max_batch, warmup=warmup)

    def _check_batch_size(self, samples: int) -> None:
        """:meth:`DPOptimizer.check_batch_size <privleak.dpsgd.DPOptimizer.check_batch_size>` of the
        step's batch, before its release; across processes each has only a share of it, and the
        first process checks their total in the release (:meth:`_release`)."""
        if self._replicas is None:
            self._dp.check_batch_size(samples)

    def _check_finite(self, norm_sums: torch.Tensor, batch: int) -> None:
        """Raise, in ``non_finite="raise"`` mode, if a sample among the first ``batch`` has a
        non-finite norm (the clip kernel's norm sums (B, C)); its sums are then not to be used."""
        if self.config.non_finite != "drop" and (keep := finite_samples(norm_sums[:batch])) is not None:
            raise non_finite_error((~keep).nonzero().flatten().tolist(), self.config.mechanism.clip_norm_type,
                                   f" (of the {batch} whose losses were given)")

    @contextlib.contextmanager
    def _failure_deferred(self):
        """In one process, errors raise where they happen. Across processes, an error of this
        process's batch is kept for the step, where the processes learn of it with the sums and
        all raise together (:meth:`distributed.Replicas.release`): raised here, it would leave the
        others waiting in the step's collectives, or pair their next step with this one's."""
        if self._replicas is None:
            yield
            return
        try:
            yield
        except Exception as error:
            self._failure = self._failure or error

    def _release(self, sums: list, averaged: bool, samples: int) -> list:
        """Noise the clipped sums of ``samples`` samples (divided by L if ``averaged``), make them
        the parameters' gradients and step the optimizer: the step's privacy, always run eagerly."""
        if self._replicas is None:
            update = self._privatised(sums, averaged)
        else:
            def privatised(sums: list, batch: int) -> list:  # on the first process, with the processes' batch
                self._dp.check_batch_size(batch)
                return self._privatised(sums, averaged)

            failure, self._failure = self._failure, None
            update = self._replicas.release(sums, privatised, failure, samples)
        self._dp.apply(update)
        for p in self.params:  # as zero_grad(set_to_none=True): the update is as large as the model
            p.grad = None
        return update

    def _privatised(self, sums: list, averaged: bool) -> list:
        """The update: the mechanism's release of the clipped sums (consumed), which come divided by L
        if ``averaged`` and are otherwise divided after the noise (a direction is not divided)."""
        clipping = self.config.clipping(len(self.params))
        mechanism = self.config.mechanism
        batch_size = self._dp.expected_batch_size
        update = mechanism.noise(sums, clipping, batch_size if averaged else 1.0, self._dp.generator, inplace=True)
        if not averaged and not mechanism.releases_direction:
            torch._foreach_mul_(update, 1.0 / batch_size)
        return update

    def _clipped_sums(self, losses: torch.Tensor, scale: float, *, synced: bool = True) -> Optional[tuple]:
        """(sums, norm sums): scale sum_i f_i g_i per parameter, float32, in the optimizer's
        order, and the clip kernel's per-sample norm sums (B, C), not yet checked for non-finite
        samples (:meth:`_check_finite`); None for no samples. ``synced=False``: nothing in it waits
        for the device (a CUDA graph captures it), so samples to drop are masked, not looked up."""
        batch = losses.shape[0]
        if batch == 0:
            if losses.grad_fn is not None:  # layers that saw samples raise: these losses are not their batch's
                parents: dict = {}
                self._check_uses(losses, parents)
                self._shared_outputs(batch, parents)
            return None
        if losses.grad_fn is None:
            raise ValueError("per_sample_losses must come from the model's forward with grad enabled "
                             "(it has no autograd graph)")
        if not any(layer.calls for layer in self.layers):  # else the uses' count below names a parameter
            raise ValueError("per_sample_losses: no layer of the model recorded a forward pass with grad since the "
                             "last step or accumulate() (the losses of a batch already taken, or of a forward pass "
                             "run before BookKeeping was built or under torch.no_grad())")
        parents: dict = {}
        self._check_uses(losses, parents)
        shared = self._shared_outputs(batch, parents)
        self._check_order(batch, parents)
        for layer in self.layers:
            layer.check_inputs()
            layer.may_sync = synced
        if not any(layer.edges for layer in self.layers):
            raise ValueError("per_sample_losses: no layer of the model recorded a forward pass with grad since the "
                             "last step")
        # The outputs of chained calls and of the layers in a region are left out (a backward reaching them would run,
        # and free, the region's graph); the ops bounding a region are asked for, so that the ops broadcasting them
        # run (a table added to data without grad: nothing else below them)
        apart = {(id(layer), call) for layer, call in self._chained} | \
            {(id(layer), call) for layer in self._in_region for call in range(len(layer.calls))}
        edges = [edge for layer in self.layers for call in range(len(layer.calls)) if (id(layer), call) not in apart
                 for edge in layer.call_edges(call)] + [edge for edge, _ in self._bounds]
        own = None
        if not self._checked and batch > 1 and not capturing():
            own = self._first_sample_norms(losses)
            self._checked = own is None  # out of memory: not again
        rows, below = None, lowest(edges, parents)
        if self._row_weights is not None and batch > 1:
            rows = RowCheck(self._sample_rows(batch, shared), batch, losses.device, self._row_weights)
            rows.weighted_pass(losses, below)
        with rows.watching() if rows is not None else contextlib.nullcontext():
            self._backward(losses, shared, below, rows)
        if rows is not None:
            rows.raise_if_moved()
        for layer in self.layers:
            layer.finish()
        # The layers' own parameters enter some products (the convolution's weight gradient). The
        # norms and sums in IEEE float32 both: a per-sample gradient formed for its norm is formed
        # again for its sum, by the same calls under the same flags.
        with torch.no_grad(), ieee_float32():
            return self._clip(batch, scale, synced, own)

    def _first_sample_norms(self, losses: torch.Tensor) -> Optional[tuple]:
        """(norms, checked, spread) from the backward pass of the first sample's loss alone, the
        graph kept for the step's, which :meth:`_check_first_sample` holds the step to: per
        parameter slot its gradient's norm (squared for L2; float64), which the layer rules'
        norms must give, and whether that one is ``checked`` (not for a half-precision
        parameter, whose gradient that pass adds up in half precision: an fp16 Embedding's 3000
        tokens 15% off, where book-keeping adds in float32); ``spread``: (layer, [largest
        |gradient| in the other samples' rows, in the sample's own]) for each output of a layer
        whose rows are samples (:attr:`~privleak.dpsgd.layers.Layer.rows_are_samples`), where
        the first must be 0 (independent samples give exact zeros; flagged above 2^-20 of the
        second), whatever the width.

        Each gradient is reduced to its norm and let go as it is made, so at most one is alive
        (all at once, they added the model's size to the first step's peak). oneDNN is off in it:
        its convolution weight gradients' workspaces, on top of the kept graph, took the CIFAR
        CNN's first-step peak RSS from 1.19x the non-private step's to 1.43x at B 128 (1.20x
        without it); torch's own kernels cost the check 0.4 s more there, once. The parameters'
        own hooks are off meanwhile (a gradient logger's would get the sample's unclipped
        gradient, an optimizer in the backward would step with it), the layers' take nothing,
        and ``.grad`` is left as it was. None where it ran out of memory (warned)."""
        norm_type, batch = self.config.mechanism.clip_norm_type, losses.shape[0]
        device = self.params[0].device
        norms = torch.zeros(len(self.params), dtype=torch.float64, device=device)
        checked = [p.element_size() >= 4 for p in self.params]
        spread: list = []

        def reduce(slot: int, p: torch.Tensor) -> None:
            grad, p.grad = p.grad, None
            if checked[slot]:
                grad = grad.coalesce().values() if grad.is_sparse else grad  # a sparse Embedding's
                norms[slot] = torch.linalg.vector_norm(grad, norm_type, dtype=torch.float64).to(device)

        def look(what: str, output: int, grad_outputs: tuple) -> None:
            grad = grad_outputs[output]
            if grad is not None and grad.ndim and grad.shape[0] == batch and grad[0].numel():  # not an empty one
                spread.append((what, torch.stack([torch.linalg.vector_norm(rows, math.inf).float()
                                                  for rows in (grad[1:], grad[0])])))

        held = [(p.grad, dict(p._backward_hooks or {}), dict(p._post_accumulate_grad_hooks or {}))
                for p in self.params]
        handles = [edge.node.register_prehook(functools.partial(look, f"the output of {layer.describe()}",
                                                                edge.output_nr))
                   for layer, edge, _ in self._call_outputs() if layer.rows_are_samples]
        # the ops whose output gradients are broadcast parameters' per-sample gradients: their dim 0 too
        handles += [node.register_prehook(functools.partial(look, f"the op {node.name()} on {what}", 0))
                    for what, node in self._sample_row_nodes(batch)]
        try:
            for slot, p in enumerate(self.params):
                p.grad = None
                for hooks in (p._backward_hooks, p._post_accumulate_grad_hooks):
                    if hooks:
                        hooks.clear()
                handles.append(p.register_post_accumulate_grad_hook(functools.partial(reduce, slot)))
            with torch.backends.mkldnn.flags(enabled=False, deterministic=None, allow_tf32=None, fp32_precision=None):
                torch.autograd.backward(losses[0], inputs=self.params, retain_graph=True)
        except torch.OutOfMemoryError:
            warnings.warn("BookKeeping: the check of the first sample by its own backward pass ran out of GPU memory "
                          "(the graph is kept for the step's backward pass meanwhile) and was skipped; pass "
                          "check_first_sample=False to leave it out", RuntimeWarning, stacklevel=5)
            return None
        finally:
            for handle in handles:
                handle.remove()
            for p, (grad, tensor_hooks, accumulate_hooks) in zip(self.params, held):
                p.grad = grad
                if tensor_hooks:
                    p._backward_hooks.update(tensor_hooks)
                if accumulate_hooks:
                    p._post_accumulate_grad_hooks.update(accumulate_hooks)
        return norms.square() if norm_type == 2 else norms, torch.tensor(checked, device=device), spread

    def _check_first_sample(self, norm_sums: torch.Tensor, own: tuple, order: tuple, clip_norms: torch.Tensor) -> None:
        """Raise where the first sample's loss alone (``own``, :meth:`_first_sample_norms`) shows
        that book-keeping clips the wrong gradients, which it would do without a sign: a layer
        that read a dim other than the batch as its samples (a sequence-first (T, B, ...) input at
        T = B, which no test of shapes or graph can tell from a batch-first one), or a model whose
        losses each depend on other samples through its graph.

        Two tests. (1) Exact: that loss has no gradient in the other samples' rows of any output
        whose rows are samples (above 2^-20 of its largest in its own row: independent samples
        give exact zeros, since each row's gradient is computed from that row's alone). (2) Each
        parameter's norm for the first sample (the clip kernel's column, in slot ``order``) is the
        one of that sample's own gradient, within 5% of the norm and 0.5% of the sample's whole
        norm: far above float32's and bfloat16's rounding, also that of a ghost norm whose
        gradient cancels to about 0 (its error is relative to sum_t |a_t| |g_t|, not to the norm:
        1e-4 to 1e-3 of the sample's norm where the gradient was 1e-7 of it); it covers the
        layers (1) does not see, and the layer rules themselves, unless the fault carries under a
        few percent of the sample's norm. A difference under 2^-20 of the clip norm (``clip_norms``,
        the kernel's) does not count: it cannot move a clip factor by more than that, and a
        saturated loss's gradient (1e-30) squares to below float32's range, where book-keeping's
        norm is 0. A non-finite gradient (0 x NaN of another sample's) leaves the check to a
        later batch."""
        norms, checked, spread = own
        largest = torch.stack([rows for _, rows in spread]).tolist() if spread else []
        mine, own, checked = norm_sums[0], norms[list(order)], checked[list(order)]
        if not (torch.isfinite(mine).all() and torch.isfinite(own).all() and math.isfinite(sum(map(sum, largest)))):
            return
        cause = ("Its layer reads a dim other than the batch as the samples (a sequence-first (T, B, ...) input with "
                 "T = B? every layer input must have the batch in dim 0), or the model makes each loss depend on "
                 "other samples (as BatchNorm in training mode does), which per-sample clipping cannot bound")
        for (what, _), (others, itself) in zip(spread, largest):
            if others > 2.0**-20 * itself:
                raise ValueError(f"per_sample_losses: the first sample's loss has a gradient in the other samples' "
                                 f"rows of {what} (up to {others:.6g}; {itself:.6g} in its own), where book-keeping "
                                 f"reads each row as one sample's. {cause}")
        total = torch.where(checked, own, mine).sum()
        if self.config.mechanism.clip_norm_type == 2:  # the columns are squared norms
            mine, own, total = mine.sqrt(), own.sqrt(), total.sqrt()
        wrong = checked & ((mine - own).abs() > 0.05 * torch.maximum(mine, own) + 0.005 * total + 2.0**-20 * clip_norms)
        if wrong.any():
            column = int(wrong.nonzero()[0])
            mine, own = float(mine[column]), float(own[column])
            # a norm raised by its rounding bound is larger: the gradient cancels, and both are rounding
            cancels = ("; or, book-keeping's norm being the larger, that sample's gradient cancels to float32's "
                       "rounding (inputs far larger than it), where both norms are rounding and book-keeping's is "
                       "raised by its bound, to the safe side: then check_first_sample=False" if mine > own else "")
            parameter = self.params[order[column]]
            replayed = any(isinstance(layer, FunctionalLayer) and any(p is parameter for p in layer.parameters)
                           for layer in self.layers)
            outside = ("; or its module's forward reads a tensor made from it outside that forward (a weight a "
                       "parent module assigns before the call, as AWD-LSTM's WeightDrop does), which the module's "
                       "replay cannot remake" if replayed else "")
            raise ValueError(f"per_sample_losses: book-keeping gave the first sample's gradient of parameter "
                             f"'{self._owner(order[column])}' the norm {mine:.6g}, but the backward pass of that "
                             f"sample's loss alone gives it {own:.6g}. {cause}{outside}{cancels}")
        self._checked = True

    def _backward(self, losses: torch.Tensor, shared: list, below: list, rows: Optional[RowCheck] = None) -> None:
        """The one backward pass, its gradients handed to the layers. The layers that act on their
        gradients in the backward (reduce them, so that they are freed as it goes on) take them
        from tensor hooks as it reaches them; the others' are its results (they keep them to the
        end anyway). Asking autograd for the lowest layers' gradients too (``below``:
        :func:`lowest`'s) makes the backward run through all the layers, without holding the
        others'. A method of its own so that its
        locals, the results among them, are gone before the clip: the layers free their gradients
        as their sums are made. ``rows``: the check at every step, which sketches the gradients
        this pass reaches."""
        handles = [node.register_prehook(functools.partial(self._take_shared_grad, uses, use))
                   for uses in [uses for _, _, found in shared for uses in found] + [uses for _, uses in self._bounds]
                   for (_, use), node in uses.nodes()]
        after = [(layer, call, layer.call_edges(call)) for layer in self.layers if not layer.acts_in_backward
                 for call in range(len(layer.calls)) if (id(layer), call) not in self._shared]
        wanted = [edge for _, _, call_edges in after for edge in call_edges]
        taken = set(wanted)
        self._collecting = True
        before = [_grad_state(p) for p in self.params]
        try:
            # Parameters whose gradients come from pre-hooks on the nodes using them (broadcast
            # parameters): asking for theirs makes the backward run those nodes.
            forced = [t for layer in self.layers for t in layer.forced_inputs()]
            lowest_edges = [edge for edge in below if edge not in taken]
            grads = torch.autograd.grad(losses, wanted + lowest_edges + forced, grad_outputs=torch.ones_like(losses),
                                        allow_unused=True)
            if rows is not None:  # the results' nodes did not run: their pre-hooks did not see them
                rows.observe(wanted + lowest_edges, grads)
        finally:
            self._collecting, self._shared = False, frozenset()
            for handle in handles:
                handle.remove()
        # This backward makes no .grad; one made in it comes from a backward pass of its own that a
        # custom autograd.Function runs (Reformer's reversible layers recompute theirs and fill
        # .grad), on parameters whose uses its forward, run without grad, hid: they got the noise
        # alone (a review's repro).
        if changed := [slot for slot, (p, state) in enumerate(zip(self.params, before)) if _grad_state(p) != state]:
            for slot in changed:  # the batch's gradient, unclipped: not left for an optimizer step
                self.params[slot].grad = None
            raise ValueError(f"parameter '{self._owner(changed[0])}' got a .grad in the step's backward pass, from a "
                             "backward pass that something in the losses' graph runs itself (a custom "
                             "torch.autograd.Function, as Reformer's reversible layers are), where book-keeping "
                             "cannot see its per-sample gradients: such a model cannot be book-kept")
        grads, norm_type = iter(grads), self.config.mechanism.clip_norm_type
        for layer, call, call_edges in after:
            for output in range(len(call_edges)):
                grad = next(grads)
                if grad is not None:  # None: the loss does not use the output
                    layer.take_grad(call, output, grad, norm_type)
        rows_of = [(layer, call, [uses.rows(0) for uses in found]) for layer, call, found in shared]
        for layer, call, output_grads in rows_of:
            layer.broadcast(call, output_grads, norm_type)
        if self._chained or self._in_region:
            self._chain_shared(rows_of + [(None, edge, [uses.rows(0)]) for edge, uses in self._bounds], norm_type)

    def _chain_shared(self, rows_of: list, norm_type: int) -> None:
        """The per-sample output gradients of the chained calls (:meth:`_shared_outputs`), handed
        to their layers, and the per-sample gradients of the parameters of the fallback layers used
        in the region alone (DeBERTa's encoder reads its relative position table's weight and gives
        it to a LayerNorm), handed to them in place of a replay: one backward pass through the
        region's graph, which the step's did not run, from the per-sample output gradients of the
        shared calls bounding it (``rows_of``: (layer, call, [(B, *shape)]); (None, edge, [(B,
        *shape)]) for an op of the region whose output is only broadcast), vmapped over the
        samples (``is_grads_batched``). It costs B backward passes of the region, which holds no
        batch: a table and the layers projecting it."""
        outputs, cotangents = [], []
        for layer, call, output_grads in rows_of:  # (None, edge, ...): an op of the region broadcast over the batch
            for edge, grad in zip([call] if layer is None else layer.call_edges(call), output_grads):
                outputs.append(edge)
                cotangents.append(grad.to(edge.node._input_metadata[edge.output_nr].dtype))
        inputs = [(layer, call, edge) for layer, call in self._chained for edge in layer.call_edges(call)]
        params = [p for layer in self._in_region for p in layer.parameters]
        grads = torch.autograd.grad(outputs, [edge for _, _, edge in inputs] + params, cotangents,
                                    is_grads_batched=True, allow_unused=True)
        for layer, call in self._chained:
            found = [grad for (owner, at, _), grad in zip(inputs, grads) if owner is layer and at == call]
            if all(grad is not None for grad in found):
                layer.broadcast(call, found, norm_type)
        batch = cotangents[0].shape[0]
        rows = iter(grads[len(inputs):])
        for layer in self._in_region:
            layer.take_region_rows({id(p): next(rows) for p in layer.parameters}, batch)

    def _clip(self, batch: int, scale: float, synced: bool, own: Optional[tuple]) -> tuple:
        """Norms, clip factors and clipped sums of the layers' gradients after the backward pass.
        The per-sample gradients the layers formed go through the fused clip kernel, one call for
        their norms and clipped sums both, with the other layers' norms (ghost norms) as given
        columns of its factors; the other layers then form their sums with those factors. One call
        instead of four torch ops per tensor: on a small model each op costs more than its
        arithmetic, and on a GPU each is a launch. ``own``: the first sample's norms from its own
        backward pass, to check the layers' against (:meth:`_check_first_sample`)."""
        config, norm_type = self.config, self.config.mechanism.clip_norm_type
        rows, norms = self._rows_and_norms(batch, norm_type, synced)
        apart = {}  # by slot, a tied parameter's samples to sum in float64 (tied.clipped_sum), and its factors
        for key, sharing in self._tied.items():  # |sum_k G^k|^2 = sum_k |G^k|^2 + 2 sum_{k<l} <G^k, G^l>
            slot = self._slots[key]
            found = [f for f in (layer.factors(self.params[slot]) for layer in sharing) if f is not None]
            if len(found) > 1:
                # the layers' own lost samples too: float64 sums of each layer's, rounded apart, cancel no better
                lost = [r for layer in sharing for r in layer.lost.pop(key, [])]
                norms[slot] = tied.tied_norms(norms[slot], found, may_sync=synced, lost=lost)
                if lost:
                    apart[slot] = (torch.cat(lost).unique(), found)
        order = sorted(rows) + sorted(norms)  # the kernel's columns
        if sorted(order) != list(range(len(self.params))):
            raise RuntimeError("book-keeping: the layers' rows and norms do not cover each parameter once")
        clip_norms = self._clip_norms(tuple(order))
        given = torch.stack([norms[slot] for slot in sorted(norms)], 1) if norms else None
        sums: list = [None] * len(self.params)
        if rows:
            tensors = kernel_rows([rows[s] for s in sorted(rows)])
            *totals, norm_sums, factors = torch.ops.privleak.clip_accumulate(
                tensors, clip_norms, config.per_layer, 0.0, [0, 0], 0, scale, norm_type, given)
            for slot, t in zip(sorted(rows), totals):
                sums[slot] = t
        else:
            norm_sums = given
            factors = torch.ops.privleak.clip_factors(norm_sums, clip_norms, config.per_layer, norm_type)
        if own is not None:
            self._check_first_sample(norm_sums, own, order, clip_norms)
        # Dropping a non-finite sample needs to know it before the sums: on a GPU a host sync,
        # or, where none may wait (a graph), a mask over every sample.
        keep = None
        if config.non_finite == "drop":
            keep = finite_samples(norm_sums) if synced else torch.isfinite(norm_sums).all(1)
        columns = factors[:, len(rows):]
        if columns.shape[1] and not config.per_layer:  # one factor a sample: one tensor for every parameter
            column = dict.fromkeys(sorted(norms), columns[:, 0] if scale == 1.0 else columns[:, 0] * scale)
        else:
            column = dict(zip(sorted(norms), (columns if scale == 1.0 else columns * scale).unbind(1)))
        summed_apart = {}
        for slot, (lost, found) in apart.items():  # those samples' factors 0 in their layers' float32 sums
            lost = lost if keep is None else lost[keep[lost]]
            summed_apart[slot] = tied.clipped_sum(found, column[slot], lost, self.params[slot])
            column[slot] = column[slot].index_fill(0, lost, 0.0)
        # Each sum is allocated as the layer before frees its inputs and output gradients, which
        # it can reuse: one buffer for the whole update, allocated up front, would add a model's
        # size to the peak (69M transformer, B 8: 1061 MiB peak RSS growth against 852).
        for layer in self.layers:
            wanted = {key: column[self._slots[key]] for key in (id(p) for p in layer.parameters)
                      if self._slots[key] in norms}
            if wanted:
                for key, total in layer.clipped_sums(wanted, keep, norm_type).items():
                    slot = self._slots[key]
                    sums[slot] = total if sums[slot] is None else sums[slot].add_(total)
            layer.clear()
        for slot, total in summed_apart.items():
            sums[slot] += total.to(sums[slot].dtype)
        return sums, norm_sums

    def _rows_and_norms(self, batch: int, norm_type: int, synced: bool) -> tuple[dict, dict]:
        """By slot, the per-sample gradients the layers formed and the other parameters' norms
        (a tied parameter's: its layers' added), the ghost norms computed in one kernel call. The
        inputs of those (each layer's a and g) are let go on return: held on through the sums,
        which each layer forms as it frees its own, they added the model's activations to the
        clip's peak (69M transformer, B 8: 1.35x the non-private step's peak RSS, not 1.00x)."""
        rows, terms = {}, {}
        for layer in self.layers:
            rows.update((self._slots[key], r) for key, r in layer.rows(batch).items())
            for key, n in layer.norms(batch, norm_type).items():
                terms.setdefault(self._slots[key], []).append(n)
        return rows, _summed_norms(terms, synced)

    def _clip_norms(self, order: tuple) -> torch.Tensor:
        """The clip kernel's clip norms, float64: per column in ``order`` (parameter slots) for
        per-layer clipping, else the one norm, on the parameters' device. Made once per order and
        device: the layers give the same order every step unless a layer goes unused."""
        config, cached, device = self.config, self._clip_norm_cache, self.params[0].device
        if cached is None or cached[0] != (order, id(config), device):
            norms = list(config.clipping(len(self.params)).norms)
            cached = self._clip_norm_cache = ((order, id(config), device), torch.tensor(
                [norms[s] for s in order] if config.per_layer else norms[:1], dtype=torch.float64, device=device))
        return cached[1]

    def _shared_outputs(self, batch: int, parents: dict) -> list:
        """(layer, call, uses) for the layer calls whose output the batch of ``batch`` shares: run
        on inputs without the batch (GPT-2's position ids (1, T), T5's relative position buckets
        (T, T)), their output only added to, multiplied into or expanded over the batch, each use
        of which will hand its node's output gradient, which has each sample's, to ``uses``
        (:func:`~privleak.dpsgd.graph.shared_output_uses`). Every call is asked, whatever its
        input's dim 0: T5's buckets at T = B look like a batch, and an ordinary layer rule would
        take their rows for samples. A call whose outputs the loss does not use is passed over:
        it has no gradient (DoRA's norm of its weights, computed from an identity matrix, and
        detached). A call without the batch whose output reaches the batch only through such calls
        (:func:`~privleak.dpsgd.graph.shared_region_boundary`: DeBERTa's LayerNorm of its relative
        position embeddings, projected by every layer's Linears) is chained to them
        (``self._chained``): its per-sample output gradients come from theirs, after the backward
        pass (:meth:`_chain_shared`). Raises for a call without the batch whose output is used
        otherwise, or whose layer cannot take a shared input."""
        shared, walked, pending = [], set(), []  # the nodes the walks of selected_tokens have cleared this step
        tables = self._tables()
        for layer in self.layers:
            for call, size in enumerate(layer.batch_sizes()):
                edges = layer.call_edges(call)
                if size == batch == 1 or not any(edge.node in parents for edge in edges):
                    continue  # a batch of one sample (shared and batched are the same), or no gradient
                found = [shared_output_uses(edge, parents, batch, tables) for edge in edges]
                if layer.broadcast_calls and found and all(uses is not None for uses in found):
                    if any(uses.factors_checkpointed() for uses in found):
                        raise ValueError(f"{layer.describe()} has an output that the batch shares, multiplied into "
                                         "the batch inside an activation checkpoint: each sample's gradient of it is "
                                         "read from the product's other factor, which the checkpoint lets be "
                                         "unpacked once, by the product's own backward; multiply it outside the "
                                         "checkpointed function")
                    shared.append((layer, call, found))
                elif (size != batch and layer.flattened_batch_calls and batch and size % batch == 0
                      and flattened_batch(layer.sources[call], size, batch, tables)):
                    layer.unflatten(call, batch)
                elif size != batch and found and all(uses is not None for uses in found):
                    raise ValueError(f"{layer.describe()} ran on inputs of dim 0 {size}, not the batch's {batch}, and "
                                     "its output is shared by the batch (only added to, multiplied into or expanded "
                                     "over it), but its rule takes no shared input: expand that input over the batch "
                                     "(x.expand(B, ...)) for the layer")
                elif size != batch and layer.broadcast_calls and batch == 1 and layer.flattened_batch_calls:
                    layer.unflatten(call, 1)  # the one sample's (the calls bounding a region are its own at B = 1)
                elif size != batch and layer.broadcast_calls:  # chained, if the calls shared above bound its region
                    pending.append((layer, call, size))
                elif size != batch:
                    self._refuse_batch_of(layer, call, size, batch)
                elif selected_tokens(layer.sources[call], batch, walked):
                    raise ValueError(f"{layer.describe()} ran on {size} rows selected from the batch (tokens, as "
                                     "h.flatten(0, 1)[keep], h[keep] with a (B, T) mask or [index] select them): as "
                                     "many as the batch's samples, but not each sample's own in order; give it the "
                                     "batch whole (mask the tokens left out instead)")
                elif any(uses is not None for uses in found):
                    raise ValueError(f"{layer.describe()} ran on inputs of dim 0 {size}, the batch's size, but its "
                                     "output is broadcast over the batch (added to, multiplied into or expanded over "
                                     "it), so they were not the batch's: its per-sample gradients are not its rows; "
                                     "give it inputs with the batch in dim 0, or use its outputs only broadcast")
                elif layer.flattened_output_calls and (flat := flattened_outputs(edges, batch)):
                    layer.unflatten_outputs(call, batch, flat)
                elif layer.broadcast_calls and not layer.flattened_output_calls and \
                        all(may_be_a_table(edge, layer.parameters, tables) for edge in edges):
                    pending.append((layer, call, None))  # a table of B rows in a region: its rows no samples
        boundary: dict = {}
        for layer, call, _ in shared:
            for edge in layer.call_edges(call):
                boundary.setdefault(edge.node, []).append(edge)
        self._chained, bounds = [], {}
        candidates = {edge.node for layer, call, _ in pending for edge in layer.call_edges(call)}
        walk = RegionWalk(parents, boundary, batch, tables, frozenset(
            edge.node for layer in self.layers for call in range(len(layer.calls)) for edge in layer.call_edges(call)
            if edge.node not in candidates))
        for layer, call, size in pending:
            if self._in_a_region([consumers_of(edge, parents) for edge in layer.call_edges(call)], walk, bounds):
                self._chained.append((layer, call))
            elif size is not None and (batch or not all(  # an empty batch has no tiling to tell a region by:
                    edge.node in tables or input_from_parameters(edge, layer.parameters, budget=64)  # a table's
                    for edge in layer.call_edges(call))):
                self._refuse_batch_of(layer, call, size, batch)
        for layer in self._in_region:  # a step that failed before their rows came
            layer.in_region = False
        bounding = {id(layer) for layer, _, _ in shared}  # a shared call's own replay takes its output gradients
        self._in_region = [layer for layer in self.layers if isinstance(layer, FunctionalLayer) and id(layer) not in
                           bounding and self._used_in_region(layer, walk, bounds)]
        self._bounds = list(bounds.values())
        for layer in self._in_region:
            layer.in_region = True  # its broadcast rule's nodes, in the region, hold no batch (a table plus a constant)
        self._shared = frozenset((id(layer), call) for layer, call, _ in shared) | \
            frozenset((id(layer), call) for layer, call in self._chained)
        return shared

    def _tables(self) -> frozenset:
        """The output nodes of the layer calls on a buffer of the model, which holds no batch whatever
        its dim 0 (Swin v2's MLP of its coordinates): tables, as if computed from parameters alone,
        for the walks that tell a region or a flattened batch
        (:func:`~privleak.dpsgd.graph.shared_region_boundary`)."""
        buffers = {b.data_ptr() for b in self._module.buffers() if _has_storage(b)}
        return frozenset(edge.node for layer in self.layers for call, x in enumerate(layer.calls)
                         if isinstance(x, torch.Tensor) and _has_storage(x)
                         and x.data_ptr() in buffers for edge in layer.call_edges(call))

    def _used_in_region(self, layer: FunctionalLayer, walk: RegionWalk, bounds: dict) -> bool:
        """Whether the loss's graph uses ``layer``'s parameters, and only in a region without the
        batch (:func:`~privleak.dpsgd.graph.shared_region_boundary`), that its calls' outputs are
        not in: bounded by the shared calls' outputs, or, for a layer that its broadcast rule does
        not take (it would replay), by ops of the region only broadcast over the batch (``bounds``).
        A module whose own output is in the region (a position table it makes) keeps its rule: the
        walk stops at the layers' outputs (``walk.layers``)."""
        uses = [[node for node, _ in self._consumers[self._slots[id(p)]]] for p in layer.parameters]
        if not any(uses):
            return False
        return self._in_a_region([nodes for nodes in uses if nodes], walk, bounds,
                                 discover=any(call[4] is None for call in layer.calls))

    @staticmethod
    def _in_a_region(starts: list, walk: RegionWalk, bounds: dict, discover: bool = True) -> bool:
        """Whether every tensor taken by the nodes of each list of ``starts`` lies in a region
        without the batch (:func:`~privleak.dpsgd.graph.shared_region_boundary`); the ops found
        bounding it are added to ``bounds`` only then."""
        found = dict(bounds)
        if all(shared_region_boundary(nodes, walk, found, discover) for nodes in starts):
            bounds.update(found)
            return True
        return False

    def _refuse_batch_of(self, layer: Layer, call: int, size: int, batch: int) -> None:
        """Raise for call ``call`` of ``layer``, which ran on inputs of dim 0 ``size``, not the
        batch's ``batch``, and whose output is not one the batch shares."""
        flattened = ""
        if layer.flattened_batch_calls and batch and size % batch == 0:
            flattened = (f"; its dim 0, {size} = {batch} x {size // batch}, is not the batch flattened with its "
                         "positions as far as its autograd graph shows: reshapes of a batch-first tensor, then "
                         "elementwise ops, LayerNorms, Linears, ops on the dims after dim 0 or batched products of "
                         "such tensors (not a sequence-first tensor's, at T = B not one made batch-first by a "
                         "transpose, and not a model input's, which has no graph)")
        raise ValueError(f"per_sample_losses has {batch} samples, but {layer.describe()} saw a batch of {size} in a "
                         "forward pass since the last step, and its output is not one shared by the batch (only "
                         "added to, multiplied into or expanded over it, or through ops on parameters alone into "
                         "layers whose output is) (every layer input must have the batch in dim 0, and step() takes "
                         f"every forward pass since the last step){flattened}")

    def _sample_rows(self, batch: int, shared: list) -> list:
        """(what, gradient edge, a function of its gradient giving it with the samples in dim 0 as
        the step reads them, or None) of each tensor whose rows the step reads as samples: the
        layers' outputs (a packed sequence's padded, attention's output projection's position by
        position), the ops whose output gradients are broadcast parameters' per-sample gradients,
        and those adding a shared output (``shared``: :meth:`_shared_outputs`'s) to the batch."""
        def same(grad: torch.Tensor) -> torch.Tensor:
            return grad

        rows = [(f"the output of {layer.describe()}", edge, functools.partial(layer.batch_first, call, output,
                                                                              batch=batch))
                for layer in self.layers for call in range(len(layer.calls)) if (id(layer), call) not in self._shared
                for output, edge in enumerate(layer.call_edges(call))]
        return rows + [(f"the op {node.name()} using {what}", GradientEdge(node, 0), same)
                       for what, node in self._sample_row_nodes(batch, shared)]

    def _sample_row_nodes(self, batch: int, shared: list = ()) -> list:
        """(what it uses, node) of each op whose output gradient's rows are read as the samples':
        broadcast parameters' (their layers' :meth:`~privleak.dpsgd.layers.Layer.sample_row_nodes`)
        and, of ``shared`` (:meth:`_shared_outputs`'s), the ops adding a shared output to the batch,
        and those broadcasting an op of a region without the batch over it."""
        owners = {id(p): name for name, p in self._module.named_parameters()}
        return [(f"parameter '{owners[id(parameter)]}'", node) for layer in self.layers
                for call in range(len(layer.calls)) for parameter, node in layer.sample_row_nodes(call, batch)] + [
            (f"the output of {layer.describe()}", node) for layer, _, found in shared for uses in found
            for _, node in uses.nodes()] + [
            (f"the output of {edge.node.name()}, computed from parameters alone", node) for edge, uses in self._bounds
            for _, node in uses.nodes()]

    def _call_outputs(self) -> list:
        """(layer, gradient edge, the dim of the batch in it) of each output of the step's calls not
        shared by the batch (:meth:`_shared_outputs`)."""
        return [(layer, edge, dim) for layer in self.layers for call in range(len(layer.calls))
                if (id(layer), call) not in self._shared
                for edge, dim in zip(layer.call_edges(call), layer.batch_dims(call))]

    def _check_order(self, batch: int, parents: dict) -> None:
        """Raise where the loss's graph (``parents``) takes rows that depend on a layer call in
        another order along the batch's dim (:func:`~privleak.dpsgd.graph.reordered_rows`):
        book-keeping reads row i of every layer as sample i, so a layer whose rows were the samples
        in another order than another's, or the losses', would clip the wrong rows together."""
        outputs = {(edge.node, edge.output_nr): (layer, dim) for layer, edge, dim in self._call_outputs()}
        packings = [packing for layer in self.layers for packing in layer.packings()]
        inner = set().union(*(layer.inner_nodes() for layer in self.layers))
        layer = reordered_rows(parents, batch, outputs, packings, inner)
        if layer is not None:
            raise ValueError(f"per_sample_losses: rows computed from the output of {layer.describe()} are taken along "
                             "the batch's dim in another order before the loss (h[order], index_select or gather "
                             "along it, new[order] = h, index_copy or scatter, or rows stacked or concatenated in "
                             "another order: the batch sorted, or put back in order after a sort), but book-keeping "
                             "reads row i of every layer as sample i, and would clip parts of different samples "
                             "together; order the batch before the model, inputs and targets alike (for an RNN, "
                             "pack_padded_sequence(..., enforce_sorted=False) sorts and restores it itself)")

    def _take_shared_grad(self, uses, use: int, grad_outputs: tuple) -> None:
        """A pre-hook on a node using a shared layer output: that use's per-sample gradients."""
        if grad_outputs[0] is not None:
            uses.take(0, use, grad_outputs[0])

    def _check_uses(self, losses: torch.Tensor, parents: dict) -> None:
        """Every use of a trainable parameter in the loss's autograd graph must be one a hooked
        layer recorded in a call whose outputs the graph holds; any other (a parameter used
        outside its module's forward, e.g. ``F.linear(x, other_module.weight)``; the losses of a
        forward pass before the last step, whose uses the calls of another since stood for, a
        review's repro: the noise alone released) would escape clipping. A recorded output that is a
        view changed in place after its call (:func:`~privleak.dpsgd.graph.changed_in_place`; a
        Linear's and an InstanceNorm's are handed on as aliases, :func:`~privleak.dpsgd.graph.unviewed`)
        is refused: the gradient taken at it would miss the uses after the change. The walk fills in
        ``parents``, each node's parents (:func:`~privleak.dpsgd.graph.count_uses`)."""
        self._consumers = [[] for _ in self.params]  # per slot, the (node, input index) of each use in the graph
        used = count_uses([losses.grad_fn], self.params, graph="per_sample_losses", parents=parents,
                          consumers=self._consumers)
        if losses.shape[0] and not any(used):
            raise ValueError("per_sample_losses does not depend on any of the model's trainable parameters (the "
                             "losses of another model, or of outputs detached from it): the step would release the "
                             "noise alone")
        for layer in self.layers:
            for call in range(len(layer.calls)):
                if any(changed_in_place(edge, parents) for edge in layer.call_edges(call)):
                    raise ValueError(f"the output of {layer.describe()} was changed in place after its forward call "
                                     "(`h += x`, an in-place activation), and it is a view of a tensor that its "
                                     "forward made: the change moved the view's autograd history onto that tensor, "
                                     "around the node where book-keeping takes the output's gradient; change a copy, "
                                     "or write `h = h + x`")
        seen = [0] * len(self.params)
        for layer in self.layers:
            for call, uses in enumerate(layer.uses):
                if any(edge.node in parents for edge in layer.call_edges(call)):
                    for p, count in zip(layer.parameters, uses):
                        seen[self._slots[id(p)]] += count
        for slot, (count, recorded) in enumerate(zip(used, seen)):
            if count > recorded:
                owner = self._owner(slot)
                raise ValueError(f"parameter '{owner}' is used {count} time(s) in the graph of per_sample_losses, but "
                                 f"its module's forward calls in that graph recorded {recorded}: it is used where the "
                                 "book-keeping hooks cannot see (outside its module's forward, e.g. functionally or by "
                                 "weight tying; or in a forward pass run before the last step or before BookKeeping "
                                 "was built, whose losses these are); use it through its module, or make that code a "
                                 "module of its own")

    def _check_model(self) -> None:
        """The hooks must still be on the model (not :meth:`remove`-d), and its trainable parameters
        the ones this was built for (its layers' records, the optimizer's groups and the processes'
        agreement are made for them): a parameter frozen or unfrozen since (gradual unfreezing) is
        named, with the way out."""
        if not self._hooks:
            raise ValueError("this BookKeeping was removed (remove() took its hooks off the model); build a new one")
        change = ("the trainable parameters are fixed when BookKeeping is built, as its optimizer's are: to train "
                  "another set, call remove() and build a new BookKeeping with an optimizer of the new set "
                  "(state_dict() and load_state_dict() carry the steps and the noise stream over)")
        if frozen := [slot for slot, p in enumerate(self.params) if not p.requires_grad]:
            raise ValueError(f"parameter '{self._owner(frozen[0])}' was frozen (requires_grad=False) after "
                             f"BookKeeping was built; {change}")
        if unfrozen := [name for name, p in self._module.named_parameters()
                        if p.requires_grad and id(p) not in self._slots]:
            raise ValueError(f"parameter '{unfrozen[0]}' is trainable but was not among the model's trainable "
                             f"parameters when BookKeeping was built (unfrozen, replaced or added since); {change}")

    def _owner(self, slot: int) -> str:
        """The name of the parameter in ``slot``, for messages."""
        return next(name for name, p in self._module.named_parameters() if p is self.params[slot])


def lowest(edges: list, parents: dict) -> list:
    """The gradient edges (of the layers' outputs) with no other of them below: none is reached
    from their node in the autograd graph, whose nodes' parents ``parents`` holds
    (:func:`~privleak.dpsgd.graph.count_uses`). A backward to these passes through every node
    with an edge on the way down, so the tensor hooks of every one of them fire."""
    above: set = set()  # the nodes from which a target is reached: the targets' ancestors
    stack = [parent for node in {edge.node for edge in edges} for parent, _ in parents.get(node, ())]
    while stack:
        node = stack.pop()
        if node not in above:
            above.add(node)
            stack.extend(parent for parent, _ in parents[node])
    return [edge for edge in edges if edge.node not in above]


def _summed_norms(terms: dict, synced: bool) -> dict:
    """Per slot the sum of its layers' norms, the ghost norms given as their inputs computed first,
    all in one kernel call (``synced``: a host read may wait for them)."""
    pending = [n for ns in terms.values() for n in ns if isinstance(n, GhostNormInputs)]
    if pending:
        computed = iter(ghost_norms(pending, clipping=True, may_sync=synced))
        terms = {slot: [next(computed) if isinstance(n, GhostNormInputs) else n for n in ns]
                 for slot, ns in terms.items()}
    return {slot: total(ns) for slot, ns in terms.items()}


#: the BookKeeping whose hooks are on each module, weakly
_HOOKED: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def _remove_hooks(hooks: list, modules: list, owner: weakref.ref) -> None:
    """Take a BookKeeping's hooks off its modules and its marks (at remove(), or once it is collected)."""
    for hook in hooks:
        hook.remove()
    for module in modules:
        if _HOOKED.get(module) is owner:
            del _HOOKED[module]


def _has_storage(x: torch.Tensor) -> bool:
    """Whether ``x`` has storage of its own to compare (not a functorch wrapper or a fake tensor)."""
    try:
        x.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _grad_state(p: torch.Tensor) -> tuple:
    """What tells whether ``p.grad`` was set or added to: its identity and version."""
    return (None, 0) if p.grad is None else (id(p.grad), p.grad._version)


def finite_samples(norm_sums: torch.Tensor) -> Optional[torch.Tensor]:
    """(B,) bool: the samples whose norm sums (B, C) are all finite; None when all are. Norms are
    >= 0, so their total is finite when each is, and then one reduction decides (torch.isfinite
    paged in 1 MiB of libtorch's code, a third of what the paper CNN's whole step does); a total
    that overflowed takes the exact test."""
    if math.isfinite(norm_sums.sum()):
        return None
    finite = torch.isfinite(norm_sums).all(1)
    return None if bool(finite.all()) else finite


def _layers_of(model: nn.Module) -> tuple[list[Layer], dict]:
    """The hooked layers of ``model``, and the tied parameters: by id, the layers sharing each
    trainable parameter that is in more than one (each of which gives its factors)."""
    layers, owners, covered = [], {}, set()
    names = {id(p): name for name, p in model.named_parameters()}
    for name, module in model.named_modules():  # parents before children
        if id(module) in covered:
            continue
        layer = layer_for(name, module)
        if layer is None:
            continue
        covered.update(id(sub) for sub in layer.claimed_modules())
        for p in layer.parameters:
            owners.setdefault(id(p), []).append(layer)
            sharing = owners[id(p)]
            if len(sharing) > 1 and not all(owner.can_tie(p) for owner in sharing):
                raise ValueError(f"parameter '{names[id(p)]}' belongs to modules "
                                 f"{', '.join(repr(o.name) for o in sharing)} (tied weights): book-keeping ties only "
                                 "the weights of nn.Linear, nn.Embedding (and scaled word embeddings) and "
                                 "transformers' Conv1D layers; any other parameter must be in one module")
        layers.append(layer)
    return layers, {key: sharing for key, sharing in owners.items() if len(sharing) > 1}


def check_losses(losses) -> torch.Tensor:
    """``losses`` if they are per-sample losses (a 1-D floating-point tensor), else the error naming
    per_sample_losses; for the eager and the graphed step alike."""
    if not isinstance(losses, torch.Tensor):
        raise validation.ArgumentTypeError(f"per_sample_losses must be a torch tensor, got {type(losses).__name__}")
    if losses.ndim != 1:
        raise ValueError(f"per_sample_losses must be a 1-D tensor of one loss per sample (reduction='none'), got "
                         f"shape {tuple(losses.shape)}")
    if not losses.is_floating_point():
        raise validation.ArgumentTypeError(f"per_sample_losses must be floating point, got {losses.dtype}")
    return losses
