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
    reproduce.add_argument("--out", required=True, help="output folder (created if missing)")
    reproduce.add_argument("--paper-scale", action="store_true",
                           help="32 clients, 12 epsilons, 4800 attack iterations, 4 restarts (hours on a CPU)")
    reproduce.add_argument("--dataset", help="mnist-5k (default), sklearn-digits, or a folder of MNIST/Fashion-MNIST IDX files")
    reproduce.add_argument("--epsilons", type=float, nargs="+", help="the epsilons of one update to sweep")
    reproduce.add_argument("--mechanisms", nargs="+", choices=["gaussian", "vmf"])
    reproduce.add_argument("--delta", type=float, help="delta of the Gaussian mechanism (default 1e-5)")
    reproduce.add_argument("--clients", type=int, help="clients, one attacked image each per setting")
    reproduce.add_argument("--rounds", type=int, help="federated rounds; the last one's updates are attacked")
    reproduce.add_argument("--iterations", type=int, help="attack iterations")
    reproduce.add_argument("--restarts", type=int, help="attack restarts")
    reproduce.add_argument("--grid-epsilons", type=float, nargs="+",
                           help="epsilons shown in reconstructions.png (default 173 1e4 1e5)")
    reproduce.add_argument("--seed", type=int)
    reproduce.add_argument("--quiet", action="store_true", help="no progress bars")
    reproduce.set_defaults(run=_reproduce)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
