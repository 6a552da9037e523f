"""privleak.audit.report and ``privleak audit run --out``: the sweep report's three files agree
with each other and with the rows, the capacity column is capacity.dpsgd_gaussian of the run, and
the CLI refuses bad --epsilons / --out with one line naming the option."""
from __future__ import annotations

import csv
import math
import os

import pytest
from privleak import accounting, capacity
from privleak.audit import one_run as O
from privleak.audit import report

SMALL = {"steps": 2, "canaries": 60, "images": 30}
NUMBERS = ("epsilon", "epsilon_claimed", "delta", "confidence", "lower_bound", "fraction", "noise_multiplier",
           "kappa", "log_capacity", "log2_capacity", "seconds")
INTEGERS = ("guesses", "correct", "canaries", "included", "steps", "images", "seed")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    calls = []
    rows = report.audit_sweep("gaussian", [1.0, 20.0], progress=lambda *a: calls.append(a), **SMALL)
    out = tmp_path_factory.mktemp("audit") / "new" / "report"
    return rows, report.write_audit_report(rows, str(out)), calls


def _read_csv(path):
    with open(path, newline="") as stream:
        return [{k: float(v) if k in NUMBERS else int(v) if k in INTEGERS else v for k, v in row.items()}
                for row in csv.DictReader(stream)]


def _markdown_table(path):
    lines = open(path).read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| mechanism |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    table = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        table.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")))))
    return table


def test_sweep_writes_three_files_that_agree(sweep):
    rows, paths, calls = sweep
    assert set(paths) == {"audit.csv", "lower_bound_vs_epsilon.png", "audit.md"}
    for path in paths.values():
        assert os.path.getsize(path) > 0
    assert open(paths["lower_bound_vs_epsilon.png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert calls == [("one-run audits", 1, 2), ("one-run audits", 2, 2)]
    assert [r["epsilon"] for r in rows] == [1.0, 20.0]
    parsed = _read_csv(paths["audit.csv"])
    assert tuple(parsed[0]) == report.CSV_FIELDS
    for got, row in zip(parsed, rows, strict=True):
        for key in report.CSV_FIELDS:
            if isinstance(row[key], float) and math.isnan(row[key]):
                assert math.isnan(got[key]), key
            else:
                assert got[key] == row[key], key  # floats as repr: exact
    table = _markdown_table(paths["audit.md"])
    columns = {"claimed epsilon": "epsilon_claimed", "delta": "delta", "lower bound": "lower_bound",
               "fraction of claim": "fraction", "confidence": "confidence", "noise multiplier": "noise_multiplier",
               "log capacity (nats)": "log_capacity", "log2 capacity (bits)": "log2_capacity"}
    for cells, row in zip(table, parsed, strict=True):
        assert cells["mechanism"] == row["mechanism"] and cells["kappa"] == "-"
        for name in ("correct", "guesses", "canaries", "included", "steps"):
            assert int(cells[name]) == row[name]
        for name, key in columns.items():
            assert float(cells[name]) == pytest.approx(row[key], rel=1e-5), name  # 6 significant digits


def test_rows_are_the_audits_and_the_capacity_is_recomputed(sweep):
    rows, _, _ = sweep
    for row in rows:
        audit = O.audit_digits("gaussian", row["epsilon"], **SMALL)
        assert (row["lower_bound"], row["correct"], row["guesses"], row["included"]) == \
            (audit.epsilon_lower, audit.correct, audit.guesses, audit.included)
        assert row["epsilon_claimed"] == audit.epsilon_claimed == pytest.approx(row["epsilon"], rel=1e-9)
        assert 0.0 <= row["lower_bound"] <= row["epsilon_claimed"]
        assert row["fraction"] == row["lower_bound"] / row["epsilon_claimed"]
        sigma = accounting.analytic_gaussian_noise_multiplier(row["epsilon"], 1e-5) * math.sqrt(SMALL["steps"])
        assert row["noise_multiplier"] == pytest.approx(sigma, rel=1e-12)
        expected = capacity.dpsgd_gaussian(7850, 1.0, sigma, SMALL["images"] + audit.included).log_capacity()
        assert row["log_capacity"] == pytest.approx(expected.log, rel=1e-9)
        assert row["log2_capacity"] == pytest.approx(expected.bits, rel=1e-9)
    # less noise per update, more capacity
    assert rows[1]["log_capacity"] > rows[0]["log_capacity"]


def test_vmf_and_paper_cnn_rows():
    (row,) = report.audit_sweep(["vmf"], [4.0], steps=1, canaries=20, images=5, model="paper-cnn")
    assert row["model"] == "paper-cnn" and row["delta"] == 0.0 and math.isnan(row["noise_multiplier"])
    assert row["kappa"] == 2.0
    assert row["log_capacity"] == pytest.approx(capacity.dpsgd_vmf(13426, 2.0).log_capacity().log, rel=1e-12)
    with pytest.raises(ValueError, match="model"):
        report.audit_sweep("gaussian", [1.0], model="resnet")


def test_a_laplace_row_fills_the_shared_parameter_column(tmp_path):
    from privleak import dpsgd

    rows = report.audit_sweep(["vmf", "laplace"], [4.0], steps=2, canaries=20, images=5)
    assert [r["mechanism"] for r in rows] == ["vmf", "laplace"] and [r["delta"] for r in rows] == [0.0, 0.0]
    laplace = rows[1]
    assert laplace["noise_multiplier"] == pytest.approx(2 / 4.0, rel=1e-12) and math.isnan(laplace["kappa"])
    config = dpsgd.DPSGDConfig(1.0, "laplace", noise_multiplier=laplace["noise_multiplier"])
    expected = config.mechanism.log_capacity([7850], config.clipping(1), 5 + laplace["included"])
    assert laplace["log_capacity"] == pytest.approx(expected.log, rel=1e-12)
    paths = report.write_audit_report(rows, str(tmp_path))
    assert tuple(_read_csv(paths["audit.csv"])[0]) == report.csv_fields(["vmf", "laplace"]) == report.CSV_FIELDS
    assert [cells["noise multiplier"] for cells in _markdown_table(paths["audit.md"])] == ["-", "0.5"]


def test_cli_out_writes_the_report(tmp_path, capsys):
    from privleak import cli

    out = tmp_path / "made" / "here"
    assert cli.main(["audit", "run", "--mechanism", "gaussian", "--epsilons", "2", "8", "--steps", "2",
                     "--canaries", "60", "--images", "30", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert sorted(os.listdir(out)) == ["audit.csv", "audit.md", "lower_bound_vs_epsilon.png"]
    assert printed.out.split() == [str(out / name) for name in ("audit.csv", "lower_bound_vs_epsilon.png",
                                                                "audit.md")]
    assert "one-run audits" in printed.err  # the progress bar
    assert [r["epsilon"] for r in _read_csv(out / "audit.csv")] == [2.0, 8.0]


def test_cli_single_run_prints_the_capacity(capsys):
    import json

    from privleak import cli

    argv = ["audit", "run", "--mechanism", "gaussian", "--epsilon", "4", "--steps", "2", "--canaries", "60",
            "--images", "30"]
    assert cli.main(argv) == 0
    text = capsys.readouterr()
    assert "Bayes capacity       log " in text.out and text.err == ""
    assert cli.main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    sigma = accounting.analytic_gaussian_noise_multiplier(4.0, 1e-5) * math.sqrt(2)  # 2 steps: sigma / sqrt(2)
    expected = capacity.dpsgd_gaussian(7850, 1.0, sigma, 30 + result["included"]).log_capacity()
    assert result["log_capacity"] == pytest.approx(expected.log, rel=1e-12)
    assert result["log2_capacity"] == pytest.approx(expected.bits, rel=1e-12)


@pytest.mark.parametrize("argv, named", [
    (["--epsilons"], "--epsilons"),
    (["--epsilons", "1", "nan"], "--epsilons"),
    (["--epsilons", "0"], "--epsilons"),
    (["--epsilons", "-1", "2"], "--epsilons"),
    (["--epsilons", "1", "1"], "--epsilons"),
    (["--epsilons", "1", "--epsilon", "2"], "--epsilon"),
    (["--epsilon", "1", "--out", ""], "--out"),
    (["--epsilons", "1", "2", "--out", "FILE"], "--out"),
    (["--epsilons", "1", "--out", "FILE/below"], "--out"),
    (["--epsilon", "1", "--model", "resnet"], "--model"),
    (["--epsilon", "1", "--model", "paper-cnn", "--canaries", "13427"], "--canaries"),
])
def test_cli_refuses_bad_sweeps(tmp_path, capsys, monkeypatch, argv, named):
    from privleak import cli

    path = tmp_path / "a-file"
    path.write_text("")
    argv = [str(path) if a == "FILE" else str(path) + "/below" if a == "FILE/below" else a for a in argv]
    monkeypatch.setattr(O, "audit_digits", lambda *a, **k: pytest.fail("the run started"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["audit", "run", "--mechanism", "gaussian", *argv])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and f"argument {named}" in error[0], error


def test_cli_paper_cnn_takes_more_canaries(capsys, monkeypatch):
    from privleak import cli

    seen = {}

    def fake(*args, **kwargs):
        seen.update(kwargs)
        raise SystemExit(0)

    monkeypatch.setattr(O, "audit_digits", fake)
    with pytest.raises(SystemExit):
        cli.main(["audit", "run", "--mechanism", "gaussian", "--epsilon", "1", "--model", "paper-cnn",
                  "--canaries", "13426"])
    assert seen["model"] == "paper-cnn" and seen["canaries"] == 13426
