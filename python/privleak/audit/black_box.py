"""Black-box one-run auditing of DP-SGD with input canaries (Steinke, Nasr and Jagielski 2023,
Section 6's black-box setting).

**The canaries are examples.** :func:`audit_dpsgd_black_box` sets ``canaries`` = m examples of
the given data aside (a seeded choice; they are not trained on as ordinary data) and turns each
into an example the rest of the data does not explain:

- ``kind="mislabelled"``: the image with its label moved to a wrong class, (y + s) mod C with a
  seeded shift s uniform in 1..C-1 (C = the model's number of outputs);
- ``kind="ood"``: the image with its pixels inverted (lo + hi - x, lo and hi the smallest and
  largest value in ``inputs``: 1 - x for images in [0, 1]) and a seeded label uniform over the C
  classes. The labels differ from canary to canary on purpose: with one fixed label, the included
  canaries would teach the model "inverted image -> that label", which generalises to the excluded
  canaries as well and lowers every canary's loss alike, so the scores would stop telling them apart.

Each canary is included with probability 1/2 (seeded), and the model trains with
:class:`privleak.dpsgd.DPOptimizer` on the remaining data plus the included canaries: every step
Poisson-samples all of them at ``sampling_rate`` and the canaries' per-sample gradients go through
the same clipping and noise as the data's (the loop is the white-box audit's, ``_CanaryRun`` in
:mod:`privleak.audit.one_run`). The claimed epsilon is the accountant's for the run on that data set
(data + included canaries), as in :func:`privleak.audit.one_run.audit_dpsgd`.

**The score is black-box.** The score of canary i is how much the run learnt it,

    score_i = loss(initial model; canary i) - loss(final model; canary i),

the per-example loss ``loss_fn(model(x_i[None]), y_i[None])`` before the first step and after the
last. Nothing else of the run is used: neither the intermediate models nor the updates (unlike the
white-box Dirac canaries, whose score sums every released update on the canary's coordinate).
Guesses "in" on the highest scores and "out" on the lowest, and the exact bound, are
:func:`privleak.audit.one_run.audit_one_run`'s.

**Why it is weaker.** The final model is the last of T noisy steps, and a canary's loss moves with
everything the model learns from the data and the other canaries, not just with its own gradient:
the signal of S_i reaches the score through the model's generalisation, and the white-box score's
noise-only sum is replaced by the interference of the whole run. On full-batch Gaussian DP-SGD of a
logistic regression on MNIST digits the bound is far below the claim at honest noise levels; it
becomes large only when the run memorises the canaries (little noise), which is what a black-box
audit is for: catching an implementation whose noise is much smaller than the accountant assumes.
"""
from __future__ import annotations

import numpy as np

from privleak import validation
from privleak.audit.one_run import OneRunAudit, _CanaryRun, _check_run, _check_training_data, audit_one_run

KINDS = ("mislabelled", "ood")


def per_example_losses(model, loss_fn, inputs, targets):
    """``loss_fn(model(x_b[None]), y_b[None])`` for every example b, as a float64 numpy vector
    (``torch.func.vmap`` over a ``functional_call``, no gradients)."""
    import torch
    from torch.func import vmap

    from privleak.dpsgd.stateless import functional_call

    params = {name: p.detach() for name, p in model.named_parameters()}
    buffers = {name: b.detach() for name, b in model.named_buffers()}

    def loss_of_one(x, y):
        return loss_fn(functional_call(model, (params, buffers), (x.unsqueeze(0),)), y.unsqueeze(0))

    with torch.no_grad():
        return vmap(loss_of_one)(inputs, targets).to(torch.float64).cpu().numpy()


def make_canaries(inputs, targets, num_classes: int, canaries: int, kind: str, rng: np.random.Generator):
    """(indices of the examples set aside, canary inputs, canary targets), module docstring."""
    import torch

    chosen = np.sort(rng.permutation(inputs.shape[0])[:canaries])
    index = torch.from_numpy(chosen).to(inputs.device)
    x, y = inputs[index], targets[index]
    if kind == "mislabelled":
        shift = torch.from_numpy(rng.integers(1, num_classes, size=canaries)).to(device=y.device, dtype=y.dtype)
        return chosen, x.clone(), (y + shift) % num_classes
    low, high = inputs.min(), inputs.max()
    labels = torch.from_numpy(rng.integers(0, num_classes, size=canaries)).to(device=y.device, dtype=y.dtype)
    return chosen, (low + high) - x, labels


def audit_dpsgd_black_box(model, loss_fn, inputs, targets, config, *, steps: int, canaries: int = 500,
                          kind: str = "mislabelled", sampling_rate: float = 1.0, lr: float = 0.1,
                          delta: float = 1e-5, confidence: float = 0.95, guesses=None, seed: int = 0,
                          generator=None) -> OneRunAudit:
    """Black-box one-run audit of a DP-SGD run of ``model`` (a classifier: ``targets`` are class
    indices, ``loss_fn`` a loss of logits and labels such as cross-entropy) on (``inputs``,
    ``targets``) with ``canaries`` input canaries of ``kind`` "mislabelled" or "ood" made from a
    seeded choice of the examples, which are then left out of the ordinary data (module docstring).

    Trains ``model`` in place for ``steps`` steps of :class:`privleak.dpsgd.DPOptimizer` (SGD at
    ``lr``) under ``config`` on the rest of the data plus the included canaries (each in with
    probability 1/2), Poisson-sampled at ``sampling_rate``. Scores each canary by its loss under the
    initial model minus its loss under the final one and audits with
    :func:`privleak.audit.one_run.audit_one_run` (``guesses``: default m // 20 on each side).
    ``seed`` draws the canaries, their labels, the membership, the batches, the tie-break and (with
    ``generator`` None) the noise. Returns :class:`~privleak.audit.one_run.OneRunAudit` whose
    ``epsilon_claimed`` is the accountant's epsilon at ``delta`` for the run.
    """
    import torch

    from privleak import dpsgd
    from privleak import mechanisms as _mechanisms

    _check_training_data(model, loss_fn, inputs, targets)
    if targets.ndim != 1 or targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise validation.ArgumentTypeError("targets must be a 1-d tensor of integer class labels, got "
                                           f"{targets.dtype} of shape {tuple(targets.shape)}")
    kind = validation.choice(kind, "kind", KINDS)
    steps = validation.integer(steps, "steps", low=1)
    n = inputs.shape[0]
    if n < 2:
        raise ValueError("inputs must have at least 2 examples: the canaries are made from some and the rest is data")
    m = validation.integer(canaries, "canaries", low=1, high=n - 1)
    q = validation.probability(sampling_rate, "sampling_rate", open_low=True)
    lr = validation.non_negative(lr, "lr")
    delta = validation.probability(delta, "delta", open_high=True)
    confidence = validation.probability(confidence, "confidence", open_low=True, open_high=True)
    seed = validation.integer(seed, "seed", low=0)
    params, config, pairs = _check_run(model, config, delta, guesses, m)
    if generator is None:
        generator = _mechanisms.NoiseGenerator(seed)
    _mechanisms._check_generator(generator)
    with torch.no_grad():
        logits = model(inputs[:1])
    if logits.ndim != 2 or logits.shape[1] < 2:
        raise ValueError(f"model must output (batch, classes) logits with at least 2 classes, got shape "
                         f"{tuple(logits.shape)}")
    num_classes = logits.shape[1]
    if int(targets.min()) < 0 or int(targets.max()) >= num_classes:
        raise ValueError(f"targets must be class labels in 0..{num_classes - 1} (the model's outputs), got "
                         f"{int(targets.min())}..{int(targets.max())}")

    rng = np.random.default_rng(seed)
    held_out, canary_inputs, canary_targets = make_canaries(inputs, targets, num_classes, m, kind, rng)
    included = rng.random(m) < 0.5
    keep = np.ones(n, dtype=bool)
    keep[held_out] = False
    keep = torch.from_numpy(keep).to(inputs.device)
    data_inputs, data_targets = inputs[keep], targets[keep]

    def canary_gradients(chosen: np.ndarray, dtype) -> list:
        if chosen.size == 0:
            return [p.new_zeros((0, *p.shape), dtype=dtype) for p in params]
        index = torch.from_numpy(chosen).to(canary_inputs.device)
        grads = dpsgd.per_sample_gradients(model, loss_fn, canary_inputs[index], canary_targets[index])
        return [g.detach() for g in grads]

    before = per_example_losses(model, loss_fn, canary_inputs, canary_targets)
    run = _CanaryRun(model, loss_fn, data_inputs, data_targets, config, params, steps=steps, sampling_rate=q, lr=lr,
                     generator=generator, members=np.flatnonzero(included), canary_gradients=canary_gradients,
                     seed=seed)
    for _ in run.updates():
        pass
    scores = before - per_example_losses(model, loss_fn, canary_inputs, canary_targets)
    if not np.isfinite(scores).all():
        raise FloatingPointError("the canaries' losses are not finite after the run (diverged? try a smaller lr)")
    return audit_one_run(scores, included, delta=delta, confidence=confidence, guesses=pairs, seed=seed,
                         epsilon_claimed=run.claimed_epsilon(delta))
