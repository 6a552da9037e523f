"""The type stubs _core.pyi and _cuda.pyi describe the compiled modules as they are.

pybind11 writes each function's signature as the first line of its docstring; the stub must have
the same functions, with the same parameter names in the same order and the same defaults.
"""
import ast
import importlib
import re
from pathlib import Path

import privleak
import pytest

STUBS = Path(privleak.__file__).parent


def _stub_signatures(module: str) -> dict[str, list[tuple[str, bool]]]:
    tree = ast.parse((STUBS / f"{module}.pyi").read_text())
    signatures = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            args = node.args.args
            first_default = len(args) - len(node.args.defaults)
            signatures[node.name] = [(a.arg, i >= first_default) for i, a in enumerate(args)]
    return signatures


def _split_top_level(parameters: str) -> list[str]:
    """Split "a: T[x, y], b: U = 1" at the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for char in parameters:
        depth += char in "[(" and 1 or (char in "])" and -1 or 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [p.strip() for p in parts + [current] if p.strip()]


def _compiled_signatures(module) -> dict[str, list[tuple[str, bool]]]:
    signatures = {}
    for name in dir(module):
        function = getattr(module, name)
        if name.startswith("_") or not callable(function):
            continue
        first_line = (function.__doc__ or "").splitlines()[0]
        match = re.fullmatch(rf"{name}\((.*)\) -> .*", first_line)
        assert match, f"{module.__name__}.{name} has no pybind11 signature line: {first_line!r}"
        signatures[name] = [(p.split(":")[0].strip(), "=" in p) for p in _split_top_level(match.group(1))]
    return signatures


@pytest.mark.parametrize("module_name", ["_core", "_cuda"])
def test_the_stub_matches_the_compiled_module(module_name):
    try:
        module = importlib.import_module(f"privleak.{module_name}")
    except ImportError:
        if module_name == "_cuda":
            pytest.skip("privleak was built without CUDA (no nvcc at build time): nothing to compare the stub with")
        raise
    compiled, stub = _compiled_signatures(module), _stub_signatures(module_name)
    assert sorted(compiled) == sorted(stub), "functions differ between the module and its stub"
    for name, parameters in compiled.items():
        assert stub[name] == parameters, f"{module_name}.{name}: stub {stub[name]} vs compiled {parameters}"
        assert not any(p.startswith("arg") and p[3:].isdigit() for p, _ in parameters), \
            f"{module_name}.{name} has unnamed parameters: give them py::arg names"
