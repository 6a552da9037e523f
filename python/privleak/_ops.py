"""privleak's torch operators (``torch.ops.privleak.*``), all defined through :func:`operator`.

An op is a Python function over tensors that checks nothing the public function has not checked
and calls a native kernel (:mod:`privleak._backend`). Registering it with torch's dispatcher makes
it work under ``torch.compile`` and fake tensors, and every one passes ``torch.library.opcheck``
(tests/test_ops.py). It is registered with the dispatcher's own API (a schema inferred from the
function's type hints, one kernel for the CPU and CUDA alike, a fake kernel) rather than
``torch.library.custom_op``, whose Python wrappers around each call cost 15-50 us on a CPU
against 3 us here (measured on torch 2.13): a DP-SGD step on a small model calls a few such ops,
and their wrappers were a fifth of what book-keeping adds to the step of the paper's CNN.

An op is not differentiable unless it registers a backward (:meth:`Operator.register_autograd`):
its autograd kernel falls through, so its outputs do not require grad, and a backward through one
raises torch's usual error. Ops that mutate an argument bump its version counter, as torch's own
in-place ops do, so autograd notices a tensor it saved being overwritten.
"""
from __future__ import annotations

import inspect
from typing import Callable, Iterable

import torch

_LIBRARY = torch.library.Library("privleak", "DEF")
OPERATORS: dict[str, "Operator"] = {}  #: every privleak op by name, for the tests


class Operator:
    """One op, ``torch.ops.privleak.<name>``; calling this object calls the op."""

    def __init__(self, name: str, function: Callable, mutates_args: Iterable[str], differentiable: bool):
        mutates_args = frozenset(mutates_args)
        self.name, self.qualname = name, f"privleak::{name}"
        _LIBRARY.define(name + torch.library.infer_schema(function, mutates_args=mutates_args))
        kernel = function
        if mutates_args:
            names = list(inspect.signature(function).parameters)
            mutated = [names.index(arg) for arg in sorted(mutates_args)]

            def kernel(*args):
                result = function(*args)
                for index in mutated:
                    torch.autograd.graph.increment_version(args[index])  # a tensor or a list of them
                return result
        _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
        if not differentiable:
            _LIBRARY.impl(name, torch.library.fallthrough_kernel, "Autograd")
        OPERATORS[name] = self

    @property
    def default(self) -> torch._ops.OpOverload:
        return getattr(torch.ops.privleak, self.name).default

    def __call__(self, *args, **kwargs):
        return self.default(*args, **kwargs)

    def register_fake(self, fake: Callable) -> Callable:
        """Decorator: the op's shapes and dtypes without data, for torch.compile's tracing."""
        torch.library.register_fake(self.qualname, fake, lib=_LIBRARY)
        return fake

    def register_autograd(self, backward: Callable, *, setup_context: Callable | None = None) -> None:
        """The op's backward (only for an op defined with ``differentiable=True``)."""
        torch.library.register_autograd(self.qualname, backward, setup_context=setup_context, lib=_LIBRARY)


def operator(name: str, *, mutates_args: Iterable[str] = (), differentiable: bool = False) -> Callable:
    """Decorator: define ``torch.ops.privleak.<name>`` from a function with type hints (as
    ``torch.library.custom_op`` takes them); ``mutates_args`` names the arguments it writes to."""
    def define(function: Callable) -> Operator:
        return Operator(name, function, mutates_args, differentiable)
    return define
