"""privleak.report: the CSV reads back as written, the Markdown tables hold the CSV's numbers, the
parameter columns come from the registry, and the figures use one colour per registered mechanism."""
import csv
import math

import numpy as np
import pytest
from privleak import dpsgd, report

ROWS = [
    {"mechanism": "none", "epsilon": math.inf, "noise_multiplier": math.nan, "kappa": math.nan, "client": 0,
     "mse": 0.0123456789012345},
    {"mechanism": "gaussian", "epsilon": 10.0, "noise_multiplier": 0.9997772394180168, "kappa": math.nan, "client": 1,
     "mse": np.float64(1e-300)},
    {"mechanism": "vmf", "epsilon": 173.0, "noise_multiplier": math.nan, "kappa": 86.5, "client": 2,
     "mse": -2.5e17},
]
FIELDS = ("mechanism", "epsilon", "noise_multiplier", "kappa", "client", "mse")


def _same(got, expected):
    if isinstance(expected, float) and math.isnan(expected):
        return isinstance(got, float) and math.isnan(got)
    return got == expected and type(got) is type(expected if not isinstance(expected, np.floating) else 0.0)


def test_csv_reads_back_equal_to_the_rows(tmp_path):
    path = str(tmp_path / "rows.csv")
    report.write_csv(ROWS, path, FIELDS)
    back = report.read_csv(path)
    assert [tuple(row) for row in back] == [FIELDS] * len(ROWS)
    for got, row in zip(back, ROWS, strict=True):
        for key in FIELDS:
            assert _same(got[key], row[key]), (key, got[key], row[key])
    with open(path, newline="") as stream:
        assert next(csv.reader(stream)) == list(FIELDS)


def test_csv_columns_follow_fields_not_the_rows_order(tmp_path):
    path = str(tmp_path / "rows.csv")
    report.write_csv([dict(reversed(list(ROWS[1].items())))], path, FIELDS)
    assert tuple(report.read_csv(path)[0]) == FIELDS


def _table(lines):
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert lines[1] == "|" + "---|" * len(header)
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in lines[2:]]


def test_markdown_numbers_are_the_csvs(tmp_path):
    path = str(tmp_path / "rows.csv")
    report.write_csv(ROWS, path, FIELDS)
    back = report.read_csv(path)
    headers = ["mechanism", *(report.column_title(f) for f in FIELDS[1:])]
    table = _table(report.markdown_table(headers, ([r[f] for f in FIELDS] for r in back)))
    assert len(table) == len(back)
    for cells, row in zip(table, back, strict=True):
        assert cells["mechanism"] == row["mechanism"] and int(cells["client"]) == row["client"]
        for key in ("epsilon", "noise_multiplier", "kappa", "mse"):
            cell, value = cells[report.column_title(key)], row[key]
            if math.isnan(value):
                assert cell == "-"
            else:
                assert float(cell) == pytest.approx(value, rel=5e-6)  # 6 significant digits
    assert report.number(math.inf) == "inf" and report.number(math.nan) == "-" and report.number(1 / 3) == "0.333333"


def test_parameter_columns_come_from_the_registry():
    names = dpsgd.mechanism.names()
    columns = report.parameter_columns(names)
    assert len(columns) == len(set(columns))
    for name in names:
        noise = dpsgd.mechanism.get(name).calibrate(1.0, 1e-5)
        cells = report.parameter_cells(noise, columns)
        assert set(cells) == set(columns)
        for column in columns:
            if column in noise.parameters():
                assert cells[column] == noise.parameters()[column]
            else:
                assert math.isnan(cells[column])
    assert report.parameter_columns(("gaussian", "vmf")) == ("noise_multiplier", "kappa")
    assert all(math.isnan(v) for v in report.parameter_cells(None, columns).values())


def test_each_registered_mechanism_has_its_own_colour_in_registry_order():
    import matplotlib

    cycle = matplotlib.rcParamsDefault["axes.prop_cycle"].by_key()["color"]
    names = dpsgd.mechanism.names()
    assert [report.colour(n) for n in names] == [cycle[i % len(cycle)] for i in range(len(names))]
    assert report.colour(report.NOISELESS) == "black"
    assert [report.legend_label(n) for n in names] == [dpsgd.mechanism.get(n).__name__ for n in names]
    groups = report.by_mechanism(["vmf", "none", "gaussian", "vmf"], lambda m: m)
    assert [name for name, _ in groups] == [n for n in names if n in ("gaussian", "vmf")]


def test_figure_writes_a_png_with_one_curve_per_mechanism(tmp_path):
    path = tmp_path / "figure.png"
    with report.figure(str(path)) as (axes,):
        for name in dpsgd.mechanism.names():
            report.curve(axes, name, [1.0, 10.0], [0.5, 0.25], yerr=[0.1, 0.1])
        axes.set_xscale("log")
        lines = axes.get_legend_handles_labels()[1]
    assert lines == [report.legend_label(n) for n in dpsgd.mechanism.names()]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_standard_error_is_scipys_sem():
    from scipy.stats import sem

    generator = np.random.default_rng(3)
    for n in (2, 3, 8, 100):
        values = generator.normal(0.3, 0.1, n)
        assert report.standard_error(values) == pytest.approx(float(sem(values)), rel=1e-12)
        assert report.standard_error(list(values)) == pytest.approx(np.std(values, ddof=1) / math.sqrt(n), rel=1e-12)
    assert report.standard_error([0.25] * 5) == 0.0
    assert math.isnan(report.standard_error([0.5])) and math.isnan(report.standard_error([]))
    assert report.standard_error_caption([8]) == \
        "error bars: standard error of the mean over the 8 attacked images of each setting"
    assert "standard error" in report.STANDARD_ERROR_LEGEND
