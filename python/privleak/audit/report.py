"""The report of ``privleak audit run --out``: one-run audits over a sweep of claimed epsilons.

:func:`audit_sweep` runs :func:`privleak.audit.one_run.audit_digits` for each mechanism and each
claimed epsilon and returns one row per run: the accountant's epsilon, the empirical lower bound
with its confidence, the guesses behind it, the noise, and the Bayes capacity of one update of
the run (:mod:`privleak.capacity`). :func:`write_audit_report` writes them as audit.csv,
lower_bound_vs_epsilon.png and audit.md.

**The capacity of one update.** audit_digits runs full-batch DP-SGD with flat clipping at c = 1,
so one released update is the mechanism's release of the average of L = images + included
canaries clipped gradients: the mechanism's ``log_capacity`` for P parameters in one tensor
(7850 for the logistic regression, 13426 for the paper CNN) and batch size L, the mechanism being
:func:`privleak.audit.one_run.calibrated_config`'s. For the Gaussian that is
:func:`privleak.capacity.dpsgd_gaussian` (P, 1, sigma, L) with sigma the per-step noise multiplier
(sqrt(T) x the analytic calibration of the run's (epsilon, delta)); for VMF
:func:`privleak.capacity.dpsgd_vmf` (P, kappa) with kappa = epsilon / (2 T).

The files go through :mod:`privleak.report`; the CSV has one column per parameter of the
mechanisms audited (``noise_multiplier`` and ``kappa`` always, nan where a mechanism has none).
"""
from __future__ import annotations

import math
import os
import time
from typing import Callable, Optional, Sequence, Union

from privleak import report, validation
from privleak.audit.one_run import calibrated_config, default_delta

#: The mechanisms whose parameters audit.csv always has columns for.
_DEFAULT_MECHANISMS = ("gaussian", "vmf")


def csv_fields(mechanisms: Sequence[str] = _DEFAULT_MECHANISMS) -> tuple:
    """audit.csv's columns, in order, for rows of ``mechanisms``."""
    return ("mechanism", "model", "epsilon", "epsilon_claimed", "delta", "confidence", "lower_bound", "fraction",
            "guesses", "correct", "canaries", "included", "steps", "images",
            *report.parameter_columns((*_DEFAULT_MECHANISMS, *mechanisms)), "log_capacity", "log2_capacity", "seed",
            "seconds")


#: audit.csv's columns for Gaussian and VMF rows.
CSV_FIELDS = csv_fields()

#: Trainable parameters of the models audit_digits can train (audit_digits' ``model``).
MODEL_PARAMETERS = {"logistic": 784 * 10 + 10, "paper-cnn": 13426}

_MODEL_NAMES = {"logistic": "logistic regression (784 -> 10)",
                "paper-cnn": "paper CNN (privleak.models.PaperNetwork)"}


def update_capacity(mechanism: str, epsilon: float, delta: float, steps: int, batch_size: int,
                    model: str = "logistic"):
    """The Bayes capacity (:class:`privleak.capacity.LogCapacity`) of one update of audit_digits'
    run: full batch of ``batch_size`` = images + included canaries, clip norm 1 (module docstring)."""
    config = calibrated_config(mechanism, epsilon, delta, steps)
    return config.mechanism.log_capacity([MODEL_PARAMETERS[model]], config.clipping(1), batch_size)


def audit_row(mechanism: str, epsilon: float, result, *, steps: int, images: int, model: str, seed: int,
              seconds: float = math.nan) -> dict:
    """One row of the report: ``result`` (:class:`~privleak.audit.one_run.OneRunAudit`) of
    audit_digits(``mechanism``, ``epsilon``, ...) with its noise and its update's capacity."""
    config = calibrated_config(mechanism, epsilon, result.delta, steps)
    parameters = report.parameter_cells(config.mechanism, report.parameter_columns((*_DEFAULT_MECHANISMS, mechanism)))
    log_capacity = update_capacity(mechanism, epsilon, result.delta, steps, images + result.included, model)
    return {"mechanism": mechanism, "model": model, "epsilon": float(epsilon),
            "epsilon_claimed": float(result.epsilon_claimed), "delta": float(result.delta),
            "confidence": float(result.confidence), "lower_bound": float(result.epsilon_lower),
            "fraction": float(result.epsilon_lower / result.epsilon_claimed), "guesses": result.guesses,
            "correct": result.correct, "canaries": result.canaries, "included": result.included, "steps": steps,
            "images": images, **parameters, "log_capacity": log_capacity.log,
            "log2_capacity": log_capacity.bits, "seed": seed, "seconds": float(seconds)}


def audit_sweep(mechanism: Union[str, Sequence[str]], epsilons: Sequence[float], *, delta: Optional[float] = None,
                steps: int = 10, canaries: int = 1000, images: int = 300, secure: bool = False,
                confidence: float = 0.95, seed: int = 0, model: str = "logistic",
                progress: Optional[Callable[[str, int, int], None]] = None) -> list:
    """audit_digits for each mechanism (a name or a sequence of names) and each claimed epsilon;
    one :func:`audit_row` dict per run, mechanisms outer, epsilons in the given order.

    ``delta`` None: :func:`privleak.audit.one_run.default_delta` (1e-5 for the Gaussian, 0 for a
    pure-DP mechanism such as VMF). The other knobs are audit_digits'.
    ``progress(stage, done, total)`` is called after each run (the CLI draws a tqdm bar with it).
    """
    from privleak.audit.one_run import audit_digits
    from privleak.dpsgd import mechanism as registry

    mechanisms = (mechanism,) if isinstance(mechanism, str) else tuple(mechanism)
    if not mechanisms:
        raise ValueError("mechanism: give at least one mechanism")
    for name in mechanisms:
        validation.choice(name, "mechanism", registry.names())
    if isinstance(epsilons, (str, bytes)) or not isinstance(epsilons, Sequence) or not epsilons:
        raise validation.ArgumentTypeError(f"epsilons must be a non-empty sequence of numbers, got {epsilons!r}")
    epsilons = [validation.positive(e, f"epsilons[{i}]") for i, e in enumerate(epsilons)]
    model = validation.choice(model, "model", tuple(MODEL_PARAMETERS))
    total = len(mechanisms) * len(epsilons)
    rows = []
    for name in mechanisms:
        run_delta = default_delta(name) if delta is None else delta
        for epsilon in epsilons:
            started = time.perf_counter()
            result = audit_digits(name, epsilon, delta=run_delta, steps=steps, canaries=canaries, images=images,
                                  secure=secure, confidence=confidence, seed=seed, model=model)
            rows.append(audit_row(name, epsilon, result, steps=steps, images=images, model=model, seed=seed,
                                  seconds=time.perf_counter() - started))
            if progress is not None:
                progress("one-run audits", len(rows), total)
    return rows


# ----------------------------------------------------------------------------- outputs


def _plot(rows: list, path: str) -> None:
    claimed = [r["epsilon_claimed"] for r in rows]
    low, high = min(claimed), max(claimed)
    decades = high / low >= 10
    line = [low, high] if not decades else [low * (high / low) ** (i / 50) for i in range(51)]
    with report.figure(path, legend_fontsize=7) as (axes,):
        axes.plot(line, line, ":", color="grey", label="lower bound = claim (a tight audit)")
        for mechanism, mine in report.by_mechanism(rows, lambda r: r["mechanism"]):
            report.curve(axes, mechanism, [r["epsilon_claimed"] for r in mine], [r["lower_bound"] for r in mine],
                         label=f"{report.legend_label(mechanism)}: lower bound, "
                               f"{mine[0]['confidence']:.0%} confidence")
        if decades:
            axes.set_xscale("log")
            axes.set_yscale("symlog", linthresh=low)
        axes.set_ylim(bottom=0.0)
        axes.set_xlabel("claimed epsilon (privleak's accountant)")
        axes.set_ylabel("one-run audited lower bound on epsilon")
        axes.set_title("markers: the true epsilon is >= the marker w.p. >= confidence", fontsize=8)


def _mechanisms(rows: list) -> tuple:
    return tuple(dict.fromkeys(r["mechanism"] for r in rows))


def report_markdown(rows: list) -> str:
    """audit.md: the parameters, one table row per run, what the numbers mean."""
    first = rows[0]
    mechanisms = _mechanisms(rows)
    columns = report.parameter_columns((*_DEFAULT_MECHANISMS, *mechanisms))
    lines = [
        "# privleak audit run",
        "",
        "One-run privacy audits (Steinke, Nasr and Jagielski, NeurIPS 2023) of full-batch DP-SGD on the shipped "
        f"MNIST digits. Run time {sum(r['seconds'] for r in rows):.0f} s.",
        "",
        "## Parameters",
        "",
        f"- model: {_MODEL_NAMES[first['model']]}, {MODEL_PARAMETERS[first['model']]} parameters, clip norm 1",
        f"- data: the first {first['images']} images of mnist-5k, {first['steps']} full-batch steps",
        f"- mechanisms: {', '.join(mechanisms)}; each calibrated so that privleak's accountant gives the run of "
        "steps exactly the claimed (epsilon, delta) (privleak.audit.one_run.calibrated_config)",
        f"- canaries: {first['canaries']} Dirac gradient canaries, each included with probability 1/2",
        f"- confidence {first['confidence']:g}, seed {first['seed']}",
        "",
        "## Results",
        "",
    ]
    lines += report.markdown_table(
        ["mechanism", "claimed epsilon", "delta", "lower bound", "fraction of claim", "confidence", "correct",
         "guesses", "canaries", "included", "steps", *(report.column_title(c) for c in columns),
         "log capacity (nats)", "log2 capacity (bits)"],
        ([r["mechanism"], r["epsilon_claimed"], r["delta"], r["lower_bound"], r["fraction"], r["confidence"],
          r["correct"], r["guesses"], r["canaries"], r["included"], r["steps"], *(r[c] for c in columns),
          r["log_capacity"], r["log2_capacity"]] for r in rows))
    contradicted = [r for r in rows if r["lower_bound"] > r["epsilon_claimed"]]
    lines += [
        "",
        "## What the numbers mean",
        "",
        "The claimed epsilon is what privleak's accountant says the whole run satisfies. The lower bound is what "
        "the audit proves: if the run were (epsilon', delta)-DP for any epsilon' below it, as many right guesses "
        "(correct of guesses) would happen with probability at most 1 - confidence, so the true epsilon is at "
        "least the lower bound with that confidence. A bound below the claim does not show the claim is loose "
        "(one-run audits are far from tight, and a white-box auditor of one run cannot reach the claim at large "
        "epsilon); a bound above it shows the run is less private than claimed"
        + (f" — {len(contradicted)} run(s) here do that, or this is the 1 - confidence chance of a false alarm. "
           if contradicted else " (none here does). ")
        + "The Bayes capacity is that of the channel of one released update (the noisy average of "
        "images + included clipped gradients): how much one update can tell an attacker about the batch, "
        "whatever the prior, independently of how the run composes its steps.",
        "",
        "![lower bound vs claimed epsilon](lower_bound_vs_epsilon.png)",
        "",
        "Per-run numbers, full precision: audit.csv.",
        "",
    ]
    return "\n".join(lines)


def write_audit_report(rows: list, out: str) -> dict:
    """audit.csv, lower_bound_vs_epsilon.png and audit.md in ``out`` (created if needed); their paths."""
    if not rows:
        raise ValueError("rows: nothing to report")
    os.makedirs(out, exist_ok=True)
    paths = {name: os.path.join(out, name) for name in ("audit.csv", "lower_bound_vs_epsilon.png", "audit.md")}
    report.write_csv(rows, paths["audit.csv"], csv_fields(_mechanisms(rows)))
    _plot(rows, paths["lower_bound_vs_epsilon.png"])
    with open(paths["audit.md"], "w") as stream:
        stream.write(report_markdown(rows))
    return paths
