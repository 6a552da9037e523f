"""Children whose parameters a module's own code reads, outside the children's forwards.

A state-space or linear-attention mixer (transformers' Mamba, Mamba-2, Jamba, Bamba, Falcon-H1,
Nemotron-H, Qwen3-Next and Qwen3.5's gated delta net, Kimi-Linear's delta attention) holds an
``nn.Conv1d`` and often an ``nn.Linear`` it never calls: it passes ``self.conv1d.weight`` to a
causal convolution of its own (``self.conv1d.weight.squeeze(1)``) and multiplies by
``self.dt_proj.weight``. Those uses run in no hooked forward, so the children's rules cannot see
them, and the fallback that replays the mixer (for its own ``A_log`` and ``D`` where it has
them; :class:`~privleak.dpsgd.layers.FunctionalLayer`) answers for them instead. This module
names the candidates, each child whose parameter the class's
source reads as ``self.<child>...<parameter>``; the module's first call with grad then shows
which of them its graph uses outside the calls their layers recorded (``BookKeeping._settle``),
and only those are claimed: a read on a path the forward does not take (a CUDA kernel's, CLIP's
interpolation of its position embedding) leaves the child its own rule, and a module without
parameters of its own that reads none (T5's feed-forward block, which tests its output layer's
weight's type) loses its layer. A read the source does
not show (through ``getattr``, or a function handed the module) is refused at the step, as any
use the hooks cannot see. A child's method other than ``forward`` that the module calls
(``self.position_embeddings._forward(ids)``, ProphetNet's) runs without the child's hooks too, and
names a candidate the same way.
"""
from __future__ import annotations

import functools
import inspect
import re

from torch import nn
from torch.nn.utils import parametrize

#: attributes of a parameter that read its metadata, not its values: no use in the autograd graph
_METADATA = frozenset({"dtype", "device", "shape", "ndim", "size", "numel", "dim", "requires_grad", "is_cuda",
                       "is_meta", "data", "grad", "data_ptr", "nbytes", "element_size", "stride", "is_contiguous",
                       "is_floating_point", "layout"})
_CHAIN = re.compile(r"\bself((?:\s*\.\s*[A-Za-z_]\w*)+)(\s+is\b|\s*=(?!=))?")
_TIED = re.compile(r"\bself(?:\s*\.\s*\w+)+\s*=\s*$")  # a line so far that ties an attribute: ``self.a.weight =``


def children_read_directly(module: nn.Module) -> list[str]:
    """The names of ``module``'s children holding a parameter (theirs or a descendant's) that a
    method of the module's class reads as ``self.<child>....<parameter>``, other than for its
    metadata (``.dtype``, ``.shape``, ...), a test for None, an assignment to it or a tie
    (``self.head.weight = self.embed.weight``); or whose method other than ``forward`` (and
    nn.Module's own) it names, ``self.<child>....<method>``, which runs without the hooks
    (ProphetNet's decoder calls its position embedding's ``_forward``). In their order in the
    module."""
    read = set()
    for chain, only_named in _chains(type(module)):
        owner, child = module, None
        for k, part in enumerate(chain):
            if part in owner._modules and owner._modules[part] is not None:
                owner = owner._modules[part]
                child = child or part
                continue
            if child is None or only_named:
                break
            if part in owner._parameters or parametrize.is_parametrized(owner, part):
                if k + 1 == len(chain) or chain[k + 1] not in _METADATA:
                    read.add(child)
            elif part != "forward" and not hasattr(nn.Module, part) and callable(getattr(type(owner), part, None)):
                read.add(child)
            break
    return [name for name in module._modules if name in read]


@functools.lru_cache(maxsize=None)
def _chains(cls: type) -> tuple:
    """Each ``self.a.b...`` attribute chain in the source of ``cls`` and of its bases up to
    nn.Module's (torch's own classes read only their own parameters), with whether it is only
    named (``is`` or ``=`` follows it, or it is the whole value tied to another attribute); none
    where the source cannot be read (a class made at run time)."""
    chains = set()
    for base in cls.__mro__:
        if base.__module__.startswith("torch.") or base is object:
            continue
        try:
            source = inspect.getsource(base)
        except (OSError, TypeError):
            continue
        for match in _CHAIN.finditer(source):
            parts = tuple(part.strip() for part in match.group(1).split(".") if part.strip())
            line_start, line_end = source.rfind("\n", 0, match.start()) + 1, source.find("\n", match.end())
            tied = (_TIED.search(source, line_start, match.start()) is not None
                    and not source[match.end():line_end if line_end >= 0 else None].strip())
            chains.add((parts, match.group(2) is not None or tied))
    return tuple(sorted(chains))
