import os
import subprocess
import sys

import privleak
import pytest

try:
    import torch
except ImportError:  # torch is optional at run time; torch-facing tests import it themselves
    torch = None

# Where torch sees a GPU the CUDA tests run, and fail with privleak's reason if its CUDA module
# cannot use it (not built, built for other architectures, a driver too old): they never skip
# on a GPU machine, where a skip would pass for a green run.
HAS_CUDA = torch is not None and torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.fixture
def threads():
    """Set privleak's CPU thread count for one test and restore it afterwards."""
    before = privleak.num_threads()
    yield privleak.set_num_threads
    privleak.set_num_threads(before)


def run_processes(worker_file: str, folder, world: int, timeout: float) -> list:
    """Run ``python worker_file RANK folder`` for each of ``world`` ranks at once (a test file that
    is also its processes' worker) and return what each saved as ``folder/rank{RANK}.pt``; a
    process that fails fails the test with the end of its log."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    logs = [folder / f"rank{rank}.log" for rank in range(world)]
    processes = []
    for rank, log in enumerate(logs):
        with open(log, "wb") as out:  # a file each: a pipe read after the other process's could fill and block
            processes.append(subprocess.Popen([sys.executable, worker_file, str(rank), str(folder)], env=env,
                                              stdout=out, stderr=subprocess.STDOUT))
    try:
        for process in processes:
            process.wait(timeout=timeout)
    finally:
        for process in processes:
            process.kill()
    for process, log in zip(processes, logs):
        assert process.returncode == 0, log.read_text(errors="replace")[-6000:]
    return [torch.load(folder / f"rank{rank}.pt") for rank in range(world)]
