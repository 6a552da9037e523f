"""privleak estimate: the attack's recoveries turned into MBP/ABP estimates, checked against the
estimators applied by hand to the same scores."""
import csv
import math

import numpy as np
import pytest
from privleak import attacks, bayesian_privacy, cli, estimation

SMALL = estimation.Estimation(dataset="sklearn-digits", epsilons=(1e6,), mechanisms=("vmf",), images=3, releases=3,
                              runs=2, attack=attacks.InvertingGradients(iterations=150))


def test_best_match_names_one_candidate_above_the_threshold():
    scores = np.array([[[0.2, 0.7, 0.1], [-0.3, -0.1, -0.2]]])
    recovered = estimation.best_match(scores, 0.0)
    assert recovered.tolist() == [[[False, True, False], [False, False, False]]]
    assert estimation.best_match(scores, 0.8).sum() == 0


def test_estimates_are_the_estimators_on_the_attacks_scores(monkeypatch):
    seen = []
    real = estimation._scores

    def keep(*args, **kwargs):
        scores = real(*args, **kwargs)
        seen.append(scores)
        return scores

    monkeypatch.setattr(estimation, "_scores", keep)
    (estimate,) = estimation.run(SMALL)
    (scores,) = seen
    # Every check below holds for whatever scores the attacks reached (the estimators are re-applied to
    # the very scores estimation saw), so no trajectory of the 150-iteration attacks can fail it.
    assert scores.shape == (3, 2, 3) and np.all(np.abs(scores) <= 1)
    counts = bayesian_privacy.count_recoveries(scores, estimation.best_match, 0.0, batch_size=1)
    prior = np.full(3, 1 / 3)
    mbp = bayesian_privacy.estimate_mbp(counts, prior)
    abp = bayesian_privacy.estimate_abp(counts, prior)
    assert estimate.mbp.xi == mbp.xi and estimate.mbp.interval == mbp.interval
    assert estimate.abp.c1 == pytest.approx(abp.c1) and estimate.abp.c1_interval == pytest.approx(abp.c1_interval)
    # Release m leaked image m mod n: the recovery rate counts runs that named that image.
    own = counts.successes[np.arange(3), np.arange(3)].sum() / 6
    assert estimate.recovery_rate == pytest.approx(own)
    assert estimate.mean_ssim == pytest.approx(np.mean([scores[m, :, m] for m in range(3)]))
    # VMF at epsilon = 1e6 is 2 kappa-LDP with 2 kappa = 1e6: the implied bound is log(1/3 + 2/3 e^1e6).
    assert estimate.implied_mbp_bound == pytest.approx(1e6 + math.log(2 / 3), rel=1e-12)


def test_the_command_line_writes_the_csv_and_the_plot(tmp_path, capsys):
    code = cli.main(["estimate", "--out", str(tmp_path), "--dataset", "sklearn-digits", "--epsilons", "1e6",
                     "--mechanisms", "gaussian", "--images", "2", "--releases", "2", "--runs", "2",
                     "--iterations", "20", "--quiet"])
    assert code == 0
    with open(tmp_path / "bayesian_privacy.csv", newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert len(rows) == 1 and rows[0]["mechanism"] == "gaussian" and float(rows[0]["implied_mbp_bound"]) == math.inf
    assert float(rows[0]["xi_low"]) <= float(rows[0]["xi"]) <= float(rows[0]["xi_high"])
    assert (tmp_path / "bayesian_privacy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "xi^=" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, match", [
    (dict(images=1), "images"), (dict(releases=0), "releases"), (dict(runs=0), "runs"),
    (dict(threshold=1.0), "threshold"), (dict(attack=attacks.InvertingGradients(restarts=2)), "restarts=1"),
    (dict(epsilons=(-1.0,)), "epsilons")])
def test_bad_estimations_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimation.Estimation(**kwargs)
