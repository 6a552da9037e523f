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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="privleak", description=privleak.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"privleak {privleak.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="version, compiled backends, threads, CUDA and GPU")
    info.add_argument("--json", action="store_true", help="print the report as JSON")
    info.set_defaults(run=_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
