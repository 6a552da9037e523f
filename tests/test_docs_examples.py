"""The Python examples of README.md and docs/*.md run as written, and the values their comments
quote are what they compute.

Each page's blocks run in order in one namespace (a block may use what an earlier one defined),
seeded with the small stand-ins the examples leave to the reader: a model, a batch, a loss, a
gradient. A line ``expression  # 7432.2`` (a number first in its comment) must evaluate to that
number to the digits shown. The blocks in NOT_RUN are fragments of other programs or need
what a test machine has not; each names the test that runs its code.
"""
import ast
import math
import re
from pathlib import Path

import numpy as np
import privleak
import pytest
import torch
import torch.nn.functional as F
from privleak import dpsgd, fl
from privleak.models import PaperNetwork
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: (page, block number from 1): why it does not run here, and where its code is tested.
NOT_RUN = {
    ("README.md", 4): "processes of torch.distributed (tests/test_bookkeeping_distributed.py)",
    ("README.md", 5): "a CUDA graph, on a GPU (tests/test_graphed_step.py)",
    ("capacity.md", 2): "10^9 exponents, 5 s on 2 cores (tests/test_estimator.py)",
    ("federated.md", 2): "Flower's simulation, tens of seconds (tests/test_flower.py)",
    ("federated.md", 4): "a record a deployed run wrote (tests/test_flower_deployment.py)",
    ("federated.md", 5): "two files of a Flower App, with the user's attack and data (tests/test_flower.py)",
    ("reproduce.md", 1): "MNIST and 1500 attack iterations, minutes (tests/test_reproduce.py, smaller)",
}


def blocks(page: Path) -> list:
    """(number, first line, code) of each ```python block of ``page``."""
    found, lines, start = [], page.read_text().splitlines(), None
    for i, line in enumerate(lines):
        if start is None and line.strip() == "```python":
            start = i + 1
        elif start is not None and line.strip() == "```":
            found.append((len(found) + 1, start + 1, "\n".join(lines[start:i])))
            start = None
    return found


def stand_ins(tmp_path: Path) -> dict:
    """What the examples take as given: a small classifier and its batch, and the like."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 3))  # 1347 weights
    x, y = torch.randn(64, 16), torch.randint(0, 3, (64,))
    clients = fl.split_among_clients(torch.rand(8, 1, 8, 8), torch.randint(0, 10, (8,)), 2, 4)
    federation = fl.run(PaperNetwork((1, 8, 8)), clients, dpsgd.DPSGDConfig(1.0, noise_multiplier=1.0), rounds=1,
                        batch_size=2)
    return dict(torch=torch, nn=nn, F=F, np=np, privleak=privleak, model=model, net=model, x=x, y=y, inputs=x,
                targets=y, loss_fn=nn.CrossEntropyLoss(reduction="sum"), grad=torch.randn(10), c=1.0, sigma=1.1,
                L=64, batches=[torch.arange(0, 20), torch.arange(20, 20), torch.arange(30, 64)],
                queries=torch.randn(100, 16), scores=np.random.default_rng(2).normal(size=200),
                included=np.arange(200) % 2 == 0, federation=federation, path=tmp_path / "checkpoint.pt")


_NUMBER = r"-?\d+(?:\.(?P<frac>\d+))?(?P<cut>\.\.\.)?"


def _tolerance(match: re.Match) -> float:
    """Half a unit of the last digit shown; a whole unit where the digits end in "..." (cut, not rounded)."""
    unit = 10.0 ** -len(match["frac"] or "")
    return unit if match["cut"] else unit / 2


def _is_expression(text: str) -> bool:
    try:
        ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        return False  # a statement (an assignment), not a value
    return True


def quoted_values(code: str) -> list:
    """(line, expression, value, tolerance) of each value an example's comments quote: a line
    ``expression  # number ...``, or a comment line ``# Name(field=number..., ...)`` after an
    expression line (the expression's fields, "expression.field")."""
    found, lines = [], code.splitlines()
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("#"):
            fields = re.fullmatch(r"\s*#\s*\w+\((.*)\)\s*", line)
            previous = lines[number - 2] if number > 1 else ""
            if fields and _is_expression(previous.split("#")[0]):
                for field in re.finditer(rf"(?P<name>\w+)=(?P<value>{_NUMBER})", fields[1]):
                    value = re.fullmatch(_NUMBER, field["value"])
                    found.append((number, f"({previous.split('#')[0].strip()}).{field['name']}",
                                  float(field["value"].rstrip(".")), _tolerance(value)))
            continue
        match = re.match(rf"^(?P<expr>[^#]+?)\s+#\s*(?P<value>{_NUMBER})(?![\w.])", line)
        if match and _is_expression(match["expr"]):
            found.append((number, match["expr"], float(match["value"].rstrip(".")), _tolerance(match)))
    return found


CASES = [pytest.param(page, id=page.name) for page in PAGES
         if any((page.name, number) not in NOT_RUN for number, _, _ in blocks(page))]


def test_the_blocks_left_out_are_blocks_of_the_pages():
    """NOT_RUN names blocks that exist (a page edited under it would leave a block unrun unseen)."""
    pages = {page.name: len(blocks(page)) for page in PAGES}
    assert all(number <= pages.get(name, 0) for name, number in NOT_RUN)


def run(name: str, page_blocks: list, namespace: dict) -> int:
    """Runs the blocks of page ``name`` not in NOT_RUN in ``namespace``, checking the values their
    comments quote; returns how many ran."""
    ran = 0
    for number, line, code in page_blocks:
        if (name, number) in NOT_RUN:
            continue
        exec(compile(code, f"{name}:{line}", "exec"), namespace)
        for offset, expression, value, tolerance in quoted_values(code):
            computed = float(eval(expression, namespace))
            assert math.isclose(computed, value, abs_tol=tolerance), (
                f"{name}:{line + offset - 1}: {expression} is {computed}, the page says {value}")
        ran += 1
    return ran


@pytest.mark.parametrize("page", CASES)
def test_the_examples_of_a_page_run_and_compute_what_they_quote(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write (an App's folder) write here
    assert run(page.name, blocks(page), stand_ins(tmp_path))


@pytest.mark.parametrize("code", [
    "import math\nmath.pi * 1000  # 3141.6",
    "import math\nmath.pi * 1000  # 3141.5...",
    "from fractions import Fraction\nFraction(7, 4)\n# Fraction(numerator=7, denominator=5)",
], ids=["rounded", "cut", "fields"])
def test_a_value_a_page_misquotes_fails(code):
    """The check reads each form of quoted value (3141.59 rounded to 3141.6 and cut to 3141.5
    pass; the quotes above are one digit off, or a field off)."""
    with pytest.raises(AssertionError, match="the page says"):
        run("page.md", [(1, 1, code.replace("3141.6", "3141.7").replace("3141.5...", "3141.4..."))], {})
    if "Fraction" not in code:
        run("page.md", [(1, 1, code)], {})
