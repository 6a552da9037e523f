"""The ``privleak`` command line."""
from __future__ import annotations

import argparse
import json
import sys

import privleak


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
    import dataclasses

    from privleak import reproduce

    experiment = reproduce.PAPER_SCALE if args.paper_scale else reproduce.Experiment()
    attack = experiment.attack
    attack = dataclasses.replace(attack, **{k: v for k, v in (("iterations", args.iterations),
                                                              ("restarts", args.restarts)) if v is not None})
    changes = {name: getattr(args, name) for name in ("dataset", "clients", "rounds", "seed", "delta")
               if getattr(args, name) is not None}
    if args.epsilons is not None:
        changes["epsilons"] = tuple(args.epsilons)
    if args.grid_epsilons is not None:
        changes["grid_epsilons"] = tuple(args.grid_epsilons)
    if args.mechanisms is not None:
        changes["mechanisms"] = tuple(args.mechanisms)
    experiment = dataclasses.replace(experiment, attack=attack, **changes)
    results = reproduce.run(experiment, None if args.quiet else _progress_bars())
    paths = reproduce.write_outputs(experiment, results, args.out)
    for path in paths.values():
        print(path)
    return 0


def _estimate(args: argparse.Namespace) -> int:
    import dataclasses

    from privleak import estimation

    experiment = estimation.Estimation()
    changes = {name: getattr(args, name) for name in ("dataset", "images", "releases", "runs", "threshold", "seed")
               if getattr(args, name) is not None}
    for name in ("epsilons", "mechanisms"):
        if getattr(args, name) is not None:
            changes[name] = tuple(getattr(args, name))
    if args.iterations is not None:
        changes["attack"] = dataclasses.replace(experiment.attack, iterations=args.iterations)
    experiment = dataclasses.replace(experiment, **changes)
    estimates = estimation.run(experiment, None if args.quiet else _progress_bars())
    for row in estimation.rows(estimates):
        print(f"{row['mechanism']:>8} eps={row['epsilon']:<9g} recovered {row['recovery_rate']:.2f}  "
              f"xi^={row['xi']:.3f} [{row['xi_low']:.3f}, {row['xi_high']:.3f}]  implied bound {row['implied_mbp_bound']:.3f}  "
              f"C1^={row['c1']:.4f} [{row['c1_low']:.4f}, {row['c1_high']:.4f}]")
    for path in estimation.write_outputs(estimates, args.out).values():
        print(path)
    return 0


def _add_sweep_arguments(command: argparse.ArgumentParser, default_epsilons: str) -> None:
    """The arguments ``reproduce`` and ``estimate`` share: where to write, what data, which sweep."""
    command.add_argument("--out", required=True, help="output folder (created if missing)")
    command.add_argument("--dataset", help="mnist-5k (default), sklearn-digits, or a folder of MNIST/Fashion-MNIST IDX files")
    command.add_argument("--epsilons", type=float, nargs="+", help=f"epsilons of one update (default {default_epsilons})")
    command.add_argument("--mechanisms", nargs="+", choices=["gaussian", "vmf"])
    command.add_argument("--iterations", type=int, help="attack iterations")
    command.add_argument("--seed", type=int)
    command.add_argument("--quiet", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="privleak", description=privleak.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"privleak {privleak.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="version, compiled backends, threads, CUDA and GPU")
    info.add_argument("--json", action="store_true", help="print the report as JSON")
    info.set_defaults(run=_info)

    reproduce = commands.add_parser(
        "reproduce", help="paper 004's experiment: FL with Gaussian and VMF DP-SGD, Inverting Gradients, Fig. 1 and 2",
        description="Sweep epsilon for the Gaussian and VMF mechanisms, attack the leaked updates, and write a CSV, "
                    "the figures and a Markdown report into --out. The defaults take a few minutes on 2 CPU cores.")
    _add_sweep_arguments(reproduce, "10 173 1e3 3e3 1e4 3e4 1e5 1e6")
    reproduce.add_argument("--paper-scale", action="store_true",
                           help="32 clients, 12 epsilons, 4800 attack iterations, 4 restarts (hours on a CPU)")
    reproduce.add_argument("--delta", type=float, help="delta of the Gaussian mechanism (default 1e-5)")
    reproduce.add_argument("--clients", type=int, help="clients, one attacked image each per setting")
    reproduce.add_argument("--rounds", type=int, help="federated rounds; the last one's updates are attacked")
    reproduce.add_argument("--restarts", type=int, help="attack restarts")
    reproduce.add_argument("--grid-epsilons", type=float, nargs="+",
                           help="epsilons shown in reconstructions.png (default 173 1e4 1e5)")
    reproduce.set_defaults(run=_reproduce)

    estimate = commands.add_parser(
        "estimate", help="MBP and ABP of federated DP-SGD measured from Inverting Gradients' recovery rate",
        description="Draw M releases of a client's one-image updates per (mechanism, epsilon), run the attack T times "
                    "on each, count recoveries (SSIM above --threshold) and estimate xi (MBP) and C1, C2 (ABP) with "
                    "confidence intervals (papers 000 App. C-D, 001 App. E-I). Writes a CSV and a plot into --out.")
    _add_sweep_arguments(estimate, "1e3 3e3 1e4")
    estimate.add_argument("--images", type=int, help="n, the client's private images (default 4)")
    estimate.add_argument("--releases", type=int, help="M, independent releases per setting (default 8)")
    estimate.add_argument("--runs", type=int, help="T, attack runs per release (default 32)")
    estimate.add_argument("--threshold", type=float, help="a run names no image unless its best SSIM exceeds this (default 0)")
    estimate.set_defaults(run=_estimate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
