"""The in-process federated loop against a hand-written FedSGD / FedAvg."""
import pytest
import torch
import torch.nn.functional as F
from privleak import dpsgd, fl


def _data(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(36, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _clipped_mean_gradient(model, images, labels, clip):
    """DP-SGD without noise by hand: one backward per example, clip, average."""
    total = None
    for x, y in zip(images, labels):
        model.zero_grad()
        F.cross_entropy(model(x[None]), y[None]).backward()
        g = [p.grad.clone() for p in model.parameters()]
        norm = torch.sqrt(sum((t.double() ** 2).sum() for t in g))
        scale = float(min(1.0, clip / norm))
        g = [t * scale for t in g]
        total = g if total is None else [a + b for a, b in zip(total, g)]
    return [t / len(labels) for t in total]


def test_noiseless_rounds_match_hand_written_federated_averaging():
    images, labels = _data()
    clients = [fl.Client(images[i::3], labels[i::3]) for i in range(3)]
    config = dpsgd.DPSGDConfig(0.5, "gaussian", noise_multiplier=0.0)
    model = _model()
    federation = fl.run(model, clients, config, rounds=3, batch_size=2, local_steps=2, learning_rate=0.3,
                        server_learning_rate=0.5, seed=7)
    # The tolerances below compare two float32 computations of the same 3 rounds (vmap against a
    # loop of backwards), not where training lands: the worst difference was 6% of its tolerance with
    # native, AVX2 and SSE4.1 kernels alike.
    assert len(federation.leaked) == 9 and federation.rounds == 3

    reference = _model()
    for r in range(3):
        start = [p.detach().clone() for p in reference.parameters()]
        for record in federation.updates_of_round(r):
            for a, b in zip(record.parameters, start):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        aggregate = [torch.zeros_like(p) for p in start]
        for record in federation.updates_of_round(r):
            client = clients[record.client]
            local = _model()
            with torch.no_grad():
                for p, s in zip(local.parameters(), start):
                    p.copy_(s)
            sent = [torch.zeros_like(p) for p in start]
            for batch in record.private_batches:
                g = _clipped_mean_gradient(local, client.images[batch], client.labels[batch], 0.5)
                with torch.no_grad():
                    for p, t, s in zip(local.parameters(), g, sent):
                        p.sub_(0.3 * t)
                        s.add_(t)
            for a, b in zip(record.update, sent):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            for a, s in zip(aggregate, sent):
                a.add_(s / 3)  # equal shards, so FedAvg weights are 1/3
        with torch.no_grad():
            for p, a in zip(reference.parameters(), aggregate):
                p.sub_(0.5 * 0.3 * a)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_vmf_clients_leak_unit_vectors_reproducibly():
    images, labels = _data()
    clients = fl.split_among_clients(images, labels, 4, 5, torch.Generator().manual_seed(0))
    config = dpsgd.DPSGDConfig(1.0, "vmf", kappa=50.0)
    first = fl.run(_model(), clients, config, rounds=2, seed=3)
    again = fl.run(_model(), clients, config, rounds=2, seed=3)
    other = fl.run(_model(), clients, config, rounds=2, seed=4)
    for a, b in zip(first.leaked, again.leaked):
        for x, y in zip(a.update, b.update):
            assert torch.equal(x, y)
    flat = [torch.cat([t.flatten() for t in u.update]) for u in first.leaked]
    for f in flat:
        assert float(f.double().norm()) == pytest.approx(1.0, abs=1e-5)
    assert len({tuple(f[:4].tolist()) for f in flat}) == len(flat)  # every update has its own noise
    assert not torch.equal(flat[0], torch.cat([t.flatten() for t in other.leaked[0].update]))


def test_hooks_see_every_update_and_round():
    images, labels = _data()
    clients = fl.split_among_clients(images, labels, 2, 6)
    seen, rounds = [], []
    federation = fl.run(_model(), clients, dpsgd.DPSGDConfig(1.0, noise_multiplier=1.0), rounds=3, record=False,
                        on_update=seen.append, on_round=lambda r, m: rounds.append(r))
    assert federation.leaked == []
    assert [(u.round, u.client) for u in seen] == [(r, c) for r in range(3) for c in range(2)]
    assert rounds == [0, 1, 2]


def test_clients_get_disjoint_shards():
    images, labels = _data(30)
    clients = fl.split_among_clients(images, labels, 3, 10)
    rows = torch.cat([c.images.flatten(1) for c in clients])
    assert torch.unique(rows, dim=0).shape[0] == 30


def test_bad_federations_are_rejected():
    images, labels = _data()
    clients = fl.split_among_clients(images, labels, 2, 3)
    config = dpsgd.DPSGDConfig(1.0)
    with pytest.raises(ValueError, match="clients must not be empty"):
        fl.run(_model(), [], config, rounds=1)
    with pytest.raises(ValueError, match="rounds"):
        fl.run(_model(), clients, config, rounds=0)
    with pytest.raises(ValueError, match="batch_size 4 exceeds"):
        fl.run(_model(), clients, config, rounds=1, batch_size=4)
    with pytest.raises(ValueError, match="cannot give 5 clients"):
        fl.split_among_clients(images, labels, 5, 5)
    with pytest.raises(ValueError, match="as many labels as images"):
        fl.Client(images[:3], labels[:2])
