import privleak
import pytest

try:
    import torch
except ImportError:  # torch is optional at run time; torch-facing tests import it themselves
    torch = None

HAS_CUDA = torch is not None and torch.cuda.is_available() and privleak.info()["cuda_usable"]
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and privleak's CUDA module")


@pytest.fixture
def threads():
    """Set privleak's CPU thread count for one test and restore it afterwards."""
    before = privleak.num_threads()
    yield privleak.set_num_threads
    privleak.set_num_threads(before)
