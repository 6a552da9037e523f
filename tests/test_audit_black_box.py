"""Black-box one-run auditing with input canaries (privleak.audit.black_box): the score is the
canary's loss drop, the canaries and membership are seeded, the bound never contradicts an honest
run, and it sees a run whose noise is 10x too small.

Measured on the setting below (logistic regression 784 -> 10 on the first 1100 shipped MNIST
digits, 1000 of them made canaries, 100 ordinary data, full-batch Gaussian DP-SGD, clip 1, 100
steps at lr 4, m = 1000, guesses 50 + 50, delta = 1e-5, 95%), mislabelled canaries, seed 0:

    claimed eps      2      8     32   1000   | 2 with noise 10x too small (seeds 0, 1, 2)
    lower bound   0.47   1.32   1.81   1.81   | 1.81, 1.81, 2.03

Out-of-distribution (inverted) canaries at the faulty eps = 2 run: 0.01. The bound saturates at
about 1.8 (92 of 100 guesses right) however little noise there is: the canaries' losses move with
what the model learns from the 500 other included canaries and the data, and that interference,
not the noise, limits a black-box score here (white-box Dirac canaries reach 3.47, every guess
right, on the same fault: tests/test_audit_one_run.py).
"""
import math

import numpy as np
import pytest
import torch
from privleak import accounting, datasets, dpsgd
from privleak.audit import black_box as B

STEPS, IMAGES, CANARIES, LR = 100, 1100, 1000, 4.0


@pytest.fixture(scope="module")
def digits():
    data = datasets.mnist_5k()
    return data.images[:IMAGES].reshape(IMAGES, -1), data.labels[:IMAGES]


def gaussian_config(epsilon, steps=STEPS, delta=1e-5):
    return dpsgd.DPSGDConfig(clip_norm=1.0, noise_multiplier=accounting.analytic_gaussian_noise_multiplier(
        epsilon, delta) * math.sqrt(steps))


def run_audit(digits, config, seed=0, model=None, **kwargs):
    torch.manual_seed(seed)
    inputs, targets = digits
    model = torch.nn.Linear(784, 10) if model is None else model
    return B.audit_dpsgd_black_box(model, torch.nn.functional.cross_entropy, inputs, targets, config,
                                   steps=kwargs.pop("steps", STEPS), canaries=kwargs.pop("canaries", CANARIES),
                                   lr=kwargs.pop("lr", LR), seed=seed, **kwargs)


@pytest.fixture
def captured(monkeypatch):
    """The scores and membership audit_dpsgd_black_box hands to audit_one_run."""
    seen = {}
    honest = B.audit_one_run

    def capture(scores, included, **kwargs):
        seen["scores"], seen["included"] = np.array(scores), np.array(included)
        return honest(scores, included, **kwargs)

    monkeypatch.setattr(B, "audit_one_run", capture)
    return seen


def cross_entropy_by_hand(model, x, label):
    with torch.no_grad():
        logits = (model.weight.double() @ x.double() + model.bias.double()).numpy()
    return float(np.log(np.exp(logits - logits.max()).sum()) + logits.max() - logits[label])


def test_score_is_the_loss_drop_of_each_canary(digits, captured):
    inputs, targets = digits[0][:60], digits[1][:60]
    torch.manual_seed(5)
    model = torch.nn.Linear(784, 10)
    initial = torch.nn.Linear(784, 10)
    initial.load_state_dict(model.state_dict())
    B.audit_dpsgd_black_box(model, torch.nn.functional.cross_entropy, inputs, targets, gaussian_config(8.0, 3),
                            steps=3, canaries=20, lr=1.0, seed=4, guesses=(2, 2))
    _, x, y = B.make_canaries(inputs, targets, 10, 20, "mislabelled", np.random.default_rng(4))
    for i in (0, 7, 19):
        expected = cross_entropy_by_hand(initial, x[i], int(y[i])) - cross_entropy_by_hand(model, x[i], int(y[i]))
        assert captured["scores"][i] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert np.any(captured["scores"] != 0)


def test_canaries_and_membership_are_seeded(digits, captured):
    inputs, targets = digits
    chosen, x, y = B.make_canaries(inputs, targets, 10, 300, "mislabelled", np.random.default_rng(1))
    assert len(set(chosen.tolist())) == 300 and torch.equal(x, inputs[chosen])
    assert bool((y != targets[chosen]).all()) and int(y.min()) >= 0 and int(y.max()) <= 9
    again = B.make_canaries(inputs, targets, 10, 300, "mislabelled", np.random.default_rng(1))
    assert np.array_equal(chosen, again[0]) and torch.equal(y, again[2])
    _, inverted, labels = B.make_canaries(inputs, targets, 10, 300, "ood", np.random.default_rng(1))
    assert torch.allclose(inverted, 1.0 - inputs[chosen]) and len(set(labels.tolist())) == 10

    small = (inputs[:200], targets[:200])
    memberships = []
    for seed in (3, 3, 4):
        run_audit(small, gaussian_config(4.0, 1), seed=seed, steps=1, canaries=150)
        memberships.append(captured["included"])
    assert np.array_equal(memberships[0], memberships[1]) and not np.array_equal(memberships[0], memberships[2])
    assert abs(memberships[0].mean() - 0.5) < 4 * 0.5 / math.sqrt(150)


@pytest.fixture
def noise_scale_fault(monkeypatch):
    """The Gaussian step's noise std 10x too small; the accountant still reads the noise multiplier."""
    honest = dpsgd.Gaussian.noise_std
    monkeypatch.setattr(dpsgd.Gaussian, "noise_std", lambda self, clipping: 0.1 * honest(self, clipping))


def test_honest_run_never_contradicts_the_claim(digits):
    audit = run_audit(digits, gaussian_config(2.0))
    assert audit.epsilon_claimed == pytest.approx(2.0, rel=1e-6)
    assert 0.0 <= audit.epsilon_lower <= 2.0  # measured 0.47


def test_sees_noise_ten_times_too_small(digits, noise_scale_fault):
    """Claim eps = 2, noise 10x too small: the bound was 1.81, 1.81, 2.03 on seeds 0-2 (and 0.47 for
    the honest run of seed 0). It cannot clearly exceed 2 on this model (module docstring: at eps =
    1000 it reaches 1.81 too), so the assertion is a floor of 1.4 on two seeds: far above the honest
    run's bound, but not a proof of the bug by itself."""
    for seed in (0, 1):
        audit = run_audit(digits, gaussian_config(2.0), seed=seed)
        assert audit.epsilon_claimed == pytest.approx(2.0, rel=1e-6)
        assert audit.epsilon_lower >= 1.4
        assert audit.correct >= 0.85 * audit.guesses


def test_bad_arguments_are_refused_with_their_name(digits):
    inputs, targets = digits[0][:50], digits[1][:50]
    model, loss = torch.nn.Linear(784, 10), torch.nn.functional.cross_entropy
    config = gaussian_config(2.0, 1)

    def call(**kwargs):
        arguments = dict(model=model, loss_fn=loss, inputs=inputs, targets=targets, config=config, steps=1,
                         canaries=10)
        arguments.update(kwargs)
        return B.audit_dpsgd_black_box(arguments.pop("model"), arguments.pop("loss_fn"), arguments.pop("inputs"),
                                       arguments.pop("targets"), arguments.pop("config"), **arguments)

    for kwargs, error, named in [
        (dict(kind="noise"), ValueError, "kind"), (dict(canaries=50), ValueError, "canaries"),
        (dict(canaries=0), ValueError, "canaries"), (dict(canaries=2.0), TypeError, "canaries"),
        (dict(steps=0), ValueError, "steps"), (dict(delta=0.0), ValueError, "delta"),
        (dict(sampling_rate=0.0), ValueError, "sampling_rate"), (dict(lr=-1.0), ValueError, "lr"),
        (dict(confidence=1.0), ValueError, "confidence"), (dict(guesses=(6, 5)), ValueError, "k_plus"),
        (dict(targets=targets[:5]), ValueError, "samples"), (dict(targets=targets.float()), TypeError, "targets"),
        (dict(targets=targets + 10), ValueError, "targets"), (dict(model="model"), TypeError, "model"),
        (dict(loss_fn=3), TypeError, "loss_fn"), (dict(model=torch.nn.Linear(784, 1)), ValueError, "model"),
    ]:
        with pytest.raises(error, match=named):
            call(**kwargs)
