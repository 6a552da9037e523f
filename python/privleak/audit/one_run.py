"""One-run privacy auditing (Steinke, Nasr and Jagielski, "Privacy Auditing with One (1)
Training Run", NeurIPS 2023).

**The experiment.** m canaries, each included in the run independently with probability 1/2
(S_i = +1 in, -1 out). After the run the auditor computes a score per canary from what the run
released, guesses "in" for the k_+ highest scores and "out" for the k_- lowest, and abstains on
the rest: r = k_+ + k_- guesses, v of them correct.

**The bound.** If the run is (eps, delta)-DP with respect to each canary's inclusion, then
(Theorem 5.2 of the paper; Theorem 3.1 for delta = 0), with f(k) = P[Binomial(r, q) >= k],
q = e^eps / (1 + e^eps) the accuracy of eps-randomised response (f(k) = 1 for k <= 0),

    P[W >= v] <= f(v) + 2 m delta max_{i = 1..m} (f(v - i) - f(v)) / i.

For i > v the ratio is (1 - f(v)) / i < (1 - f(v)) / v, so the maximum is over i = 1..v, and
f(v - i) - f(v) = P[v - i <= B <= v - 1] is a sum of binomial probabilities: :func:`one_run_p_value`
forms it by cumulating pmf(v - 1), pmf(v - 2), ... (a sum of positive terms, no cancellation),
and f(v) with ``scipy.stats.binom.sf``: exact binomial tails, no normal approximation. With
delta = 0 it is f(v), the tail of Binomial(r, q).

:func:`one_run_epsilon_lower_bound` returns the eps at which this p-value first exceeds
1 - confidence: every eps' below the returned value has p(eps') <= 1 - confidence, i.e. the claim
"(eps', delta)-DP" is rejected at that confidence. Bisection keeps that invariant at its low end
and returns the low end, so round-off in the root can only understate the bound. Returning the
first crossing is sound even if the p-value were not monotone in eps (if the true eps* is below
the returned value, the test at eps* rejected, which happens with probability <= 1 - confidence);
the tests check that it is monotone anyway, so first and last crossings agree.

**Choosing the guesses.** The bound holds for any rule that fixes (k_+, k_-) before seeing the
membership. :func:`audit_one_run` takes one pair, or several pairs, in which case each is tested
at level (1 - confidence) / (number of pairs) (Bonferroni) and the best bound is reported, so the
maximum over the pairs is still a (confidence)-level lower bound. Ties in the scores are broken by
a seeded permutation that does not depend on the membership.

**White-box gradient canaries in DP-SGD** (:func:`audit_dpsgd`). A canary is a sample whose
per-sample gradient the auditor chooses: a Dirac gradient (norm c on one coordinate; the m
canaries on the m coordinates that the data's clipped per-sample gradients touch least at the
start, chosen before any canary is drawn, so the choice does not depend on the membership) or a
random direction (a uniform unit vector times c; the data's gradient projects onto every such
direction, which makes these canaries much weaker on a real model). The
gradient is already at the clip norm, so clipping leaves it unchanged, and it goes through the
same step as the data (:class:`privleak.dpsgd.DPOptimizer`, hence the fused clipping kernel and
privleak's noise, plain or secure, or VMF). Each step, each included canary is sampled like any
other example (Poisson, the run's rate q; q = 1 puts every included canary in every step), so the
canaries are ordinary members of the data set and the accountant's epsilon for the run
(:func:`privleak.dpsgd.privacy_report`) is exactly the claim the audit tests. The score of canary
i is sum_t <u_t, d_i>, the released update u_t of every step projected on the canary's direction
d_i: a white-box auditor that sees every update. For full-batch Gaussian DP-SGD, where the data
leave a Dirac canary's coordinate alone, this sum is the Gaussian mechanism with sensitivity
sqrt(T) c / L in S_i, i.e. everything the run says about S_i; the audit then reaches what a
one-run audit of that Gaussian mechanism reaches (the tests compare the two). Subsampled runs
(q < 1) are audited as well, but their accountant's epsilon includes amplification by sampling,
which a one-run audit with these scores is far from reaching.

Default guesses: k_+ = k_- = m // 20 (for Gaussian scores at eps 2-8 and m = 1000-3000 this was
within 10% of the best fixed fraction, and a single pair needs no correction).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Sequence, Union

import numpy as np
import scipy.special
import scipy.stats

from privleak import validation

#: Largest m x P canary matrix (random-direction canaries) or m x P block of canary rows per step
#: that :func:`audit_dpsgd` materialises; larger audits are refused before anything is allocated.
MAX_CANARY_ELEMENTS = 2 ** 28


class OneRunAudit(NamedTuple):
    """Result of a one-run audit."""

    epsilon_lower: float  #: the audited lower bound on epsilon at ``delta``, ``confidence``
    epsilon_claimed: Optional[float]  #: the accountant's epsilon for the run (audit_dpsgd), else None
    delta: float
    confidence: float
    canaries: int  #: m
    included: int  #: canaries included in the run
    guesses: int  #: r = k_plus + k_minus
    correct: int  #: v
    k_plus: int  #: "in" guesses (highest scores)
    k_minus: int  #: "out" guesses (lowest scores)


# ----------------------------------------------------------------------------- the bound


def _check_counts(canaries, guesses, correct) -> tuple[int, int, int]:
    m = validation.integer(canaries, "canaries", low=1)
    r = validation.integer(guesses, "guesses", low=0, high=m)
    v = validation.integer(correct, "correct", low=0, high=r)
    return m, r, v


def _p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    if v == 0:
        return 1.0
    q = float(scipy.special.expit(epsilon))
    tail = float(scipy.stats.binom.sf(v - 1, r, q))  # f(v) = P[B >= v]
    if delta == 0.0:
        return min(tail, 1.0)
    below = scipy.stats.binom.pmf(np.arange(v - 1, -1, -1), r, q)  # pmf(v - 1), ..., pmf(0)
    window = np.cumsum(below)  # window[i - 1] = P[v - i <= B <= v - 1] = f(v - i) - f(v)
    alpha = float(np.max(window / np.arange(1, v + 1)))
    return min(tail + 2.0 * m * delta * alpha, 1.0)


def one_run_p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float = 0.0) -> float:
    """Upper bound on P[>= ``correct`` of ``guesses`` guesses right] for a run that is
    (epsilon, delta)-DP in each of ``canaries`` canaries (module docstring): the p-value of the
    claim "(epsilon, delta)-DP" given the observed count."""
    m, r, v = _check_counts(canaries, guesses, correct)
    epsilon = validation.non_negative(epsilon, "epsilon", allow_inf=True)
    delta = validation.probability(delta, "delta")
    return _p_value(m, r, v, epsilon, delta)


def _lower_bound(m: int, r: int, v: int, delta: float, significance: float) -> float:
    if _p_value(m, r, v, 0.0, delta) > significance:
        return 0.0
    low, high = 0.0, 1.0
    while _p_value(m, r, v, high, delta) <= significance:
        # expit(eps) rounds to 1 below eps = 40, where P[B >= v] = 1 for any v <= r
        low, high = high, 2.0 * high
    while True:  # invariant: p(low) <= significance < p(high)
        middle = 0.5 * (low + high)
        if not low < middle < high or high - low <= 1e-12 * high:
            return low
        if _p_value(m, r, v, middle, delta) <= significance:
            low = middle
        else:
            high = middle


def one_run_epsilon_lower_bound(canaries: int, guesses: int, correct: int, *, delta: float = 0.0,
                        confidence: float = 0.95) -> float:
    """The largest epsilon that ``correct`` right guesses out of ``guesses`` (m = ``canaries``)
    reject at ``confidence``: every epsilon below it has :func:`one_run_p_value` <= 1 - confidence. 0 when
    even epsilon = 0 is not rejected."""
    m, r, v = _check_counts(canaries, guesses, correct)
    delta = validation.probability(delta, "delta", open_high=True)
    confidence = validation.probability(confidence, "confidence", open_low=True, open_high=True)
    return _lower_bound(m, r, v, delta, 1.0 - confidence)


# ----------------------------------------------------------------------------- guesses from scores


def _check_guess_pairs(guesses, m: int) -> list[tuple[int, int]]:
    if guesses is None:
        k = max(1, m // 20)
        return [(k, k)] if 2 * k <= m else [(0, m)]
    if isinstance(guesses, (str, bytes)) or not isinstance(guesses, Sequence) or not guesses:
        raise validation.ArgumentTypeError("guesses must be a (k_plus, k_minus) pair or a non-empty sequence of "
                                           f"pairs, got {guesses!r}")
    pairs = [guesses] if not isinstance(guesses[0], Sequence) else list(guesses)
    checked = []
    for j, pair in enumerate(pairs):
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise validation.ArgumentTypeError(f"guesses[{j}] must be a (k_plus, k_minus) pair, got {pair!r}")
        k_plus = validation.integer(pair[0], f"guesses[{j}][0] (k_plus)", low=0)
        k_minus = validation.integer(pair[1], f"guesses[{j}][1] (k_minus)", low=0)
        if k_plus + k_minus > m:
            raise ValueError(f"guesses[{j}]: k_plus + k_minus must be <= the number of canaries {m}, "
                             f"got {k_plus} + {k_minus}")
        checked.append((k_plus, k_minus))
    return checked


def _as_vector(values, name: str, dtype) -> np.ndarray:
    if hasattr(values, "detach"):
        values = values.detach().cpu().numpy()
    if isinstance(values, (str, bytes)):
        raise validation.ArgumentTypeError(f"{name} must be a 1-d array, got {type(values).__name__}")
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as error:
        raise validation.ArgumentTypeError(f"{name} must be a 1-d array: {error}") from None
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-d array, got shape {array.shape}")
    if dtype is bool:
        if array.dtype != np.bool_ and not (np.issubdtype(array.dtype, np.integer) and np.isin(array, (0, 1)).all()):
            raise validation.ArgumentTypeError(f"{name} must be booleans (or 0/1), got dtype {array.dtype}")
        return array.astype(bool)
    if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)) \
            or array.dtype == np.bool_:
        raise validation.ArgumentTypeError(f"{name} must be real numbers, got dtype {array.dtype}")
    array = array.astype(np.float64)
    if not np.isfinite(array).all():
        raise ValueError(f"{name} must be finite; entries {np.flatnonzero(~np.isfinite(array))[:10].tolist()} are not")
    return array


def audit_one_run(scores, included, *, delta: float = 0.0, confidence: float = 0.95,
                 guesses: Union[None, Sequence[int], Sequence[Sequence[int]]] = None, seed: int = 0,
                 epsilon_claimed: Optional[float] = None) -> OneRunAudit:
    """The one-run audit of ``scores`` (higher = more likely included) against the true
    membership ``included`` (booleans), both of length m.

    ``guesses`` is a (k_plus, k_minus) pair, or a sequence of pairs tested with a Bonferroni
    correction (the best bound is reported); default (m // 20, m // 20). Ties are broken by a
    permutation seeded with ``seed``, independent of the membership.
    """
    scores = _as_vector(scores, "scores", float)
    included = _as_vector(included, "included", bool)
    if scores.shape != included.shape:
        raise ValueError(f"scores and included must have the same length, got {scores.size} and {included.size}")
    delta = validation.probability(delta, "delta", open_high=True)
    confidence = validation.probability(confidence, "confidence", open_low=True, open_high=True)
    seed = validation.integer(seed, "seed", low=0)
    if epsilon_claimed is not None:
        epsilon_claimed = validation.non_negative(epsilon_claimed, "epsilon_claimed", allow_inf=True)
    m = scores.size
    pairs = _check_guess_pairs(guesses, m)
    tie_break = np.random.default_rng(seed).permutation(m)
    order = np.lexsort((tie_break, scores))  # ascending score, ties in the seeded order
    truth = included[order]
    significance = (1.0 - confidence) / len(pairs)
    best = None
    for k_plus, k_minus in pairs:
        correct = int(truth[m - k_plus:].sum()) if k_plus else 0
        correct += int((~truth[:k_minus]).sum())
        bound = _lower_bound(m, k_plus + k_minus, correct, delta, significance)
        if best is None or bound > best.epsilon_lower:
            best = OneRunAudit(bound, epsilon_claimed, delta, confidence, m, int(included.sum()), k_plus + k_minus,
                               correct, k_plus, k_minus)
    return best


# ----------------------------------------------------------------------------- DP-SGD with gradient canaries


def _data_mass(data_grads, clip: list[float], per_layer: bool) -> np.ndarray:
    """Per coordinate, the sum over samples of |clipped per-sample gradient| (flat, float64)."""
    import torch

    flat = torch.cat([g.reshape(g.shape[0], -1).to(torch.float64) for g in data_grads], dim=1)
    if per_layer:
        parts, start = [], 0
        for g, c in zip(data_grads, clip):
            size = g[0].numel()
            part = flat[:, start:start + size]
            norms = torch.linalg.vector_norm(part, dim=1, keepdim=True)
            parts.append(part * torch.clamp(c / norms.clamp_min(1e-300), max=1.0))
            start += size
        flat = torch.cat(parts, dim=1)
    else:
        norms = torch.linalg.vector_norm(flat, dim=1, keepdim=True)
        flat = flat * torch.clamp(clip[0] / norms.clamp_min(1e-300), max=1.0)
    return flat.abs().sum(0).cpu().numpy()


def _canary_gradients(kind: str, m: int, sizes: list[int], clip: list[float], per_layer: bool,
                      rng: np.random.Generator, data_mass: Optional[np.ndarray] = None):
    """Dirac: (coordinates, values), the m quietest coordinates (least ``data_mass``, ties in a
    seeded random order) and the gradient's value there (the clip norm of its tensor). Random:
    ((m, P) float32 unit directions, the gradients as float32 rows: direction times the norm that
    clipping leaves unchanged)."""
    total = sum(sizes)
    if kind == "dirac":
        if m > total:
            raise ValueError(f"canaries: {m} Dirac canaries need as many coordinates, the model has {total}; "
                             "use fewer canaries or canary='random'")
        mass = np.zeros(total) if data_mass is None else data_mass
        coordinates = np.lexsort((rng.permutation(total), mass))[:m]
        if per_layer:
            tensor_of = np.searchsorted(np.cumsum(sizes), coordinates, side="right")
            values = np.asarray(clip, dtype=np.float64)[tensor_of]
        else:
            values = np.full(m, clip[0])
        return coordinates, values
    directions = rng.standard_normal((m, total)).astype(np.float32)
    if per_layer:  # each tensor's part at its own clip norm c_t
        start = 0
        for size, c in zip(sizes, clip):
            part = directions[:, start:start + size]
            part *= (c / np.linalg.norm(part.astype(np.float64), axis=1, keepdims=True)).astype(np.float32)
            start += size
        norm = math.sqrt(sum(c * c for c in clip))
        return directions / np.float32(norm), directions  # unit directions, gradients
    directions /= np.linalg.norm(directions.astype(np.float64), axis=1, keepdims=True).astype(np.float32)
    return directions, directions * np.float32(clip[0])


class _CanaryRun:
    """DP-SGD of ``params`` (SGD at ``lr``, :class:`privleak.dpsgd.DPOptimizer` under ``config``)
    on the data plus the included canaries ``members`` (indices into the canaries): each step
    Poisson-samples the data and the included canaries at ``sampling_rate`` (from a torch generator
    seeded with ``seed``: data first, then canaries), computes the data's per-sample gradients and
    appends ``canary_gradients(chosen, dtype)`` (one (k, *p.shape) tensor per parameter for the k
    chosen canaries) after them. Shared by the white-box (:func:`audit_dpsgd`) and black-box
    (:func:`privleak.audit.black_box.audit_dpsgd_black_box`) audits."""

    def __init__(self, model, loss_fn, inputs, targets, config, params, *, steps, sampling_rate, lr, generator,
                 members, canary_gradients, seed):
        import torch

        from privleak import dpsgd

        self.model, self.loss_fn, self.inputs, self.targets = model, loss_fn, inputs, targets
        self.params, self.steps, self.q, self.members = params, steps, sampling_rate, members
        self.canary_gradients = canary_gradients
        self.batches = torch.Generator().manual_seed(seed)
        self.dataset_size = inputs.shape[0] + members.size
        self.optimizer = dpsgd.DPOptimizer(torch.optim.SGD(params, lr=lr), config, sampling_rate * self.dataset_size,
                                           generator=generator)

    def updates(self):
        """Runs the steps, yielding each step's released update."""
        import torch

        from privleak import dpsgd

        inputs, targets, q = self.inputs, self.targets, self.q
        for _ in range(self.steps):
            take = torch.rand(inputs.shape[0], generator=self.batches) < q
            chosen = self.members[(torch.rand(self.members.size, generator=self.batches) < q).numpy()]
            if bool(take.any()):
                data = [g.detach() for g in dpsgd.per_sample_gradients(self.model, self.loss_fn, inputs[take],
                                                                       targets[take])]
            else:
                data = [p.new_zeros((0, *p.shape)) for p in self.params]
            extra = self.canary_gradients(chosen, data[0].dtype)
            per_sample = [torch.cat([g, part.to(g.dtype)]).contiguous() for g, part in zip(data, extra)]
            yield self.optimizer.step(per_sample)

    def claimed_epsilon(self, delta: float) -> float:
        """The accountant's epsilon for the steps taken (data set = data + included canaries)."""
        return self.optimizer.privacy_report(dataset_size=self.dataset_size, delta=delta).epsilon


def _white_box_canaries(kind: str, m: int, params: list, clip: list[float], per_layer: bool,
                        rng: np.random.Generator, data_mass: Optional[np.ndarray] = None):
    """The m white-box gradient canaries of :func:`_canary_gradients` on ``params``, as two functions:
    ``canary_gradients(chosen, dtype)``, the rows of the canaries ``chosen`` (indices), one
    (k, *p.shape) tensor per parameter; and ``project(update)``, an update (one tensor per
    parameter) projected on each canary's direction (float64, length m). Shared by
    :func:`audit_dpsgd` and :func:`privleak.audit.federated.audit_fl`."""
    import torch

    sizes = [p.numel() for p in params]
    total = sum(sizes)
    directions, rows = _canary_gradients(kind, m, sizes, clip, per_layer, rng, data_mass)
    projection = directions.astype(np.float64) if kind == "random" else None
    device = params[0].device

    def canary_gradients(chosen: np.ndarray, dtype) -> list:
        if kind == "dirac":
            block = np.zeros((chosen.size, total), dtype=np.float32)
            block[np.arange(chosen.size), directions[chosen]] = rows[chosen]
        else:
            block = rows[chosen]
        block = torch.from_numpy(block).to(device=device, dtype=dtype)
        return [part.reshape(-1, *p.shape) for part, p in zip(block.split(sizes, dim=1), params)]

    def project(update) -> np.ndarray:
        flat = torch.cat([u.reshape(-1) for u in update]).to(torch.float64).cpu().numpy()
        return flat[directions] if kind == "dirac" else projection @ flat

    return canary_gradients, project



def _check_training_data(model, loss_fn, inputs, targets) -> None:
    """The model, loss and (inputs, targets) of an audited run, each error naming its argument."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise validation.ArgumentTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise validation.ArgumentTypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    for name, value in (("inputs", inputs), ("targets", targets)):
        if not isinstance(value, torch.Tensor):
            raise validation.ArgumentTypeError(f"{name} must be a torch tensor, got {type(value).__name__}")
        if value.ndim < 1 or value.shape[0] == 0:
            raise ValueError(f"{name} must have a non-empty leading sample dimension, got shape {tuple(value.shape)}")
    if inputs.shape[0] != targets.shape[0]:
        raise ValueError(f"inputs and targets must have as many samples, got {inputs.shape[0]} and {targets.shape[0]}")


def _check_run(model, config, delta: float, guesses, m: int):
    """Checks shared by every audited DP-SGD run: the trainable parameters, ``config``, the guess
    pairs, and that the run has a claimed epsilon (the mechanism gives one update a finite epsilon
    at ``delta``: not so for a Gaussian without noise or at delta = 0). Returns (params, checked
    config, guess pairs)."""
    from privleak.dpsgd.config import check_config

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters")
    config = check_config(config, len(params))
    pairs = _check_guess_pairs(guesses, m)
    if math.isinf(_update_epsilon(config.mechanism, delta)):
        raise ValueError(f"a {config.mechanism.name} run with {config.mechanism} has no claimed epsilon at "
                         f"delta = {delta}: it needs noise (and delta > 0 unless the mechanism is pure DP)")
    return params, config, pairs


def _update_epsilon(noise, delta: float) -> float:
    """``noise.update_epsilon(delta)``, inf where the mechanism has none at ``delta``."""
    try:
        return float(noise.update_epsilon(delta))
    except ValueError:
        return math.inf


def _check_canary_run(config, m: int, params) -> list:
    """The gradient-canary audits' rows must fit; returns the per-tensor clip norms of ``config``
    (already checked) for ``params``: one per tensor with per-layer clipping, else the flat one."""
    total = sum(p.numel() for p in params)
    if m * total > MAX_CANARY_ELEMENTS:
        raise ValueError(f"canaries: {m} canaries x {total} parameters is more than {MAX_CANARY_ELEMENTS} elements "
                         "of canary gradients; use fewer canaries or a smaller model")
    return list(config.clipping(len(params)).norms)


def audit_dpsgd(model, loss_fn, inputs, targets, config, *, steps: int, canaries: int = 1000,
                sampling_rate: float = 1.0, lr: float = 0.1, delta: float = 1e-5, confidence: float = 0.95,
                guesses=None, canary: str = "dirac", seed: int = 0, generator=None) -> OneRunAudit:
    """One-run audit of a DP-SGD run of ``model`` on (``inputs``, ``targets``) with white-box
    gradient canaries (module docstring).

    Trains ``model`` in place for ``steps`` steps of :class:`privleak.dpsgd.DPOptimizer` (SGD at
    ``lr``) under ``config`` (any registered mechanism). Each step Poisson-samples the data and the included
    canaries at ``sampling_rate`` (1: full batch, every included canary every step); the expected
    batch size is sampling_rate x (data + included canaries). ``canary`` is "dirac" (norm c on one
    coordinate each, distinct coordinates; needs as many parameters as canaries) or "random"
    (uniform unit directions times c; with per-layer clipping each tensor's part at its c_t).
    ``generator`` is the noise generator: a :class:`~privleak.mechanisms.NoiseGenerator` (default,
    seeded with ``seed``) or a :class:`~privleak.mechanisms.SecureNoiseGenerator` (Gaussian only).
    ``seed`` also draws the membership (each canary in with probability 1/2), the directions, the
    batches and the tie-break.

    Returns :class:`OneRunAudit` with the lower bound at (``delta``, ``confidence``) and the
    accountant's epsilon for the same run (:meth:`DPOptimizer.privacy_report`, Poisson sampling,
    data set = data + included canaries) as ``epsilon_claimed``.
    """

    from privleak import dpsgd
    from privleak import mechanisms as _mechanisms

    _check_training_data(model, loss_fn, inputs, targets)
    steps = validation.integer(steps, "steps", low=1)
    m = validation.integer(canaries, "canaries", low=1)
    q = validation.probability(sampling_rate, "sampling_rate", open_low=True)
    lr = validation.non_negative(lr, "lr")
    delta = validation.probability(delta, "delta", open_high=True)
    confidence = validation.probability(confidence, "confidence", open_low=True, open_high=True)
    seed = validation.integer(seed, "seed", low=0)
    kind = validation.choice(canary, "canary", ("dirac", "random"))
    params, config, pairs = _check_run(model, config, delta, guesses, m)
    if generator is None:
        generator = _mechanisms.NoiseGenerator(seed)
    _mechanisms._check_generator(generator)
    clip = _check_canary_run(config, m, params)

    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    mass = None
    if kind == "dirac":  # the coordinates the data's clipped gradients touch least at the start
        mass = _data_mass(dpsgd.per_sample_gradients(model, loss_fn, inputs, targets), clip, config.per_layer)
    canary_gradients, project = _white_box_canaries(kind, m, params, clip, config.per_layer, rng, mass)

    scores = np.zeros(m)
    run = _CanaryRun(model, loss_fn, inputs, targets, config, params, steps=steps, sampling_rate=q, lr=lr,
                     generator=generator, members=np.flatnonzero(included), canary_gradients=canary_gradients,
                     seed=seed)
    for update in run.updates():
        scores += project(update)
    claimed = run.claimed_epsilon(delta)
    return audit_one_run(scores, included, delta=delta, confidence=confidence, guesses=pairs, seed=seed,
                         epsilon_claimed=claimed)


def default_delta(mechanism: str) -> float:
    """The default delta of a claim for ``mechanism``: 0 for a pure-DP mechanism (its one update
    has a finite epsilon at delta = 0), 1e-5 otherwise (the Gaussian)."""
    from privleak import dpsgd

    noise = dpsgd.mechanism.get(mechanism).calibrate(1.0, 1e-5)
    return 0.0 if math.isfinite(_update_epsilon(noise, 0.0)) else 1e-5


@functools.lru_cache(maxsize=256)
def calibrated_config(mechanism: str, epsilon: float, delta: float, steps: int):
    """The :class:`~privleak.dpsgd.DPSGDConfig` (clip norm 1) of ``steps`` full-batch DP-SGD steps
    whose run is (``epsilon``, ``delta``)-DP by privleak's accountant.

    The mechanism is the registered class's ``calibrate(e, delta)`` at the e for which its own
    accountant (``epsilon``, ``steps`` steps at sampling rate 1, add/remove neighbours) gives the
    run ``epsilon``: found by bisection on log e to the float resolution, keeping the side whose
    run epsilon is <= ``epsilon``. For the Gaussian the accountant at rate 1 is the exact
    composition, one Gaussian of multiplier sigma / sqrt(T), so sigma = sqrt(T) x the analytic
    calibration of (epsilon, delta) (Balle and Wang 2018); VMF steps are 2 kappa-DP each and
    compose to 2 kappa T, so kappa = epsilon / (2 T) at delta = 0; Laplace steps are
    1 / noise_multiplier-DP for add/remove and compose to T / noise_multiplier.
    """
    from privleak import dpsgd
    from privleak.dpsgd.mechanism import Sampling

    cls = dpsgd.mechanism.get(mechanism)
    epsilon = validation.positive(epsilon, "epsilon")
    delta = validation.probability(delta, "delta", open_high=True)
    steps = validation.integer(steps, "steps", low=1)
    full_batch = Sampling("poisson", 1.0, 1)

    def run_epsilon(log_e: float) -> float:
        return cls.calibrate(math.exp(log_e), delta).epsilon(steps, delta, full_batch)

    if math.isinf(run_epsilon(math.log(epsilon))):
        raise ValueError(f"the {mechanism} mechanism has no finite epsilon at delta = {delta}: "
                         "give a delta > 0")
    low = high = math.log(epsilon)
    while run_epsilon(low) > epsilon:  # bracket: run_epsilon(low) <= epsilon < run_epsilon(high)
        low -= math.log(2.0)
    while run_epsilon(high) <= epsilon:
        high += math.log(2.0)
    while True:
        middle = 0.5 * (low + high)
        if not low < middle < high:
            break
        if run_epsilon(middle) <= epsilon:
            low = middle
        else:
            high = middle
    return dpsgd.DPSGDConfig(1.0, cls.calibrate(math.exp(low), delta))


def audit_digits(mechanism: str = "gaussian", epsilon: float = 4.0, *, delta: float = 1e-5, steps: int = 10,
                 canaries: int = 1000, images: int = 300, secure: bool = False, confidence: float = 0.95,
                 seed: int = 0, model: str = "logistic") -> OneRunAudit:
    """The one-run audit ``privleak audit run`` performs: full-batch DP-SGD of a logistic regression
    (784 -> 10, 7850 parameters; ``model="paper-cnn"``: :class:`privleak.models.PaperNetwork` on the
    28 x 28 images, 13426 parameters), clip norm 1, on the first ``images`` of the shipped MNIST digits for ``steps``
    steps, calibrated so that the run claims ``epsilon`` at ``delta``, audited with ``canaries``
    Dirac gradient canaries (:func:`audit_dpsgd`).

    The noise comes from :func:`calibrated_config`. ``secure`` draws the Gaussian noise from a
    :class:`~privleak.mechanisms.SecureNoiseGenerator`.
    """
    import torch

    from privleak import datasets, dpsgd
    from privleak import mechanisms as _mechanisms

    mechanism = validation.choice(mechanism, "mechanism", dpsgd.mechanism.names())
    epsilon = validation.positive(epsilon, "epsilon")
    steps = validation.integer(steps, "steps", low=1)
    images = validation.integer(images, "images", low=1, high=5000)
    model = validation.choice(model, "model", ("logistic", "paper-cnn"))
    if secure and not dpsgd.mechanism.get(mechanism).secure:
        raise ValueError(f"secure: the {mechanism} mechanism has no secure mode")
    config = calibrated_config(mechanism, epsilon, delta, steps)
    data = datasets.mnist_5k()
    torch.manual_seed(seed)
    if model == "logistic":
        network, inputs = torch.nn.Linear(784, 10), data.images[:images].reshape(images, -1)
    else:
        from privleak.models import PaperNetwork

        network, inputs = PaperNetwork(data.image_shape, data.num_classes), data.images[:images]
    return audit_dpsgd(network, torch.nn.functional.cross_entropy, inputs, data.labels[:images], config, steps=steps,
                       canaries=canaries, delta=delta, confidence=confidence, seed=seed,
                       generator=_mechanisms.SecureNoiseGenerator() if secure else None)
