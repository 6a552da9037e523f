"""Issue 16, the command line: every option of every subcommand is checked before any work starts.

A bad value must end ``privleak.cli.main`` with exit status 2 and one line on stderr that names
the option, without training, loading data or creating the output folder (the entry points are
replaced by functions that fail the test). Valid edge values must still parse.
"""
import gzip
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from privleak import cli, datasets, dpsgd, estimation, reproduce


class Reached(Exception):
    """Raised by the stubbed entry points of a command line that parsed."""

    def __init__(self, experiment):
        super().__init__("reached")
        self.experiment = experiment


def _fail(*args, **kwargs):
    pytest.fail("work started for a command line that should have been refused")


@pytest.fixture
def no_work(monkeypatch):
    """Any training, data loading or writing fails the test."""
    for module, name in ((reproduce, "run"), (reproduce, "write_outputs"), (reproduce, "train_and_collect"),
                         (estimation, "run"), (estimation, "write_outputs"), (datasets, "load"),
                         (datasets, "load_idx"), (datasets, "read_idx")):
        monkeypatch.setattr(module, name, _fail)


@pytest.fixture
def reach(monkeypatch):
    """The run functions raise Reached(experiment): the command line parsed and was accepted."""

    def stop(experiment, progress=None):
        raise Reached(experiment)

    monkeypatch.setattr(reproduce, "run", stop)
    monkeypatch.setattr(estimation, "run", stop)
    for module, name in ((datasets, "load"), (datasets, "load_idx"), (datasets, "read_idx")):
        monkeypatch.setattr(module, name, _fail)


def _write_idx(folder, count, side=4, gz=False, labels=None, magic_images=b"\x00\x00\x08\x03"):
    """Small MNIST-layout IDX files (train split) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    labels = count if labels is None else labels
    sizes = b"".join(int(v).to_bytes(4, "big") for v in (count, side, side))
    images = magic_images + sizes + bytes(count * side * side)
    label_bytes = b"\x00\x00\x08\x01" + labels.to_bytes(4, "big") + bytes(np.arange(labels, dtype=np.uint8) % 10)
    opener = gzip.open if gz else open
    suffix = ".gz" if gz else ""
    with opener(folder / f"train-images-idx3-ubyte{suffix}", "wb") as stream:
        stream.write(images)
    with opener(folder / f"train-labels-idx1-ubyte{suffix}", "wb") as stream:
        stream.write(label_bytes)
    return folder


# Bad values every option of reproduce and estimate shares, as (extra argv, option named).
SHARED = [
    (["--dataset", "/nonexistent"], "--dataset"),
    (["--dataset", ""], "--dataset"),
    (["--dataset", "mnist"], "--dataset"),
    (["--dataset"], "--dataset"),
    *[(["--epsilons", *v], "--epsilons") for v in (["0"], ["-1"], ["nan"], ["inf"], ["-inf"], ["1e999"], ["abc"], [""],
                                                   ["10", "nan"], ["1e3", "1000"], [])],
    *[(["--mechanisms", *v], "--mechanisms") for v in (["no-such"], ["vmf", "vmf"], ["Gaussian"], [])],
    *[(["--iterations", v], "--iterations") for v in ("0", "-1", "1.5", "nan", "1e3", "abc", "")],
    *[(["--seed", v], "--seed") for v in ("-1", str(2 ** 63), str(2 ** 64), str(2 ** 70), "2**70", "1.5", "nan", "",
                                          "-1e3")],
    (["--seed"], "--seed"),
    (["--quiet=yes"], "--quiet"),
]

REPRODUCE = [
    *[(["--delta", v], "--delta") for v in ("0", "1", "-1e-5", "2", "nan", "inf", "-inf", "abc", "")],
    *[(["--clients", v], "--clients") for v in ("0", "-3", "1.5", "nan", "313")],
    (["--clients", "157", "--paper-scale"], "--clients"),  # 157 x 32 > 5000
    (["--clients", "113", "--dataset", "sklearn-digits"], "--clients"),  # 113 x 16 > 1797
    *[(["--rounds", v], "--rounds") for v in ("0", "-1", "2.0", "x")],
    *[(["--restarts", v], "--restarts") for v in ("0", "-2", "nan")],
    *[(["--grid-epsilons", *v], "--grid-epsilons") for v in (["nan"], ["0"], ["-1"], ["inf"], ["173", "173"], [])],
    (["--paper-scale=1"], "--paper-scale"),
]

ESTIMATE = [
    *[(["--images", v], "--images") for v in ("1", "0", "-1", "2.5", "313", "nan")],
    (["--images", "113", "--dataset", "sklearn-digits"], "--images"),
    *[(["--releases", v], "--releases") for v in ("0", "-1", "1.5")],
    *[(["--runs", v], "--runs") for v in ("0", "-4", "abc")],
    *[(["--threshold", v], "--threshold") for v in ("nan", "1", "1.5", "-1.5", "inf", "-inf", "abc")],
    (["--delta", "1e-5"], "--delta"),  # estimate has no --delta
]


def _refused(capsys, argv, option):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert "error:" in lines[0] and option in lines[0], lines[0]
    assert "Traceback" not in captured.err
    return lines[0]


@pytest.mark.parametrize("command", ["reproduce", "estimate"])
@pytest.mark.parametrize("extra, option", SHARED, ids=[" ".join(a) or "-" for a, _ in SHARED])
def test_shared_options_are_checked(tmp_path, capsys, no_work, command, extra, option):
    out = tmp_path / "out"
    line = _refused(capsys, [command, "--out", str(out), *extra], option)
    assert line.startswith(f"privleak {command}: error: argument {option}")
    assert not out.exists()


@pytest.mark.parametrize("extra, option", REPRODUCE, ids=[" ".join(a) or "-" for a, _ in REPRODUCE])
def test_reproduce_options_are_checked(tmp_path, capsys, no_work, extra, option):
    out = tmp_path / "out"
    line = _refused(capsys, ["reproduce", "--out", str(out), *extra], option)
    assert line.startswith("privleak reproduce: error:")
    assert not out.exists()


@pytest.mark.parametrize("extra, option", ESTIMATE, ids=[" ".join(a) or "-" for a, _ in ESTIMATE])
def test_estimate_options_are_checked(tmp_path, capsys, no_work, extra, option):
    out = tmp_path / "out"
    line = _refused(capsys, ["estimate", "--out", str(out), *extra], option)
    # argparse reports an option the subcommand lacks from the top-level parser
    assert line.startswith("privleak estimate: error:") or line.startswith("privleak: error: unrecognized arguments")
    assert not out.exists()


def test_the_messages_say_what_is_wanted(tmp_path, capsys, no_work):
    out = str(tmp_path / "out")
    assert "(0, 1)" in _refused(capsys, ["reproduce", "--out", out, "--delta", "0"], "--delta")
    assert "[0, 2^63)" in _refused(capsys, ["reproduce", "--out", out, "--seed", str(2 ** 70)], "--seed")
    assert "5000" in _refused(capsys, ["estimate", "--out", out, "--images", "313"], "--images")
    assert "does not exist" in _refused(capsys, ["reproduce", "--out", out, "--dataset", "/nonexistent"], "--dataset")


# ----------------------------------------------------------------------------- --out


def _unwritable_folder(tmp_path):
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    return folder


@pytest.mark.parametrize("command", ["reproduce", "estimate"])
@pytest.mark.parametrize("case", ["file", "under-a-file", "empty", "broken-link", "unwritable", "unwritable-parent",
                                  "virtual-fs", "missing"])
def test_out_must_be_a_writable_folder(tmp_path, capsys, no_work, command, case):
    if case == "missing":
        argv = [command]
    else:
        if case == "file":
            out = tmp_path / "a-file"
            out.write_text("x")
        elif case == "under-a-file":
            (tmp_path / "a-file").write_text("x")
            out = tmp_path / "a-file" / "sub" / "dir"
        elif case == "empty":
            out = ""
        elif case == "broken-link":
            out = tmp_path / "link"
            out.symlink_to(tmp_path / "nowhere")
        elif case in ("unwritable", "unwritable-parent"):
            if os.geteuid() == 0:
                pytest.skip("root writes in read-only-mode folders; the virtual-fs case covers root")
            out = _unwritable_folder(tmp_path)
            if case == "unwritable-parent":
                out = out / "new" / "out"
        else:  # a folder nobody can create files in, root included
            if not os.path.isdir("/proc/self"):
                pytest.skip("no /proc")
            out = "/proc/privleak-test/out"
        argv = [command, "--out", str(out)]
    try:
        _refused(capsys, argv, "--out")
    finally:
        if case.startswith("unwritable"):
            (tmp_path / "locked").chmod(0o755)


def test_out_refused_where_access_says_no(tmp_path, capsys, no_work, monkeypatch):
    """The permission branch, for runs as root too (where chmod does not stop writing)."""
    monkeypatch.setattr(os, "access", lambda path, mode, **kwargs: False)
    line = _refused(capsys, ["reproduce", "--out", str(tmp_path / "out")], "--out")
    assert "permission denied" in line


# ----------------------------------------------------------------------------- --dataset folders


@pytest.mark.parametrize("case", ["a-file", "empty-folder", "no-labels", "bad-magic", "count-mismatch", "not-square",
                                  "truncated-header", "corrupt-gzip", "unreadable"])
def test_dataset_folders_are_checked_from_their_headers(tmp_path, capsys, no_work, case):
    folder = tmp_path / "idx"
    if case == "a-file":
        folder = tmp_path / "file"
        folder.write_text("x")
    elif case == "empty-folder":
        folder.mkdir()
    elif case == "no-labels":
        _write_idx(folder, 100)
        (folder / "train-labels-idx1-ubyte").unlink()
    elif case == "bad-magic":
        _write_idx(folder, 100, magic_images=b"\x00\x00\x08\x02")
    elif case == "count-mismatch":
        _write_idx(folder, 100, labels=99)
    elif case == "not-square":
        _write_idx(folder, 100)
        raw = bytearray((folder / "train-images-idx3-ubyte").read_bytes())
        raw[15] = 5
        (folder / "train-images-idx3-ubyte").write_bytes(bytes(raw))
    elif case == "truncated-header":
        _write_idx(folder, 100)
        (folder / "train-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x01\x00")
    elif case == "corrupt-gzip":
        _write_idx(folder, 100, gz=True)
        (folder / "train-images-idx3-ubyte.gz").write_bytes(b"not gzip at all")
    else:
        if os.geteuid() == 0:
            pytest.skip("root reads any folder")
        _write_idx(folder, 100)
        folder.chmod(0o000)
    try:
        _refused(capsys, ["reproduce", "--out", str(tmp_path / "out"), "--dataset", str(folder)], "--dataset")
    finally:
        if folder.is_dir():
            folder.chmod(0o755)


def test_an_idx_folder_too_small_for_the_clients_is_refused(tmp_path, capsys, no_work):
    folder = _write_idx(tmp_path / "idx", 40, gz=True)
    line = _refused(capsys, ["reproduce", "--out", str(tmp_path / "out"), "--dataset", str(folder), "--clients", "3"],
                    "--clients")
    assert "48" in line and "40" in line
    _refused(capsys, ["estimate", "--out", str(tmp_path / "out"), "--dataset", str(folder), "--images", "3"],
             "--images")


# ----------------------------------------------------------------------------- info and the top level


@pytest.mark.parametrize("argv, named", [
    (["info", "extra"], "extra"), (["info", "--json=1"], "--json"), (["info", "--nope"], "--nope"),
    ([], "command"), (["nope"], "nope"), (["--nope"], "command")])  # argparse names the missing command first
def test_info_and_the_top_level_refuse_bad_arguments(capsys, no_work, monkeypatch, argv, named):
    import privleak

    monkeypatch.setattr(privleak, "info", _fail)
    _refused(capsys, argv, named)


# ----------------------------------------------------------------------------- valid edges still parse


@pytest.mark.parametrize("extra, expected", [
    (["--delta", "1e-9"], dict(delta=1e-9)),
    (["--delta", "0.999999"], dict(delta=0.999999)),
    (["--epsilons", "1e-300", "1e300", "173"], dict(epsilons=(1e-300, 1e300, 173.0))),
    (["--grid-epsilons", "1e-300"], dict(grid_epsilons=(1e-300,))),
    (["--seed", "0"], dict(seed=0)),
    (["--seed", str(2 ** 63 - 1)], dict(seed=2 ** 63 - 1)),
    (["--clients", "312"], dict(clients=312)),  # 312 x 16 = 4992 <= 5000
    (["--clients", "156", "--paper-scale"], dict(clients=156, examples_per_client=32)),
    (["--clients", "112", "--dataset", "sklearn-digits"], dict(clients=112, dataset="sklearn-digits")),
    (["--rounds", "1", "--iterations", "1", "--restarts", "1"], dict(rounds=1)),
    (["--mechanisms", "vmf"], dict(mechanisms=("vmf",))),
    (["--mechanisms", *dpsgd.mechanism.names()], dict(mechanisms=dpsgd.mechanism.names())),
])
def test_valid_reproduce_edges_parse(tmp_path, reach, extra, expected):
    out = tmp_path / "new" / "nested" / "out"
    with pytest.raises(Reached) as reached:
        cli.main(["reproduce", "--out", str(out), "--quiet", *extra])
    for name, value in expected.items():
        assert getattr(reached.value.experiment, name) == value
    assert not out.exists()  # parsing creates nothing


@pytest.mark.parametrize("extra, expected", [
    (["--threshold", "-1"], dict(threshold=-1.0)),
    (["--threshold", "0.999"], dict(threshold=0.999)),
    (["--images", "2", "--releases", "1", "--runs", "1"], dict(images=2, releases=1, runs=1)),
    (["--images", "312"], dict(images=312)),
    (["--seed", str(2 ** 63 - 1)], dict(seed=2 ** 63 - 1)),
])
def test_valid_estimate_edges_parse(tmp_path, reach, extra, expected):
    with pytest.raises(Reached) as reached:
        cli.main(["estimate", "--out", str(tmp_path), "--quiet", *extra])
    for name, value in expected.items():
        assert getattr(reached.value.experiment, name) == value


@pytest.mark.parametrize("gz", [False, True])
def test_a_valid_idx_folder_parses_without_being_loaded(tmp_path, reach, gz):
    folder = _write_idx(tmp_path / "idx", 48, gz=gz)
    with pytest.raises(Reached) as reached:
        cli.main(["reproduce", "--out", str(tmp_path / "out"), "--dataset", str(folder), "--clients", "3"])
    assert reached.value.experiment.dataset == str(folder)


def test_the_cli_s_dataset_sizes_and_seed_limit_match_the_library():
    assert set(cli.DATASET_SIZES) == set(datasets.LOADERS)
    for name, size in cli.DATASET_SIZES.items():
        assert len(datasets.load(name).labels) == size
    assert cli.SEED_LIMIT == reproduce.SEED_LIMIT
    torch.Generator().manual_seed(cli.SEED_LIMIT)  # seed + 1 of the largest seed


# ----------------------------------------------------------------------------- the library's own doors


@pytest.mark.parametrize("kwargs, match", [
    (dict(seed=-1), "seed"), (dict(seed=2 ** 63), "seed"), (dict(seed=1.5), "seed"),
    (dict(grid_epsilons=(math.nan,)), "grid_epsilons"), (dict(grid_epsilons=()), "grid_epsilons")])
def test_experiment_checks_seed_and_grid(kwargs, match):
    with pytest.raises(ValueError, match=match):
        reproduce.Experiment(**kwargs)


def test_estimation_checks_its_seed():
    with pytest.raises(ValueError, match="seed"):
        estimation.Estimation(seed=2 ** 70)


def test_too_few_images_for_the_clients_is_a_value_error():
    tiny = datasets.ImageDataset(torch.zeros(20, 1, 8, 8), torch.arange(20) % 10, "tiny")
    experiment = reproduce.Experiment(dataset="tiny", clients=2)
    setting = reproduce.settings(experiment, 10)[0]
    with pytest.raises(ValueError, match="clients"):
        reproduce.train_and_collect(experiment, tiny, setting)


# ----------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("argv, option", [
    (["reproduce", "--delta", "0"], "--delta"),
    (["estimate", "--runs", "0"], "--runs"),
    (["reproduce", "--dataset", "/nonexistent"], "--dataset"),
])
def test_python_m_privleak_exits_2_without_a_traceback(tmp_path, argv, option):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "privleak", argv[0], "--out", str(out), *argv[1:]],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and f"argument {option}" in lines[0], done.stderr
    assert not out.exists()
