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
