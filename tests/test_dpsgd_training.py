"""The DP-SGD step against a hand-written DP-SGD, and privleak inside Opacus against Opacus."""
import copy
import warnings

import pytest
import torch
from privleak import dpsgd
from privleak import mechanisms as M
from privleak.opacus_interop import (  # Opacus is a test dependency: no skip without it
    PrivleakDPOptimizer,
    PrivleakGhostClippingDPOptimizer,
    PrivleakPerLayerDPOptimizer,
)
from torch.nn.functional import cross_entropy


def small_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def data(n=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)


def loop_per_sample_gradients(model, x, y):
    """One backward pass per example: the independent reference for torch.func's vmap."""
    grads = []
    for i in range(len(x)):
        model.zero_grad()
        cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
    return [torch.stack(per_param) for per_param in zip(*grads)]


def test_per_sample_gradients_match_one_backward_per_example():
    model, (x, y) = small_model(), data()
    for got, want in zip(dpsgd.per_sample_gradients(model, cross_entropy, x, y),
                         loop_per_sample_gradients(model, x, y)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


class Aliased(torch.nn.Module):
    """The small model with its first layer registered under a second name too."""

    def __init__(self):
        super().__init__()
        self.layers = small_model()
        self.first = torch.nn.ModuleList([self.layers[0]])

    def forward(self, x):
        return self.layers[2](self.layers[1](self.first[0](x)))


def test_per_sample_gradients_leave_a_module_registered_twice_as_it_was():
    """torch's functional_call left the first layer (also ``first[0]``) holding a plain tensor in
    place of its weight (pytorch/pytorch#164759), which an optimizer built before no longer trained:
    the gradients are the loop's, the parameters the model's own, and a step trains them."""
    model, (x, y) = Aliased(), data()
    before = list(model.named_parameters())
    for got, want in zip(dpsgd.per_sample_gradients(model, cross_entropy, x, y),
                         loop_per_sample_gradients(model, x, y)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert [(name, id(p)) for name, p in model.named_parameters()] == [(name, id(p)) for name, p in before]
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    weight = model.first[0].weight.detach().clone()
    model.zero_grad()
    cross_entropy(model(x), y).backward()
    optimizer.step()
    assert not torch.equal(model.first[0].weight, weight)


def test_gaussian_step_matches_a_hand_written_dp_sgd_step():
    model, (x, y) = small_model(), data()
    c, sigma, lr, expected = 0.5, 1.2, 0.1, 30.0
    before = [p.detach().clone().double() for p in model.parameters()]
    grads = loop_per_sample_gradients(model, x, y)
    # By hand: clip each example to c over all parameters, sum, add N(0, (sigma c)^2) noise from the
    # same stream, divide by the expected batch size, descend.
    norms = torch.sqrt(sum(g.double().reshape(len(x), -1).pow(2).sum(1) for g in grads))
    factors = torch.clamp(c / norms, max=1.0)
    z = M.gaussian_noise(sum(p.numel() for p in model.parameters()), key=42).double()
    want, start = [], 0
    for p0, g in zip(before, grads):
        noise = sigma * c * z[start:start + p0.numel()].view_as(p0)
        noisy = (factors.view(-1, *[1] * (g.ndim - 1)) * g.double()).sum(0) + noise
        want.append(p0 - lr * noisy / expected)
        start += p0.numel()
    optimizer = dpsgd.DPOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                  dpsgd.DPSGDConfig(clip_norm=c, noise_multiplier=sigma), expected,
                                  generator=M.NoiseGenerator(42))
    optimizer.step(dpsgd.per_sample_gradients(model, cross_entropy, x, y))
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.detach().double(), w, rtol=1e-5, atol=1e-6)


def test_vmf_step_releases_a_unit_direction_around_the_clipped_average():
    model, (x, y) = small_model(), data()
    grads = dpsgd.per_sample_gradients(model, cross_entropy, x, y)
    config = dpsgd.DPSGDConfig(clip_norm=1.0, mechanism="vmf", kappa=50.0)
    update = torch.cat([u.reshape(-1) for u in dpsgd.privatize(grads, config, 24.0, generator=M.NoiseGenerator(3))])
    average = torch.cat([a.reshape(-1) for a in dpsgd.clip_and_accumulate(grads, 1.0).grads])
    torch.testing.assert_close(update, M.vmf_sample(average, 50.0, 1, key=3)[0])
    assert abs(float(update.norm()) - 1) < 1e-6


def test_a_zero_average_releases_a_uniform_direction():
    # No direction to perturb (an empty batch, every gradient zero): a uniform draw on the sphere,
    # whose coordinates have mean 0 and second moment 1 / p.
    generator = M.NoiseGenerator(7)
    draws = torch.stack([torch.cat([u.reshape(-1) for u in dpsgd.vmf_release([torch.zeros(2, 2)], 5.0, generator)])
                         for _ in range(4000)]).double()
    torch.testing.assert_close(draws.norm(dim=1), torch.ones(4000, dtype=torch.float64))
    assert float(draws.mean(0).abs().max()) < 0.05  # 4000 draws: standard error 0.008
    assert float((draws.pow(2).mean(0) - 0.25).abs().max()) < 0.03  # standard error 0.0035


@pytest.mark.parametrize("mechanism", [dpsgd.Gaussian(1.5), dpsgd.VMF(10.0)], ids=["gaussian", "vmf"])
def test_an_empty_poisson_batch_is_a_step(mechanism):
    model = small_model()
    config = dpsgd.DPSGDConfig(clip_norm=1.0, mechanism=mechanism)
    optimizer = dpsgd.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), config, 24,
                                  generator=M.NoiseGenerator(4))
    empty = [torch.empty(0, *p.shape) for p in model.parameters()]
    update = torch.cat([u.reshape(-1) for u in optimizer.step(empty)])
    if isinstance(mechanism, dpsgd.Gaussian):
        torch.testing.assert_close(update, M.gaussian_noise(update.numel(), key=4) * 1.5 / 24)
    else:
        assert abs(float(update.norm()) - 1) < 1e-6
    assert optimizer.steps == 1


def _dp_sgd_run(steps, resume_at=None, generator=None):
    """DP-SGD with momentum on batches of 8: the updates, and the optimizer's report. With
    ``resume_at``, the run stops there, saves the model's, optimizer's and DP state, and goes on
    in new objects built from the saved state alone (the same seed for a new generator)."""
    model, (x, y) = small_model(), data()

    def build(model):
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return dpsgd.DPOptimizer(sgd, dpsgd.DPSGDConfig(0.5, noise_multiplier=1.1), 8.0,
                                 generator=generator() if generator else None)

    optimizer, updates = build(model), []
    for step in range(steps):
        if step == resume_at:
            saved = copy.deepcopy((model.state_dict(), optimizer.optimizer.state_dict(), optimizer.state_dict()))
            model = small_model(seed=9)
            M.manual_seed(3)  # as a restarted script seeds privleak's default generator again
            optimizer = build(model)
            model.load_state_dict(saved[0])
            optimizer.optimizer.load_state_dict(saved[1])
            optimizer.load_state_dict(saved[2])
        batch = slice(8 * (step % 3), 8 * (step % 3) + 8)
        updates.append(optimizer.step(dpsgd.per_sample_gradients(model, cross_entropy, x[batch], y[batch])))
    return updates, optimizer


@pytest.mark.parametrize("generator", [lambda: M.NoiseGenerator(5), None], ids=["seeded", "default"])
def test_a_run_resumed_from_its_state_is_the_run_uninterrupted(generator):
    """The steps carry over into the privacy report, and the generator's offset into the noise: a
    generator seeded again would draw the first steps' noise once more."""
    M.manual_seed(3)
    whole, optimizer = _dp_sgd_run(5, generator=generator)
    M.manual_seed(3)
    resumed, again = _dp_sgd_run(5, resume_at=3, generator=generator)
    for a, b in zip(whole, resumed):
        for u, v in zip(a, b):
            torch.testing.assert_close(u, v, rtol=1e-6, atol=1e-7)
    assert again.steps == 5
    assert again.privacy_report(24, 1e-5) == optimizer.privacy_report(24, 1e-5)


def test_a_bad_dp_state_is_refused():
    optimizer = dpsgd.DPOptimizer(torch.optim.SGD(small_model().parameters(), lr=0.1), dpsgd.DPSGDConfig(1.0), 8.0)
    with pytest.raises(TypeError, match=r"state must be a dict with the keys 'steps' and 'generator' \(and "
                                        r"'accounting'\)"):
        optimizer.load_state_dict({"steps": 3})
    with pytest.raises(ValueError, match=r"state\['steps'\] must be >= 0"):
        optimizer.load_state_dict({"steps": -1, "generator": None})
    secure = dpsgd.DPOptimizer(torch.optim.SGD(small_model().parameters(), lr=0.1), dpsgd.DPSGDConfig(1.0), 8.0,
                               generator=M.SecureNoiseGenerator())
    assert secure.state_dict() == {"steps": 0, "generator": None, "accounting": {
        "mechanism": "Gaussian(noise_multiplier=1.0)", "expected_batch_size": 8.0, "sampling": "poisson"}}
    secure.load_state_dict(optimizer.state_dict())  # a secure generator keeps its own state
    optimizer.load_state_dict({"steps": 4, "generator": None})  # a state saved before 'accounting': on trust
    assert optimizer.steps == 4


def test_a_state_loaded_after_a_step_of_this_run_is_refused():
    """The loaded count would drop this run's releases from the report (a review: 4 releases
    reported as 3, after a step taken before the checkpoint was loaded)."""
    model = small_model()
    saved = dpsgd.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dpsgd.DPSGDConfig(1.0), 8.0).state_dict()
    saved["steps"] = 3
    optimizer = dpsgd.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dpsgd.DPSGDConfig(1.0), 8.0)
    optimizer.step([torch.zeros(2, *p.shape) for p in model.parameters()])
    with pytest.raises(ValueError, match=r"load_state_dict\(\): this run has taken 1 step\(s\), whose releases the "
                                         "loaded count would drop"):
        optimizer.load_state_dict(saved)
    assert optimizer.steps == 1


@pytest.mark.parametrize("changed", ["mechanism", "expected_batch_size", "sampling"])
def test_a_state_saved_under_other_accounting_is_refused(changed):
    """The report composes the saved steps as this run's: 100 steps at sigma 0.6 resumed at 3.0
    were reported at epsilon 0.11, where dp-accounting gives the two phases 3.8."""
    def build(noise=0.6, batch=8.0, sampling="poisson"):
        return dpsgd.DPOptimizer(torch.optim.SGD(small_model().parameters(), lr=0.1),
                                 dpsgd.DPSGDConfig(1.0, noise_multiplier=noise), batch, sampling=sampling)

    saved = build().state_dict()
    other = {"mechanism": lambda: build(noise=3.0), "expected_batch_size": lambda: build(batch=16.0),
             "sampling": lambda: build(sampling="fixed")}[changed]()
    with pytest.raises(ValueError, match=f"state was saved by a run with {changed} .* and this one has"):
        other.load_state_dict(saved)
    build().load_state_dict(saved)
    build(batch=0.07 * 100).load_state_dict(build(batch=7.0).state_dict())  # 7.000000000000001 is 7


def test_fixed_size_sampling_takes_batches_of_its_size_alone():
    """Its accounting (replace-one, batches of exactly L) and the update's division are for L
    examples: ten batches of 32 at L = 8 were reported at epsilon 6.45 for 13.1."""
    (x, y) = data()
    with pytest.raises(ValueError, match="expected_batch_size must be a whole number, got 2.5"):
        dpsgd.DPOptimizer(torch.optim.SGD(small_model().parameters(), lr=0.1), dpsgd.DPSGDConfig(1.0), 2.5,
                          sampling="fixed")
    model = small_model()
    optimizer = dpsgd.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dpsgd.DPSGDConfig(1.0), 8,
                                  sampling="fixed")
    optimizer.step(dpsgd.per_sample_gradients(model, cross_entropy, x[:8], y[:8]))
    with pytest.raises(ValueError, match=r"sampling='fixed' draws batches of expected_batch_size=8 examples, got a "
                                         r"batch of 12"):
        optimizer.step(dpsgd.per_sample_gradients(model, cross_entropy, x[:12], y[:12]))
    assert optimizer.steps == 1
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.1), dpsgd.DPSGDConfig(1.0),
                           expected_batch_size=8, sampling="fixed")
    bk.accumulate(cross_entropy(model(x[:5]), y[:5], reduction="none"))
    bk.step(cross_entropy(model(x[5:8]), y[5:8], reduction="none"))  # 5 + 3 physical samples: one batch of 8
    with pytest.raises(ValueError, match="got a batch of 12"):
        bk.step(cross_entropy(model(x[:12]), y[:12], reduction="none"))
    with pytest.raises(ValueError, match="got a batch of 0"):
        bk.step()
    assert bk.steps == 1


def test_frozen_parameters_in_the_optimizer_are_passed_over():
    """An optimizer of all of a model's parameters, some frozen (a LoRA model's base weights): the
    step is that of an optimizer of the trainable ones (same noise stream); the frozen stay."""
    (x, y), update = data(), []
    for everything in (True, False):
        model = small_model()
        model[0].requires_grad_(False)
        frozen = model[0].weight.detach().clone()
        params = model.parameters() if everything else [p for p in model.parameters() if p.requires_grad]
        optimizer = dpsgd.DPOptimizer(torch.optim.SGD(params, lr=0.1),
                                      dpsgd.DPSGDConfig([0.5, 0.7], noise_multiplier=1.0, per_layer=True), 24,
                                      generator=M.NoiseGenerator(3))
        update.append(optimizer.step(dpsgd.per_sample_gradients(model, cross_entropy, x, y)))
        assert torch.equal(model[0].weight, frozen) and model[0].weight.grad is None
    assert len(update[0]) == 2
    for got, want in zip(*update):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="optimizer holds no trainable parameters"):
        dpsgd.DPOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), dpsgd.DPSGDConfig(1.0), 24)


def test_gradients_in_another_order_than_the_optimizers_are_rejected():
    model = small_model()
    weight, bias = model[0].weight, model[0].bias
    optimizer = dpsgd.DPOptimizer(torch.optim.SGD([{"params": [bias]}, {"params": [weight]}], lr=0.1),
                                  dpsgd.DPSGDConfig(clip_norm=1.0), 24)
    with pytest.raises(ValueError, match=r"per_sample_grads\[0\] must be \(B, \*\(5,\)\)"):
        optimizer.step([torch.zeros(4, 5, 6), torch.zeros(4, 5)])


def test_privacy_report_follows_the_sampling_and_counts_no_steps_as_no_loss():
    from privleak import accounting

    shapes, config = [(5, 6), (5,)], dpsgd.DPSGDConfig(clip_norm=1.0, noise_multiplier=1.1)
    fixed = dpsgd.privacy_report(config, shapes, expected_batch_size=24, dataset_size=600, steps=10, delta=1e-5,
                                 sampling="fixed")
    assert fixed.epsilon == accounting.gaussian_epsilon(1.1, 10, 1e-5, sampling_rate=0.04, sampling="fixed",
                                                        dataset_size=600, accountant="rdp")
    optimizer = dpsgd.DPOptimizer(torch.optim.SGD(small_model().parameters(), lr=0.1), config, 24, sampling="fixed")
    assert optimizer.privacy_report(600, 1e-5).epsilon == 0.0
    with pytest.raises(ValueError, match="sampling must be"):
        dpsgd.privacy_report(config, shapes, expected_batch_size=24, dataset_size=600, steps=1, delta=1e-5,
                             sampling="shuffle")


def test_a_report_of_fixed_size_batches_of_a_fractional_size_is_refused():
    """As DPOptimizer refuses it: batches of 2.5 examples were reported as batches of 2."""
    config, shapes = dpsgd.DPSGDConfig(1.0, noise_multiplier=1.0), [(3,)]
    with pytest.raises(ValueError, match="expected_batch_size must be a whole number, got 2.5"):
        dpsgd.privacy_report(config, shapes, expected_batch_size=2.5, dataset_size=100, steps=100, delta=1e-5,
                             sampling="fixed")
    assert dpsgd.privacy_report(config, shapes, expected_batch_size=2.5, dataset_size=100, steps=100,
                                delta=1e-5).epsilon > 0


def test_sampling_is_poisson_or_fixed():
    g = torch.Generator().manual_seed(0)
    sizes = [len(dpsgd.sample_batch(1000, 50, "poisson", g)) for _ in range(400)]
    assert abs(sum(sizes) / 400 - 50) < 5 * (50 ** 0.5) / 20 and len(set(sizes)) > 5
    fixed = dpsgd.sample_batch(1000, 50, "fixed", g)
    assert len(fixed) == 50 and len(set(fixed.tolist())) == 50
    with pytest.raises(ValueError, match="sampling must be"):
        dpsgd.sample_batch(10, 5, "bernoulli")


# ------------------------------------------------------------------------------- Opacus interop

def opacus_grads(optimizer_factory, noise_multiplier):
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    model, (x, y) = small_model(), data()
    module = GradSampleModule(model)
    opacus_optimizer = DPOptimizer(torch.optim.SGD(module.parameters(), lr=0.1), noise_multiplier=noise_multiplier,
                                   max_grad_norm=0.5, expected_batch_size=24)
    optimizer = optimizer_factory(opacus_optimizer)
    cross_entropy(module(x), y).backward()
    grad_samples = [p.grad_sample.clone() for p in module.parameters()]
    optimizer.pre_step()
    return [p.grad.clone() for p in module.parameters()], grad_samples


def test_privleak_inside_opacus_gives_opacus_update_without_noise():
    want, _ = opacus_grads(lambda o: o, 0.0)
    got, _ = opacus_grads(PrivleakDPOptimizer.from_opacus, 0.0)
    for a, b in zip(got, want):  # Opacus clips to c / (norm + 1e-6), privleak to c / norm
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_privleak_noise_inside_opacus_is_privleaks_noise():
    got, grad_samples = opacus_grads(
        lambda o: PrivleakDPOptimizer.from_opacus(o, noise_generator=M.NoiseGenerator(5)), 1.3)
    want = dpsgd.clip_and_accumulate(grad_samples, 0.5, noise_std=1.3 * 0.5, key=5, batch_size=24.0).grads
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b.view_as(a), rtol=1e-5, atol=1e-6)


def test_laplace_inside_opacus_is_privleaks_laplace_step():
    """mechanism="laplace": Opacus's max_grad_norm becomes an L1 clip and its noise_multiplier the
    Laplace one; the update is privatize's with the same generator (noise on the sum, then / L,
    against noise / L on the average: float32 rounding apart)."""
    got, grad_samples = opacus_grads(
        lambda o: PrivleakDPOptimizer.from_opacus(o, mechanism="laplace", noise_generator=M.NoiseGenerator(5)), 1.3)
    config = dpsgd.DPSGDConfig(0.5, "laplace", noise_multiplier=1.3)
    want = dpsgd.privatize(grad_samples, config, 24.0, M.NoiseGenerator(5))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b.view_as(a), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mistake", ["step-twice", "no-zero-grad-between-virtual-steps"])
def test_per_sample_gradients_clipped_before_are_refused_as_opacus_refuses_them(mistake):
    """Without zero_grad() the per-sample gradients of a released or accumulated batch were clipped
    again, a sample's share of a release reaching 2 and 3 times max_grad_norm (a review's repros);
    Opacus refuses them, and so does privleak's optimizer, with Opacus's message."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    model, (x, y) = small_model(), data()
    module = GradSampleModule(model)
    optimizer = PrivleakDPOptimizer.from_opacus(DPOptimizer(torch.optim.SGD(module.parameters(), lr=0.1),
                                                            noise_multiplier=0.0, max_grad_norm=0.5,
                                                            expected_batch_size=24))
    cross_entropy(module(x), y).backward()
    if mistake == "step-twice":
        optimizer.step()
    else:
        optimizer.signal_skip_step(do_skip=True)
        optimizer.step()  # a virtual step: clipped and accumulated, not released
    with pytest.raises(ValueError, match="Gradients haven't been cleared since the last optimizer step"):
        optimizer.step()


def test_per_layer_clipping_with_a_frozen_parameter_takes_one_norm_per_trainable_parameter():
    """Opacus takes one max_grad_norm per trainable parameter; from_opacus asked for one per
    parameter, frozen ones too, and refused the engine (a review's repro)."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPPerLayerOptimizer

    updates = []
    for swap in (False, True):
        model, (x, y) = small_model(), data()
        model[0].bias.requires_grad_(False)
        module = GradSampleModule(model)
        optimizer = DPPerLayerOptimizer(torch.optim.SGD(module.parameters(), lr=0.1), noise_multiplier=0.0,
                                        max_grad_norm=[0.3, 0.5, 0.05], expected_batch_size=24)
        optimizer = PrivleakDPOptimizer.from_opacus(optimizer) if swap else optimizer
        cross_entropy(module(x), y).backward()
        optimizer.pre_step()
        updates.append([p.grad.clone() for p in module.parameters() if p.requires_grad])
    for a, b in zip(*updates):  # Opacus clips to c / (norm + 1e-6), privleak to c / norm
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_a_float64_model_and_dropped_samples_inside_opacus():
    """Per-sample gradients of a dtype the kernel does not take (float64) are clipped in float32,
    as Opacus's update to float32 rounding (they failed at the first step); non_finite="drop"
    leaves out a sample whose gradient is not finite, as its error advised (refused as a keyword)."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    def update(swap, **keywords):
        model, (x, y) = small_model(), data()
        model.double()
        if keywords:
            x[5, 0] = float("nan")
        module = GradSampleModule(model)
        optimizer = DPOptimizer(torch.optim.SGD(module.parameters(), lr=0.1), noise_multiplier=0.0,
                                max_grad_norm=0.5, expected_batch_size=24)
        optimizer = PrivleakDPOptimizer.from_opacus(optimizer, **keywords) if swap else optimizer
        cross_entropy(module(x.double()), y).backward()
        grad_samples = [p.grad_sample.clone() for p in module.parameters()]
        optimizer.pre_step()
        return [p.grad.clone() for p in module.parameters()], grad_samples

    for a, b in zip(update(True)[0], update(False)[0]):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    got, grad_samples = update(True, non_finite="drop")
    kept = [torch.cat([g[:5], g[6:]]).float() for g in grad_samples]
    want = dpsgd.clip_and_accumulate(kept, 0.5, batch_size=24.0).grads
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.view_as(a), rtol=1e-5, atol=1e-7)


def test_opacus_s_noise_generator_is_refused_where_privleak_s_noise_would_not_draw_from_it():
    """make_private(noise_generator=torch.Generator().manual_seed(0)): privleak's noise never read
    it, and a seeded run became unseeded, silently (a review's repro)."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    module = GradSampleModule(small_model())
    optimizer = DPOptimizer(torch.optim.SGD(module.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=0.5,
                            expected_batch_size=24, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"generator: Opacus's noise generator .* pass noise_generator="
                                         r"privleak.mechanisms.NoiseGenerator\(seed\)"):
        PrivleakDPOptimizer.from_opacus(optimizer)


PER_LAYER_NORMS = [0.3, 0.1, 0.5, 0.05]  # small enough that every tensor of some samples is clipped


def per_layer_opacus_grads(optimizer_factory, noise_multiplier):
    from opacus import GradSampleModule
    from opacus.optimizers import DPPerLayerOptimizer

    model, (x, y) = small_model(), data()
    module = GradSampleModule(model)
    opacus_optimizer = DPPerLayerOptimizer(torch.optim.SGD(module.parameters(), lr=0.1),
                                           noise_multiplier=noise_multiplier, max_grad_norm=PER_LAYER_NORMS,
                                           expected_batch_size=24)
    optimizer = optimizer_factory(opacus_optimizer)
    cross_entropy(module(x), y).backward()
    grad_samples = [p.grad_sample.clone() for p in module.parameters()]
    optimizer.pre_step()
    return [p.grad.clone() for p in module.parameters()], grad_samples


def test_per_layer_clipping_inside_opacus_is_opacus_per_layer_step_with_privleak_noise():
    want, grad_samples = per_layer_opacus_grads(lambda o: o, 0.0)
    optimizers = []
    got, _ = per_layer_opacus_grads(lambda o: optimizers.append(PrivleakDPOptimizer.from_opacus(o)) or optimizers[0],
                                    0.0)
    assert type(optimizers[0]) is PrivleakPerLayerDPOptimizer
    for a, b in zip(got, want):  # Opacus clips to c / (norm + 1e-6), privleak to c / norm
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # independent of both: each tensor's per-sample gradients clipped to its own norm, by hand
    for a, g, c in zip(got, grad_samples, PER_LAYER_NORMS):
        norms = g.flatten(1).norm(dim=1)
        assert (norms > c).any()
        by_hand = (g * (c / norms).clamp(max=1).view(-1, *[1] * (g.dim() - 1))).sum(0) / 24
        torch.testing.assert_close(a, by_hand, rtol=1e-5, atol=1e-7)

    noisy, _ = per_layer_opacus_grads(
        lambda o: PrivleakDPOptimizer.from_opacus(o, noise_generator=M.NoiseGenerator(5)), 1.3)
    # Opacus's per-layer rule: noise std sigma |(c_t)|_2 on the sum, one stream over the tensors in order
    std = 1.3 * torch.tensor(PER_LAYER_NORMS).norm().item()
    noise = M.gaussian_noise(sum(p.numel() for p in got), key=5) * std / 24
    torch.testing.assert_close(torch.cat([(n - a).reshape(-1) for n, a in zip(noisy, got)]), noise,
                               rtol=1e-4, atol=1e-6)


def ghost_step(mechanism_kwargs, noise_multiplier, x, y):
    """One step of Opacus's ghost clipping (grad_sample_mode="ghost"), with privleak's optimizer
    when ``mechanism_kwargs`` is not None; returns the update written into .grad."""
    from opacus import PrivacyEngine

    model = small_model()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine()
        model, optimizer, criterion, _ = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
            criterion=torch.nn.CrossEntropyLoss(), noise_multiplier=noise_multiplier, max_grad_norm=0.5,
            grad_sample_mode="ghost", poisson_sampling=False)
    if mechanism_kwargs is not None:
        optimizer = PrivleakDPOptimizer.from_opacus(optimizer, **mechanism_kwargs)
        assert type(optimizer) is PrivleakGhostClippingDPOptimizer
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.pre_step()
    return [p.grad.clone() for p in model.parameters()], engine


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_ghost_clipping_inside_opacus_gets_privleak_noise_on_the_clipped_sum():
    x, y = data()
    x = x * 5  # most samples' gradients exceed the clip norm 0.5
    clipped = dpsgd.clip_and_accumulate(loop_per_sample_gradients(small_model(), x, y), 0.5, batch_size=24.0).grads
    assert dpsgd.clip_and_accumulate(loop_per_sample_gradients(small_model(), x, y), 0.5).norms.gt(0.5).sum() > 12
    want, _ = ghost_step(None, 0.0, x, y)
    got, _ = ghost_step({}, 0.0, x, y)
    for a, b, c in zip(got, want, clipped):  # the same clipped average: Opacus's ghost norms, a hand-written loop
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(a, c.view_as(a), rtol=1e-4, atol=1e-6)

    noisy, engine = ghost_step({"noise_generator": M.NoiseGenerator(5)}, 1.3, x, y)
    noise = M.gaussian_noise(sum(p.numel() for p in got), key=5) * 1.3 * 0.5 / 24
    torch.testing.assert_close(torch.cat([(n - a).reshape(-1) for n, a in zip(noisy, got)]), noise,
                               rtol=1e-4, atol=1e-6)
    assert engine.accountant.history == [(1.3, 1.0, 1)]  # Opacus's accountant still counts the Gaussian step

    direction, _ = ghost_step({"mechanism": "vmf", "kappa": 1e6, "noise_generator": M.NoiseGenerator(5)}, 1.3, x, y)
    flat = torch.cat([d.reshape(-1) for d in direction])
    mean = torch.cat([c.reshape(-1) for c in clipped])
    torch.testing.assert_close(flat.norm().item(), 1.0, rtol=1e-5, atol=0)  # Alg. 2 releases a unit direction
    assert torch.nn.functional.cosine_similarity(flat, mean, dim=0) > 0.99  # kappa 1e6: close to the mean's
    with pytest.raises(ValueError, match="mechanism: ghost clipping clips in L2, but the laplace mechanism"):
        ghost_step({"mechanism": "laplace"}, 1.3, x, y)


def opacus_ghost(x, y):
    """(model, Opacus's ghost-clipping optimizer, its loss wrapper) for a step of all of (x, y)."""
    from opacus import PrivacyEngine

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))
    model = small_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, criterion, _ = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
            criterion=torch.nn.CrossEntropyLoss(), noise_multiplier=0.0, max_grad_norm=0.5,
            grad_sample_mode="ghost", poisson_sampling=False)
    return model, optimizer, criterion


@pytest.mark.filterwarnings("ignore:Full backward hook")
@pytest.mark.parametrize("ours", [False, True], ids=["opacus", "privleak"])
def test_ghost_clipping_accumulates_physical_batches_as_opacus_does(ours):
    """A logical batch of 24 in three physical batches (signal_skip_step, as BatchMemoryManager
    does) gives the update of one batch: make_private's loss wrapper calls the zero_grad of the
    optimizer it was made with between its two backward passes, which had dropped privleak's sums
    of the skipped batches."""
    x, y = data()
    x = x * 5
    whole, split = [], []
    for out, parts in ((whole, [slice(0, 24)]), (split, [slice(0, 8), slice(8, 16), slice(16, 24)])):
        model, optimizer, criterion = opacus_ghost(x, y)
        if ours:
            optimizer = PrivleakDPOptimizer.from_opacus(optimizer)
        optimizer.zero_grad()
        for k, part in enumerate(parts):
            optimizer.signal_skip_step(do_skip=k < len(parts) - 1)
            criterion(model(x[part]), y[part]).backward()
            optimizer.step()
            optimizer.zero_grad()
        out.extend(p.detach().clone() for p in model.parameters())
    assert any(float((p - small_model().state_dict()[name]).abs().max()) > 1e-3
               for p, name in zip(whole, small_model().state_dict()))  # the step moved the model
    for a, b in zip(split, whole):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_keywords_that_opacus_would_drop_and_a_mechanism_off_the_accountant_are_refused():
    """Opacus's DPOptimizer swallows unknown keywords: a misspelt noise_generator made a seeded run
    unseeded. And a mechanism object whose noise differs from the engine's left Opacus's
    accountant counting the engine's (epsilon 0.94 reported for noise 0.01)."""
    x, y = data()
    for keywords in ({"noise_generater": M.NoiseGenerator(1)}, {"kappa": 3.0}, {"max_grad_norms": [1.0]}):
        with pytest.raises(TypeError, match=f"unexpected keyword argument\\(s\\) '{next(iter(keywords))}'"):
            PrivleakDPOptimizer.from_opacus(opacus_ghost(x, y)[1], **keywords)
    with pytest.raises(ValueError, match="non_finite='drop': ghost clipping's norms cannot tell which sample"):
        PrivleakDPOptimizer.from_opacus(opacus_ghost(x, y)[1], non_finite="drop")
    optimizer = opacus_ghost(x, y)[1]  # noise_multiplier 0
    with pytest.raises(ValueError, match=r"mechanism: its noise_multiplier 0.01 is not the optimizer's "
                                         r"noise_multiplier 0.0, which Opacus's accountant records"):
        PrivleakDPOptimizer.from_opacus(optimizer, mechanism=dpsgd.Gaussian(noise_multiplier=0.01))
    assert PrivleakDPOptimizer.from_opacus(optimizer, mechanism=dpsgd.Gaussian(noise_multiplier=0.0)).mechanism \
        == dpsgd.Gaussian(0.0)


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_a_ghost_clipped_sum_that_is_not_finite_is_refused():
    """A NaN in one sample's input: Opacus's ghost clipping makes the clipped sum NaN (it cannot say
    which sample), which Gaussian noise had carried into the parameters silently."""
    x, y = data()
    x[3, 0] = float("nan")
    model, optimizer, criterion = opacus_ghost(x, y)
    optimizer = PrivleakDPOptimizer.from_opacus(optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    with pytest.raises(ValueError, match="the clipped sum of Opacus's ghost clipping is not finite"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.filterwarnings("ignore:Full backward hook")  # Opacus's hooks on a model whose inputs need no grad
@pytest.mark.parametrize("mechanism, kwargs, learning_rate", [
    ("gaussian", {}, 0.5), ("vmf", {"kappa": 200.0}, 0.05), ("laplace", {}, 1.5)])  # L1 clipping shrinks more
def test_opacus_trains_with_privleak(mechanism, kwargs, learning_rate):
    from opacus import PrivacyEngine

    model = small_model()
    x, y = data(n=512, seed=4)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()  # a learnable rule
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus warns about its secure RNG and the accountant's defaults
        engine = PrivacyEngine(accountant="rdp")
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=learning_rate),
            data_loader=loader, noise_multiplier=0.3, max_grad_norm=1.0)
    optimizer = PrivleakDPOptimizer.from_opacus(optimizer, mechanism=mechanism,
                                                noise_generator=M.NoiseGenerator(0), **kwargs)
    def loss():
        with torch.no_grad():  # a forward with grad would leave Opacus hooks activations to pair with a backward
            return float(cross_entropy(model(x), y))

    first = loss()
    for _ in range(8):
        for xb, yb in loader:
            optimizer.zero_grad()
            cross_entropy(model(xb), yb).backward()
            optimizer.step()
    # Margin: over 8 seeds of the model, the Poisson sampling and the noise, 8 epochs ended at
    # 0.28-0.49 (Gaussian) and 0.47-0.54 (VMF) of the first loss, over 4 noise
    # seeds Laplace 0.59-0.62; a step that does not learn stays near 1.
    assert loss() < 0.8 * first
    # Opacus's accountant counts the Gaussian steps privleak took, and no VMF step as Gaussian.
    assert engine.accountant.history == ([(0.3, 64 / 512, 8 * len(loader))] if mechanism == "gaussian" else [])


def test_opacus_secure_mode_gets_secure_noise_and_an_empty_batch_gets_noise_alone():
    from opacus.optimizers import AdaClipDPOptimizer, DPOptimizer

    params = list(small_model().parameters())
    secure = DPOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                         expected_batch_size=4, secure_mode=True)
    assert isinstance(PrivleakDPOptimizer.from_opacus(secure).noise_generator, M.SecureNoiseGenerator)
    with pytest.raises(ValueError, match="secure_mode needs noise_generator"):
        PrivleakDPOptimizer.from_opacus(secure, noise_generator=M.NoiseGenerator(0))
    with pytest.raises(ValueError, match="no secure mode"):
        PrivleakDPOptimizer.from_opacus(secure, mechanism="vmf", kappa=3.0)
    adaptive = AdaClipDPOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                                  expected_batch_size=4, target_unclipped_quantile=0.5, clipbound_learning_rate=0.2,
                                  max_clipbound=2.0, min_clipbound=0.1, unclipped_num_std=1.0)
    with pytest.raises(TypeError, match="optimizer must be an Opacus DPOptimizer, DPPerLayerOptimizer"):
        PrivleakDPOptimizer.from_opacus(adaptive)
    with pytest.raises(TypeError, match="optimizer must be an Opacus DPPerLayerOptimizer, "
                                        "SimpleDistributedPerLayerOptimizer, got DPOptimizer"):
        PrivleakPerLayerDPOptimizer.from_opacus(secure)
    with pytest.raises(ValueError, match="max_grad_norm must be a list of 4 clip norms"):
        PrivleakPerLayerDPOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=1.0, max_grad_norm=[1.0] * 3,
                                    expected_batch_size=4)

    def empty_batch_grads(optimizer):
        for p in params:
            p.grad_sample, p.summed_grad, p.grad = torch.zeros(0, *p.shape), None, None
        optimizer.pre_step()
        return [p.grad.clone() for p in params]

    def plain(sigma):
        return DPOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=sigma, max_grad_norm=0.5,
                           expected_batch_size=4)

    for a, b in zip(empty_batch_grads(PrivleakDPOptimizer.from_opacus(plain(0.0))), empty_batch_grads(plain(0.0))):
        assert torch.equal(a, b)  # both zero
    got = empty_batch_grads(PrivleakDPOptimizer.from_opacus(plain(2.0), noise_generator=M.NoiseGenerator(6)))
    want = M.gaussian_noise(sum(p.numel() for p in params), key=6) * 2.0 * 0.5 / 4
    torch.testing.assert_close(torch.cat([g.reshape(-1) for g in got]), want)


def test_privacy_report_puts_epsilon_next_to_capacity():
    from privleak import accounting, capacity

    model, (x, y) = small_model(), data()
    optimizer = dpsgd.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  dpsgd.DPSGDConfig(clip_norm=1.0, noise_multiplier=1.1), 24,
                                  generator=M.NoiseGenerator(0))
    for _ in range(3):
        optimizer.step(dpsgd.per_sample_gradients(model, cross_entropy, x, y))
    report = optimizer.privacy_report(dataset_size=600, delta=1e-5)
    dim = sum(p.numel() for p in model.parameters())
    assert report.steps == 3
    assert report.epsilon == accounting.gaussian_epsilon(1.1, 3, 1e-5, sampling_rate=24 / 600)
    assert report.capacity_bits == capacity.dpsgd_gaussian(dim, 1.0, 1.1, 24).log_capacity().bits
    vmf = dpsgd.privacy_report(dpsgd.DPSGDConfig(clip_norm=1.0, mechanism="vmf", kappa=30.0), [(5, 6), (5,)],
                               expected_batch_size=24, dataset_size=600, steps=10, delta=1e-5)
    assert vmf.epsilon == accounting.vmf_privacy(30.0, 10, 1e-5, sampling_rate=0.04).epsilon
    assert vmf.capacity_log == capacity.vmf_log_capacity(35, 30.0).log
