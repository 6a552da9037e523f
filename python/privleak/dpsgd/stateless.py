"""A module's forward with other tensors in place of its parameters and buffers."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn


def functional_call(module: nn.Module, tensors: Any, args: Any, kwargs: Optional[dict] = None) -> Any:
    """``torch.func.functional_call(module, tensors, args, kwargs)``, every parameter and buffer of
    ``module`` put back after the call as it was before. torch swaps a tied parameter in under
    each of its names, and restores them in turn: a submodule registered under two names (``self.a``
    and ``self.blocks[0]``, the same module) has its slot swapped twice and is left holding the
    tensor swapped in, a plain tensor no optimizer trains (pytorch/pytorch#164759, open in torch
    2.13)."""
    slots = [(store, name, tensor) for m in module.modules() for store in (m._parameters, m._buffers)
             for name, tensor in store.items()]
    try:
        return torch.func.functional_call(module, tensors, args, kwargs)
    finally:
        for store, name, tensor in slots:
            store[name] = tensor
