"""dpsgd.BookKeeping on nn.MultiheadAttention (and torch's transformer layers built on it), against
each sample's gradient by autograd through torch's own attention, dropout included: the same
dropout masks when the book-kept forward draws as torch's does."""
import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import requires_cuda
from privleak import dpsgd
from privleak import mechanisms as M
from privleak.dpsgd import attention, layers
from test_bookkeeping import CONFIGS, assert_same_update, clip_between, one_backward_per_sample, regression, trainable
from torch import nn


class Attending(nn.Module):
    """Linear layers around one nn.MultiheadAttention of width 8 called as ``form`` says; dropout 0.3
    on the attention weights."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        kw = {"kdim": 5, "vdim": 3} if form == "separate" else {}
        if form == "bias-kv-zero":
            kw = {"bias": False, "add_bias_kv": True, "add_zero_attn": True}
        self.mha = nn.MultiheadAttention(8, 2, dropout=0.3, batch_first=form != "sequence-first", **kw)
        self.inp, self.memory, self.out = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 2)
        self.key, self.value = (nn.Linear(4, 5), nn.Linear(4, 3)) if form == "separate" else (None, None)

    def forward(self, x):
        h, T = self.inp(x), x.shape[1]
        form, mha = self.form, self.mha
        if form == "self":
            y = mha(h, h, h, need_weights=False)[0]
        elif form == "weights":  # the loss reads the per-head attention weights too
            y, weights = mha(h, h, h, average_attn_weights=False)
            y = y + weights.mean(1)[..., :1]
        elif form == "sequence-first":
            s = h.transpose(0, 1)
            y = mha(s, s, s)[0].transpose(0, 1)
        elif form == "cross":  # a key-value memory of other length
            m = self.memory(x)[:, :3]
            y = mha(h, m, m, need_weights=False)[0]
        elif form == "separate":
            y = mha(h, self.key(x), self.value(x))[0]
        elif form == "bias-kv-zero":
            rows, keys = torch.arange(x.shape[0], device=x.device), torch.arange(T, device=x.device)
            padding = keys >= T - 1 - rows[:, None] % 3  # some keys masked per sample
            future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            y = mha(h, h, h, key_padding_mask=padding, attn_mask=future)[0]
        elif form == "causal":
            causal = nn.Transformer.generate_square_subsequent_mask(T)
            y = mha(h, h, h, attn_mask=causal, is_causal=True, need_weights=False)[0]
        elif form == "twice":  # one module, self-attention and then attention to a memory: other row blocks
            m = self.memory(x)
            y = mha(h, h, h, need_weights=False)[0]
            y = mha(y, m, m, need_weights=False)[0]
        return self.out(torch.tanh(y))


def encoder_layer():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True)
    return nn.Sequential(nn.Linear(4, 8), nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                         nn.Linear(8, 2))


class Decoder(nn.Module):
    """nn.TransformerDecoderLayer (pre-norm, causal self-attention and attention to a memory)."""

    def __init__(self):
        super().__init__()
        self.inp, self.memory, self.out = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 2)
        self.layer = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.1, batch_first=True, norm_first=True)

    def forward(self, x):
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.out(self.layer(self.inp(x), self.memory(x), tgt_mask=causal, tgt_is_causal=True))


class VisionTransformer(nn.Module):
    """torchvision's ViT in small: patches by a strided Conv2d, a class token and position embedding
    of the model's own (expanded and added over the batch), nn.TransformerEncoder, a head on the
    class token. Images (B, 3, 8, 8) in place of the (B, T, 4) sequences (:data:`IMAGES`)."""

    def __init__(self):
        super().__init__()
        self.patches = nn.Conv2d(3, 8, 4, stride=4)
        self.cls, self.positions = nn.Parameter(torch.randn(1, 1, 8)), nn.Parameter(torch.randn(1, 5, 8) * 0.1)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 2)

    def forward(self, images):
        x = self.patches(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.positions
        return self.head(self.encoder(x)[:, :1]).expand(-1, 5, -1)


class EncoderDecoder(nn.Module):
    """nn.Transformer, batch first: an encoder layer and a decoder layer with a causal mask."""

    def __init__(self):
        super().__init__()
        self.inp, self.memory, self.out = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 2)
        self.transformer = nn.Transformer(8, 2, 1, 1, 16, dropout=0.1, batch_first=True)

    def forward(self, x):
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.out(self.transformer(self.memory(x), self.inp(x), tgt_mask=causal))


def frozen_projection():
    model = Attending("self")
    model.mha.in_proj_weight.requires_grad_(False)
    return model


def frozen_bias_k():
    model = Attending("bias-kv-zero")
    model.mha.bias_k.requires_grad_(False)
    return model


class OnTheData(nn.Module):
    """nn.MultiheadAttention first, on the data (no gradient reaches its input), its in-projection
    frozen: only out_proj and the head train."""

    def __init__(self):
        super().__init__()
        self.mha, self.out = nn.MultiheadAttention(4, 2, dropout=0.3, batch_first=True), nn.Linear(4, 2)
        self.mha.in_proj_weight.requires_grad_(False)
        self.mha.in_proj_bias.requires_grad_(False)

    def forward(self, x):
        return self.out(self.mha(x, x, x)[0])


FORMS = ["self", "weights", "sequence-first", "cross", "separate", "bias-kv-zero", "causal", "twice"]
CASES = {**{form: (lambda form=form: Attending(form)) for form in FORMS},
         "encoder-layer": encoder_layer, "decoder-layer": Decoder, "encoder-decoder": EncoderDecoder,
         "frozen-in-proj": frozen_projection, "frozen-bias-k": frozen_bias_k, "on-the-data": OnTheData,
         "vision-transformer": VisionTransformer}


IMAGES = ("vision-transformer",)  #: cases whose inputs are images (B, 3, 8, 8)


def setting(case):
    torch.manual_seed(0)
    model = CASES[case]()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(6, *((3, 8, 8) if case in IMAGES else (5, 4)), generator=generator)
    target = torch.randn(6, 5, 2, generator=generator)
    return model, x, target


def per_sample_grads_of_one_forward(model, x, target, seed):
    """(B, *shape) per trainable parameter: each sample's loss differentiated through one batched
    forward of torch's own modules (its dropout masks drawn from ``seed``)."""
    params = trainable(model)
    torch.manual_seed(seed)
    losses = regression(model(x), target)
    rows = [torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True) for loss in losses]
    return [torch.stack([torch.zeros_like(p) if g is None else g for g in column])
            for p, column in zip(params, zip(*rows))]


@pytest.mark.parametrize("mechanism, per_layer", [("gaussian", False), ("vmf", True), ("laplace", False)])
@pytest.mark.parametrize("case", CASES)
def test_attention_gives_the_update_of_each_samples_gradient(case, mechanism, per_layer, monkeypatch):
    """The update equals privatize() of the per-sample gradients through torch's own attention, with
    the same dropout masks; every nn.MultiheadAttention gets the attention rule, and nothing is
    replayed (a ViT's class token and positions take their ops' output gradients)."""
    replayed, replay = [], layers.FunctionalLayer.per_sample_grads
    monkeypatch.setattr(layers.FunctionalLayer, "per_sample_grads",
                        lambda self, *args: replayed.append(self.name) or replay(self, *args))
    model, x, target = setting(case)
    reference = copy.deepcopy(model)
    grads = per_sample_grads_of_one_forward(reference, x, target, seed=5)
    config = CONFIGS[mechanism](clip_between(grads, per_layer), per_layer)
    want = dpsgd.privatize(grads, config, 4.5, M.NoiseGenerator(7))
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(trainable(model), lr=0.0), config, expected_batch_size=4.5,
                           generator=M.NoiseGenerator(7))
    assert sum(type(layer) is attention.MultiheadAttentionLayer for layer in bk.layers) == sum(
        isinstance(m, nn.MultiheadAttention) for m in model.modules())
    torch.manual_seed(5)
    assert_same_update(bk.step(regression(model(x), target)), want)
    assert torch._C._len_torch_function_stack() == 0
    assert not replayed


@requires_cuda
@pytest.mark.parametrize("case", ["self", "cross", "separate", "bias-kv-zero", "encoder-decoder", "vision-transformer"])
def test_attention_on_cuda_matches_the_cpu(case):
    """Book-keeping on the GPU against the per-sample gradients on the CPU, without dropout (the
    devices draw other masks): eval mode, which turns dropout off and still records."""
    model, x, target = setting(case)
    model.eval()
    grads = per_sample_grads_of_one_forward(copy.deepcopy(model), x, target, seed=5)
    config = CONFIGS["gaussian"](clip_between(grads, False), False)
    want = dpsgd.privatize(grads, config, 4.5, M.NoiseGenerator(7))
    model.cuda()
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(trainable(model), lr=0.0), config, expected_batch_size=4.5,
                           generator=M.NoiseGenerator(7))
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # float32 convolutions, as on the CPU
        got = bk.step(regression(model(x.cuda()), target.cuda()))
    assert all(g.is_cuda for g in got)
    assert_same_update([g.cpu() for g in got], want)


def test_dropout_draws_as_torch_draws():
    """The reference above is only one if the masks differ between samples and calls: dropout at
    p = 0.3 changes the per-sample gradients, and the seeded forward repeats them."""
    model, x, target = setting("self")
    with_dropout = per_sample_grads_of_one_forward(model, x, target, seed=5)
    again = per_sample_grads_of_one_forward(model, x, target, seed=5)
    model.mha.dropout = 0.0
    without = per_sample_grads_of_one_forward(model, x, target, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(with_dropout, again))
    assert not torch.allclose(with_dropout[2], without[2])  # out_proj.weight's


ARGUMENTS = {  # F.multi_head_attention_forward's keyword arguments per case, beyond the weights
    "self": {},
    "weights-per-head": {"average_attn_weights": False},
    "no-weights": {"need_weights": False},
    "masks": {"key_padding_mask": "padding", "attn_mask": "future-bool"},
    "float-masks-no-weights": {"key_padding_mask": "padding-float", "attn_mask": "future", "need_weights": False},
    "causal": {"attn_mask": "future", "is_causal": True, "need_weights": False},
    "bias-kv-zero": {"add_zero_attn": True, "bias_kv": True, "key_padding_mask": "padding"},
    "eval": {"training": False},
}


@pytest.mark.parametrize("inputs", ["self", "shared-key-value", "three", "separate-weights"])
@pytest.mark.parametrize("case", ARGUMENTS)
def test_the_recorded_forward_is_torchs(case, inputs):
    """attention_forward against F.multi_head_attention_forward on the same arguments and seed:
    the same outputs, attention weights and input gradients, and each projection kept."""
    E, H, T, S, B = 8, 2, 5, 4, 3
    g = torch.Generator().manual_seed(0)
    leaf = lambda *shape: torch.randn(*shape, generator=g).requires_grad_()  # noqa: E731
    query = leaf(T, B, E)
    key = value = leaf(S, B, E)
    if inputs == "self":
        key = value = query
    elif inputs != "shared-key-value":
        value = leaf(S, B, E)
    kwargs = dict(ARGUMENTS[case])
    bias_kv = kwargs.pop("bias_kv", False)
    masks = {"padding": torch.arange(key.shape[0]) >= key.shape[0] - 1 - torch.arange(B)[:, None] % 2,
             "future": torch.full((T, key.shape[0]), float("-inf")).triu(1),
             "future-bool": torch.ones(T, key.shape[0], dtype=torch.bool).triu(1)}
    masks["padding-float"] = torch.zeros(B, key.shape[0]).masked_fill(masks["padding"], float("-inf"))
    kwargs = {k: masks[v] if isinstance(v, str) else v for k, v in kwargs.items()}
    separate = inputs == "separate-weights"
    weights = dict(in_proj_weight=None if separate else leaf(3 * E, E), in_proj_bias=leaf(3 * E),
                   bias_k=leaf(1, 1, E) if bias_kv else None, bias_v=leaf(1, 1, E) if bias_kv else None,
                   out_proj_weight=leaf(E, E), out_proj_bias=leaf(E))
    if separate:
        kwargs.update(use_separate_proj_weight=True, q_proj_weight=leaf(E, E), k_proj_weight=leaf(E, E),
                      v_proj_weight=leaf(E, E))
    kwargs = {"add_zero_attn": False, "dropout_p": 0.4, **kwargs}
    positional = [weights[n] for n in ("in_proj_weight", "in_proj_bias", "bias_k", "bias_v")]
    tail = [kwargs.pop("add_zero_attn"), kwargs.pop("dropout_p"), weights["out_proj_weight"], weights["out_proj_bias"]]
    results, kept = [], []

    def project(x, w, b, rows, bias_rows):
        kept.append(rows)
        return F.linear(x, w[rows[0]:rows[1]], None if b is None else b[bias_rows[0]:bias_rows[1]])

    for run in (F.multi_head_attention_forward, attention.attention_forward):
        extra = [] if run is F.multi_head_attention_forward else [project, lambda p, batch: p.repeat(1, batch, 1)]
        torch.manual_seed(3)
        out, attn = run(*extra, query, key, value, E, H, *positional, *tail, **kwargs)
        leaves = [t for t in (query, key, value, *weights.values(), kwargs.get("q_proj_weight")) if t is not None]
        loss = out.square().sum() + (0 if attn is None else attn.square().sum())
        results.append((out, attn, torch.autograd.grad(loss, leaves), kept))
    (want, want_attn, want_grads, _), (got, got_attn, got_grads, kept) = results
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert (got_attn is None) == (want_attn is None)
    if want_attn is not None:
        torch.testing.assert_close(got_attn, want_attn, rtol=1e-6, atol=1e-7)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    in_rows = {"self": [(0, 3 * E)], "shared-key-value": [(0, E), (E, 3 * E)]}.get(
        inputs, [(0, E), (E, 2 * E), (2 * E, 3 * E)] if not separate else [(0, E)] * 3)
    assert kept == [*in_rows, (0, E)]


def test_a_forward_that_raises_leaves_no_mode_behind():
    model = nn.MultiheadAttention(4, 2, batch_first=True)
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.1), dpsgd.DPSGDConfig(1.0),
                           expected_batch_size=2)
    x = torch.randn(2, 3, 4)
    with pytest.raises(AssertionError, match="key_padding_mask"):
        model(x, x, x, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))
    assert torch._C._len_torch_function_stack() == 0
    with pytest.raises(ValueError, match="unbatched"):
        model(x[0], x[0], x[0])
    assert torch._C._len_torch_function_stack() == 0
    with torch.no_grad():
        model(x, x, x)  # evaluation: torch's own forward, nothing recorded
    assert all(u.isfinite().all() for u in bk.step(model(x, x, x)[0].sum((1, 2))))
    assert torch._C._len_torch_function_stack() == 0


def test_a_backward_the_user_runs_gives_torchs_gradients():
    """The recorded forward is torch's: a backward outside step() gives every parameter torch's
    gradient."""
    model, x, target = setting("decoder-layer")
    model.eval()  # no dropout, so that the twins' forwards agree
    twin = copy.deepcopy(model)
    dpsgd.BookKeeping(model, torch.optim.SGD(trainable(model), lr=0.1), dpsgd.DPSGDConfig(1.0), expected_batch_size=6)
    for network in (model, twin):
        regression(network(x), target).sum().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_sample_with_a_non_finite_gradient_is_dropped():
    """non_finite="drop": a sample whose input holds a NaN gets clip factor 0, the others the update
    of their per-sample gradients alone."""
    model, x, target = setting("cross")
    model.mha.dropout = 0.0
    x[3, 2, 1] = float("nan")
    grads = one_backward_per_sample(model, x, target)  # one batched backward would spread the NaN (0 * NaN)
    config = dpsgd.DPSGDConfig(0.5, noise_multiplier=0.3, non_finite="drop")
    want = dpsgd.privatize(grads, config, 4.0, M.NoiseGenerator(1))
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(trainable(model), lr=0.0), config, expected_batch_size=4.0,
                           generator=M.NoiseGenerator(1))
    got = bk.step(regression(model(x), target))
    assert all(bool(torch.isfinite(g).all()) for g in got)
    assert_same_update(got, want)


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning")  # nn.Transformer's, of batch_first
@pytest.mark.parametrize("build", [
    lambda: nn.TransformerEncoderLayer(8, 2, 16),
    lambda: nn.Sequential(nn.Linear(4, 8), nn.TransformerDecoder(nn.TransformerDecoderLayer(8, 2, 16), 1)),
    lambda: nn.Transformer(8, 2, 1, 1, 16)])
def test_torchs_transformer_layers_with_the_sequence_first_are_refused(build):
    """Their Linear layers would take the positions for the samples, silently when T = B."""
    model = build()
    with pytest.raises(ValueError, match=r"\(Transformer(Encoder|Decoder)Layer\) has batch_first=False"):
        dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.1), dpsgd.DPSGDConfig(1.0),
                          expected_batch_size=2)


def test_a_mode_left_by_an_interrupted_forward_takes_nothing_else():
    """A KeyboardInterrupt runs no forward hook, so the recorder's mode stays on: it passes other
    modules' attention and evaluations on to torch, and the module's next forward replaces it."""
    model = nn.MultiheadAttention(4, 2, batch_first=True)
    other = nn.MultiheadAttention(4, 2, batch_first=True)
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.1), dpsgd.DPSGDConfig(1.0),
                           expected_batch_size=2)
    x = torch.randn(2, 3, 4)

    def interrupt(module, args):
        raise KeyboardInterrupt

    handle = model.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(x, x, x)
    handle.remove()
    assert torch._C._len_torch_function_stack() == 1
    torch.testing.assert_close(other(x[0], x[0], x[0])[0], other(x, x, x)[0][0])  # unbatched: torch's own
    with torch.no_grad():
        model(x[0], x[0], x[0])
    assert all(u.isfinite().all() for u in bk.step(model(x, x, x)[0].sum((1, 2))))
    assert torch._C._len_torch_function_stack() == 0
