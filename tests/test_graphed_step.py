"""BookKeeping.graphed: the step with its forward, backward and clip captured in a CUDA graph (on a
CPU, the same padded step run eagerly), against the materialised path (torch.func per-sample
gradients through DPOptimizer, same config, same noise stream), and what its captured part may
not do: wait for the device."""
import math
import re
import warnings

import pytest
import torch
from conftest import requires_cuda
from privleak import dpsgd
from privleak import mechanisms as M
from privleak.dpsgd import graph, layers
from test_bookkeeping import (
    CONFIGS,
    LAYER_CASES,
    assert_same_update,
    clip_between,
    one_backward_per_sample,
    regression,
    setting,
    training_pair,
)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = [
    # torch.func has no batching rule for the fused CPU attention kernel that nn.MultiheadAttention calls
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
    # graphs smaller than most Poisson batches, so that the tests take the eager step too
    pytest.mark.filterwarnings("ignore:max_batch=.* a Poisson batch:UserWarning"),
]

#: ops that read a tensor's value on the host: a sync on a GPU, refused inside a graph capture
HOST_READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.item.default",
              "aten.is_nonzero.default", "aten.equal.default"}


class HostReads(TorchDispatchMode):
    """Records the ops reading a tensor on the host, and Tensor.tolist (which reads a CPU tensor's
    data without dispatching an op)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in HOST_READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._tolist = torch.Tensor.tolist

        def tolist(tensor):
            self.seen.append("Tensor.tolist")
            return self._tolist(tensor)
        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def make(kind, mechanism, per_layer, device, max_batch, non_finite="raise"):
    reference, model, dp, bk, inputs, targets, loss = training_pair(kind, mechanism, per_layer, device,
                                                                    non_finite=non_finite)
    step = bk.graphed(lambda x, y: loss(model(x), y), inputs[:3].to(device), targets[:3].to(device),
                      max_batch=max_batch)
    return reference, model, dp, bk, step, inputs, targets, loss


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("kind, mechanism, per_layer", [
    ("transformer", "gaussian", False), ("transformer", "vmf", True), ("cnn", "gaussian", True),
    ("cnn", "laplace", False)])
def test_a_graphed_step_matches_the_materialised_path(kind, mechanism, per_layer, device):
    """Steps of SGD with momentum on batches of 3, 5 (the graph's size), 0, 7 (more than it: the
    eager step), 1 and 4 samples: the materialised path's updates and parameters after every step,
    its step count and privacy report. On CUDA the reference runs on the CPU (the noise streams
    give the same bits on both) and the step replays a captured graph."""
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # float32 convolutions, as on the CPU
        reference, model, dp, bk, step, inputs, targets, loss = make(kind, mechanism, per_layer, device,
                                                                     max_batch=5)
    assert (step._graph is not None) == (device == "cuda")
    start = 0
    for size in (3, 5, 0, 7, 1, 4):
        rows = torch.arange(start, start + size)
        start += size
        if size:
            grads = dpsgd.per_sample_gradients(reference, lambda out, y: loss(out, y).sum(), inputs[rows],
                                               targets[rows])
        else:  # torch.func cannot vmap nn.MultiheadAttention over zero samples
            grads = [torch.zeros(0, *p.shape) for p in reference.parameters()]
        want = dp.step(grads)
        bk.model(inputs[:2].to(device))  # a forward with grad between steps (an evaluation), let go by the step
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # captured so; the eager steps too
            got = step(inputs[rows].to(device), targets[rows].to(device))
        assert not any(layer.calls for layer in bk.layers)
        assert_same_update([g.cpu() for g in got], want)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach().cpu(), q, rtol=1e-4, atol=1e-6)
    assert bk.steps == dp.steps == 6
    assert bk.privacy_report(24, 1e-5) == dp.privacy_report(24, 1e-5)


@pytest.mark.parametrize("non_finite", ["raise", "drop"])
@pytest.mark.parametrize("kind", ["transformer", "cnn"])
def test_the_captured_part_reads_nothing_on_the_host(kind, non_finite):
    """The captured part (forward, backward, clip) has no op that reads a tensor's value on the host
    (a sync, which a capture refuses); the eager step has one, the non-finite check, which shows
    that the probe sees them."""
    *_, bk, step, inputs, targets, loss = make(kind, "gaussian", False, "cpu", max_batch=5, non_finite=non_finite)
    with HostReads() as captured:
        step._clipped_sums()
    assert captured.seen == []
    with HostReads() as eager:
        bk.step(loss(bk.model(inputs[:4]), targets[:4]))
    assert "aten._local_scalar_dense.default" in eager.seen
    with HostReads() as listed:
        torch.arange(3).tolist()
    assert listed.seen == ["Tensor.tolist"]


@pytest.mark.parametrize("case", LAYER_CASES)
def test_no_layer_rule_reads_a_tensor_on_the_host_in_the_captured_part(case):
    """Every layer rule (shared outputs, views of broadcast parameters, the fallback, tied weights
    among them), drop mode: the captured part of a step after the warm-up reads nothing on the
    host. (A view's positions, computed on the CPU with a nonzero, are kept from the warm-up.)"""
    model, x, target = setting(case)
    config = dpsgd.DPSGDConfig(1.0, noise_multiplier=1.0, non_finite="drop")
    bk = dpsgd.BookKeeping(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0),
                           config, expected_batch_size=4)
    step = bk.graphed(lambda x, target: regression(model(x), target), x, target, max_batch=len(x) + 2)
    with HostReads() as captured:
        step._clipped_sums()
    assert captured.seen == []


class TwoParameters(nn.Module):
    """Parameters in a matrix product and a product after a tanh: no book-keeping rule fits, so
    the fallback replays the module, which owns both."""

    def __init__(self, width=6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) * 0.4)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x):
        return torch.tanh(x @ self.weight) * self.scale


class CopiedInto(TwoParameters):
    """An in-place copy into a tensor the forward makes, which torch.func cannot vmap: the
    fallback replays the module one sample at a time."""

    def forward(self, x):
        out = torch.zeros(x.shape[0], self.weight.shape[1], dtype=x.dtype, device=x.device)
        out.copy_(super().forward(x))
        return out


def replayed_step(module, per_layer):
    """(graphed step, bk, inputs, targets, the materialised update of the 5 samples) for
    module -> Linear, Gaussian noise, clip norms at the median."""
    torch.manual_seed(0)
    model = nn.Sequential(module, nn.Linear(6, 2))
    generator = torch.Generator().manual_seed(1)
    x, target = torch.randn(5, 6, generator=generator), torch.randn(5, 2, generator=generator)
    grads = one_backward_per_sample(model, x, target)  # torch.func cannot vmap CopiedInto
    config = CONFIGS["gaussian"](clip_between(grads, per_layer), per_layer)
    want = dpsgd.privatize(grads, config, 4.5, M.NoiseGenerator(7))
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.0), config, expected_batch_size=4.5,
                           generator=M.NoiseGenerator(7))
    step = bk.graphed(lambda x, target: regression(model(x), target), x[:3], target[:3], max_batch=5)
    return step, bk, x, target, want


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
def test_a_module_replayed_in_chunks_reads_nothing_on_the_host_in_the_captured_part(per_layer, monkeypatch):
    """A replayed module whose per-sample gradients are never formed whole (its norms a few samples
    at a time, its clipped sum by the same chunks replayed again) reads nothing on the host: the
    chunks are the batch's, not the factors'. The update is the materialised path's."""
    monkeypatch.setattr(layers, "when_to_form", lambda per_sample, held: layers.Forming.NEVER)
    monkeypatch.setattr(layers, "samples_per_chunk", lambda held, transient, **_: 3)
    chunks = []
    replay = layers.FunctionalLayer.per_sample_grads
    monkeypatch.setattr(layers.FunctionalLayer, "per_sample_grads",
                        lambda self, batch, samples=slice(None): chunks.append(samples) or replay(self, batch, samples))
    step, bk, x, target, want = replayed_step(TwoParameters(), per_layer)
    chunks.clear()
    with HostReads() as captured:
        step._clipped_sums()
    assert captured.seen == []
    batch = len(x)
    assert chunks == 2 * [slice(start, start + 3) for start in range(0, batch, 3)]  # norms, then sums
    assert_same_update(step(x, target), want)


def test_a_module_replayed_one_sample_at_a_time_reads_nothing_on_the_host_in_a_capture(monkeypatch):
    """A module torch.func cannot vmap is replayed one sample at a time, the default generators'
    states compared around it (a draw is refused); a capture may not read a CUDA generator's state,
    and its warm-up ran the check: in a capture (simulated here) the replay reads nothing on the
    host. The update is each sample's own backward pass's."""
    replays = []
    replay = layers.FunctionalLayer._one_at_a_time_grads
    monkeypatch.setattr(layers.FunctionalLayer, "_one_at_a_time_grads",
                        lambda self, *args, **kwargs: replays.append(self.name) or replay(self, *args, **kwargs))
    step, bk, x, target, want = replayed_step(CopiedInto(), False)
    assert replays  # the warm-up's
    with HostReads() as eager:
        step._clipped_sums()
    assert "aten.equal.default" in eager.seen  # the generators' states compared
    monkeypatch.setattr(graph, "capturing", lambda: True)
    with HostReads() as captured:
        step._clipped_sums()
    assert captured.seen == []
    assert_same_update(step(x, target), want)


@pytest.mark.parametrize("non_finite", ["raise", "drop"])
def test_a_non_finite_sample_follows_the_config(non_finite):
    """A batch of 3 with a NaN in sample 1, padded to 5 with copies of sample 0: raise names sample 1
    alone and leaves the model and the step count as they were; drop gives the materialised update
    of the batch with that sample dropped."""
    reference, model, dp, bk, step, inputs, targets, loss = make("cnn", "gaussian", False, "cpu", max_batch=5,
                                                                 non_finite=non_finite)
    x = inputs[:3].clone()
    x[1, 0, 2, 2] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    if non_finite == "raise":
        with pytest.raises(ValueError, match=re.escape("samples [1] (of the 3 whose losses were given) are not")):
            step(x, targets[:3])
        assert bk.steps == 0
        for p, p0 in zip(model.parameters(), before):
            assert torch.equal(p.detach(), p0)
        return
    grads = dpsgd.per_sample_gradients(reference, lambda out, y: loss(out, y).sum(), x, targets[:3])
    got = step(x, targets[:3])
    assert all(bool(torch.isfinite(g).all()) for g in got)
    assert_same_update(got, dp.step(grads))


def test_bad_arguments_are_refused_by_name():
    model = nn.Linear(4, 2)
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.1), dpsgd.DPSGDConfig(1.0),
                           expected_batch_size=3)
    x, y = torch.randn(3, 4), torch.randn(3, 2)

    def loss(x, y):
        return (model(x) - y).pow(2).mean(1)

    for args, kwargs, error, match in [
        ((None, x), {}, TypeError, "loss_fn must be callable"),
        ((loss,), {}, ValueError, "example_inputs: give at least one"),
        ((loss, x, [1.0]), {}, TypeError, r"example_inputs\[1\] must be a torch tensor"),
        ((loss, x, torch.tensor(1.0)), {}, ValueError, r"example_inputs\[1\] must have the batch in dim 0"),
        ((loss, x, y[:2]), {}, ValueError, r"example_inputs must all have the batch in dim 0, got dim 0 sizes "
                                            r"\[3, 2\]"),
        ((loss, x[:0], y[:0]), {}, ValueError, "the example batch is empty"),
        ((loss, x, y), {"max_batch": 2}, ValueError, "max_batch"),
        ((loss, x, y), {"warmup": 0}, ValueError, "warmup"),
        ((lambda x, y: loss(x, y).mean(), x, y), {}, ValueError, r"per_sample_losses must be a 1-D tensor"),
        ((lambda x, y: loss(x, y)[:2], x, y), {}, ValueError,
         r"loss_fn must return the per-sample losses, shape \(3,\) for inputs of 3 rows, got \(2,\)"),
        ((lambda x, y: 1.0, x, y), {}, TypeError, "per_sample_losses must be a torch tensor"),
    ]:
        with pytest.raises(error, match=match):
            bk.graphed(*args, **kwargs)
        assert not any(layer.calls for layer in bk.layers)  # a failed warm-up's records let go
    step = bk.graphed(loss, x, y, max_batch=4)
    for inputs, error, match in [
        ((x,), ValueError, r"inputs: the step was made for 2 input\(s\) of loss_fn, got 1"),
        ((x, 1.0), TypeError, r"inputs\[1\] must be a torch tensor"),
        ((x, y[:, :1]), ValueError, r"inputs\[1\] must be like the example: \(B, 2\) torch.float32"),
        ((x, y.double()), ValueError, r"inputs\[1\] must be like the example"),
        ((x, y[:2]), ValueError, "inputs must all have the batch in dim 0"),
    ]:
        with pytest.raises(error, match=match):
            step(*inputs)
    bk.accumulate(loss(x, y))
    with pytest.raises(ValueError, match="accumulated since the last step"):
        step(x, y)
    with pytest.raises(ValueError, match="accumulated since the last step"):
        bk.graphed(loss, x, y)
    assert bk.steps == 0


@requires_cuda
def test_a_graphed_cuda_step_refuses_another_mode_moved_parameters_and_the_autocast_weight_cache():
    """A graph reads the parameters where they were at its capture, in the modules' mode then: a
    model put in eval mode, or a parameter given new storage, is refused by name of the cause.
    Under torch.autocast with its weight cache the capture would keep the first step's
    low-precision weights: refused."""
    *_, bk, step, inputs, targets, loss = make("cnn", "gaussian", False, "cuda", max_batch=5)
    model = bk.model
    with torch.autocast("cuda", dtype=torch.bfloat16), pytest.raises(ValueError, match="cache_enabled=False"):
        bk.graphed(lambda x, y: loss(model(x), y), inputs[:3].cuda(), targets[:3].cuda())
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        assert bk.graphed(lambda x, y: loss(model(x), y), inputs[:3].cuda(), targets[:3].cuda())._graph is not None
    model.eval()
    with pytest.raises(ValueError, match="not in the train\\(\\)/eval\\(\\) mode"):
        step(inputs[:3].cuda(), targets[:3].cuda())
    model.train()
    first = next(model.parameters())
    first.data = first.data.clone()
    with pytest.raises(ValueError, match="not where graphed\\(\\) found them"):
        step(inputs[:3].cuda(), targets[:3].cuda())
    assert bk.steps == 0


@pytest.mark.filterwarnings("default")
@pytest.mark.parametrize("expected", [4.0, 64.0])
def test_a_graph_smaller_than_most_poisson_batches_is_warned_of(expected):
    """Poisson batches larger than max_batch run eagerly: a graph that misses more than 1% of them
    is warned of, with the least max_batch that a Poisson(L) batch exceeds with probability at most
    1e-4 (checked here by summing the probabilities), which is then not warned of; nor are
    fixed-size batches."""
    model = nn.Linear(4, 2)
    x, y = torch.randn(3, 4), torch.randn(3, 2)

    def graphed(sampling="poisson", **kwargs):
        bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.1), dpsgd.DPSGDConfig(1.0),
                               expected_batch_size=expected, sampling=sampling)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            bk.graphed(lambda x, y: (model(x) - y).pow(2).mean(1), x, y, **kwargs)
        bk.remove()
        return [str(w.message) for w in caught]

    found = graphed()
    assert len(found) == 1 and found[0].startswith(f"max_batch=3: a Poisson batch of expected size {expected:g}")
    enough = int(re.search(r"max_batch=(\d+) keeps all but 1 in 10\^4", found[0]).group(1))

    def larger(k):  # P(X > k), X ~ Poisson(expected)
        return 1.0 - math.fsum(math.exp(-expected + i * math.log(expected) - math.lgamma(i + 1)) for i in range(k + 1))
    assert larger(enough) <= 1e-4 < larger(enough - 1)
    assert f"larger in {math.ceil(100 * larger(3))}% of steps" in found[0]
    assert graphed(max_batch=enough) == []
    assert graphed("fixed") == []
