"""Writing results: CSV files, figures and Markdown tables, shared by ``privleak reproduce``,
``privleak estimate`` and ``privleak audit run --out``.

- CSV: :func:`write_csv` writes floats as ``repr`` (they read back exactly) and :func:`read_csv`
  parses every cell back to the int, float or string it was written from.
- Mechanism parameters: a sweep's CSV has one column per parameter name of its mechanisms
  (:func:`parameter_columns`, from the registry's classes), filled by :func:`parameter_cells`
  (nan where a mechanism has no such parameter). Gaussian and VMF give ``noise_multiplier`` and
  ``kappa``, the columns these reports always had.
- Markdown: :func:`number` formats a cell (6 significant digits, ``inf``, ``-`` for nan) and
  :func:`markdown_table` lays out a table.
- Error bars: :func:`standard_error` of a mean, and the words that say so in a legend
  (:data:`STANDARD_ERROR_LEGEND`) and a caption (:func:`standard_error_caption`).
- Figures: :func:`figure` opens one row of axes and saves it (grid, legend, 120 dpi);
  :func:`by_mechanism` groups results by mechanism in the registry's order, and :func:`colour`
  gives each registered mechanism the colour of its place in the registry along matplotlib's
  colour cycle (the noiseless reference is black), so a mechanism keeps its colour in every figure.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import math
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

#: The name a sweep's noiseless reference row (clipping only) goes by.
NOISELESS = "none"


# ----------------------------------------------------------------------------- mechanism columns


def parameter_columns(mechanisms: Iterable[str]) -> tuple:
    """The parameter names of the registered ``mechanisms``, in their order, each once."""
    from privleak.dpsgd import mechanism as registry

    columns: dict = {}
    for name in mechanisms:
        for field in dataclasses.fields(registry.get(name)):
            columns.setdefault(field.name)
    return tuple(columns)


def parameter_cells(noise: Any, columns: Sequence[str]) -> dict:
    """``columns`` filled with the parameters of ``noise`` (a DP-SGD mechanism, or None for the
    noiseless row): nan where it has no such parameter."""
    parameters = {} if noise is None else noise.parameters()
    return {column: float(parameters.get(column, math.nan)) for column in columns}


# ----------------------------------------------------------------------------- CSV


def _cell(value: Any) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, float):  # numpy floats too: repr(np.float64(1.0)) is not '1.0' in numpy 2
        return repr(float(value))
    return value


def write_csv(rows: Sequence[dict], path: str, fields: Sequence[str]) -> None:
    """``rows`` (dicts with the keys ``fields``, in that column order) as CSV, floats as repr."""
    with open(path, "w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=list(fields))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(v) for k, v in row.items()})


def _parse(text: str) -> Any:
    try:
        return int(text, 10)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def read_csv(path: str) -> list:
    """The rows of :func:`write_csv` with their numbers parsed back: a cell written from an int
    reads as that int, one written from a float (its repr has a '.', an exponent, inf or nan) as
    that float, anything else as the string."""
    with open(path, newline="") as stream:
        return [{k: _parse(v) for k, v in row.items()} for row in csv.DictReader(stream)]


# ----------------------------------------------------------------------------- Markdown


def number(value: float) -> str:
    """A Markdown cell: 6 significant digits, ``inf``, ``-`` for nan."""
    return "inf" if value == math.inf else "-" if math.isnan(value) else f"{value:.6g}"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> list:
    """The lines of a Markdown table; float cells through :func:`number`, others through str."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        cells = [number(v) if isinstance(v, float) else str(v) for v in row]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def column_title(name: str) -> str:
    """A CSV column's name as a table header: ``noise_multiplier`` -> ``noise multiplier``."""
    return name.replace("_", " ")


# ----------------------------------------------------------------------------- error bars

#: What a curve's error bars are, for its legend entry.
STANDARD_ERROR_LEGEND = "mean ± standard error"


def standard_error(values: Sequence[float]) -> float:
    """The standard error of the mean of ``values``: s / sqrt(n), s the sample standard deviation
    (n - 1 in its denominator); nan for fewer than two values (no spread to estimate)."""
    values = [float(v) for v in values]
    if len(values) < 2:
        return math.nan
    mean = math.fsum(values) / len(values)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def standard_error_caption(counts: Sequence[int]) -> str:
    """A caption saying the error bars are standard errors over ``counts`` values per point."""
    over = " or ".join(str(n) for n in counts)
    return f"error bars: standard error of the mean over the {over} attacked images of each setting"


# ----------------------------------------------------------------------------- figures


def _registry_names() -> tuple:
    from privleak.dpsgd import mechanism as registry

    return registry.names()


def by_mechanism(items: Iterable, mechanism_of: Callable[[Any], str]) -> list:
    """(mechanism, its items) for every mechanism among ``items``: registered ones in the
    registry's order, then any others in order of appearance; the noiseless row is left out."""
    groups: dict = {}
    for item in items:
        name = mechanism_of(item)
        if name != NOISELESS:
            groups.setdefault(name, []).append(item)
    order = {name: i for i, name in enumerate(_registry_names())}
    return sorted(groups.items(), key=lambda pair: order.get(pair[0], len(order)))


def colour(mechanism: str) -> str:
    """The mechanism's colour: matplotlib's colour cycle at its place in the registry (black for
    the noiseless row)."""
    if mechanism == NOISELESS:
        return "black"
    import matplotlib

    cycle = matplotlib.rcParamsDefault["axes.prop_cycle"].by_key()["color"]
    names = _registry_names()
    place = names.index(mechanism) if mechanism in names else len(names)
    return cycle[place % len(cycle)]


def legend_label(mechanism: str) -> str:
    """A legend label: the registered class's name (``Gaussian``, ``VMF``, ...), ``no noise`` for
    the noiseless row."""
    if mechanism == NOISELESS:
        return "no noise"
    from privleak.dpsgd import mechanism as registry

    return registry.get(mechanism).__name__ if mechanism in registry.names() else mechanism


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(figure, path: str) -> None:
    """Lay out, write at 120 dpi and close ``figure``."""
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot().close(figure)


@contextlib.contextmanager
def figure(path: str, columns: int = 1, *, figsize: tuple = (5.5, 4), legend_fontsize: Optional[float] = None,
           grid: bool = True) -> Iterator[list]:
    """A row of ``columns`` axes to draw on; on leaving, each gets a grid and a legend and the
    figure is written to ``path`` (and closed either way)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, columns, figsize=figsize, squeeze=False)
    try:
        yield list(axes[0])
        for ax in axes[0]:
            if grid:
                ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=legend_fontsize)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def curve(axes, mechanism: str, x: Sequence[float], y: Sequence[float], *, yerr: Any = None, fmt: str = "o-",
          label: Optional[str] = None, **style: Any) -> None:
    """One mechanism's curve in its colour: error bars (capsize 3) when ``yerr`` is given, else
    ``fmt``; labelled :func:`legend_label` unless ``label`` is given."""
    style.setdefault("color", colour(mechanism))
    text = legend_label(mechanism) if label is None else label
    if yerr is not None:
        axes.errorbar(x, y, yerr=yerr, marker="o", capsize=3, label=text, **style)
    else:
        axes.plot(x, y, fmt, label=text, **style)
