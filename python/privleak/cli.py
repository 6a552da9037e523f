"""The ``privleak`` command line.

Every option is checked before any work starts (no training, no data loaded): a bad value ends
the command with one line, ``privleak <command>: error: argument --option: ...``, and exit status
2. Each option's range is what the code behind it needs:

- numbers: ``type=`` functions built on :mod:`privleak.validation` (NaN and infinities are refused
  everywhere; epsilons > 0, delta in (0, 1) (an audited claim's delta in [0, 1), > 0 for a
  mechanism that is not pure DP, such as the Gaussian), confidence in (0, 1), SSIM threshold in
  [-1, 1), counts >= 1, images >= 2, audit releases in [2, 10^8], seed in [0, 2^63));
- mechanisms: the choices are the registered DP-SGD mechanisms (:func:`privleak.dpsgd.mechanism.names`)
  or, for ``audit release``, the audited releases (:data:`privleak.audit.release.MECHANISMS`);
  what a mechanism needs (delta > 0, a secure mode) is asked of the mechanism;
- after parsing: no value repeated in a list option, ``--out`` an existing writable folder or one
  that can be created, ``--dataset`` a known name or a readable folder holding IDX files with
  enough images for the clients asked for (only the files' headers are read).
"""
from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import sys
import tempfile

import privleak
from privleak import validation

#: Seeds go to torch.Generator.manual_seed (seed and seed + 1; it takes [-2^63, 2^64)), to
#: privleak's NoiseGenerator (modulo 2^64) and into fl.client_streams' hash. [0, 2^63) suits all
#: three and keeps distinct seeds distinct everywhere.
SEED_LIMIT = 2 ** 63

#: Images in the data sets privleak ships (privleak.datasets.LOADERS), so the CLI can check
#: --clients / --images without loading them. tests/test_bad_input_cli.py keeps this in step.
DATASET_SIZES = {"mnist-5k": 5000, "sklearn-digits": 1797}

_IDX_TYPE_CODES = (0x08, 0x09, 0x0B, 0x0C, 0x0D, 0x0E)  # privleak.datasets._IDX_TYPES


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (the usage is one --help away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _BadOption(Exception):
    """A value that fails a check made after parsing; the message starts with the option."""

    def __init__(self, option: str, message: str):
        super().__init__(f"argument {option}: {message}")


def _checked_type(parse, check, description: str, type_name: str):
    """A ``type=`` function: ``parse(text)`` (float or int) checked by a :mod:`privleak.validation`
    rule; argparse reports a refusal as one line naming the option."""

    def convert(text: str):
        try:
            value = parse(text)  # float() takes 'nan' and 'inf' too: validation refuses them
        except ValueError:
            value = text  # refused by the check as not a number
        try:
            return check(value, "value")
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {description}, got {text!r}") from None

    convert.__name__ = type_name  # argparse names the expected type with it
    return convert


def _real_type(description: str, **limits):
    return _checked_type(float, functools.partial(validation.real, **limits), description, "real number")


def _integer_type(description: str, **limits):
    return _checked_type(functools.partial(int, base=10), functools.partial(validation.integer, **limits),
                         description, "integer")


_EPSILON = _real_type("a finite number > 0", low=0.0, low_open=True)
_DELTA = _real_type("a number in (0, 1)", low=0.0, high=1.0, low_open=True, high_open=True)
_THRESHOLD = _real_type("an SSIM in [-1, 1)", low=-1.0, high=1.0, high_open=True)
_COUNT = _integer_type("an integer >= 1", low=1)
_IMAGES = _integer_type("an integer >= 2 (the prior is uniform over the images)", low=2)
_SEED = _integer_type("an integer in [0, 2^63)", low=0, high=SEED_LIMIT - 1)
_DELTA_OR_ZERO = _real_type("a number in [0, 1)", low=0.0, high=1.0, high_open=True)
_CONFIDENCE = _real_type("a number in (0, 1)", low=0.0, high=1.0, low_open=True, high_open=True)
_RELEASES = _integer_type("an integer in [2, 10^8]", low=2, high=10**8)  # privleak.audit.release.MAX_RELEASES


def _check_distinct(args: argparse.Namespace, names: tuple) -> None:
    for name in names:
        values = getattr(args, name, None)
        if values is None:
            continue
        seen = set()
        for value in values:
            if value in seen:
                raise _BadOption("--" + name.replace("_", "-"), f"{value:g} is given twice" if isinstance(value, float)
                                 else f"{value!r} is given twice")
            seen.add(value)


def _check_out(path: str) -> None:
    """--out: an existing folder we may write in, or a path whose nearest existing ancestor is one."""
    if not path:
        raise _BadOption("--out", "must name a folder, got ''")
    if os.path.lexists(path) and not os.path.exists(path):
        raise _BadOption("--out", f"{path!r} is a broken symbolic link")
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise _BadOption("--out", f"{path!r} exists and is not a folder")
        folder = path
    else:
        folder = os.path.dirname(os.path.abspath(path))
        while not os.path.lexists(folder):
            folder = os.path.dirname(folder)
        if not os.path.isdir(folder):
            raise _BadOption("--out", f"cannot create {path!r}: {folder!r} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise _BadOption("--out", f"cannot write in {folder!r}: permission denied")
    try:  # access() says yes to root even where writing fails (read-only or virtual file systems)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as error:
        raise _BadOption("--out", f"cannot create files in {folder!r} ({error.strerror or error})") from None


def _idx_header(path: str, ndim: int) -> tuple:
    """The sizes in an IDX file's header (its first 4 + 4 ndim bytes), checked against ``ndim``."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as stream:
            head = stream.read(4 + 4 * ndim)
    except (OSError, EOFError) as error:
        raise _BadOption("--dataset", f"cannot read {path!r}: {getattr(error, 'strerror', None) or error}") from None
    if len(head) < 4 + 4 * ndim or head[0] != 0 or head[1] != 0 or head[2] not in _IDX_TYPE_CODES or head[3] != ndim:
        raise _BadOption("--dataset", f"{path!r} is not a {ndim}-dimensional IDX file")
    return tuple(int.from_bytes(head[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))


def _dataset_size(name: str) -> int:
    """Images in --dataset, from DATASET_SIZES or from the IDX files' headers (datasets.load_idx's layout)."""
    if name in DATASET_SIZES:
        return DATASET_SIZES[name]
    known = ", ".join(DATASET_SIZES)
    if not os.path.exists(name):
        raise _BadOption("--dataset", f"must be one of {known} or a folder of IDX files; {name!r} does not exist")
    if not os.path.isdir(name):
        raise _BadOption("--dataset", f"must be one of {known} or a folder of IDX files; {name!r} is not a folder")
    if not os.access(name, os.R_OK | os.X_OK):
        raise _BadOption("--dataset", f"cannot read folder {name!r}: permission denied")
    files = {}
    for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
        found = [os.path.join(name, f"train-{kind}{gz}") for gz in ("", ".gz")]
        found = [path for path in found if os.path.isfile(path)]
        if not found:
            raise _BadOption("--dataset", f"no train-{kind}[.gz] in folder {name!r}")
        files[kind] = found[0]
    count, rows, columns = _idx_header(files["images-idx3-ubyte"], 3)
    (labels,) = _idx_header(files["labels-idx1-ubyte"], 1)
    if rows != columns or count != labels:
        raise _BadOption("--dataset", f"folder {name!r}: {count} images of {rows} x {columns} and {labels} labels "
                                      "do not pair up (square images, one label each)")
    return count


def _check_images_suffice(dataset: str, option: str, clients: int, per_client: int) -> None:
    """``clients`` disjoint shards of ``per_client`` images must fit in ``dataset``."""
    size = _dataset_size(dataset)
    if clients * per_client > size:
        raise _BadOption(option, f"{clients} x {per_client} training images per client need {clients * per_client} "
                                 f"images; {dataset} has {size}")


def _sweep_changes(args: argparse.Namespace, names: tuple) -> dict:
    changes = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    for name in ("epsilons", "grid_epsilons", "mechanisms"):
        if getattr(args, name, None) is not None:
            changes[name] = tuple(getattr(args, name))
    return changes


def _prepare_reproduce(args: argparse.Namespace):
    """The Experiment the arguments describe, every argument checked; nothing run or loaded."""
    import dataclasses

    from privleak import reproduce

    experiment = reproduce.PAPER_SCALE if args.paper_scale else reproduce.Experiment()
    attack = dataclasses.replace(experiment.attack, **{k: v for k, v in (("iterations", args.iterations),
                                                                         ("restarts", args.restarts)) if v is not None})
    changes = _sweep_changes(args, ("dataset", "clients", "rounds", "seed", "delta", "batch_size"))
    if args.calibration is not None and args.convention != reproduce.PaperConvention.name:
        raise _BadOption("--calibration", f"applies to --convention {reproduce.PaperConvention.name} only")
    rules = reproduce.convention(args.convention if args.calibration is None else
                                 f"{args.convention}-{args.calibration}")
    try:
        rules.check(changes.get("mechanisms", experiment.mechanisms))
    except ValueError as error:
        raise _BadOption("--mechanisms", str(error).removeprefix("mechanisms: ")) from None
    if changes.get("batch_size", 1) > experiment.examples_per_client:
        raise _BadOption("--batch-size", f"must be at most the {experiment.examples_per_client} examples per client, "
                                         f"got {changes['batch_size']}")
    experiment = dataclasses.replace(experiment, attack=attack, convention=rules, engine=_engine(args), **changes)
    _check_images_suffice(experiment.dataset, "--clients", experiment.clients, experiment.examples_per_client)
    return experiment


def _engine(args: argparse.Namespace):
    """The reproduce.Engine of --engine, --superlink and --insecure."""
    from privleak import reproduce

    if args.engine == reproduce.InProcess.name:
        for option, given in (("--superlink", args.superlink is not None), ("--insecure", args.insecure)):
            if given:
                raise _BadOption(option, "applies to --engine flower only")
        return reproduce.InProcess()
    if args.superlink is None:
        if args.insecure:
            raise _BadOption("--insecure", "applies to --superlink only")
        return reproduce.FlowerSimulation()
    host, _, port = args.superlink.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _BadOption("--superlink", f"must be HOST:PORT with a port in 1..65535, got {args.superlink!r}")
    return reproduce.FlowerDeployment(args.superlink, insecure=args.insecure)


def _prepare_estimate(args: argparse.Namespace):
    import dataclasses

    from privleak import estimation, reproduce

    experiment = estimation.Estimation()
    changes = _sweep_changes(args, ("dataset", "images", "releases", "runs", "threshold", "seed"))
    if args.iterations is not None:
        changes["attack"] = dataclasses.replace(experiment.attack, iterations=args.iterations)
    experiment = dataclasses.replace(experiment, **changes)
    # estimation.run trains one client per image with reproduce.Experiment's examples per client.
    _check_images_suffice(experiment.dataset, "--images", experiment.images,
                          reproduce.Experiment().examples_per_client)
    return experiment


def _info(args: argparse.Namespace) -> int:
    report = privleak.info()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    width = max(map(len, report))
    for key, value in report.items():
        shown = ", ".join(value) if isinstance(value, list) else value
        print(f"{key:<{width}}  {shown}")
    return 0


def _progress_bars():
    """A callback drawing one tqdm bar per stage of a long run."""
    from tqdm import tqdm

    bars = {}

    def update(stage: str, done: int, total: int) -> None:
        bar = bars.get(stage)
        if bar is None:
            bar = bars[stage] = tqdm(total=total, desc=stage, unit="it" if stage == "attack" else "run",
                                     dynamic_ncols=True, leave=True)
        bar.update(done - bar.n)
        if done == total:
            bar.close()

    return update


def _reproduce(args: argparse.Namespace) -> int:
    from privleak import reproduce

    experiment = args.prepared
    results = reproduce.run(experiment, None if args.quiet else _progress_bars())
    paths = reproduce.write_outputs(experiment, results, args.out)
    for path in paths.values():
        print(path)
    return 0


def _estimate(args: argparse.Namespace) -> int:
    from privleak import estimation

    experiment = args.prepared
    estimates = estimation.run(experiment, None if args.quiet else _progress_bars())
    for row in estimation.rows(estimates):
        print(f"{row['mechanism']:>8} eps={row['epsilon']:<9g} recovered {row['recovery_rate']:.2f}  "
              f"xi^={row['xi']:.3f} [{row['xi_low']:.3f}, {row['xi_high']:.3f}]  "
              f"implied bound {row['implied_mbp_bound']:.3f}  "
              f"C1^={row['c1']:.4f} [{row['c1_low']:.4f}, {row['c1_high']:.4f}]")
    for path in estimation.write_outputs(estimates, args.out).values():
        print(path)
    return 0


def _prepare_audit_release(args: argparse.Namespace) -> dict:
    """audit_release's arguments; the checks that span options (a mechanism that is not pure DP
    needs delta > 0)."""
    from privleak.audit import release

    mechanism = release.release_mechanism(args.mechanism)
    delta = release.DEFAULT_DELTA[args.mechanism] if args.delta is None else args.delta
    if not mechanism.pure and delta == 0.0:
        raise _BadOption("--delta", f"must be > 0 for the {args.mechanism} mechanism (it is not pure DP), got 0")
    release._check_noise(args.mechanism, args.epsilon, delta, 1.0, None)  # the calibration exists (ValueError: exit 2)
    return {"mechanism": args.mechanism, "epsilon": args.epsilon, "delta": delta, "releases": args.releases,
            "confidence": args.confidence, "seed": args.seed}


def _audit_release(args: argparse.Namespace) -> int:
    from privleak.audit import audit_release
    from privleak.audit.release import release_mechanism

    result = audit_release(**args.prepared)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2, allow_nan=False))
        return 0
    mechanism = release_mechanism(result.mechanism)
    print(f"{result.mechanism} mechanism{mechanism.where(result.dim)}, {mechanism.noise_name} {result.noise:.6g}: "
          f"{result.releases} releases on each of two neighbouring inputs x0, x1 ({result.selection_releases} choose "
          f"the test, {result.evaluation_releases} measure it), seed {result.seed}")
    print(f"claimed epsilon      {result.epsilon:g} at delta {result.delta:g} "
          f"(privleak's accountant for this noise: {result.accountant_epsilon:.6g})")
    print(f"audited lower bound  {result.lower_bound:.4f} at {result.confidence:g} confidence "
          f"({result.lower_bound / result.epsilon:.1%} of the claim)")
    print(f"attack               'x1 if {mechanism.statistic} > {result.threshold:.6g}': FPR {result.fpr:.4g} (upper "
          f"bound {result.fpr_upper:.4g}), FNR {result.fnr:.4g} (upper bound {result.fnr_upper:.4g})")
    print(f"Bayes capacity       log {result.log_capacity:.4f} nats of one release")
    if result.lower_bound > result.epsilon:
        print("the audit contradicts the claim: the mechanism is not as private as claimed (or this is the "
              f"{1 - result.confidence:g} chance of a false alarm)")
    return 0


def _prepare_audit_run(args: argparse.Namespace) -> dict:
    """audit_digits's arguments; the checks that span options (delta > 0 for a mechanism that is
    not pure DP, --secure for one with a secure mode, the calibration of every epsilon)."""
    from privleak import dpsgd
    from privleak.audit.one_run import calibrated_config, default_delta
    from privleak.audit.report import MODEL_PARAMETERS

    pure = default_delta(args.mechanism) == 0.0
    delta = default_delta(args.mechanism) if args.delta is None else args.delta
    if not pure and delta == 0.0:
        raise _BadOption("--delta", f"must be > 0 for the {args.mechanism} mechanism (it is not pure DP), got 0")
    if args.secure and not dpsgd.mechanism.get(args.mechanism).secure:
        raise _BadOption("--secure", f"the {args.mechanism} mechanism has no secure mode")
    epsilons = [args.epsilon] if args.epsilons is None else args.epsilons
    option = "--epsilon" if args.epsilons is None else "--epsilons"
    for epsilon in epsilons:  # the calibration exists
        try:
            calibrated_config(args.mechanism, epsilon, delta, args.steps)
        except ValueError as error:
            raise _BadOption(option, f"{epsilon:g}: {error}") from None
    limit = MODEL_PARAMETERS[args.model]
    if args.canaries > limit:
        raise _BadOption("--canaries", f"must be at most {limit} for --model {args.model} (one parameter each), "
                                       f"got {args.canaries}")
    return {"mechanism": args.mechanism, "epsilons": epsilons, "delta": delta, "steps": args.steps,
            "canaries": args.canaries, "images": args.images, "secure": args.secure,
            "confidence": args.confidence, "seed": args.seed, "model": args.model}


def _audit_run(args: argparse.Namespace) -> int:
    from privleak.audit import report
    from privleak.audit.one_run import audit_digits

    options = dict(args.prepared)
    epsilons = options.pop("epsilons")
    if args.out is not None or args.epsilons is not None:
        rows = report.audit_sweep(options.pop("mechanism"), epsilons, progress=None if args.quiet
                                  else _progress_bars(), **options)
        if args.json:
            print(json.dumps(rows, indent=2))
        elif args.out is None:
            for row in rows:
                print(f"{row['mechanism']:>8} claimed eps={row['epsilon_claimed']:<9.6g} lower bound "
                      f"{row['lower_bound']:.4f} at {row['confidence']:g} ({row['correct']} of {row['guesses']} "
                      f"right)  log capacity of one update {row['log_capacity']:.4f} nats")
        if args.out is not None:
            for path in report.write_audit_report(rows, args.out).values():
                print(path, file=sys.stderr if args.json else sys.stdout)
        return 0
    result = audit_digits(epsilon=epsilons[0], **options)
    log_capacity = report.update_capacity(args.mechanism, epsilons[0], result.delta, args.steps,
                                          args.images + result.included, args.model)
    if args.json:
        print(json.dumps({**result._asdict(), "mechanism": args.mechanism, "model": args.model, "steps": args.steps,
                          "epsilon": result.epsilon_claimed, "lower_bound": result.epsilon_lower,
                          "log_capacity": log_capacity.log, "log2_capacity": log_capacity.bits}, indent=2))
        return 0
    model = "a logistic regression" if args.model == "logistic" else "the paper CNN"
    print(f"{args.mechanism} DP-SGD, {args.steps} full-batch steps of {model} on {args.images} "
          f"MNIST digits, {result.canaries} Dirac gradient canaries ({result.included} included), seed {args.seed}")
    print(f"claimed epsilon      {result.epsilon_claimed:.6g} at delta {result.delta:g} (privleak's accountant)")
    print(f"audited lower bound  {result.epsilon_lower:.4f} at {result.confidence:g} confidence "
          f"({result.epsilon_lower / result.epsilon_claimed:.1%} of the claim)")
    print(f"guesses              {result.correct} of {result.guesses} right ({result.k_plus} 'in' on the highest "
          f"scores, {result.k_minus} 'out' on the lowest)")
    print(f"Bayes capacity       log {log_capacity.log:.4f} nats ({log_capacity.bits:.4f} bits) of one update")
    if result.epsilon_lower > result.epsilon_claimed:
        print("the audit contradicts the claim: the run is not as private as claimed (or this is the "
              f"{1 - result.confidence:g} chance of a false alarm)")
    return 0


def _mechanism_names() -> tuple:
    """The registered DP-SGD mechanisms: the choices of every --mechanism(s) option but audit release's."""
    from privleak import dpsgd

    return dpsgd.mechanism.names()


def _add_audit_commands(commands) -> None:
    """``privleak audit``, a command with its own subcommands (``release``; more go beside it)."""
    audit = commands.add_parser("audit", help="statistical lower bounds on epsilon from attacks on real releases",
                                description="Privacy auditing: run a mechanism, attack its outputs and turn the "
                                            "attack's error rates into a lower bound on epsilon.")
    audit_commands = audit.add_subparsers(dest="audit_command", required=True)
    from privleak.audit.release import MECHANISMS as releases

    release = audit_commands.add_parser(
        "release", help=f"audit one release of a mechanism ({', '.join(releases)}) in isolation",
        description="Release the mechanism on two worst-case neighbouring inputs --releases times each (privleak's "
                    "keyed noise), attack with a threshold test on the privacy-loss statistic chosen on a quarter of "
                    "the releases, bound its error rates on the rest (Clopper-Pearson) and print the lower bound on "
                    "epsilon that holds with probability --confidence.")
    release.add_argument("--mechanism", required=True, choices=releases,
                         help="gaussian (std from the exact (epsilon, delta) calibration), laplace (scale 1 / epsilon) "
                              "or vmf (kappa = epsilon / 2 on S^1, antipodal means)")
    release.add_argument("--epsilon", required=True, type=_EPSILON, help="the claimed epsilon, finite and > 0")
    release.add_argument("--delta", type=_DELTA_OR_ZERO,
                         help="the claimed delta, in [0, 1); > 0 for gaussian (default 1e-5 for gaussian, 0 for "
                              "laplace and vmf)")
    release.add_argument("--releases", type=_RELEASES, default=100_000,
                         help="releases on each neighbour, in [2, 10^8] (default 100000; ~1 s per 10^6)")
    release.add_argument("--confidence", type=_CONFIDENCE, default=0.95,
                         help="probability that the bound is below the true epsilon, in (0, 1) (default 0.95)")
    release.add_argument("--seed", type=_SEED, default=0, help="key of the noise, an integer in [0, 2^63) (default 0)")
    release.add_argument("--json", action="store_true", help="print the result as JSON")
    release.set_defaults(run=_audit_release, prepare=_prepare_audit_release, parser=release)

    run = audit_commands.add_parser(
        "run", help="one-run audit of a DP-SGD training run with gradient canaries (Steinke et al. 2023)",
        description="Train a logistic regression on the shipped MNIST digits with privleak's DP-SGD for --steps "
                    "full-batch steps, calibrated to claim --epsilon; inject --canaries Dirac gradient canaries, "
                    "each included with probability 1/2; guess membership from the released updates and print the "
                    "one-run lower bound on epsilon that holds with probability --confidence.")
    run.add_argument("--mechanism", required=True, choices=_mechanism_names(),
                     help="the DP-SGD mechanism, calibrated so that privleak's accountant gives the run --epsilon "
                          "(gaussian, Alg. 1: noise multiplier from the exact calibration; vmf, Alg. 2: "
                          "kappa = epsilon / (2 steps))")
    claims = run.add_mutually_exclusive_group(required=True)
    claims.add_argument("--epsilon", type=_EPSILON, help="the run's claimed epsilon, finite and > 0")
    claims.add_argument("--epsilons", type=_EPSILON, nargs="+", metavar="E",
                        help="a sweep: one audit per claimed epsilon, each finite, > 0 and given once")
    run.add_argument("--delta", type=_DELTA_OR_ZERO,
                     help="the claimed delta, in [0, 1); > 0 for a mechanism that is not pure DP (default 1e-5 "
                          "for gaussian, 0 for pure-DP mechanisms such as vmf)")
    run.add_argument("--steps", type=_COUNT, default=10, help="DP-SGD steps, >= 1 (default 10)")
    run.add_argument("--canaries", type=_COUNT, default=1000,
                     help="canaries, >= 1 and at most the model's parameters (7850 logistic, 13426 paper-cnn; "
                          "one each; default 1000)")
    run.add_argument("--model", choices=["logistic", "paper-cnn"], default="logistic",
                     help="logistic regression 784 -> 10 (default) or the paper CNN (privleak.models.PaperNetwork)")
    run.add_argument("--images", type=_integer_type("an integer in [1, 5000]", low=1, high=5000), default=300,
                     help="training digits, in [1, 5000] (default 300)")
    run.add_argument("--secure", action="store_true",
                     help="secure noise (SecureNoiseGenerator), for a mechanism that has a secure mode")
    run.add_argument("--confidence", type=_CONFIDENCE, default=0.95,
                     help="probability that the bound is below the true epsilon, in (0, 1) (default 0.95)")
    run.add_argument("--seed", type=_SEED, default=0, help="an integer in [0, 2^63) (default 0)")
    run.add_argument("--json", action="store_true", help="print the result as JSON (a list of rows for a sweep)")
    run.add_argument("--out", help="write audit.csv, lower_bound_vs_epsilon.png and audit.md into this folder (an "
                                   "existing writable folder, or a path that can be created)")
    run.add_argument("--quiet", action="store_true", help="no progress bars (drawn on stderr for --out or --epsilons)")
    run.set_defaults(run=_audit_run, prepare=_prepare_audit_run, parser=run)


def _calibrations() -> tuple:
    from privleak import reproduce

    return reproduce.CALIBRATIONS


def _add_sweep_arguments(command: argparse.ArgumentParser, default_epsilons: str) -> None:
    """The arguments ``reproduce`` and ``estimate`` share: where to write, what data, which sweep."""
    command.add_argument("--out", required=True,
                         help="output folder: an existing writable folder, or a path that can be created")
    command.add_argument("--dataset", help="mnist-5k (default), sklearn-digits, or a folder of MNIST/Fashion-MNIST "
                                           "IDX files (train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz])")
    command.add_argument("--epsilons", type=_EPSILON, nargs="+", metavar="EPSILON",
                         help=f"epsilons of one update, finite and > 0, each once (default {default_epsilons})")
    command.add_argument("--mechanisms", nargs="+", choices=_mechanism_names(),
                         help="registered DP-SGD mechanisms, each once (default gaussian vmf)")
    command.add_argument("--iterations", type=_COUNT, help="attack iterations, >= 1")
    command.add_argument("--seed", type=_SEED, help="an integer in [0, 2^63) (default 0)")
    command.add_argument("--quiet", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="privleak", description=privleak.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"privleak {privleak.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="version, compiled backends, threads, CUDA and GPU")
    info.add_argument("--json", action="store_true", help="print the report as JSON")
    info.set_defaults(run=_info)

    reproduce = commands.add_parser(
        "reproduce", help="paper 004's experiment: FL with Gaussian and VMF DP-SGD, Inverting Gradients, Fig. 1 and 2",
        description="Sweep epsilon for the Gaussian and VMF mechanisms (or any registered ones, --mechanisms), attack "
                    "the leaked updates, and write a CSV, "
                    "the figures and a Markdown report into --out. The defaults take a few minutes on 2 CPU cores.")
    _add_sweep_arguments(reproduce, "10 173 1e3 3e3 1e4 3e4 1e5 1e6")
    reproduce.add_argument("--paper-scale", action="store_true",
                           help="32 clients, 12 epsilons, 4800 attack iterations, 4 restarts (hours on a CPU)")
    reproduce.add_argument("--delta", type=_DELTA,
                           help="delta of each update's (epsilon, delta) calibration, in (0, 1); pure-DP mechanisms "
                                "do not use it (default 1e-5)")
    reproduce.add_argument("--clients", type=_COUNT,
                           help="clients, >= 1, one attacked image each per setting; clients x 16 (32 with "
                                "--paper-scale) images must fit in the data set")
    reproduce.add_argument("--rounds", type=_COUNT, help="federated rounds, >= 1; the last one's updates are attacked")
    reproduce.add_argument("--restarts", type=_COUNT, help="attack restarts, >= 1")
    reproduce.add_argument("--grid-epsilons", type=_EPSILON, nargs="+", metavar="EPSILON",
                           help="epsilons shown in reconstructions.png, finite and > 0, each once "
                                "(default 173 1e4 1e5)")
    reproduce.add_argument("--convention", choices=["privleak", "paper"], default="privleak",
                           help="how epsilon becomes noise: privleak (default; one update as local DP, any two "
                                "clipped gradients: Gaussian sensitivity 2c, VMF kappa = eps/2, flat clipping) or "
                                "paper (paper 004's: Gaussian sensitivity c, VMF kappa = eps, per-layer clipping); "
                                "paper takes gaussian and vmf only")
    reproduce.add_argument("--calibration", choices=list(_calibrations()),
                           help="the Gaussian's sigma under --convention paper: analytic (default; Balle and Wang) or "
                                "classic sqrt(2 ln(1.25/delta))/epsilon, not a valid calibration above epsilon = 1 "
                                "(a warning says so)")
    reproduce.add_argument("--batch-size", type=_COUNT,
                           help="images behind each client's update, >= 1 and at most the examples per client (16; "
                                "32 with --paper-scale); the attack reconstructs all of them (default 1)")
    reproduce.add_argument("--engine", choices=["local", "flower"], default="local",
                           help="where the federated training runs: local (default; privleak.fl in this process) or "
                                "flower (privleak.flower's ClientApp and ServerApp on Flower's simulation, or on "
                                "Flower's Deployment Runtime with --superlink); the same updates either way")
    reproduce.add_argument("--superlink", metavar="HOST:PORT",
                           help="with --engine flower: run each setting on the SuperLink at HOST:PORT (its Control "
                                "API), with --clients SuperNodes started with --node-config 'partition-id=K "
                                "num-partitions=N' (docs/federated.md)")
    reproduce.add_argument("--insecure", action="store_true",
                           help="with --superlink: connect without TLS (a SuperLink started with --insecure)")
    reproduce.set_defaults(run=_reproduce, prepare=_prepare_reproduce, parser=reproduce)

    estimate = commands.add_parser(
        "estimate", help="MBP and ABP of federated DP-SGD measured from Inverting Gradients' recovery rate",
        description="Draw M releases of a client's one-image updates per (mechanism, epsilon), run the attack T times "
                    "on each, count recoveries (SSIM above --threshold) and estimate xi (MBP) and C1, C2 (ABP) with "
                    "confidence intervals (papers 000 App. C-D, 001 App. E-I). Writes a CSV and a plot into --out.")
    _add_sweep_arguments(estimate, "1e3 3e3 1e4")
    estimate.add_argument("--images", type=_IMAGES,
                          help="n, the client's private images, >= 2; n x 16 images must fit in the data set "
                               "(default 4)")
    estimate.add_argument("--releases", type=_COUNT, help="M, independent releases per setting, >= 1 (default 8)")
    estimate.add_argument("--runs", type=_COUNT, help="T, attack runs per release, >= 1 (default 32)")
    estimate.add_argument("--threshold", type=_THRESHOLD,
                          help="a run names no image unless its best SSIM exceeds this; in [-1, 1) (default 0)")
    estimate.set_defaults(run=_estimate, prepare=_prepare_estimate, parser=estimate)
    _add_audit_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse and check every argument, then run the command. A bad argument exits with status 2
    and one line on stderr before anything is trained or loaded."""
    args = build_parser().parse_args(argv)
    prepare = getattr(args, "prepare", None)
    if prepare is not None:
        try:
            _check_distinct(args, ("epsilons", "grid_epsilons", "mechanisms"))
            if getattr(args, "out", None) is not None:  # commands that write files
                _check_out(args.out)
            args.prepared = prepare(args)
        except _BadOption as error:
            args.parser.error(str(error))
        except ValueError as error:  # a check of the experiment's own that the options above missed
            args.parser.error(str(error))
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
