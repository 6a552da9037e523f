"""privleak reproduce end to end on a small sweep, and its report against its CSV."""
import math
import re
import warnings

import mpmath
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dp_accounting import dp_event, pld
from privleak import accounting, attacks, capacity, cli, datasets, dpsgd, reproduce
from privleak.models import PaperNetwork, parameter_count

SMALL = reproduce.Experiment(dataset="sklearn-digits", epsilons=(100.0, 1e6), clients=3, examples_per_client=4,
                             rounds=2, attack=attacks.InvertingGradients(iterations=300), grid_epsilons=(1e6,))
#: The paper's conventions with the classic calibration (its caveat above epsilon 1), batches of 2.
PAPER = reproduce.Experiment(dataset="sklearn-digits", epsilons=(0.5, 1e3), clients=2, examples_per_client=4,
                             rounds=1, attack=attacks.InvertingGradients(iterations=40), grid_epsilons=(1e3,),
                             batch_size=2, convention=reproduce.PaperConvention("classic"))


def _run(experiment, out):
    stages = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = reproduce.run(experiment, lambda stage, done, total: stages.append((stage, done, total)))
    paths = reproduce.write_outputs(experiment, results, str(out))
    return results, paths, stages, [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    return _run(SMALL, tmp_path_factory.mktemp("reproduce"))[:3]


@pytest.fixture(scope="module")
def paper_run(tmp_path_factory):
    return _run(PAPER, tmp_path_factory.mktemp("paper"))


@pytest.fixture(params=["privleak", "paper"])
def any_run(request, small_run, paper_run):
    """(experiment, results, paths) of the run under each convention."""
    return (SMALL, *small_run[:2]) if request.param == "privleak" else (PAPER, *paper_run[:2])


def test_every_output_is_written(small_run):
    _, paths, stages = small_run
    for name in ("epsilon_vs_mse.png", "capacity_vs_mse.png", "reconstructions.png"):
        with open(paths[name], "rb") as stream:
            assert stream.read(8) == b"\x89PNG\r\n\x1a\n"
    assert ("federated training", 5, 5) in stages and ("attack", 300, 300) in stages


def test_the_csv_holds_every_attacked_image_with_its_settings(small_run):
    results, paths, _ = small_run
    rows = reproduce.read_csv(paths["reconstructions.csv"])
    assert len(rows) == (1 + 2 * 2) * SMALL.clients
    dim = parameter_count(PaperNetwork((1, 8, 8), 10))
    assert results.dim == dim
    for row in rows:
        assert row["convention"] == "privleak" and row["image"] == 0 and row["labels_given"] == 0
        # Under privleak's convention the row's epsilon is its update epsilon.
        assert row["update_epsilon"] == pytest.approx(row["epsilon"], rel=1e-9)
        if row["mechanism"] == "gaussian":
            # The noise multiplier makes one update (epsilon, delta)-LDP: sensitivity 2c.
            assert accounting.analytic_gaussian_epsilon(row["noise_multiplier"] / 2, row["delta"]) == \
                pytest.approx(row["epsilon"], rel=1e-9)
            expected = capacity.dpsgd_gaussian(dim, 1.0, row["noise_multiplier"], 1).log_capacity().bits
        elif row["mechanism"] == "vmf":
            assert accounting.vmf_privacy(row["kappa"]).step_epsilon == pytest.approx(row["epsilon"])
            expected = capacity.dpsgd_vmf(dim, row["kappa"]).log_capacity().bits
        else:
            expected = math.inf
        assert row["log2_capacity"] == pytest.approx(expected, rel=1e-12)
        assert 0.0 <= row["mse"] <= 1.0 and row["psnr"] == pytest.approx(-10 * math.log10(row["mse"]), rel=1e-9)
    # The CSV's scores are those of the returned images.
    mse = attacks.mse(results.reconstructions.flatten(0, 1), results.originals.flatten(0, 1)).numpy()
    np.testing.assert_allclose([r["mse"] for r in rows], mse, rtol=1e-12)
    # Every setting attacked the same client images: the sweep changes only the noise.
    assert len({tuple(r["dataset_index"] for r in rows if r["epsilon"] == e and r["mechanism"] == m)
                for m, e in {(r["mechanism"], r["epsilon"]) for r in rows}}) == 1


def _report_table(text: str, header: str) -> list:
    """The body of the table whose header line starts with ``header``; for a section title
    ("## ..."), the first table after it, header row included."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    if header.startswith("#"):
        start = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
        return [[cell.strip() for cell in lines[start].strip("|").split("|")]]
    table = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip("|").split("|")])
    return table


def _column(table_header, name):
    return table_header.index(name)


def test_the_report_numbers_are_the_csvs(any_run):
    experiment, _, paths = any_run
    rows = reproduce.read_csv(paths["reconstructions.csv"])
    with open(paths["report.md"]) as stream:
        text = stream.read()
    header = _report_table(text, "## Results")[0]
    table = _report_table(text, "| convention | mechanism | epsilon |")
    settings = _settings_of(rows)
    assert len(table) == len(settings) == 1 + 2 * len(experiment.epsilons)
    per_update = experiment.clients * experiment.batch_size
    for cells in table:
        value = dict(zip(header, cells, strict=True))
        mechanism, epsilon = value["mechanism"], float(value["epsilon"])
        mine = [r for r in rows if r["mechanism"] == mechanism and r["epsilon"] == epsilon]
        assert len(mine) == per_update
        assert value["convention"] == mine[0]["convention"] == experiment.convention.label
        mse = np.array([r["mse"] for r in mine])
        assert float(value["mean MSE"]) == pytest.approx(mse.mean(), rel=1e-5)
        assert float(value["median MSE"]) == pytest.approx(np.median(mse), rel=1e-5)
        assert float(value["mean SSIM"]) == pytest.approx(np.mean([r["ssim"] for r in mine]), rel=1e-5, abs=1e-6)
        inferred = [r["label"] == r["attack_label"] for r in mine if not r["labels_given"]]
        if inferred:
            assert float(value["label accuracy"]) == pytest.approx(np.mean(inferred))
        else:
            assert value["label accuracy"] == "-"
        for column, title in (("log2_capacity", "log2 Bayes capacity"), ("update_epsilon", "update epsilon"),
                              ("noise_multiplier", "noise multiplier"), ("kappa", "kappa")):
            cell = value[title]
            if math.isnan(mine[0][column]):
                assert cell == "-"
            else:
                assert float(cell) == pytest.approx(mine[0][column], rel=1e-5)
        # The noise measures are per update: each client's once.
        updates = {r["client"]: r for r in mine}.values()
        assert float(value["noise norm ratio"]) == pytest.approx(np.mean([r["noise_norm_ratio"] for r in updates]),
                                                                 rel=1e-5, abs=1e-12)
        assert float(value["cosine"]) == pytest.approx(np.mean([r["cosine"] for r in updates]), rel=1e-5)
    measures = _report_table(text, "| measure |")
    assert [m[0] for m in measures] == ["epsilon", "log2 Bayes capacity"]
    summaries = reproduce.summarise(rows, settings)
    assert float(measures[1][1]) == pytest.approx(reproduce.mechanism_gap(summaries, "log2_capacity"), rel=1e-5)
    assert re.search(r"Run time \d+ s", text)
    assert f"convention {experiment.convention.label}" in text
    assert f"standard error of the mean over the {per_update} attacked images" in text


def _settings_of(rows):
    seen = {}
    for r in rows:
        seen.setdefault((r["mechanism"], r["epsilon"]), reproduce.Setting.from_row(r))
    return list(seen.values())


def test_the_noiseless_attack_beats_the_noisy_ones(small_run):
    results, paths, _ = small_run
    summaries = {(s.setting.mechanism, s.setting.epsilon): s
                 for s in reproduce.summarise(reproduce.read_csv(paths["reconstructions.csv"]), results.settings)}
    # Medians over the 3 clients (one client's attack may stall on another CPU's trajectory), and
    # each step at least doubles the median. Margin: over 7 runs (seeds 0-5 native, 0 on SSE4.1
    # kernels) the medians were <= 0.0003 noiseless, 0.0025-0.006 at epsilon 1e6 and 0.33-0.45 at
    # epsilon 100, ratios >= 8 and >= 50; an attack that ignores the update scores alike at every level.
    noiseless = summaries[("none", math.inf)].median_mse
    for mechanism in ("gaussian", "vmf"):
        weak, strong = summaries[(mechanism, 1e6)].median_mse, summaries[(mechanism, 100.0)].median_mse
        assert 2 * noiseless < weak and 2 * weak < strong, (mechanism, noiseless, weak, strong)


def _summary(mechanism, epsilon, log2_capacity, mse):
    return reproduce.Summary(reproduce.Setting(mechanism, epsilon, None, log2_capacity), mse, mse, math.nan,
                             math.nan, 1.0)


def test_mechanism_gap_is_the_distance_between_the_curves():
    # Gaussian MSE = 1 - log10(x) / 4 on x = 1..1e4; VMF points sit 0.1 above it at x = 10 and 1000.
    gaussian = [_summary("gaussian", x, x, 1 - math.log10(x) / 4) for x in (1.0, 100.0, 1e4)]
    vmf = [_summary("vmf", x, x, 1.1 - math.log10(x) / 4) for x in (10.0, 1e3)]
    # VMF against the Gaussian line: 0.1 each. Gaussian x = 100 against the VMF segment: 0.1.
    assert reproduce.mechanism_gap(gaussian + vmf, "epsilon") == pytest.approx(0.1)
    assert reproduce.mechanism_gap(gaussian + [_summary("vmf", x, x, 1 - math.log10(x) / 4) for x in (10.0, 1e3)],
                                   "log2_capacity") == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(reproduce.mechanism_gap(gaussian + [_summary("vmf", 1e9, 1e9, 0.5)], "epsilon"))


@pytest.mark.parametrize("name", dpsgd.mechanism.names())
def test_settings_are_each_mechanisms_own_calibration(name):
    experiment = reproduce.Experiment(epsilons=(10.0, 1e3), mechanisms=(name,), delta=1e-6, clip_norm=0.5)
    noiseless, *grid = reproduce.settings(experiment, 1000)
    assert (noiseless.mechanism, noiseless.epsilon, noiseless.noise, noiseless.log2_capacity) == \
        ("none", math.inf, None, math.inf)
    assert math.isnan(noiseless.noise_multiplier) and math.isnan(noiseless.kappa)
    assert [(s.mechanism, s.epsilon) for s in grid] == [(name, 10.0), (name, 1e3)]
    for setting in grid:
        noise = dpsgd.mechanism.get(name).calibrate(setting.epsilon, 1e-6)
        assert setting.noise == noise and setting.parameters == noise.parameters()
        config = dpsgd.DPSGDConfig(0.5, noise)
        assert setting.log2_capacity == noise.log_capacity([1000], config.clipping(1), 1).bits
        assert reproduce.dpsgd_config(setting, 0.5) == config
        assert reproduce.Setting.from_row({"mechanism": name, "epsilon": setting.epsilon,
                                           "log2_capacity": setting.log2_capacity,
                                           **setting.parameters}) == setting


def test_gaussian_and_vmf_settings_are_the_papers_calibrations():
    # Gaussian: two clipped gradients differ by up to 2c, so 2 x the analytic sigma; VMF: kappa = eps / 2.
    experiment = reproduce.Experiment(epsilons=(10.0, 173.0, 1e6))
    _, *grid = reproduce.settings(experiment, 13426)
    for setting in grid:
        if setting.mechanism == "gaussian":
            sigma = 2 * accounting.analytic_gaussian_noise_multiplier(setting.epsilon, 1e-5)
            assert setting.noise_multiplier == sigma and math.isnan(setting.kappa)
            assert setting.log2_capacity == capacity.dpsgd_gaussian(13426, 1.0, sigma, 1).log_capacity().bits
        else:
            assert setting.kappa == setting.epsilon / 2 and math.isnan(setting.noise_multiplier)
            assert setting.log2_capacity == capacity.dpsgd_vmf(13426, setting.epsilon / 2).log_capacity().bits
    with pytest.raises(AttributeError):
        grid[0].no_such_parameter  # noqa: B018


def test_csv_has_a_column_per_parameter_of_the_sweeps_mechanisms():
    assert reproduce.CSV_FIELDS[:7] == ("convention", "mechanism", "epsilon", "update_epsilon", "delta",
                                        "noise_multiplier", "kappa")
    every = reproduce.csv_fields(dpsgd.mechanism.names())
    for name in dpsgd.mechanism.names():
        for field in dpsgd.mechanism.get(name).calibrate(1.0, 1e-5).parameters():
            assert every.count(field) == 1


@pytest.mark.filterwarnings("ignore:An input array is constant")  # one epsilon: no rank correlation
def test_every_registered_mechanism_runs_from_the_command_line(tmp_path):
    names = dpsgd.mechanism.names()
    code = cli.main(["reproduce", "--out", str(tmp_path), "--dataset", "sklearn-digits", "--epsilons", "1e4",
                     "--mechanisms", *names, "--clients", "1", "--rounds", "1", "--iterations", "5",
                     "--grid-epsilons", "1e4", "--quiet"])
    assert code == 0
    rows = reproduce.read_csv(str(tmp_path / "reconstructions.csv"))
    assert [r["mechanism"] for r in rows] == ["none", *names]
    for row in rows[1:]:
        noise = dpsgd.mechanism.get(row["mechanism"]).calibrate(1e4, 1e-5)
        for key, value in noise.parameters().items():
            assert row[key] == value
    text = (tmp_path / "report.md").read_text()
    assert all(f"| privleak | {name} | 10000 |" in text for name in names)


def test_the_command_line_runs_a_sweep(tmp_path, capsys):
    code = cli.main(["reproduce", "--out", str(tmp_path), "--dataset", "sklearn-digits", "--epsilons", "1e4",
                     "--mechanisms", "vmf", "--clients", "2", "--rounds", "1", "--iterations", "20", "--quiet"])
    assert code == 0
    printed = capsys.readouterr().out.split()
    assert sorted(p.rsplit("/", 1)[-1] for p in printed) == sorted(
        ["reconstructions.csv", "epsilon_vs_mse.png", "capacity_vs_mse.png", "reconstructions.png", "report.md"])
    rows = reproduce.read_csv(str(tmp_path / "reconstructions.csv"))
    assert [r["mechanism"] for r in rows] == ["none", "none", "vmf", "vmf"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(epsilons=()), "epsilons"), (dict(epsilons=(0.0,)), "epsilons"), (dict(mechanisms=("no-such",)), "mechanisms"),
    (dict(delta=0.0), "delta"), (dict(clients=0), "clients"), (dict(rounds=0), "rounds")])
def test_bad_experiments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        reproduce.Experiment(**kwargs)


def test_unknown_data_sets_are_rejected():
    with pytest.raises(ValueError, match="dataset must be one of"):
        reproduce.run(reproduce.Experiment(dataset="no-such-data"))


# ----------------------------------------------------------------------------- conventions


def _analytic_delta(sigma: float, epsilon: float) -> float:
    """delta(eps) of one Gaussian release N(f(x), sigma^2) at sensitivity 1, Balle and Wang's exact
    curve Phi(1/(2 sigma) - eps sigma) - e^eps Phi(-1/(2 sigma) - eps sigma) (ICML 2018, Thm 8), in
    mpmath at 50 digits: independent of privleak's calibration."""
    mpmath.mp.dps = 50
    s, e = mpmath.mpf(sigma), mpmath.mpf(epsilon)
    return float(mpmath.ncdf(1 / (2 * s) - e * s) - mpmath.exp(e) * mpmath.ncdf(-1 / (2 * s) - e * s))


@pytest.mark.parametrize("calibration", ["analytic", "classic"])
def test_paper_settings_are_the_papers_calibrations(calibration):
    sizes = [p.numel() for p in PaperNetwork().parameters()]
    assert len(sizes) == 8  # 4 layers, a weight and a bias each: the per-layer blocks
    experiment = reproduce.Experiment(epsilons=(0.5, 173.0, 1e4), clip_norm=0.5, batch_size=4,
                                      convention=reproduce.PaperConvention(calibration))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        noiseless, *grid = reproduce.settings(experiment, sizes)
    assert noiseless.convention == experiment.convention and noiseless.log2_capacity == math.inf
    for setting in grid:
        assert setting.convention.label == f"paper-{calibration}"
        if setting.mechanism == "vmf":  # App. A: kappa = epsilon
            assert setting.kappa == setting.epsilon and math.isnan(setting.noise_multiplier)
            assert setting.log2_capacity == capacity.dpsgd_vmf(sum(sizes), setting.epsilon).log_capacity().bits
            assert setting.update_epsilon(1e-5) == 2 * setting.epsilon
            continue
        # The noise's std on the clipped sum is sigma c: privleak's multiplier times |(c, ..., c)|_2 = c sqrt(8).
        sigma = setting.noise_multiplier * math.sqrt(8)
        if calibration == "analytic":  # (epsilon, delta) exactly, at sensitivity c
            assert _analytic_delta(sigma, setting.epsilon) == pytest.approx(1e-5, rel=1e-6)
        else:
            assert sigma == pytest.approx(math.sqrt(2 * math.log(1.25 / 1e-5)) / setting.epsilon, rel=1e-12)
        # Per-layer clipping: the capacity of the product of 8 balls of radius c, noise sigma c / L.
        product = capacity.gaussian_product_of_balls_log_capacity(sizes, [0.5] * 8, sigma * 0.5 / 4)
        assert setting.log2_capacity == pytest.approx(product.bits, rel=1e-12)
        # The same release under privleak's convention (any two clipped updates: sensitivity 2 c sqrt(8)) is
        # worth a larger epsilon.
        assert setting.update_epsilon(1e-5) > setting.epsilon
    if calibration == "analytic":  # dp-accounting's PLD agrees where it is cheap (large sigma)
        sigma = grid[0].noise_multiplier * math.sqrt(8)
        engine = pld.PLDAccountant()
        engine.compose(dp_event.GaussianDpEvent(sigma))
        assert 0.5 <= engine.get_epsilon(1e-5) <= 0.5 * (1 + 1e-3)
        assert not caught
    else:
        assert [str(w.message).count("not a valid") for w in caught] == [1]
        assert "epsilon 173, 10000" in str(caught[0].message)


def test_conventions_are_named_and_checked():
    assert reproduce.convention("privleak") == reproduce.PrivleakConvention()
    assert reproduce.convention("paper") == reproduce.PaperConvention("analytic")
    for label in ("paper-analytic", "paper-classic"):
        assert reproduce.convention(label).label == label
    for bad in ("nope", "privleak-classic", "paper-exact", ""):
        with pytest.raises(ValueError, match="calibration|convention"):
            reproduce.convention(bad)
    with pytest.raises(ValueError, match="convention"):
        reproduce.Experiment(convention="paper")
    with pytest.raises(ValueError, match="laplace"):
        reproduce.Experiment(mechanisms=("gaussian", "laplace"), convention=reproduce.PaperConvention())
    with pytest.raises(ValueError, match="batch_size"):
        reproduce.Experiment(batch_size=17)
    with pytest.raises(ValueError, match="batch_size"):
        reproduce.Experiment(batch_size=0)
    # Axis labels say which epsilon is meant.
    privleak_axis, paper_axis = (reproduce.PrivleakConvention().epsilon_axis(),
                                 reproduce.PaperConvention("classic").epsilon_axis())
    assert "sensitivity 2c" in privleak_axis and "kappa = eps/2" in privleak_axis
    assert "sensitivity c," in paper_axis and "kappa = eps)" in paper_axis and "classic" in paper_axis


def test_the_paper_runs_csv_follows_the_papers_conventions(paper_run):
    results, paths, stages, messages = paper_run
    rows = reproduce.read_csv(paths["reconstructions.csv"])
    b = PAPER.batch_size
    assert len(rows) == (1 + 2 * 2) * PAPER.clients * b
    sizes = [p.numel() for p in PaperNetwork((1, 8, 8), 10).parameters()]
    for row in rows:
        assert row["convention"] == "paper-classic" and row["image"] in (0, 1)
        if row["mechanism"] == "vmf":
            assert row["kappa"] == row["epsilon"]
        elif row["mechanism"] == "gaussian":
            sigma = row["noise_multiplier"] * math.sqrt(len(sizes))
            assert sigma == pytest.approx(math.sqrt(2 * math.log(1.25 / row["delta"])) / row["epsilon"], rel=1e-12)
            product = capacity.gaussian_product_of_balls_log_capacity(sizes, [1.0] * len(sizes), sigma / b)
            assert row["log2_capacity"] == pytest.approx(product.bits, rel=1e-12)
    # Each client's update covers b distinct images.
    for setting in {(r["mechanism"], r["epsilon"]) for r in rows}:
        for client in range(PAPER.clients):
            mine = [r["dataset_index"] for r in rows if (r["mechanism"], r["epsilon"]) == setting
                    and r["client"] == client]
            assert len(set(mine)) == b
    # The classic calibration above epsilon 1 is flagged, in a warning and in the report.
    assert any("not a valid (epsilon, delta) calibration above epsilon = 1" in m for m in messages)
    with open(paths["report.md"]) as stream:
        text = stream.read()
    assert "**Caveat:** the classic calibration" in text and "at epsilon 1000" in text
    assert ("attack", PAPER.attack.iterations, PAPER.attack.iterations) in stages
    # What the clients added is the noise the convention says: std sigma c on the clipped sum,
    # measured over the ~8,000 coordinates of each Gaussian release (relative error ~1%).
    for setting, attacked in zip(results.settings, results.attacked):
        if setting.mechanism != "gaussian":
            continue
        noise = torch.cat([(u - c).flatten(1) for u, c in zip(attacked.updates, attacked.clean)], 1).double() * b
        std = noise.norm(dim=1) / math.sqrt(noise.shape[1])
        expected = math.sqrt(2 * math.log(1.25 / PAPER.delta)) / setting.epsilon * PAPER.clip_norm
        np.testing.assert_allclose(std.numpy(), expected, rtol=0.05)


def _clean_update_by_hand(parameters, images, labels, clip_norm, per_layer):
    """A client's clipped average, one image at a time by plain autograd at ``parameters``, each
    gradient clipped to c (flat) or each tensor to c (per layer)."""
    model = PaperNetwork(tuple(images.shape[1:]), 10)
    with torch.no_grad():
        for p, q in zip(model.parameters(), parameters):
            p.copy_(q)
    total = 0.0
    for image, label in zip(images, labels):
        loss = F.cross_entropy(model(image[None]), label.reshape(1))
        grads = [g.double().flatten() for g in torch.autograd.grad(loss, list(model.parameters()))]
        if per_layer:
            grads = [g * min(1.0, clip_norm / float(g.norm())) for g in grads]
        else:
            norm = float(torch.cat(grads).norm())
            grads = [g * min(1.0, clip_norm / norm) for g in grads]
        total = total + torch.cat(grads)
    return total / len(labels)


def test_the_noise_columns_are_recomputed_from_the_releases(any_run):
    experiment, results, paths = any_run
    rows = reproduce.read_csv(paths["reconstructions.csv"])
    data = datasets.load(experiment.dataset)
    b = experiment.batch_size
    for setting, attacked in zip(results.settings, results.attacked):
        for client in range(experiment.clients):
            mine = [r for r in rows if r["mechanism"] == setting.mechanism and r["epsilon"] == setting.epsilon
                    and r["client"] == client]
            indices = torch.tensor([r["dataset_index"] for r in mine])
            assert torch.equal(attacked.images[client * b:(client + 1) * b], data.images[indices])
            clean = _clean_update_by_hand([p[client] for p in attacked.parameters], data.images[indices],
                                          data.labels[indices], experiment.clip_norm, experiment.convention.per_layer)
            release = torch.cat([u[client].flatten() for u in attacked.updates]).double()
            # VMF releases a unit vector: its noiseless release is the clipped update's direction.
            direction = setting.noise is not None and setting.noise.releases_direction
            if direction:
                assert float(release.norm()) == pytest.approx(1.0, rel=1e-5)
            reference = clean / clean.norm() if direction else clean
            ratio = float((release - reference).norm() / reference.norm())
            cosine = float(release @ clean / (release.norm() * clean.norm()))
            for row in mine:
                assert row["noise_norm_ratio"] == pytest.approx(ratio, rel=1e-4, abs=1e-5)
                assert row["cosine"] == pytest.approx(cosine, rel=1e-5, abs=1e-6)
        if setting.noise is None:  # the noiseless release is the clipped update itself
            assert all(r["noise_norm_ratio"] < 1e-5 and r["cosine"] == pytest.approx(1.0) for r in rows
                       if r["mechanism"] == "none")


def test_the_csvs_scores_are_the_paired_images(any_run):
    experiment, results, paths = any_run
    rows = reproduce.read_csv(paths["reconstructions.csv"])
    assert results.reconstructions.shape == results.originals.shape == (
        len(results.settings), experiment.clients * experiment.batch_size, 1, 8, 8)
    mse = attacks.mse(results.reconstructions.flatten(0, 1), results.originals.flatten(0, 1)).numpy()
    np.testing.assert_allclose([r["mse"] for r in rows], mse, rtol=1e-12)
    # Pairing by least MSE: no swap of two reconstructions within a batch lowers the batch's total.
    b = experiment.batch_size
    found, truth = results.reconstructions.flatten(0, 1), results.originals.flatten(0, 1)
    for start in range(0, len(rows), b):
        for i in range(b):
            for j in range(i + 1, b):
                kept = float(attacks.mse(found[[start + i, start + j]], truth[[start + i, start + j]]).sum())
                swapped = float(attacks.mse(found[[start + j, start + i]], truth[[start + i, start + j]]).sum())
                assert kept <= swapped + 1e-12


def test_the_figures_say_what_they_show(any_run, tmp_path, monkeypatch):
    import matplotlib.axes

    experiment, results, paths = any_run
    seen = {"set_xlabel": [], "set_title": [], "errorbar": []}

    def recording(name):
        original = getattr(matplotlib.axes.Axes, name)

        def record(self, *args, **kwargs):
            seen[name].append(kwargs.get("label") if name == "errorbar" else args[0])
            return original(self, *args, **kwargs)

        return record

    for name in seen:
        monkeypatch.setattr(matplotlib.axes.Axes, name, recording(name))
    reproduce.write_outputs(experiment, results, str(tmp_path))
    assert experiment.convention.epsilon_axis() in seen["set_xlabel"]
    assert seen["errorbar"] and all(label.endswith("(mean ± standard error)") for label in seen["errorbar"])
    images = experiment.clients * experiment.batch_size
    assert seen["set_title"] == [f"error bars: standard error of the mean over the {images} attacked images of each "
                                 "setting"] * 2
    # The reconstruction grid writes each image's MSE under it; the no-noise row's are the CSV's.
    rows = reproduce.read_csv(paths["reconstructions.csv"])
    labels = [text for text in seen["set_xlabel"] if text.startswith("MSE ")]
    rows_shown = 1 + len(experiment.grid_epsilons) * len(experiment.mechanisms)
    assert len(labels) == rows_shown * images
    assert labels[:images] == [f"MSE {r['mse']:.3f}" for r in rows if r["mechanism"] == "none"]


class _Reached(Exception):
    pass


def _parse(monkeypatch, argv):
    def stop(experiment, progress=None):
        raise _Reached(experiment)

    monkeypatch.setattr(reproduce, "run", stop)
    with pytest.raises(_Reached) as reached:
        cli.main(["reproduce", "--quiet", *argv])
    return reached.value.args[0]


def test_the_command_line_takes_conventions_and_batch_sizes(monkeypatch, tmp_path, capsys):
    out = str(tmp_path / "out")
    default = _parse(monkeypatch, ["--out", out])
    assert default.convention == reproduce.PrivleakConvention() and default.batch_size == 1
    paper = _parse(monkeypatch, ["--out", out, "--convention", "paper"])
    assert paper.convention == reproduce.PaperConvention("analytic")
    classic = _parse(monkeypatch, ["--out", out, "--convention", "paper", "--calibration", "classic",
                                   "--batch-size", "8"])
    assert classic.convention == reproduce.PaperConvention("classic") and classic.batch_size == 8
    assert _parse(monkeypatch, ["--out", out, "--paper-scale", "--batch-size", "32"]).batch_size == 32
    for argv, option in ((["--calibration", "classic"], "--calibration"),
                         (["--convention", "paper", "--mechanisms", "gaussian", "laplace"], "--mechanisms"),
                         (["--convention", "nope"], "--convention"),
                         (["--convention", "paper", "--calibration", "exact"], "--calibration"),
                         (["--batch-size", "17"], "--batch-size"), (["--batch-size", "0"], "--batch-size"),
                         (["--batch-size", "2.5"], "--batch-size")):
        assert_refused(capsys, ["reproduce", "--out", out, *argv], option)
    assert not (tmp_path / "out").exists()


def assert_refused(capsys, argv, option):
    """The command line ``argv`` ends with exit code 2 and one line naming ``option``."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and f"argument {option}" in lines[0], lines
