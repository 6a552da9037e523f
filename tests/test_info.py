import json
import os
import subprocess
import sys

import privleak
import pytest
from conftest import HAS_CUDA, requires_cuda


def test_info_reports_the_build():
    report = privleak.info()
    assert report["version"] == privleak.__version__
    assert report["backends"][0] == "cpu"
    assert report["openmp_threads"] >= 1
    assert report["cuda_compiled"] == ("cuda" in report["backends"])
    if not report["cuda_usable"]:
        assert report["gpu_name"] is None and report["cuda_error"]


def test_cli_prints_the_same_report_as_json():
    out = subprocess.run([sys.executable, "-m", "privleak", "info", "--json"], check=True,
                         capture_output=True, text=True).stdout
    assert json.loads(out)["version"] == privleak.__version__


def test_import_needs_no_torch():
    code = "import sys, privleak; privleak.info(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@requires_cuda
def test_a_gpu_torch_sees_is_usable_by_privleak():
    report = privleak.info()
    assert report["cuda_usable"] and report["cuda_devices"] >= 1, report["cuda_error"]
    assert report["gpu_name"]


@pytest.mark.skipif(HAS_CUDA, reason="checks the error on machines without a GPU")
def test_asking_for_cuda_without_a_gpu_says_why():
    from privleak import _backend

    with pytest.raises(RuntimeError, match="built without CUDA|no GPU is usable"):
        _backend.cuda()


def test_thread_count_is_validated(threads):
    with pytest.raises(ValueError, match="threads must be >= 1"):
        privleak.set_num_threads(0)
    with pytest.raises(TypeError, match="threads must be an int"):
        privleak.set_num_threads(1.5)


@pytest.mark.parametrize("requested", ["default", "avx2", "avx512", "native", None])
def test_cpu_capability_follows_the_environment_up_to_what_the_cpu_has(requested):
    # PRIVLEAK_CPU_CAPABILITY lowers the path to the one named; it never raises it above the CPU's.
    from privleak import _backend

    paths = ["default", "avx2", "avx512"]
    best = _backend.core.build_info()["cpu_best_capability"]
    env = {k: v for k, v in os.environ.items() if k != "PRIVLEAK_CPU_CAPABILITY"}
    if requested is not None:
        env["PRIVLEAK_CPU_CAPABILITY"] = requested
    code = "import privleak; print(privleak.info()['cpu_capability'])"
    chosen = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                            env=env).stdout.strip()
    want = best if requested in (None, "native") else paths[min(paths.index(requested), paths.index(best))]
    assert chosen == want
