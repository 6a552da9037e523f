"""Issue 16, noise / generators / DP-SGD: every public function of mechanisms (VMF aside), dpsgd and
opacus_interop called with bad values raises the right exception with a message naming the
argument, before any noise is drawn or any state changes."""
import math

import numpy as np
import pytest
import torch
from privleak import dpsgd, validation
from privleak import mechanisms as M

NAN, INF = float("nan"), float("inf")
G = [torch.randn(4, 3), torch.randn(4, 5)]
CFG = dpsgd.DPSGDConfig(clip_norm=1.0, noise_multiplier=1.0)
SHAPES = [(3,), (5,)]


def report(**kwargs):
    args = dict(expected_batch_size=2, dataset_size=100, steps=1, delta=1e-5)
    config = kwargs.pop("config", CFG)
    shapes = kwargs.pop("shapes", SHAPES)
    args.update(kwargs)
    return dpsgd.privacy_report(config, shapes, **args)


def optimizer(**kwargs):
    model = torch.nn.Linear(3, 1)
    args = dict(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=CFG, expected_batch_size=2)
    args.update(kwargs)
    return dpsgd.DPOptimizer(**args)


def clip(**kwargs):
    grads = kwargs.pop("grads", G)
    norm = kwargs.pop("clip_norm", 1.0)
    return dpsgd.clip_and_accumulate(grads, norm, **kwargs)


with torch.inference_mode():
    INFERENCE = torch.zeros(3)
LEAF = torch.zeros(3, requires_grad=True)

CASES = [
    # ---- gaussian_noise / laplace_noise: size
    ("size None", lambda: M.gaussian_noise(None), TypeError, "size must be"),
    ("size str", lambda: M.gaussian_noise("3"), TypeError, "size must be"),
    ("size True", lambda: M.gaussian_noise(True), TypeError, "size must be"),
    ("size float", lambda: M.gaussian_noise(3.0), TypeError, "size must be"),
    ("size -1", lambda: M.gaussian_noise(-1), ValueError, "size must be"),
    ("size nested", lambda: M.gaussian_noise([2, [3]]), TypeError, "size must be"),
    ("size huge", lambda: M.gaussian_noise([2**40, 2**40]), ValueError, "size .* beyond the counter space"),
    # ---- scale
    ("std None", lambda: M.gaussian_noise(3, None), TypeError, "std must be a real number"),
    ("std str", lambda: M.gaussian_noise(3, "1"), TypeError, "std must be a real number"),
    ("std True", lambda: M.gaussian_noise(3, True), TypeError, "std must be a real number"),
    ("std nan", lambda: M.gaussian_noise(3, NAN), ValueError, "std must be finite"),
    ("std inf", lambda: M.gaussian_noise(3, INF), ValueError, "std must be finite"),
    ("std -1", lambda: M.gaussian_noise(3, -1), ValueError, "std must be >= 0"),
    ("std huge int", lambda: M.gaussian_noise(3, 10**400), ValueError, "std must be finite"),
    ("std float max", lambda: M.gaussian_noise(3, 1.7e308, dtype=torch.float64), ValueError, "std = .* too large"),
    ("std 1e38 f32", lambda: M.gaussian_noise(3, 1e38), ValueError, "std = .* too large for float32"),
    ("std 1e4 f16", lambda: M.gaussian_noise(3, 1e4, dtype=torch.float16), ValueError,
     "std = .* too large for float16"),
    ("std subnormal", lambda: M.gaussian_noise(3, 1e-45), ValueError, "std must be 0 or >="),
    ("std tensor", lambda: M.gaussian_noise(3, torch.ones(2)), ValueError, "std must be a scalar"),
    ("scale 2e37 lap", lambda: M.laplace_noise(3, 2e37), ValueError, "scale = .* too large for float32"),
    ("scale nan lap", lambda: M.laplace_noise(3, NAN), ValueError, "scale must be finite"),
    ("secure std tiny", lambda: M.gaussian_noise(3, 1e-300, generator=M.SecureNoiseGenerator(), dtype=torch.float64),
     ValueError, "std must be >= 2\\^-979 for secure noise"),
    ("secure std huge", lambda: M.gaussian_noise(3, 2e37, generator=M.SecureNoiseGenerator()), ValueError,
     "std = .* too large"),
    # ---- dtype / device
    ("dtype str", lambda: M.gaussian_noise(3, dtype="float32"), TypeError, "dtype must be one of"),
    ("dtype int", lambda: M.gaussian_noise(3, dtype=torch.int32), TypeError, "dtype must be one of"),
    ("dtype complex", lambda: M.gaussian_noise(3, dtype=torch.complex64), TypeError, "dtype must be one of"),
    ("device junk", lambda: M.gaussian_noise(3, device="tpu9"), ValueError, "device must be cpu or cuda"),
    ("device meta", lambda: M.gaussian_noise(3, device="meta"), ValueError, "device must be cpu or cuda"),
    ("device list", lambda: M.gaussian_noise(3, device=["cpu"]), TypeError, "device must be a torch.device"),
    # ---- generator / key / offset
    ("generator torch", lambda: M.gaussian_noise(3, generator=torch.Generator()), TypeError,
     "generator must be a NoiseGenerator"),
    ("generator int", lambda: M.laplace_noise(3, generator=5), TypeError, "generator must be a NoiseGenerator"),
    ("key str", lambda: M.gaussian_noise(3, key="1"), TypeError, "key must be an int"),
    ("key float", lambda: M.gaussian_noise(3, key=1.0), TypeError, "key must be an int"),
    ("key True", lambda: M.gaussian_noise(3, key=True), TypeError, "key must be an int"),
    ("key -1", lambda: M.gaussian_noise(3, key=-1), ValueError, "key must be in"),
    ("key 2^64", lambda: M.gaussian_noise(3, key=2**64), ValueError, "key must be in"),
    ("offset float", lambda: M.gaussian_noise(3, key=1, offset=1.5), TypeError, "offset must be an int"),
    ("offset -1", lambda: M.gaussian_noise(3, key=1, offset=-1), ValueError, "offset must satisfy"),
    ("offset end", lambda: M.gaussian_noise(3, key=1, offset=2**63 - 2), ValueError, "offset must satisfy"),
    ("offset no key", lambda: M.gaussian_noise(3, offset=1), ValueError, "offset needs an explicit key"),
    ("key and generator", lambda: M.gaussian_noise(3, key=1, generator=M.NoiseGenerator(1)), ValueError,
     "either generator or key"),
    # ---- add_*: x
    ("x None", lambda: M.add_gaussian_noise(None, 1.0), TypeError, "x must be a torch tensor"),
    ("x list of floats", lambda: M.add_laplace_noise([1.0], 1.0), TypeError, "x\\[0\\] must be a torch tensor"),
    ("x list with an int tensor", lambda: M.add_gaussian_noise_([torch.ones(2), torch.ones(2, dtype=torch.int64)], 1.0),
     TypeError, "x\\[1\\] must have dtype"),
    # Past the first tensor of a list each refusal still names its tensor (a quick test passes the usual case).
    ("x list with a float", lambda: M.add_gaussian_noise_([torch.ones(2), 1.0], 1.0), TypeError,
     "x\\[1\\] must be a torch tensor"),
    ("x list with a sparse", lambda: M.add_gaussian_noise([torch.ones(2), torch.ones(3), torch.eye(2).to_sparse()],
                                                          1.0), TypeError, "x\\[2\\] has layout"),
    ("x list with a meta", lambda: M.add_gaussian_noise([torch.ones(2), torch.ones(2, device="meta")], 1.0),
     ValueError, "x\\[1\\] is on device meta"),
    ("x list misaligned", lambda: M.add_gaussian_noise(
        [torch.ones(2), torch.frombuffer(bytearray(9), dtype=torch.float32, offset=1)], 1.0),
     ValueError, "x\\[1\\] is not aligned"),
    ("x list with a leaf", lambda: M.add_gaussian_noise_([torch.ones(2), LEAF], 1.0, key=1), RuntimeError,
     "x\\[1\\] is a leaf tensor"),
    ("x numpy", lambda: M.add_gaussian_noise_(np.ones(3), 1.0), TypeError, "x must be a torch tensor"),
    ("x int", lambda: M.add_gaussian_noise(torch.ones(3, dtype=torch.int64), 1.0), TypeError, "x must have dtype"),
    ("x bool", lambda: M.add_gaussian_noise(torch.ones(3, dtype=torch.bool), 1.0), TypeError, "x must have dtype"),
    ("x complex", lambda: M.add_gaussian_noise(torch.ones(3, dtype=torch.complex64), 1.0), TypeError,
     "x must have dtype"),
    ("x sparse", lambda: M.add_gaussian_noise(torch.eye(3).to_sparse(), 1.0), TypeError, "x has layout"),
    ("x meta", lambda: M.add_gaussian_noise(torch.ones(3, device="meta"), 1.0), ValueError, "x is on device meta"),
    ("x std nan", lambda: M.add_gaussian_noise(torch.ones(3), NAN), ValueError, "std must be finite"),
    ("x std huge", lambda: M.add_gaussian_noise(torch.ones(3), 1e38), ValueError, "std = .* too large"),
    ("x scale huge f16", lambda: M.add_laplace_noise_(torch.ones(3, dtype=torch.float16), 3000.0), ValueError,
     "scale = .* too large for float16"),
    ("x leaf in place", lambda: M.add_gaussian_noise_(LEAF, 1.0, key=1), RuntimeError, "x is a leaf tensor"),
    ("x inference in place", lambda: M.add_laplace_noise_(INFERENCE, 1.0, key=1), RuntimeError,
     "x is an inference tensor"),
    ("x generator bad", lambda: M.add_gaussian_noise(torch.ones(3), 1.0, generator="g"), TypeError,
     "generator must be"),
    ("x secure nan", lambda: M.add_gaussian_noise(torch.tensor([NAN]), 1.0, generator=M.SecureNoiseGenerator()),
     ValueError, "x must be finite"),
    # ---- NoiseGenerator
    ("seed float", lambda: M.NoiseGenerator(1.5), TypeError, "seed must be an int"),
    ("seed str", lambda: M.NoiseGenerator("1"), TypeError, "seed must be an int"),
    ("manual_seed None", lambda: M.manual_seed(None), TypeError, "seed must be an int"),
    ("set_state 2^63", lambda: M.NoiseGenerator(1).set_state((1, 2**63)), ValueError, "offset must be in"),
    ("set_state key", lambda: M.NoiseGenerator(1).set_state((2**64, 0)), ValueError, "key must be in"),
    ("set_state short", lambda: M.NoiseGenerator(1).set_state((1,)), TypeError, "state must be a"),
    ("set_state None", lambda: M.NoiseGenerator(1).set_state(None), TypeError, "state must be a"),
    ("secure seed", lambda: M.SecureNoiseGenerator(5), TypeError, "positional argument"),
    # ---- clip_and_accumulate
    ("grads None", lambda: clip(grads=None), TypeError, "per_sample_grads must be a non-empty sequence"),
    ("grads numpy", lambda: clip(grads=np.ones((2, 3))), TypeError, "per_sample_grads must be a non-empty sequence"),
    ("grads tensor", lambda: clip(grads=G[0]), TypeError, "per_sample_grads must be a non-empty sequence"),
    ("grads empty", lambda: clip(grads=[]), TypeError, "per_sample_grads must be a non-empty sequence"),
    ("grads element", lambda: clip(grads=[G[0], "x"]), TypeError, r"per_sample_grads\[1\] must be a torch tensor"),
    ("grads float64", lambda: clip(grads=[G[0].double()]), TypeError, r"per_sample_grads\[0\] must have dtype"),
    ("grads 0-d", lambda: clip(grads=[torch.tensor(1.0)]), ValueError, "leading batch dimension"),
    ("grads strided", lambda: clip(grads=[torch.randn(3, 4).t()]), ValueError, "must be contiguous"),
    ("grads sparse", lambda: clip(grads=[torch.eye(3).to_sparse()]), TypeError, "must be a dense"),
    ("grads batch", lambda: clip(grads=[G[0], G[1][:2]]), ValueError, r"per_sample_grads\[1\] has batch 2"),
    ("clip None", lambda: clip(clip_norm=None), TypeError, "clip_norm must be a real number"),
    ("clip str", lambda: clip(clip_norm="1"), TypeError, "clip_norm must be a real number"),
    ("clip 0", lambda: clip(clip_norm=0.0), ValueError, "clip_norm must be > 0"),
    ("clip tiny", lambda: clip(clip_norm=1e-27), ValueError, "clip_norm = 1e-27 is below 1e-15: the norms are summed "
     "in float32"),
    ("clip list tiny", lambda: clip(clip_norm=[1.0, 1e-16], per_layer=True), ValueError,
     r"clip_norm\[1\] = 1e-16 is below 1e-15"),
    ("config clip tiny", lambda: dpsgd.DPSGDConfig(1e-20), ValueError, "config.clip_norm = 1e-20 is below 1e-15"),
    ("clip nan", lambda: clip(clip_norm=NAN), ValueError, "clip_norm must be finite"),
    ("clip inf", lambda: clip(clip_norm=INF), ValueError, "clip_norm must be finite"),
    ("clip list", lambda: clip(clip_norm=[1.0, 2.0]), ValueError, "clip_norm must be one number"),
    ("clip list bad", lambda: clip(clip_norm=[1.0, -2.0], per_layer=True), ValueError, r"clip_norm\[1\] must be > 0"),
    ("clip empty", lambda: clip(clip_norm=[]), ValueError, "clip_norm must be one number"),
    ("per_layer str", lambda: clip(per_layer="yes"), TypeError, "per_layer must be True or False"),
    ("noise None", lambda: clip(noise_std=None), TypeError, "noise_std must be a real number"),
    ("noise nan", lambda: clip(noise_std=NAN), ValueError, "noise_std must be finite"),
    ("noise -1", lambda: clip(noise_std=-1.0), ValueError, "noise_std must be >= 0"),
    ("noise huge", lambda: clip(noise_std=1e38, batch_size=1.0), ValueError, "noise_std = .* overflow float32"),
    # the noise is added to the float32 sum before it is divided: there it would pass float32's range
    # (inf in the release) though the divided release would not
    ("noise huge over batch", lambda: clip(noise_std=1e38, batch_size=1e3), ValueError,
     "noise_std = .* overflow float32"),
    ("noise huge empty batch", lambda: clip(grads=[torch.empty(0, 3)], noise_std=1e38, batch_size=1e3), ValueError,
     "noise_std = .* overflow float32"),
    ("l1 sum huge", lambda: clip(grads=[torch.full((2, 2), 3e38)], clip_norm=3.3e38, batch_size=10.0, norm_type=1),
     ValueError, "overflow float32"),
    ("noise subnormal", lambda: clip(noise_std=1e-40), ValueError, "noise_std must be 0 or >="),
    ("secure noise huge", lambda: clip(noise_std=2e37, batch_size=1e6, generator=M.SecureNoiseGenerator()),
     ValueError, "noise_std = .* overflow float32"),
    ("batch_size str", lambda: clip(batch_size="2"), TypeError, "batch_size must be a real number"),
    ("batch_size True", lambda: clip(batch_size=True), TypeError, "batch_size must be a real number"),
    ("batch_size 0", lambda: clip(batch_size=0), ValueError, "batch_size must be > 0"),
    ("batch_size nan", lambda: clip(batch_size=NAN), ValueError, "batch_size must be finite"),
    ("batch_size tiny", lambda: clip(batch_size=1e-39), ValueError, "batch_size = 1e-39 is out of range"),
    ("batch_size small", lambda: clip(noise_std=1.0, batch_size=1e-38), ValueError, "overflow float32"),
    ("batch_size huge", lambda: clip(batch_size=1e300), ValueError, "batch_size = 1e\\+300 is out of range"),
    ("batch_size empty", lambda: clip(grads=[torch.empty(0, 3)]), ValueError, "batch_size must be given"),
    ("non_finite", lambda: clip(non_finite="ignore"), ValueError, "non_finite must be one of"),
    ("clip generator", lambda: clip(noise_std=1.0, generator=torch.Generator()), TypeError, "generator must be"),
    ("clip key", lambda: clip(noise_std=1.0, key="1"), TypeError, "key must be an int"),
    # ---- DPSGDConfig, checked when it is built
    ("config None", lambda: dpsgd.privatize(G, None, 2), TypeError, "config must be a DPSGDConfig"),
    ("config dict", lambda: dpsgd.privatize(G, {"clip_norm": 1.0}, 2), TypeError, "config must be a DPSGDConfig"),
    ("config mechanism", lambda: dpsgd.DPSGDConfig(1.0, "exponential"), ValueError, "config.mechanism must be one of"),
    ("config mechanism type", lambda: dpsgd.DPSGDConfig(1.0, 3), ValueError, "config.mechanism must be one of"),
    ("config clip", lambda: CFG.replace(clip_norm=-1.0), ValueError, "config.clip_norm must be > 0"),
    ("config clip per layer", lambda: dpsgd.privatize(G, CFG.replace(clip_norm=[1.0, 2.0, 3.0], per_layer=True), 2),
     ValueError, "config.clip_norm must be one number, or .* one per tensor: 2, got 3"),
    ("config clip list flat", lambda: CFG.replace(clip_norm=[1.0, 2.0]), ValueError, "config.clip_norm must be one"),
    ("config noise nan", lambda: dpsgd.DPSGDConfig(1.0, noise_multiplier=NAN), ValueError,
     "config.noise_multiplier must be finite"),
    ("config noise str", lambda: dpsgd.DPSGDConfig(1.0, noise_multiplier="1"), TypeError,
     "config.noise_multiplier must be a real number"),
    ("config kappa none", lambda: dpsgd.DPSGDConfig(1.0, "vmf"), ValueError, "needs kappa: config.kappa"),
    ("config kappa 0", lambda: dpsgd.DPSGDConfig(1.0, "vmf", kappa=0.0), ValueError, "config.kappa must be > 0"),
    ("config kappa for gaussian", lambda: dpsgd.DPSGDConfig(1.0, kappa=1.0), TypeError,
     "config.kappa: the gaussian mechanism takes no parameter"),
    ("config laplace 0", lambda: dpsgd.DPSGDConfig(1.0, "laplace", noise_multiplier=0.0), ValueError,
     "config.noise_multiplier must be > 0"),
    ("config twice", lambda: dpsgd.DPSGDConfig(1.0, dpsgd.VMF(1.0), kappa=2.0), TypeError, "given twice"),
    ("config direct kappa", lambda: dpsgd.VMF(-1.0), ValueError, "kappa must be > 0"),
    ("config per_layer", lambda: CFG.replace(per_layer=1), TypeError, "config.per_layer must be True or False"),
    ("config non_finite", lambda: CFG.replace(non_finite="skip"), ValueError, "config.non_finite must be one of"),
    ("config replace", lambda: CFG.replace(kappa=1.0), TypeError, "config.replace: no field"),
    ("config immutable", lambda: setattr(CFG, "clip_norm", 2.0), AttributeError, "immutable"),
    ("privatize L", lambda: dpsgd.privatize(G, CFG, 0), ValueError, "expected_batch_size must be > 0"),
    ("privatize L str", lambda: dpsgd.privatize(G, CFG, "2"), TypeError, "expected_batch_size must be a real number"),
    ("privatize grads", lambda: dpsgd.privatize(None, CFG, 2), TypeError, "per_sample_grads must be"),
    ("clipping tensors", lambda: CFG.replace(per_layer=True).clipping(0), ValueError, "num_tensors must be >= 1"),
    # ---- privacy_report
    ("report dataset 0", lambda: report(dataset_size=0), ValueError, "dataset_size must be >= 1"),
    ("report dataset float", lambda: report(dataset_size=100.0), TypeError, "dataset_size must be an int"),
    ("report L 0", lambda: report(expected_batch_size=0), ValueError, "expected_batch_size must be > 0"),
    ("report L > N", lambda: report(expected_batch_size=200), ValueError,
     "expected_batch_size must be <= dataset_size"),
    ("report L nan", lambda: report(expected_batch_size=NAN), ValueError, "expected_batch_size must be finite"),
    ("report steps -1", lambda: report(steps=-1), ValueError, "steps must be >= 0"),
    ("report steps float", lambda: report(steps=1.0), TypeError, "steps must be an int"),
    ("report delta 1", lambda: report(delta=1.0), ValueError, "delta must be < 1"),
    ("report delta nan", lambda: report(delta=NAN), ValueError, "delta must be finite"),
    ("report delta 0 gauss", lambda: report(delta=0.0), ValueError, "delta must be > 0 for the Gaussian"),
    ("report delta str", lambda: report(delta="1e-5"), TypeError, "delta must be a real number"),
    ("report sampling", lambda: report(sampling="shuffle"), ValueError, "sampling must be one of"),
    ("report shapes None", lambda: report(shapes=None), TypeError, "parameter_shapes must be a sequence"),
    ("report shapes empty", lambda: report(shapes=[]), ValueError, "parameter_shapes must not be empty"),
    ("report shape int", lambda: report(shapes=[3]), TypeError, r"parameter_shapes\[0\] must be a shape"),
    ("report shape neg", lambda: report(shapes=[(3, -1)]), ValueError, r"parameter_shapes\[0\] must be >= 0"),
    ("report shape zero", lambda: report(shapes=[(0,)]), ValueError, "parameter_shapes must have at least one"),
    ("report sigma 0", lambda: report(config=dpsgd.DPSGDConfig(1.0, noise_multiplier=0.0)), ValueError,
     "config.noise_multiplier must be > 0 for a privacy report"),
    ("report clip only", lambda: report(config=dpsgd.DPSGDConfig(1.0, dpsgd.ClipOnly())), ValueError,
     "no finite epsilon"),
    ("report config", lambda: report(config="gaussian"), TypeError, "config must be a DPSGDConfig"),
    # ---- DPOptimizer
    ("opt optimizer", lambda: optimizer(optimizer=None), TypeError, "optimizer must be a torch.optim.Optimizer"),
    ("opt config", lambda: optimizer(config=None), TypeError, "config must be a DPSGDConfig"),
    ("opt config per layer", lambda: optimizer(config=CFG.replace(clip_norm=[1.0, 2.0, 3.0], per_layer=True)),
     ValueError, "config.clip_norm must be one number"),
    ("opt L", lambda: optimizer(expected_batch_size=-2), ValueError, "expected_batch_size must be > 0"),
    ("opt L None", lambda: optimizer(expected_batch_size=None), TypeError, "expected_batch_size must be a real"),
    ("opt generator", lambda: optimizer(generator=torch.Generator()), TypeError, "generator must be"),
    ("opt sampling", lambda: optimizer(sampling="all"), ValueError, "sampling must be one of"),
    ("opt vmf secure", lambda: optimizer(config=dpsgd.DPSGDConfig(1.0, "vmf", kappa=1.0),
                                         generator=M.SecureNoiseGenerator()), ValueError, "no secure mode"),
    ("opt step None", lambda: optimizer().step(None), TypeError, "per_sample_grads must be"),
    ("opt step count", lambda: optimizer().step([torch.zeros(2, 1, 3)]), ValueError, "1 per-sample gradients for 2"),
    ("opt report dataset", lambda: optimizer().privacy_report(0, 1e-5), ValueError, "dataset_size must be >= 1"),
    ("opt report delta", lambda: optimizer().privacy_report(100, -1.0), ValueError, "delta must be >= 0"),
    # ---- sample_batch, vmf_release
    ("sample N", lambda: dpsgd.sample_batch(0, 1), ValueError, "num_examples must be >= 1"),
    ("sample L float", lambda: dpsgd.sample_batch(10, 2.0), TypeError, "batch_size must be an int"),
    ("sample L > N", lambda: dpsgd.sample_batch(10, 20), ValueError, "batch_size must be <= num_examples"),
    ("sample generator", lambda: dpsgd.sample_batch(10, 2, generator=M.NoiseGenerator(1)), TypeError,
     "generator must be a torch.Generator"),
    ("vmf_release average", lambda: dpsgd.vmf_release(torch.ones(3), 1.0), TypeError, "average must be a sequence"),
    ("vmf_release empty", lambda: dpsgd.vmf_release([], 1.0), TypeError, "average must be a non-empty"),
    ("vmf_release generator", lambda: dpsgd.vmf_release([torch.ones(3)], 1.0, generator=3), TypeError,
     "generator must be"),
    # refused whatever the data: a zero average (which takes the uniform draw) as a non-zero one
    ("vmf_release one element", lambda: dpsgd.vmf_release([torch.ones(1)], 1.0), ValueError,
     "average must have 2 or more elements"),
    ("vmf_release one zero element", lambda: dpsgd.vmf_release([torch.zeros(1)], 1.0), ValueError,
     "average must have 2 or more elements"),
    ("vmf_release secure zero", lambda: dpsgd.vmf_release([torch.zeros(3)], 1.0, generator=M.SecureNoiseGenerator()),
     ValueError, "no secure mode"),
    ("vmf_release secure", lambda: dpsgd.vmf_release([torch.ones(3)], 1.0, generator=M.SecureNoiseGenerator()),
     ValueError, "no secure mode"),
    ("l1 ball a", lambda: dpsgd.laplace.log_l1_ball_capacity(3, -1.0), ValueError, "a must be >= 0"),
    ("l1 ball dim", lambda: dpsgd.laplace.log_l1_ball_capacity(0, 1.0), ValueError, "dim must be >= 1"),
    ("clip_factors negative", lambda: dpsgd.clip_factors(torch.tensor([[4.0, -1.0]], dtype=torch.float64), 1.0,
                                                         per_layer=True), ValueError, "norm_sums must be >= 0"),
]


@pytest.mark.parametrize("call, error, match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_refused_draws_claim_nothing():
    g = M.NoiseGenerator(3)
    for bad in (lambda: M.gaussian_noise(3, NAN, generator=g), lambda: M.gaussian_noise(3, 1e39, generator=g),
                lambda: M.gaussian_noise(3, dtype=torch.int8, generator=g),
                lambda: M.add_gaussian_noise_(LEAF, 1.0, generator=g),
                lambda: clip(noise_std=1.0, batch_size=1e-39, generator=g)):
        with pytest.raises((TypeError, ValueError, RuntimeError)):
            bad()
    assert g.get_state() == (3, 0)


def test_wrong_type_errors_are_both_type_and_value_errors():
    with pytest.raises(validation.ArgumentTypeError):
        M.gaussian_noise(3, "1")
    with pytest.raises(ValueError):
        clip(batch_size="2")


def test_numpy_and_tensor_scalars_are_taken():
    a = M.gaussian_noise(np.int64(4), np.float32(0.5), key=np.uint64(3), offset=np.int32(1))
    b = M.gaussian_noise(4, 0.5, key=3, offset=1)
    assert torch.equal(a, b)
    assert torch.equal(M.gaussian_noise(4, torch.tensor(0.5), key=3, offset=1), b)
    c = dpsgd.clip_and_accumulate(G, np.float64(1.0), noise_std=np.float32(0.5), batch_size=np.int64(4), key=1)
    d = dpsgd.clip_and_accumulate(G, 1.0, noise_std=0.5, batch_size=4.0, key=1)
    assert all(torch.equal(x, y) for x, y in zip(c.grads, d.grads))


def test_edge_values_that_are_valid_still_work():
    assert M.gaussian_noise(0).shape == (0,) and M.gaussian_noise((2, 0)).shape == (2, 0)
    assert M.add_gaussian_noise(torch.empty(0), 1.0, key=1).shape == (0,)
    x = torch.zeros(4, 6)[:, ::2]  # non-contiguous
    assert torch.equal(M.add_gaussian_noise_(x, 1.0, key=2), M.gaussian_noise((4, 3), key=2))
    assert math.isfinite(float(M.gaussian_noise(1000, 5e37, key=1).abs().max()))
    with pytest.raises(ValueError, match="std must be <= ") as refused:  # the limit it quotes is taken
        M.gaussian_noise(3, 9685.0, key=1, dtype=torch.float16)
    limit = float(str(refused.value).rsplit("<= ", 1)[1])
    assert torch.isfinite(M.gaussian_noise(10**5, limit, key=1, dtype=torch.float16)).all()
    # a half-precision average's direction is that of the same numbers in float32
    for half in (torch.float16, torch.bfloat16):
        got = dpsgd.vmf_release([torch.ones(3, dtype=half), torch.full((2,), -2.0, dtype=half)], 50.0,
                                M.NoiseGenerator(3))
        want = dpsgd.vmf_release([torch.ones(3), torch.full((2,), -2.0)], 50.0, M.NoiseGenerator(3))
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    r = report(expected_batch_size=2.5, steps=0)
    assert r.epsilon == 0.0 and math.isfinite(r.capacity_bits)
    # a fractional expected batch size (Poisson) gives the capacity of sigma / L
    assert math.isclose(report(expected_batch_size=2.5).capacity_log,
                        report(config=dpsgd.DPSGDConfig(1.0, noise_multiplier=0.4), expected_batch_size=1).capacity_log,
                        rel_tol=1e-12)


def privleak_opacus(**kwargs):
    from privleak.opacus_interop import PrivleakDPOptimizer

    args = dict(optimizer=torch.optim.SGD(torch.nn.Linear(3, 1).parameters(), lr=0.1), noise_multiplier=1.0,
                max_grad_norm=1.0, expected_batch_size=4)
    args.update(kwargs)
    return PrivleakDPOptimizer(args.pop("optimizer"), **args)


OPACUS_CASES = [
    ("optimizer", dict(optimizer=None), TypeError, "optimizer must be a torch.optim.Optimizer"),
    ("noise nan", dict(noise_multiplier=NAN), ValueError, "noise_multiplier must be finite"),
    ("noise -1", dict(noise_multiplier=-1.0), ValueError, "noise_multiplier must be >= 0"),
    ("noise str", dict(noise_multiplier="1"), TypeError, "noise_multiplier must be a real number"),
    ("clip 0", dict(max_grad_norm=0.0), ValueError, "max_grad_norm must be > 0"),
    ("clip inf", dict(max_grad_norm=INF), ValueError, "max_grad_norm must be finite"),
    ("clip None", dict(max_grad_norm=None), TypeError, "max_grad_norm must be a real number"),
    ("L 0", dict(expected_batch_size=0), ValueError, "expected_batch_size must be > 0"),
    ("L None mean", dict(expected_batch_size=None), ValueError, "expected_batch_size must be given"),
    ("reduction", dict(loss_reduction="avg"), ValueError, "loss_reduction must be one of"),
    ("mechanism", dict(mechanism="exponential"), ValueError, "mechanism must be one of"),
    ("kappa None", dict(mechanism="vmf"), ValueError, "needs kappa"),
    ("kappa nan", dict(mechanism="vmf", kappa=NAN), ValueError, "kappa must be finite"),
    ("generator", dict(noise_generator=torch.Generator()), TypeError, "generator must be a NoiseGenerator"),
]


@pytest.mark.parametrize("kwargs, error, match", [c[1:] for c in OPACUS_CASES], ids=[c[0] for c in OPACUS_CASES])
def test_bad_opacus_arguments_are_refused_naming_them(kwargs, error, match):
    pytest.importorskip("opacus")
    with pytest.raises(error, match=match):
        privleak_opacus(**kwargs)
