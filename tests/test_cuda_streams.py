"""privleak's CUDA ops run on the caller's current stream, as torch's ops do. Each op below runs on
a side stream whose input a slow kernel delays, and must give the CPU's result: an op launched on
another stream (the legacy default one, say) would read its input before the copy writes it."""
import privleak
import privleak.dpsgd  # noqa: F401  (registers privleak::ghost_norm)
import pytest
import torch
from conftest import requires_cuda
from privleak import mechanisms as M

#: name: (op, its input on the CPU); every op gives the same bits on CPU and CUDA
OPS = {
    "add_noise_": (lambda x: M.add_gaussian_noise_(x.clone(), 0.7, key=4), (1000, 37)),
    "vmf_sample": (lambda x: torch.ops.privleak.vmf_sample(x, 5.0, 3, [1, 2], 0), (300,)),
    "column_stats": (lambda x: privleak.column_stats(x).sum, (700, 50)),
    "nearest": (lambda x: privleak.nearest(x[:40], x, "squared_l2").index, (300, 9)),
    "ghost_norm": (lambda x: torch.ops.privleak.ghost_norm([x], [x[..., :5].contiguous()]), (4, 70, 33)),
}


@requires_cuda
@pytest.mark.parametrize("name", OPS)
def test_a_cuda_op_runs_on_the_current_stream(name):
    op, shape = OPS[name]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    want = op(x)
    pinned, on_device = x.pin_memory(), torch.empty(shape, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of spinning before the input is written
        on_device.copy_(pinned, non_blocking=True)
        got = op(on_device)
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), want)
