"""dpsgd.BookKeeping on recurrent modules (nn.RNN, nn.LSTM, nn.GRU) in the forms torch.func cannot
vmap, packed sequences of different lengths above all, against each sample's own backward pass."""
import copy
import warnings

import pytest
import torch
from privleak import dpsgd
from privleak import mechanisms as M
from privleak.dpsgd import layers, recurrent
from test_bookkeeping import (
    CONFIGS,
    assert_same_update,
    book_kept,
    clip_between,
    one_backward_per_sample,
    regression,
    trainable,
)
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

pytestmark = pytest.mark.filterwarnings(  # torch's note that oneDNN has no LSTM with projections
    "ignore:LSTM with projections is not supported with oneDNN:UserWarning")

LENGTHS = [7, 3, 5, 7, 1, 6]  #: each sample's tokens; the rest of its row is padding (id 0)


class Packed(nn.Module):
    """An encoder over packed sequences (a bidirectional two-layer LSTM, the lengths unsorted) whose
    final states start a GRU decoder run twice, the second time on its first output, sequence first;
    the loss reads the encoder's padded output and the decoder's."""

    def __init__(self, sorted_lengths: bool = False):
        super().__init__()
        self.sorted_lengths = sorted_lengths
        self.embed = nn.Embedding(20, 6, padding_idx=0)
        self.encoder = nn.LSTM(6, 4, num_layers=2, bidirectional=True, batch_first=True)
        self.decoder = nn.GRU(8, 4, num_layers=2)
        self.head = nn.Linear(8, 2)

    def forward(self, ids):
        lengths = (ids != 0).sum(1).cpu()
        packed = pack_padded_sequence(self.embed(ids), lengths, batch_first=True,
                                      enforce_sorted=self.sorted_lengths)
        out, (h, _) = self.encoder(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=ids.shape[1])
        start = h[-2:].contiguous()  # the last layer's two directions: the decoder's two layers
        decoded, _ = self.decoder(out[:, :3].transpose(0, 1), start)
        decoded, _ = self.decoder(torch.cat([decoded, decoded], 2), start)
        return self.head(out[:, :3] + torch.cat([decoded, decoded], 2).transpose(0, 1))


class Projected(nn.Module):
    """A ReLU RNN without biases and an LSTM with projections whose recurrent weight is frozen (on
    which torch.func's vmap fails: the reference is one backward pass per sample)."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(4, 5, nonlinearity="relu", batch_first=True, bias=False)
        self.lstm = nn.LSTM(5, 4, proj_size=2, batch_first=True)
        self.lstm.weight_hh_l0.requires_grad_(False)

    def forward(self, x):
        out, _ = self.rnn(x)
        out, (h, c) = self.lstm(out)
        return out + h[-1].unsqueeze(1) + c[-1, :, :2].unsqueeze(1)


def tokens(lengths, generator):
    ids = torch.randint(1, 20, (len(lengths), max(lengths)), generator=generator)
    return ids * (torch.arange(ids.shape[1]) < torch.tensor(lengths)[:, None])


class WeightNormed(nn.Module):
    """A GRU whose recurrent weight is weight-normalised (a parametrization: the replay, one sample
    at a time, instead of the unrolled steps), bidirectional, on packed sequences whose lengths
    are those of the nonzero rows of the input."""

    def __init__(self):
        super().__init__()
        self.gru = nn.utils.parametrizations.weight_norm(nn.GRU(4, 3, bidirectional=True), "weight_hh_l0")

    def forward(self, x):
        lengths = (x != 0).any(2).sum(1).cpu()
        out, h = self.gru(pack_padded_sequence(x.transpose(0, 1), lengths, enforce_sorted=False))
        out, _ = pad_packed_sequence(out, total_length=x.shape[1])
        return out.transpose(0, 1) + h.sum(0).unsqueeze(1).repeat(1, 1, 2)


class TiedBias(nn.Module):
    """An LSTM whose two biases are one Parameter under two names (``named_parameters`` lists it
    once: the steps written out read ``bias_hh_l0`` as absent, the gates recomputed without it, an
    RNN's bias given half its gradient): replayed."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 3, batch_first=True)
        self.lstm.bias_hh_l0 = self.lstm.bias_ih_l0

    def forward(self, x):
        return self.lstm(x)[0]


class HookNormed(nn.Module):
    """A GRU under the deprecated ``torch.nn.utils.weight_norm``, whose forward pre-hook sets
    ``weight_hh_l0`` as a plain tensor made from ``weight_hh_l0_g`` and ``_v`` (the steps written
    out found no such parameter and failed): replayed."""

    def __init__(self):
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated
            self.gru = nn.utils.weight_norm(nn.GRU(4, 3, batch_first=True), "weight_hh_l0")

    def forward(self, x):
        return self.gru(x)[0]


class Scaled(nn.Module):
    """A GRU whose output alone is used, times a scalar and plus one: its final state, an output of
    the same autograd node, has no use (once taken for the output broadcast over the batch)."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(4, 3, batch_first=True)

    def forward(self, x):
        return self.gru(x)[0] * 2 + 1


CASES = {
    "packed": (Packed, lambda generator: tokens(LENGTHS, generator)),
    "packed-sorted": (lambda: Packed(sorted_lengths=True), lambda generator: tokens(sorted(LENGTHS)[::-1], generator)),
    "projected": (Projected, lambda generator: torch.randn(6, 5, 4, generator=generator)),
    "scaled": (Scaled, lambda generator: torch.randn(6, 5, 4, generator=generator)),
    "weight-normed": (WeightNormed, lambda generator: torch.randn(6, 7, 4, generator=generator)
                      * (torch.arange(7) < torch.tensor(LENGTHS)[:, None])[..., None]),
    "tied-bias": (TiedBias, lambda generator: torch.randn(6, 5, 4, generator=generator)),
    "hook-normed": (HookNormed, lambda generator: torch.randn(6, 5, 4, generator=generator)),
}
REPLAYED = {"weight-normed", "tied-bias", "hook-normed"}  #: the cases whose weights are not Parameters by name


def setting(case):
    build, make_input = CASES[case]
    torch.manual_seed(0)
    model = build()
    generator = torch.Generator().manual_seed(1)
    x = make_input(generator)
    with torch.no_grad():
        target = torch.randn(model(x).shape, generator=generator)
    return model, x, target


@pytest.mark.parametrize("forming", [layers.Forming.AFTER, layers.Forming.NEVER], ids=["whole", "chunked"])
@pytest.mark.parametrize("mechanism, per_layer", [("gaussian", False), ("vmf", True), ("laplace", False)])
@pytest.mark.parametrize("case", CASES)
def test_a_recurrent_module_gives_the_update_of_each_samples_backward_pass(case, mechanism, per_layer, forming,
                                                                          monkeypatch):
    """Book-keeping over the unrolled steps; a parametrized module by the replay, whose
    per-sample gradients are formed whole after the backward pass, or never whole: their norms two
    samples at a time and the clipped sum by one backward pass of the module over the batch."""
    monkeypatch.setattr(layers, "when_to_form", lambda per_sample, held: forming)
    monkeypatch.setattr(layers, "samples_per_chunk", lambda held, transient, **_: 2)
    replayed, replay = [], layers.FunctionalLayer._one_at_a_time_grads
    monkeypatch.setattr(layers.FunctionalLayer, "_one_at_a_time_grads",
                        lambda self, *args, **kwargs: replayed.append(self.name) or replay(self, *args, **kwargs))
    model, x, target = setting(case)
    grads = one_backward_per_sample(model, x, target)
    config = CONFIGS[mechanism](clip_between(grads, per_layer), per_layer)
    want = dpsgd.privatize(grads, config, 4.5, M.NoiseGenerator(7))
    assert_same_update(book_kept(model, x, target, config, 4.5, M.NoiseGenerator(7)), want)
    assert bool(replayed) == (case in REPLAYED)


@pytest.mark.parametrize("case", CASES)
def test_each_recurrent_module_gets_the_recurrent_rule(case):
    model, _, _ = setting(case)
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(trainable(model), lr=0.1), dpsgd.DPSGDConfig(1.0),
                           expected_batch_size=2)
    kinds = {layer.name: type(layer) for layer in bk.layers}
    assert {name for name, kind in kinds.items() if kind is recurrent.RecurrentLayer} == {
        name for name, module in model.named_modules() if isinstance(module, nn.RNNBase)}


@pytest.mark.parametrize("case", ["packed", "packed-sorted", "projected"])
def test_a_backward_the_user_runs_through_a_hooked_module_gives_torchs_gradients(case):
    """The recurrent rule puts a node of its own in the loss's graph in place of torch's fused op
    (whose backward forms the weights' gradients, which book-keeping does not use): a backward
    pass the user runs outside ``step`` still gives every parameter torch's gradient, through
    the steps unrolled (the layers above and below included)."""
    model, x, target = setting(case)
    twin = copy.deepcopy(model)
    dpsgd.BookKeeping(model, torch.optim.SGD(trainable(model), lr=0.1), dpsgd.DPSGDConfig(1.0), expected_batch_size=6)
    for network in (model, twin):
        regression(network(x), target).sum().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        if p.requires_grad:
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


class ChangedInPlace(nn.Module):
    """A GRU whose output the forward then doubles in place, on the input or above a Linear."""

    def __init__(self, below: bool):
        super().__init__()
        self.below = nn.Linear(4, 4) if below else nn.Identity()
        self.gru = nn.GRU(4, 3, batch_first=True)

    def forward(self, x):
        out, _ = self.gru(self.below(x))
        return out.mul_(2)


@pytest.mark.parametrize("below", [False, True], ids=["on-the-input", "above-a-layer"])
def test_an_output_changed_in_place_is_refused(below):
    """The rule recomputes the gates from the recorded output, in its node's backward (a layer
    below needs the input's gradient) or after the backward pass: changed in place, it is refused."""
    model = ChangedInPlace(below)
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.1), dpsgd.DPSGDConfig(1.0),
                           expected_batch_size=5)
    with pytest.raises(ValueError, match=r"the output of module 'gru' \(GRU\) was changed in place"):
        bk.step(model(torch.randn(5, 6, 4)).pow(2).sum((1, 2)))


def test_a_weight_changed_in_place_after_the_forward_is_refused():
    """The steps written out read the weights as they are at the backward pass: one changed in
    place since the forward is refused by autograd, as torch's fused op refuses it (the update
    had come silently from the changed weight)."""
    model = nn.GRU(4, 3, batch_first=True)
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.1), dpsgd.DPSGDConfig(1.0),
                           expected_batch_size=5)
    losses = model(torch.randn(5, 6, 4))[0].pow(2).sum((1, 2))
    with torch.no_grad():
        model.weight_hh_l0.mul_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        bk.step(losses)


@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM])
def test_each_layer_and_direction_s_biases_get_its_own_rows(kind, monkeypatch):
    """Biases trained beside frozen weights (BitFit) in two bidirectional layers: each layer and
    direction's biases are its pre-activations' gradients summed. Their rows were cached by the
    id() of those gradients, and a frozen direction's, freed, left its id to a later one's, whose
    biases then took the earlier rows (4 of 252 updates of a sweep over T); here every id() is
    made the same, the worst an allocator can do."""
    monkeypatch.setattr(recurrent, "id", lambda obj: 0, raising=False)
    torch.manual_seed(0)
    model = kind(2, 3, num_layers=2, bidirectional=True, batch_first=True)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("bias"))
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 5, 2, generator=generator)
    target = torch.randn(4, 5, 6, generator=generator)

    class Output(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = model

        def forward(self, x):
            return self.rnn(x)[0]

    wrapped = Output()
    grads = one_backward_per_sample(wrapped, x, target)
    config = dpsgd.DPSGDConfig(clip_between(grads, False), noise_multiplier=0.0)
    want = dpsgd.privatize(grads, config, 4.0, M.NoiseGenerator(3))
    assert_same_update(book_kept(wrapped, x, target, config, 4.0, M.NoiseGenerator(3)), want)


class WeightDropped(nn.Module):
    """AWD-LSTM's WeightDrop: the parent assigns the LSTM's ``weight_hh_l0``, made from a raw
    parameter of the LSTM's, before each call (here without dropping any)."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 3, batch_first=True)
        raw = self.lstm.weight_hh_l0
        del self.lstm._parameters["weight_hh_l0"]
        self.lstm.register_parameter("weight_hh_l0_raw", nn.Parameter(raw.detach().clone()))

    def forward(self, x):
        self.lstm.weight_hh_l0 = self.lstm.weight_hh_l0_raw * 1.0
        return self.lstm(x)[0]


def test_a_weight_assigned_from_outside_the_forward_is_found_by_the_first_sample_check():
    """The replay remakes what the module's forward makes, not a weight its parent made before the
    call: the raw parameter's per-sample gradients would be 0, and the first sample's check says so."""
    model = WeightDropped()
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.1), dpsgd.DPSGDConfig(1.0),
                           expected_batch_size=5)
    with pytest.raises(ValueError, match=r"'lstm.weight_hh_l0_raw' the norm 0, .* as AWD-LSTM's WeightDrop does"):
        bk.step(model(torch.randn(5, 6, 4)).pow(2).sum((1, 2)))


def test_a_second_derivative_through_a_hooked_module_is_refused():
    """The rule's node has a backward without a graph: differentiating it again raises, where a
    silent zero would be wrong."""
    model = nn.GRU(4, 3, batch_first=True)
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.1),  # noqa: F841 (its hooks live with it)
                           dpsgd.DPSGDConfig(1.0), expected_batch_size=5)
    x = torch.randn(5, 6, 4, requires_grad=True)
    grad, = torch.autograd.grad(model(x)[0].pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()


@pytest.mark.parametrize("case", ["packed", "weight-normed"])
def test_a_dropped_sample_leaves_the_others_update(case):
    """non_finite="drop": the dropped sample's steps are zeroed in the sums; in the replay's clipped
    sum by one backward pass over the batch (never formed whole), its inputs, its length kept (a
    length of 0 cannot be packed)."""
    model, x, target = setting(case)
    target[2] = float("nan")
    config = dpsgd.DPSGDConfig(0.05, noise_multiplier=0.3, non_finite="drop")
    want = dpsgd.privatize(one_backward_per_sample(model, x, target), config, 4.0, M.NoiseGenerator(1))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layers, "when_to_form", lambda per_sample, held: layers.Forming.NEVER)
        got = book_kept(model, x, target, config, 4.0, M.NoiseGenerator(1))
    assert all(bool(torch.isfinite(g).all()) for g in got)
    assert_same_update(got, want)


def test_dropout_between_the_layers_of_a_recurrent_module_is_refused():
    model = nn.LSTM(4, 3, num_layers=2, dropout=0.3, batch_first=True)
    x = torch.randn(5, 6, 4)
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.1), dpsgd.DPSGDConfig(1.0),
                           expected_batch_size=5)
    with pytest.raises(ValueError, match=r"module '' \(LSTM\) has dropout=0.3 between its layers in training mode"):
        bk.step(model(x)[0].sum((1, 2)))
    model.eval()
    bk.step(model(x)[0].sum((1, 2)))


def test_an_input_without_a_batch_is_refused():
    model = nn.GRU(4, 3)
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.1), dpsgd.DPSGDConfig(1.0),
                           expected_batch_size=5)
    with pytest.raises(ValueError, match=r"module '' \(GRU\) got an input of shape \(6, 4\), without a batch"):
        model(torch.randn(6, 4))
    assert not bk.layers[0].calls


class SortedByLength(nn.Module):
    """An Embedding and an LSTM on sequences of different lengths, packed by torch (enforce_sorted
    False: sorted by length, put back in order by pad_packed_sequence), or sorted by hand, packed
    with enforce_sorted=True and put back in order after padding (``by_hand``): the token ids
    sorted (the idiom from before that option), the embedded batch (AllenNLP's
    sort_and_run_forward: ``index_select``, the sequences that are not empty packed), the ids with
    the final state put back instead (``h_n[-1][restore]``), or the embedded batch made sequence
    first, sorted and put back along dim 1 (InferSent's encoder), or the embedded batch with the
    outputs put back by writing them (``back[order] = out``); a Linear on each sample's first
    output or final state. ``trained``: the modules that train beside the Linear."""

    def __init__(self, trained, by_hand=None):
        super().__init__()
        self.by_hand = by_hand
        self.embed, self.lstm, self.head = nn.Embedding(20, 6, padding_idx=0), nn.LSTM(6, 4, batch_first=True), \
            nn.Linear(4, 2)
        self.lstm_first = nn.LSTM(6, 4) if by_hand == "sequence-first" else None
        for name in ("embed", "lstm", "lstm_first"):
            if getattr(self, name) is not None:
                getattr(self, name).requires_grad_(("lstm" if name.startswith("lstm") else name) in trained)

    def forward(self, ids):
        lengths = (ids != 0).sum(1)
        if self.by_hand is None:
            packed = pack_padded_sequence(self.embed(ids), lengths.cpu(), batch_first=True, enforce_sorted=False)
            out, _ = pad_packed_sequence(self.lstm(packed)[0], batch_first=True, total_length=ids.shape[1])
            return self.head(out[:, 0])
        lengths, order = lengths.sort(descending=True)
        if self.by_hand == "sequence-first":  # InferSent's encoder: sorted and put back along dim 1
            embedded = self.embed(ids).transpose(0, 1).index_select(1, order)
            out, _ = self.lstm_first(pack_padded_sequence(embedded, lengths.cpu()))
            out, _ = pad_packed_sequence(out, total_length=ids.shape[1])
            return self.head(out.index_select(1, order.argsort())[0])
        embedded = self.embed(ids).index_select(0, order) if self.by_hand in ("embedded", "written-back") \
            else self.embed(ids[order])
        valid = int((lengths > 0).sum())
        out, (h, _) = self.lstm(pack_padded_sequence(embedded[:valid], lengths[:valid].cpu(), batch_first=True))
        if self.by_hand == "final-state":
            return self.head(h[-1][order.argsort()])
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=ids.shape[1])
        if self.by_hand == "written-back":
            back = torch.empty_like(out)
            back[order] = out
            return self.head(back[:, 0])
        return self.head(out[order.argsort()][:, 0])


TRAINED = {"both": ("embed", "lstm"), "lstm": ("lstm",), "embed": ("embed",)}


@pytest.mark.parametrize("trained, by_hand", [*((trained, None) for trained in TRAINED), ("embed", "embedded"),
                                              ("embed", "written-back")],
                         ids=[*(f"by-torch-{trained}" for trained in TRAINED), "by-hand-around-a-frozen-lstm",
                              "written-back-around-a-frozen-lstm"])
def test_a_sort_by_length_put_back_with_no_trained_layer_between_is_no_reorder_of_the_batch(trained, by_hand):
    """pack_padded_sequence's sort of the batch by length and pad_packed_sequence's restoring of
    its order are passed over by the check of rows taken in another order: the update is that of
    each sample's own backward pass, the Embedding trained or not (the sort is in the loss's graph
    or not), the LSTM trained or not (its packed sequence's order is known or not). So is a sort
    by hand around an LSTM that does not train (AllenNLP's sort_and_run_forward around a frozen
    encoder: every trained layer reads the batch in order)."""
    torch.manual_seed(0)
    model, generator = SortedByLength(TRAINED[trained], by_hand), torch.Generator().manual_seed(1)
    x, target = tokens(LENGTHS, generator), torch.randn(len(LENGTHS), 2, generator=generator)
    grads = one_backward_per_sample(model, x, target)
    config = dpsgd.DPSGDConfig(clip_between(grads, False), noise_multiplier=0.0)
    want = dpsgd.privatize(grads, config, 4.0, M.NoiseGenerator(3))
    assert_same_update(book_kept(model, x, target, config, 4.0, M.NoiseGenerator(3)), want)


@pytest.mark.parametrize("by_hand", ["ids", "embedded", "final-state", "sequence-first", "written-back"])
@pytest.mark.parametrize("trained", ["both", "lstm"])
def test_a_batch_sorted_by_length_by_hand_for_a_trained_lstm_is_refused(trained, by_hand):
    """The idiom from before enforce_sorted=False: the LSTM reads the batch sorted, the Linear (and
    the Embedding) in order, and each row was clipped with other samples' (up to 1.41 times C; a
    review's repros, also with the embedded batch sorted by index_select, whose sort only the
    packing op reads, with the final state put back, ``h_n[-1][restore]``, and sequence first along
    dim 1), silently where the first batch was in order or its first sample the longest. Refused at any step where the
    order is not the batch's; a batch in order trains."""
    torch.manual_seed(0)
    model, generator = SortedByLength(TRAINED[trained], by_hand), torch.Generator().manual_seed(1)
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(trainable(model), lr=0.1), dpsgd.DPSGDConfig(1.0),
                           expected_batch_size=6)
    assert len(bk.step(regression(model(tokens(sorted(LENGTHS)[::-1], generator)), torch.zeros(6, 2))))
    for lengths in ([7, 3, 5, 6, 1, 2], LENGTHS):  # the longest first; the batch's own lengths
        with pytest.raises(ValueError, match="rows computed from the output of module '(lstm|lstm_first|embed)' .* are "
                                             "taken along the batch's dim in another order"):
            bk.step(regression(model(tokens(lengths, generator)), torch.zeros(6, 2)))


class TimeReversed(nn.Module):
    """A sequence-first GRU run backward in time by hand, its input reversed by an index along dim 0
    (the idiom before torch.flip) and its output reversed back."""

    def __init__(self):
        super().__init__()
        self.inp, self.gru, self.out = nn.Linear(3, 4), nn.GRU(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.inp(x).transpose(0, 1)
        reverse = torch.arange(h.shape[0] - 1, -1, -1)
        return self.out(self.gru(h[reverse])[0].index_select(-3, reverse).mean(0))


@pytest.mark.parametrize("length", [5, 4], ids=["T-not-B", "T-is-B"])
def test_sequence_first_positions_reversed_are_no_reorder_of_the_batch_where_t_is_b(length):
    """Positions of sequence-first tensors taken in another order along dim 0: at T = B (a Poisson
    batch's size may meet T) dim 0 has the batch's size, but the rows are positions (the Linear's
    output moved out of dim 0 by the transpose, the GRU's sequence-first output): the update is
    that of each sample's own backward pass, as at T != B."""
    torch.manual_seed(0)
    model, generator = TimeReversed(), torch.Generator().manual_seed(1)
    x, target = torch.randn(4, length, 3, generator=generator), torch.randn(4, 2, generator=generator)
    grads = one_backward_per_sample(model, x, target)
    config = dpsgd.DPSGDConfig(clip_between(grads, False), noise_multiplier=0.0)
    want = dpsgd.privatize(grads, config, 4.0, M.NoiseGenerator(3))
    assert_same_update(book_kept(model, x, target, config, 4.0, M.NoiseGenerator(3)), want)


class FinalStates(nn.Module):
    """An RNN on features sorted by hand (a batch sorted by length; no graph shows it), its final
    states or outputs put back in order by ``restore``, a Linear on them; or (``between``) a frozen
    LSTM on a Linear's outputs sorted and packed by hand, a trained Linear on its padded outputs
    before they are put back."""

    def __init__(self, restore):
        super().__init__()
        self.restore = restore
        bidirectional = restore in ("view", "unbind")
        self.rnn = nn.GRU(3, 4, batch_first=True) if restore == "output" else \
            nn.LSTM(3, 4, num_layers=2 if restore == "view" else 1, bidirectional=bidirectional, batch_first=True)
        self.proj_in, self.proj, self.head = nn.Linear(3, 3), nn.Linear(4, 4), nn.Linear(8 if bidirectional else 4, 2)
        if restore == "between":
            self.rnn.requires_grad_(False)

    def forward(self, x):
        order = x[:, :, 0].sum(1).argsort()
        back = order.argsort()
        if self.restore == "between":
            lengths = torch.full((len(x),), x.shape[1])  # the sort below only the packing op reads
            out, _ = self.rnn(pack_padded_sequence(self.proj_in(x)[order], lengths, batch_first=True))
            out, _ = pad_packed_sequence(out, batch_first=True)
            return self.head(self.proj(out[:, -1])[back])
        out, states = self.rnn(x[order])
        h = states[0] if isinstance(states, tuple) else states
        final = {"view": lambda: h.view(2, 2, len(x), 4)[-1].transpose(0, 1).reshape(len(x), 8)[back],
                 "index": lambda: h[:, back][0], "unbind": lambda: torch.cat(h.unbind(0), 1)[back],
                 "mean": lambda: h.mean(0)[back], "output": lambda: out[back][:, -1]}[self.restore]()
        return self.head(final)


@pytest.mark.parametrize("restore", ["view", "index", "unbind", "mean", "output", "between"])
def test_final_states_or_outputs_put_back_in_order_are_refused(restore):
    """A review's escapes of the first form of the check, each 1.41 times C after a first batch in
    order: torch's idiom ``h_n.view(layers, directions, B, h)[-1]``, ``h_n[:, restore]`` of one
    layer, ``h_n.unbind(0)``, ``h_n.mean(0)`` (the batch's dim followed through views, indexes
    after a dim of 1, unbind and reductions), a batch-first GRU's output (its output and final
    state come from one autograd node, their batch in different dims), and a trained Linear
    between a frozen RNN packed by hand and the restoring."""
    torch.manual_seed(0)
    model, generator = FinalStates(restore), torch.Generator().manual_seed(1)
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(trainable(model), lr=0.1), dpsgd.DPSGDConfig(1.0),
                           expected_batch_size=4)
    x = torch.randn(4, 5, 3, generator=generator)
    in_order = x[x[:, :, 0].sum(1).argsort()]
    assert len(bk.step(regression(model(in_order), torch.zeros(4, 2))))
    with pytest.raises(ValueError, match="rows computed from the output of module '(rnn|proj)' .* are taken along "
                                         "the batch's dim in another order"):
        bk.step(regression(model(in_order.flip(0)), torch.zeros(4, 2)))


class CellLoop(nn.Module):
    """A GRUCell run over the positions, its states stacked batch first (``dim`` 1) or sequence
    first (0), the samples then taken in the order of their first feature, a Linear head on the
    last state."""

    def __init__(self, dim):
        super().__init__()
        self.dim, self.cell, self.head = dim, nn.GRUCell(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        order, state, states = x[:, 0, 0].argsort(), x.new_zeros(x.shape[0], 4), []
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
            states.append(state)
        stacked = torch.stack(states, self.dim)
        return self.head(stacked[order][:, -1] if self.dim == 1 else stacked[:, order][-1])


@pytest.mark.parametrize("dim", [1, 0], ids=["batch-first", "sequence-first"])
def test_a_cell_s_stacked_states_taken_in_another_order_are_refused(dim):
    """A review's escape at 1.41 times C after a first batch in order: states stacked along a new
    dim, then the batch taken in another order; the stack's dims were aligned from the right, so
    the walk down from the index never reached the cell. The batch in order trains."""
    torch.manual_seed(0)
    model, generator = CellLoop(dim), torch.Generator().manual_seed(1)
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.1), dpsgd.DPSGDConfig(1.0),
                           expected_batch_size=4)
    x = torch.randn(4, 3, 3, generator=generator)
    in_order = x[x[:, 0, 0].argsort()]
    assert len(bk.step(regression(model(in_order), torch.zeros(4, 2))))
    with pytest.raises(ValueError, match=r"rows computed from the output of module 'cell' \(GRUCell\) are taken along "
                                         "the batch's dim in another order"):
        bk.step(regression(model(in_order.flip(0)), torch.zeros(4, 2)))


class Positions(nn.Module):
    """``layer`` (a batch-first GRU, nn.MultiheadAttention or nn.TransformerEncoderLayer, or a
    sequence-first nn.MultiheadAttention) on a Linear's outputs, the positions reversed after it
    by an index or (``stacked``) by stacking each position's rows in reverse, twice, a tanh
    between."""

    def __init__(self, layer, stacked=False):
        super().__init__()
        self.layer, self.stacked, self.inp, self.out = layer, stacked, nn.Linear(3, 4), nn.Linear(4, 2)
        self.mix = {"gru": lambda: nn.GRU(4, 4, batch_first=True),
                    "mha": lambda: nn.MultiheadAttention(4, 2, batch_first=True),
                    "encoder": lambda: nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True),
                    "mha-sequence-first": lambda: nn.MultiheadAttention(4, 2)}[layer]()

    def forward(self, x):
        h = self.inp(x)
        first = self.layer == "mha-sequence-first"
        if first:
            h = h.transpose(0, 1)
        y = self.mix(h, h, h)[0] if self.layer.startswith("mha") else self.mix(h)
        y = y[0] if isinstance(y, tuple) else y
        reverse = torch.arange(x.shape[1] - 1, -1, -1)
        if self.stacked:
            y = torch.stack([y[t] if first else y[:, t] for t in reverse.tolist()], 1)
            y = torch.stack([y[:, t] for t in reverse.tolist()], 1).tanh()[:, reverse]
        else:
            y = y[reverse].transpose(0, 1) if first else y[:, reverse]
        return self.out(y).mean(1)


@pytest.mark.parametrize("stacked", [False, True], ids=["index", "stacked"])
@pytest.mark.parametrize("layer", ["gru", "mha", "encoder", "mha-sequence-first"])
def test_positions_reversed_after_a_layer_at_t_equal_to_b_are_no_reorder(layer, stacked):
    """At T = B (a Poisson batch may meet T) positions reversed by an index, or each position's
    rows stacked in reverse, have the batch's size: reviews found them refused after a batch-first
    GRU (its output's node is its final state's too), attention (it projects sequence first) and
    an encoder layer (the stack's dims were aligned from the right); the update is that of each
    sample's own backward pass."""
    torch.manual_seed(0)
    model, generator = Positions(layer, stacked), torch.Generator().manual_seed(1)
    x, target = torch.randn(4, 4, 3, generator=generator), torch.randn(4, 2, generator=generator)
    grads = one_backward_per_sample(model, x, target)
    config = dpsgd.DPSGDConfig(clip_between(grads, False), noise_multiplier=0.0)
    want = dpsgd.privatize(grads, config, 4.0, M.NoiseGenerator(3))
    assert_same_update(book_kept(model, x, target, config, 4.0, M.NoiseGenerator(3)), want)
