"""Wall time of ``privleak audit run``, the whole job (start-up, data, training, audit), on 2 cores.

    python bench/bench_audit.py [--repeat 1] [--epsilon 4] [--cases default logistic-5k paper-cnn-5k]

Each case is one ``python -m privleak audit run --mechanism gaussian --epsilon 4 --quiet`` in a
fresh process with OMP_NUM_THREADS = MKL_NUM_THREADS = 2 (and taskset to CPUs 0-1 where the
machine has more): "default" is the command's defaults (logistic regression, 300 images, 10
steps, 1000 canaries); "logistic-5k" and "paper-cnn-5k" train on all 5000 MNIST digits
(``--images 5000``), the latter the paper CNN (``--model paper-cnn``, 13426 parameters). Prints
the median wall seconds of --repeat runs per case and the command's lower-bound line. Goal
(issue 20): under 10 minutes for the paper CNN on MNIST-5k.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

CASES = {"default": [], "logistic-5k": ["--images", "5000"],
         "paper-cnn-5k": ["--images", "5000", "--model", "paper-cnn"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--epsilon", default="4")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    pin = ["taskset", "-c", "0,1"] if (os.cpu_count() or 1) > 2 and shutil.which("taskset") else []
    print(f"{'case':<14} {'seconds':>9}  result")
    for case in args.cases:
        command = [*pin, sys.executable, "-m", "privleak", "audit", "run", "--mechanism", "gaussian",
                   "--epsilon", args.epsilon, "--quiet", *CASES[case]]
        times, line = [], ""
        for _ in range(args.repeat):
            started = time.perf_counter()
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            times.append(time.perf_counter() - started)
            line = next((s for s in done.stdout.splitlines() if s.startswith("audited lower bound")), "")
        print(f"{case:<14} {statistics.median(times):>9.1f}  {line}", flush=True)


if __name__ == "__main__":
    main()
