"""dpsgd.BookKeeping (ghost norms + book-keeping, one backward pass) against the materialised path:
torch.func per-sample gradients through dpsgd.privatize / DPOptimizer, same config, same noise
stream. The clip norms are set between the samples' norms, so some samples are clipped and some not."""
import contextlib
import copy
import itertools
import math
import re
import threading
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from conftest import requires_cuda
from privleak import dpsgd
from privleak import mechanisms as M
from privleak.dpsgd import (
    attention,
    bookkeeping,
    computed_weight,
    direct_reads,
    ghost_norm,
    graph,
    layers,
    recurrent,
    tied,
)
from torch import nn
from torch.autograd.graph import get_gradient_edge
from transformers.pytorch_utils import Conv1D

pytestmark = [
    # torch.func has no batching rule for the fused CPU attention kernel that nn.MultiheadAttention calls
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
    # torch's note on padding="same" with an even kernel, which the conv cases test on purpose
    pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning"),
    # torch's note that nn.RMSNorm under autocast (bfloat16 input, float32 weight) takes its unfused path
    pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning"),
]


def regression(out, target):
    """Per-sample losses (B,): mean squared error over everything but the batch dim."""
    return (out - target).pow(2).flatten(1).mean(1)


def materialised_grads(model, x, target, loss=regression):
    return dpsgd.per_sample_gradients(model, lambda out, t: loss(out, t).sum(), x, target)


def assert_book_kept_as_materialised(model, x, target):
    """Book-keeping's noiseless update of ``model`` on the batch is the materialised path's, a
    clip norm between the samples' norms (some clipped, some not)."""
    grads = materialised_grads(model, x, target)
    config = dpsgd.DPSGDConfig(clip_between(grads, False), noise_multiplier=0.0)
    want = dpsgd.privatize(grads, config, float(len(x)), M.NoiseGenerator(5))
    assert_same_update(book_kept(model, x, target, config, float(len(x)), M.NoiseGenerator(5)), want)


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def book_kept(model, x, target, config, batch_size, generator, loss=regression):
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(trainable(model), lr=0.0), config,
                           expected_batch_size=batch_size, generator=generator)
    return bk.step(loss(model(x), target))


def assert_same_update(got, want):
    assert len(got) == len(want)
    scale = max(float(w.abs().max()) for w in want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=1e-4, atol=2e-6 * scale)


def clip_between(grads, per_layer):
    """Clip norms at the median sample norm (flat) or each tensor's median (per layer)."""
    flat = torch.stack([g.reshape(g.shape[0], -1).double().norm(dim=1) for g in grads], 1)
    if per_layer:
        return [max(float(c), 1e-3) for c in flat.median(0).values]
    return float(flat.norm(dim=1).median())


class Scale(nn.Module):
    """A layer with no book-keeping rule, using its parameter twice, once through exp (not a use
    broadcast over the batch, so the fallback replays it): y = x w + x^2 exp(w) / 4."""

    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x):
        return x * self.weight + x.pow(2) * self.weight.exp() / 4


class DroppedScale(Scale):
    """Scale with dropout inside: the fallback's recomputation could not replay its mask."""

    def __init__(self, width):
        super().__init__(width)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(super().forward(x))


class FunctionallyDropped(Scale):
    """Scale with functional dropout (no dropout module to tell of it)."""

    def forward(self, x):
        return F.dropout(super().forward(x), 0.5, self.training)


class Twice(nn.Module):
    """The same Linear applied at two places of one forward."""

    def __init__(self):
        super().__init__()
        self.inner, self.outer = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.outer(torch.tanh(self.inner(torch.tanh(self.inner(x)))))


class ConvTwice(nn.Module):
    """The same Conv2d applied at two places of one forward (inputs of two sizes)."""

    def __init__(self, conv=nn.Conv2d):
        super().__init__()
        self.inner, self.outer = conv(3, 3, 3, padding=1), conv(3, 2, 3, stride=2)

    def forward(self, x):
        return self.outer(torch.tanh(self.inner(torch.tanh(self.inner(x))[..., 1:, :])))


class Attention(nn.Module):
    """nn.MultiheadAttention between Linear layers."""

    def __init__(self):
        super().__init__()
        self.inp, self.attention, self.out = nn.Linear(3, 4), nn.MultiheadAttention(4, 2, batch_first=True), \
            nn.Linear(4, 2)

    def forward(self, x):
        h = self.inp(x)
        return self.out(self.attention(h, h, h, need_weights=False)[0])


class OwnParameters(nn.Module):
    """A ViT's layout: a class token and a position embedding as parameters of the model itself,
    beside its layers (the fallback's broadcast parameters: no replay)."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(2, 4, 3, stride=3)
        self.cls, self.pos = nn.Parameter(torch.randn(1, 1, 4)), nn.Parameter(torch.randn(1, 5, 4))
        self.norm, self.head = nn.LayerNorm(4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.patch(x).flatten(2).transpose(1, 2)
        h = torch.cat([self.cls.expand(len(x), -1, -1), h], 1) + self.pos
        return self.head(torch.tanh(self.norm(h))[:, 0])


class TiedEmbeddings(nn.Module):
    """A language model's layout, GPT-2's: token embeddings plus position embeddings of position ids
    (1, T), shared by the batch; a second token embedding (the previous token's) and the output
    head both tied to the token embedding's weight (one-hot with one-hot, one-hot with dense)."""

    def __init__(self, vocab=9, width=4):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width, padding_idx=0), nn.Embedding(8, width)
        self.previous = nn.Embedding(vocab, width)
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)
        self.previous.weight = self.head.weight = self.tokens.weight

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        h = self.tokens(ids) + self.positions(positions) + self.previous(ids.roll(1, 1))
        return self.head(torch.tanh(self.norm(h)))


class SharedOutputs(nn.Module):
    """Layers run on a batch of 1 whose outputs the batch shares: a table of position embeddings
    of ids (1, 10), sliced, added and (shifted by one, times 0.5) subtracted; a Linear of a fixed
    vector (1, 1, d), multiplying every position; a LayerNorm of it, expanded over the batch and
    prepended."""

    def __init__(self):
        super().__init__()
        self.positions, self.shift, self.start_norm = nn.Embedding(10, 4), nn.Linear(4, 4), nn.LayerNorm(4)
        self.head = nn.Linear(4, 2)
        self.register_buffer("start", torch.randn(1, 1, 4))

    def forward(self, x):
        table, length = self.positions(torch.arange(10, device=x.device)[None]), x.shape[1]
        h = torch.sub(x + table[:, :length], table[:, 1:length + 1], alpha=0.5) * self.shift(self.start)
        h = torch.cat([self.start_norm(self.start).expand(len(x), -1, -1), h], 1)
        return self.head(torch.tanh(h))


class Lookup(nn.Module):
    """A table looked up functionally: a module with no rule (the fallback)."""

    def __init__(self, rows, width):
        super().__init__()
        self.table = nn.Parameter(torch.randn(rows, width))

    def forward(self, ids):
        return F.embedding(ids, self.table)


class RelativeBias(nn.Module):
    """T5's relative attention bias: an Embedding of bucket ids (T, T), one per pair of positions
    and without the batch, permuted to (1, heads, T, T), copied, and added to attention maps'
    scores: as it is; zeroed above the diagonal (a where of the bias's shape, before the batch);
    zeroed at padding (a where with the batch, the bias its second operand). A second table, with
    no rule, looked up alike: its replay takes the buckets whole. At T = 6, the batch's size, the
    buckets look like a batch: only the outputs, broadcast over the batch, tell them apart."""

    def __init__(self):
        super().__init__()
        self.bias, self.second, self.qk, self.head = nn.Embedding(9, 2), Lookup(9, 2), nn.Linear(4, 8), nn.Linear(4, 2)

    def forward(self, x):
        length = x.shape[1]
        positions = torch.arange(length, device=x.device)
        buckets = (positions[None] - positions[:, None]).clamp(-4, 4) + 4
        bias = self.bias(buckets).permute(2, 0, 1).unsqueeze(0).contiguous()
        q, k = self.qk(x).unflatten(-1, (2, 4)).transpose(1, 2).chunk(2, -1)
        scores = q @ k.transpose(-1, -2)
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        padding = x[:, None, None, :, 0] > 0.5
        maps = [scores + bias, scores + torch.where(causal, bias, 0.0), torch.where(padding, 0.0, bias) + scores,
                scores + self.second(buckets).permute(2, 0, 1)]
        return self.head(torch.cat([m.softmax(-1) for m in maps], 1).mean(1) @ x)


class RelativeTable(nn.Module):
    """DeBERTa's disentangled attention in small: a table of relative positions that the module
    reads as a weight (an Embedding's, or a parameter of its own), LayerNormed, projected by the
    query Linear that projects the batch too and by a Linear of its own: no batch in any of it.
    Each projection is split into heads (2, 2 R, 2) and tiled over the batch by ``repeat(B, 1,
    1)``, beside queries and keys (B 2, T, 2); bmm and a gather by relative position make the
    content-to-position and position-to-content scores. With a table of its own, the heads are
    split by a flatten, which views the table's projection (1, 2, 2 R, 2) as (2, 2 R, 2)."""

    def __init__(self, own_table=False):
        super().__init__()
        self.flattens = own_table
        if own_table:
            self.own = nn.Parameter(torch.randn(8, 4))
        else:
            self.table = nn.Embedding(8, 4)
        self.norm, self.query, self.key, self.position = nn.LayerNorm(4), nn.Linear(4, 4), nn.Linear(4, 4), \
            nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        batch, length, _ = x.shape

        def heads(h):  # (N, L, 4) -> (N 2, L, 2): DeBERTa's copy and view, or a flatten (a view of the table's)
            h = h.unflatten(-1, (2, 2)).transpose(1, 2)
            return h.flatten(0, 1) if self.flattens else h.contiguous().view(-1, h.shape[2], 2)

        relative = self.relative(self.own if hasattr(self, "own") else self.table.weight, x)
        q, k = heads(self.query(x)), heads(self.key(x))
        position_keys = heads(self.query(relative)).repeat(batch, 1, 1)
        position_queries = heads(self.position(relative)).repeat(batch, 1, 1)
        offsets = torch.arange(length, device=x.device)
        index = (offsets[None] - offsets[:, None]).clamp(-4, 3).add(4).expand(len(q), -1, -1)
        scores = q @ k.transpose(1, 2) + torch.bmm(q, position_keys.transpose(1, 2)).gather(-1, index) \
            + torch.bmm(k, position_queries.transpose(1, 2)).gather(-1, index).transpose(1, 2)
        out = (scores.softmax(-1) @ heads(x)).unflatten(0, (batch, 2)).transpose(1, 2).flatten(2)
        return self.head(torch.tanh(out))

    def relative(self, table, x):
        return self.norm(table)[None]


class ContinuousBias(nn.Module):
    """Swin v2's attention in small: cosine scores (queries and keys normalised), times
    exp(clamp(logit scale)), a parameter of the module that no rule takes; plus a bias that an MLP
    (Linear, ReLU, Linear) makes of a buffer of relative coordinates (1, 2T - 1, 2), indexed to
    (heads, T, T), 16 sigmoid(.), added to every sample's scores. Neither holds the batch until
    it meets the scores."""

    def __init__(self, length=5, leading_one=True):
        super().__init__()
        self.qkv, self.head = nn.Linear(4, 12), nn.Linear(4, 2)
        self.logit_scale = nn.Parameter(torch.tensor([[[1.5]], [[2.5]]]))
        self.bias = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2, bias=False))
        offsets = torch.arange(-length + 1, length, dtype=torch.float32)
        coordinates = torch.stack([offsets / length, offsets.abs().sqrt()], -1)
        self.register_buffer("coordinates", coordinates[None] if leading_one else coordinates)
        positions = torch.arange(length)
        self.register_buffer("index", (positions[None] - positions[:, None] + length - 1).flatten())

    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 2)).permute(2, 0, 3, 1, 4).unbind(0)  # (B, 2, T, 2) each
        scores = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)
        scores = scores * torch.clamp(self.logit_scale, max=4.0).exp()
        table = self.bias(self.coordinates).view(-1, 2)[self.index].view(length, length, 2).permute(2, 0, 1)
        scores = scores + 16 * torch.sigmoid(table.contiguous()).unsqueeze(0)
        return self.head(torch.tanh((scores.softmax(-1) @ v).transpose(1, 2).flatten(2)))


class LearnedPositions(nn.Embedding):
    """BART's learned position embedding: an nn.Embedding with a forward of its own that makes
    position ids from its input's shape, offset by 2, and returns their lookup: ids (1, T), or
    expanded to (B, T)."""

    def forward(self, x, expand=False):
        ids = torch.arange(x.shape[1], device=x.device) + 2
        return super().forward(ids.expand(len(x), -1) if expand else ids[None])


class OwnPositions(nn.Module):
    """A position embedding that makes its own position ids (1, T), as BART's learned one: a module
    with no rule whose output has no batch dim."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(8, 3))

    def forward(self, x):
        return F.embedding(torch.arange(x.shape[1], device=x.device)[None], self.table)


class PositionModules(nn.Module):
    """Position embeddings as modules that make their own ids: BART's (ids (1, T) and (B, T)) and
    one with no rule (replayed once for the batch, each sample with its output gradient)."""

    def __init__(self):
        super().__init__()
        self.shared, self.expanded = LearnedPositions(9, 3), LearnedPositions(9, 3)
        self.own, self.head = OwnPositions(), nn.Linear(3, 2)

    def forward(self, x):
        return self.head(torch.tanh(x + self.shared(x) + self.expanded(x, expand=True) - self.own(x)))


class FlattenedBatch(nn.Module):
    """OPT's decoder layer: the hidden states (B, T, d) reshaped to (B T, d) for a LayerNorm and the
    MLP (a scale without grad, a residual add), then back; a second reshape, of a non-contiguous (B, T, d)
    slice, for a Linear alone (its copy and view)."""

    def __init__(self):
        super().__init__()
        self.inp, self.norm, self.up, self.down = nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 6), nn.Linear(6, 4)
        self.side, self.head = nn.Linear(2, 4), nn.Linear(4, 2)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))

    def forward(self, x):
        h = self.inp(x)
        flat = h.reshape(-1, h.shape[-1])
        flat = flat + self.down(torch.relu(self.up(self.norm(flat))) * self.scale)
        side = self.side(h[..., ::2].reshape(-1, 2))
        return self.head((flat * side).view(h.shape))


class FlattenedAfterAttention(nn.Module):
    """A batch-first nn.MultiheadAttention's output, the transpose of its sequence-first result,
    flattened to (B T, d) for a Linear."""

    def __init__(self):
        super().__init__()
        self.inp, self.attention, self.mix = nn.Linear(3, 4), nn.MultiheadAttention(4, 2, batch_first=True), \
            nn.Linear(4, 2)

    def forward(self, x):
        h = self.inp(x)
        h = self.attention(h, h, h, need_weights=False)[0]
        return self.mix(h.reshape(-1, h.shape[-1])).view(*h.shape[:2], -1)


class LowRankEmbedding(nn.Module):
    """peft's LoRA embedding: a frozen table plus the lookup of A^T times B^T, A and B in a
    ParameterDict of the module that uses them, and a dropout it holds but does not run."""

    def __init__(self):
        super().__init__()
        self.base = nn.Embedding(9, 5).requires_grad_(False)
        self.low_rank = nn.ParameterDict({"a": nn.Parameter(torch.randn(2, 9)), "b": nn.Parameter(torch.randn(5, 2))})
        self.unused = nn.Dropout(0.5)

    def forward(self, ids):
        return self.base(ids) + F.embedding(ids, self.low_rank["a"].T) @ self.low_rank["b"].T


class Magnitude(nn.Module):
    """DoRA's magnitude m: the adapted layer's output (base plus low-rank update) rescaled row by
    row to m over the adapted weight's column norms, those detached (as peft computes them)."""

    def __init__(self, width):
        super().__init__()
        self.magnitude = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, base, update, weight_norms):
        scale = (self.magnitude / weight_norms).view(1, -1)
        return (scale - 1.0) * base + scale * update


class Adapted(nn.Module):
    """Adapters on frozen layers as peft builds them: the LoRA embedding above; a LoRA update B A h
    beside a frozen Linear with DoRA's magnitude, the adapted weight's norms from A and B applied
    to an identity matrix (calls of A and B whose outputs the loss does not use); scales in a
    ParameterList of the model, multiplying the batch."""

    def __init__(self):
        super().__init__()
        self.embed = LowRankEmbedding()
        self.base = nn.Linear(5, 4).requires_grad_(False)
        self.a, self.b = nn.Linear(5, 2, bias=False), nn.Linear(2, 4, bias=False)
        self.dora = Magnitude(4)
        self.scales = nn.ParameterList([nn.Parameter(torch.linspace(1.0, 2.0, 4))])
        self.head = nn.Linear(4, 2)

    def forward(self, ids):
        h = torch.tanh(self.embed(ids))
        adapted = self.base.weight + self.b(self.a(torch.eye(5, device=ids.device))).T
        h = self.dora(self.base(h), self.b(self.a(h)), adapted.detach().norm(dim=1))
        return self.head(torch.tanh(h * self.scales[0]))


class PromptTuned(nn.Module):
    """peft's prompt tuning: the virtual tokens' embeddings, looked up once for ids (1, n) and
    repeated over the batch, before the embeddings of the batch's tokens."""

    def __init__(self):
        super().__init__()
        self.tokens, self.prompt, self.head = nn.Embedding(9, 4), nn.Embedding(3, 4), nn.Linear(4, 2)

    def forward(self, ids):
        prompts = self.prompt(torch.arange(3, device=ids.device)[None]).repeat(len(ids), 1, 1)
        return self.head(torch.tanh(torch.cat([prompts, self.tokens(ids)], 1)))


class Router(nn.Module):
    """A mixture of experts' router (Mixtral's): a weight of its own applied to the tokens (B T, d),
    returning its logits and the normalised top-k weights made from them (the logits feed the
    weights, and the loss uses them too: a hook on them sees both uses)."""

    def __init__(self, width, experts, k):
        super().__init__()
        self.weight, self.k = nn.Parameter(torch.randn(experts, width) * 0.5), k

    def forward(self, tokens):
        logits = F.linear(tokens, self.weight)
        top, index = logits.softmax(-1).topk(self.k, dim=-1)
        return logits, top / top.sum(-1, keepdim=True), index


class Experts(nn.Module):
    """The experts' weights in one parameter (E, d, d), each token through its top-k experts,
    weighted: every expert on every token, then a gather; or (``indexed``) Mixtral's eager loop
    over the experts, each on the tokens routed to it (shapes that depend on the data, which
    torch.func cannot vmap)."""

    def __init__(self, width, experts, indexed):
        super().__init__()
        self.weight, self.indexed = nn.Parameter(torch.randn(experts, width, width) * 0.4), indexed

    def forward(self, tokens, index, weights):
        if self.indexed:
            out = torch.zeros_like(tokens)
            for expert, weight in enumerate(self.weight):
                token, slot = torch.where(index == expert)
                out = out.index_add(0, token, F.linear(tokens[token], weight) * weights[token, slot, None])
            return out
        every = torch.einsum("nd,eod->neo", tokens, self.weight)
        return (every.gather(1, index[..., None].expand(-1, -1, every.shape[-1])) * weights[..., None]).sum(1)


class MixtureOfExperts(nn.Module):
    """A mixture-of-experts block as Hugging Face's Mixtral builds it: the router and the experts
    take the hidden states flattened to (B T, d); the router's logits also enter the output."""

    def __init__(self, indexed=False):
        super().__init__()
        self.inp, self.router, self.head = nn.Linear(3, 4), Router(4, 3, 2), nn.Linear(4, 2)
        self.experts = Experts(4, 3, indexed)

    def forward(self, x):
        h = self.inp(x)
        tokens = h.reshape(-1, h.shape[-1])
        logits, weights, index = self.router(tokens)
        h = (tokens + self.experts(tokens, index, weights)).view(h.shape)
        return self.head(torch.tanh(h)) + 0.1 * logits.view(*h.shape[:-1], -1).logsumexp(-1, keepdim=True)


class TiedAutoencoder(nn.Module):
    """An autoencoder whose decoder is the encoder's weight transposed: transformers' Conv1D
    (y = h W) holding nn.Linear's weight (y = W x): two dense factors with their roles swapped."""

    def __init__(self):
        super().__init__()
        self.encode, self.decode = nn.Linear(5, 3), Conv1D(5, 3)
        self.decode.weight = self.encode.weight

    def forward(self, x):
        return self.decode(torch.tanh(self.encode(x)))


def frozen_first():
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    model[0].weight.requires_grad_(False)
    return model


def batchnorm_eval():
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))
    model[1].eval()
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    return model


def parametrized():
    """Weights computed as the model runs: weight norm on a Linear and a convolution (of
    torch.nn.utils.parametrizations), an orthogonal Linear, and the deprecated hook-based weight
    norm (weight_g and weight_v parameters of the Linear itself)."""
    P = nn.utils.parametrizations
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated
        hooked = nn.utils.weight_norm(nn.Linear(6, 3))
    return nn.Sequential(P.weight_norm(nn.Conv1d(2, 3, 3, padding=1)), nn.Tanh(), nn.Flatten(),
                         P.weight_norm(nn.Linear(12, 5)), nn.Tanh(), P.orthogonal(nn.Linear(5, 6)), nn.Tanh(), hooked)


def standardized_forward(self, x):
    """A weight-standardised convolution's forward (Qiao et al. 2019; De et al. 2022 train wide
    ResNets with it under DP-SGD), with a gain per output channel as in NF-Nets: it computes the
    weight it convolves with from its parameters (privleak.dpsgd.computed_weight)."""
    w = self.weight
    dims = tuple(range(1, w.ndim))
    w = self.gain * (w - w.mean(dims, keepdim=True)) / (w.std(dims, keepdim=True) + 1e-5)
    return self._conv_forward(x, w, self.bias)


class StandardizedConv2d(nn.Conv2d):
    forward = standardized_forward

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.rand(self.out_channels, 1, 1, 1) + 0.5)


class StandardizedConv1d(nn.Conv1d):
    forward = standardized_forward

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.rand(self.out_channels, 1, 1) + 0.5)


STANDARDISATIONS = {  # a weight-standardised convolution's phi as it is written, without a gain
    "std": lambda w: (w - w.mean(tuple(range(1, w.ndim)), keepdim=True))
    / (w.std(tuple(range(1, w.ndim)), keepdim=True) + 1e-5),
    "batch-norm": lambda w: F.batch_norm(w.reshape(1, w.shape[0], -1), None, None, training=True, momentum=0.0,
                                         eps=1e-6).reshape_as(w),  # timm's StdConv2d
    "rsqrt": lambda w: (w - w.mean(tuple(range(1, w.ndim)), keepdim=True))
    * torch.rsqrt(w.var(tuple(range(1, w.ndim)), keepdim=True, unbiased=False) + 1e-4),
}


def standardised(base, form):
    """A subclass of ``base`` (nn.Conv1d or nn.Conv2d) standardising its weight, one parameter of
    the weight's shape, by STANDARDISATIONS[form]: J^T in the standardised form
    (privleak.dpsgd.computed_weight)."""
    def forward(self, x):
        return self._conv_forward(x, STANDARDISATIONS[form](self.weight), self.bias)
    return type(f"Standardised{base.__name__}", (base,), {"forward": forward})


class PaddedConv2d(nn.Conv2d):
    """A convolution that pads its input itself (as TensorFlow's 'SAME' padding is written), with
    its weight as it is (the computed weight's rule with J_phi the identity), and its sizes as
    one-element lists (torch's conv2d repeats them for both dims)."""

    def forward(self, x):
        return F.conv2d(F.pad(x, [0, 1, 1, 0]), self.weight, self.bias, [self.stride[0]], [0], [self.dilation[0]])


class GainConv2d(nn.Conv2d):
    """y = conv(x, W g) without a bias (an equalised learning rate's form): the weight a product of
    parameters, which the fallback's broadcast rule would watch in the backward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, bias=False, **kwargs)
        self.gain = nn.Parameter(torch.rand(self.out_channels, 1, 1, 1) + 0.5)

    def forward(self, x):
        return self._conv_forward(x, self.weight * self.gain, None)


class ScaledOutputConv2d(nn.Conv2d):
    """A convolution whose forward multiplies its output by a parameter of its own, its input by
    another, its input and its weight by one node made of it, makes its weight from the batch, or
    changes its output in place: the
    computed weight's rule fits none of these (the parameters used outside the computed weight;
    the output gradient not the convolution's), so each is replayed."""

    def __init__(self, *args, where="output", **kwargs):
        super().__init__(*args, **kwargs)
        self.where = where
        self.scale = nn.Parameter(torch.rand(self.out_channels, 1, 1) + 0.5)

    def forward(self, x):
        if self.where == "input":
            return self._conv_forward(x * self.scale[:x.shape[1]], self.weight * 2, self.bias)
        if self.where == "dynamic":  # a weight made from the batch (no per-sample gradient to compare with)
            return self._conv_forward(x, self.weight * x.mean(), self.bias)
        if self.where == "shared":
            s = self.scale.mean().exp()
            return self._conv_forward(x * s, self.weight * s, self.bias)
        if self.where == "in place":
            return self._conv_forward(x, self.weight * self.scale.view(-1, 1, 1, 1), self.bias).mul_(1.5).tanh_()
        return super().forward(x) * self.scale


class Recurrent(nn.Module):
    """Each recurrent module with the batch where torch puts it: an LSTM batch first read at its
    output and final states, a bidirectional two-layer GRU sequence first with initial states made
    by a Linear (so they carry gradients). (tests/test_bookkeeping_recurrent.py: nn.RNN, projections
    and packed sequences, which torch.func cannot vmap, against one backward pass per sample.)"""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 5, batch_first=True)
        self.start = nn.Linear(4, 2 * 2 * 2)
        self.gru = nn.GRU(5, 2, num_layers=2, bidirectional=True)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        h0 = self.start(x[:, 0]).view(-1, 4, 2).transpose(0, 1).contiguous()
        out, _ = self.gru(torch.tanh(out).transpose(0, 1), h0)
        return out.transpose(0, 1) + h[-1, :, :4].unsqueeze(1) + c[-1].sum(1).view(-1, 1, 1)


def ids(shape, vocab=9):
    def make(generator):
        return torch.randint(0, vocab, shape, generator=generator)
    return make


def normal(*shape):
    def make(generator):
        return torch.randn(*shape, generator=generator)
    return make


# name: (model builder, input maker (per batch of 6), the layer kinds that must be hooked)
LAYER_CASES = {
    "linear": (lambda: nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)), normal(6, 5)),
    "linear-sequence": (lambda: nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3, bias=False)),
                        normal(6, 2, 7, 5)),
    "linear-frozen-weight": (frozen_first, normal(6, 5)),
    "linear-twice": (Twice, normal(6, 3, 4)),
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(3, 4, 3, stride=2, padding=1), nn.Tanh(),
                                     nn.Conv1d(4, 2, 2, dilation=2, groups=2, padding="same")), normal(6, 3, 11)),
    "conv2d": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.Tanh(),
                                     nn.Conv2d(4, 4, (2, 3), padding="same", dilation=(1, 2), groups=2, bias=False),
                                     nn.Tanh(), nn.Conv2d(4, 3, 3, padding=1, padding_mode="reflect")),
               normal(6, 2, 9, 8)),
    "conv-twice": (ConvTwice, normal(6, 3, 7, 6)),
    "conv-transpose": (lambda: nn.Sequential(nn.ConvTranspose2d(2, 4, 3, stride=2, padding=1, output_padding=1),
                                             nn.Tanh(), nn.ConvTranspose2d(4, 4, (2, 3), dilation=(1, 2), groups=2,
                                                                           bias=False),
                                             nn.Tanh(), nn.ConvTranspose2d(4, 3, 3, stride=(1, 2), padding=(0, 1))),
                       normal(6, 2, 4, 5)),
    "conv-transpose-1d": (lambda: nn.Sequential(nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1),
                                                nn.Tanh(), nn.ConvTranspose1d(4, 2, 2, dilation=3, groups=2)),
                          normal(6, 3, 7)),
    "embedding": (lambda: nn.Sequential(nn.Embedding(9, 4, padding_idx=0), nn.Tanh(), nn.Linear(4, 3)), ids((6, 8))),
    "embedding-bag": (lambda: nn.Sequential(nn.EmbeddingBag(9, 4, mode="mean", padding_idx=0), nn.Tanh(),
                                            nn.Linear(4, 3)), ids((6, 8))),
    "layernorm": (lambda: nn.Sequential(nn.Linear(4, 5), nn.LayerNorm((3, 5)), nn.Tanh(), nn.Linear(5, 2)),
                  normal(6, 3, 4)),
    "rmsnorm": (lambda: nn.Sequential(nn.Linear(4, 5), nn.RMSNorm((3, 5)), nn.Tanh(), nn.Linear(5, 2)),
                normal(6, 3, 4)),
    "transformers-conv1d": (lambda: nn.Sequential(Conv1D(6, 5), nn.Tanh(), Conv1D(3, 6)), normal(6, 7, 5)),
    "shared-outputs": (SharedOutputs, normal(6, 5, 4)),
    "relative-bias": (RelativeBias, normal(6, 6, 4)),
    "relative-table": (RelativeTable, normal(6, 5, 4)),
    "relative-own-table": (lambda: RelativeTable(own_table=True), normal(6, 6, 4)),
    "positions-exponentiated": (lambda: PositionsExponentiated(), normal(6, 5, 3)),
    "continuous-bias": (ContinuousBias, normal(6, 5, 4)),
    "flattened-batch": (FlattenedBatch, normal(6, 5, 3)),
    "flattened-after-attention": (FlattenedAfterAttention, normal(6, 5, 3)),
    "position-modules": (PositionModules, normal(6, 5, 3)),
    "tied-embeddings": (TiedEmbeddings, ids((6, 7))),
    "tied-autoencoder": (TiedAutoencoder, normal(6, 4, 5)),
    "groupnorm": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(),
                                        nn.Linear(36, 2)), normal(6, 2, 5, 5)),
    "multihead-attention": (Attention, normal(6, 5, 3)),
    "fallback": (lambda: nn.Sequential(nn.Linear(5, 4), Scale(4), nn.Linear(4, 2)), normal(6, 5)),
    "own-parameters": (OwnParameters, normal(6, 2, 6, 6)),
    "batchnorm-eval": (batchnorm_eval, normal(6, 5)),
    "adapters": (Adapted, ids((6, 5))),
    "prompt-tuning": (PromptTuned, ids((6, 5))),
    "mixture-of-experts": (MixtureOfExperts, normal(6, 5, 3)),
    "parametrized": (parametrized, normal(6, 2, 4)),
    "standardized-conv": (lambda: nn.Sequential(StandardizedConv2d(2, 4, 3, padding=1, padding_mode="reflect"),
                                                nn.GroupNorm(2, 4), nn.ReLU(), StandardizedConv2d(4, 3, 3, stride=2,
                                                                                                  bias=False)),
                          normal(6, 2, 6, 5)),
    "standardized-conv1d": (lambda: nn.Sequential(StandardizedConv1d(3, 4, 3, stride=2, padding=1), nn.Tanh(),
                                                  StandardizedConv1d(4, 2, 2, dilation=2, groups=2, padding="same")),
                            normal(6, 3, 11)),
    "standardized-conv-twice": (lambda: ConvTwice(StandardizedConv2d), normal(6, 3, 7, 6)),
    # J^T in the standardised form: G_i(w) formed whole (first), a few samples at a time (the 8-channel
    # convolutions on 2 x 3 inputs; the last one of two groups, by the ghost norm), a Conv1d of two groups
    "standardised-conv": (lambda: nn.Sequential(
        standardised(nn.Conv2d, "std")(2, 4, 3, padding=1, padding_mode="reflect"), nn.ReLU(),
        standardised(nn.Conv2d, "batch-norm")(4, 8, 3, stride=2, bias=False), nn.Tanh(),
        standardised(nn.Conv2d, "rsqrt")(8, 8, 3, padding=1, groups=2)), normal(6, 2, 6, 8)),
    "standardised-conv1d": (lambda: nn.Sequential(standardised(nn.Conv1d, "std")(4, 6, 3, padding=1, groups=2),
                                                  nn.Tanh(), standardised(nn.Conv1d, "rsqrt")(6, 2, 2)),
                            normal(6, 4, 7)),
    "conv-padded-itself": (lambda: nn.Sequential(PaddedConv2d(2, 3, 2), nn.Tanh(), nn.Flatten(), nn.Linear(75, 2)),
                           normal(6, 2, 5, 5)),
    "conv-gain": (lambda: nn.Sequential(GainConv2d(2, 3, 3, stride=2), nn.Tanh(), nn.Flatten(), nn.Linear(12, 2)),
                  normal(6, 2, 5, 5)),
    "conv-scaled-output": (lambda: nn.Sequential(*[m for where in ("output", "input", "shared", "in place") for m in (
                               ScaledOutputConv2d(2, 2, 3, padding=1, where=where), nn.Tanh())]), normal(6, 2, 5, 5)),
    "recurrent": (Recurrent, normal(6, 5, 4)),
}

CONFIGS = {
    "gaussian": lambda c, per_layer, **kw: dpsgd.DPSGDConfig(c, noise_multiplier=0.7, per_layer=per_layer, **kw),
    "vmf": lambda c, per_layer, **kw: dpsgd.DPSGDConfig(c, "vmf", kappa=20.0, per_layer=per_layer, **kw),
    "laplace": lambda c, per_layer, **kw: dpsgd.DPSGDConfig(c, "laplace", noise_multiplier=0.7, per_layer=per_layer,
                                                            **kw),
}


def setting(case, seed=0):
    build, make_input = LAYER_CASES[case]
    torch.manual_seed(seed)
    model = build()
    generator = torch.Generator().manual_seed(seed + 1)
    x = make_input(generator)
    with torch.no_grad():
        target = torch.randn(model(x).shape, generator=generator)
    return model, x, target


def compare(case, mechanism, per_layer, batch_size=4.5, seed=0):
    model, x, target = setting(case, seed)
    grads = materialised_grads(model, x, target)
    config = CONFIGS[mechanism](clip_between(grads, per_layer), per_layer)
    want = dpsgd.privatize(grads, config, batch_size, M.NoiseGenerator(7))
    got = book_kept(model, x, target, config, batch_size, M.NoiseGenerator(7))
    assert_same_update(got, want)
    return model


TIED = ("tied-embeddings", "tied-autoencoder")
#: L1 clipping (Laplace) of a tied parameter is refused (test_an_l1_norm_of_a_tied_parameter_is_refused)
CASES_AND_MECHANISMS = [(case, mechanism) for case in LAYER_CASES for mechanism in CONFIGS
                        if not (case in TIED and mechanism == "laplace")]


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
@pytest.mark.parametrize("case, mechanism", CASES_AND_MECHANISMS)
def test_every_layer_matches_the_materialised_update(case, mechanism, per_layer):
    compare(case, mechanism, per_layer)


@pytest.mark.parametrize("where", ["output", "input", "shared", "in place", "dynamic", None])
def test_only_a_weight_computed_from_the_parameters_alone_takes_the_computed_weight_rule(where):
    # The rule's own check, on a layer after another (its input has grad, so that a weight made
    # from the batch shows in its graph); None: a weight-standardised convolution, which fits.
    conv = StandardizedConv2d(2, 2, 3, padding=1) if where is None else ScaledOutputConv2d(2, 2, 3, padding=1,
                                                                                           where=where)
    model = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.Tanh(), conv)
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.0),
                           dpsgd.DPSGDConfig(1.0, noise_multiplier=1.0), expected_batch_size=4)
    model(torch.randn(4, 2, 5, 5))
    (layer,) = [layer for layer in bk.layers if layer.module is conv]
    assert len(layer.convolutions) == 1 and (layer.convolutions[0] is None) == (where is not None)


class DropConnectConv2d(nn.Conv2d):
    """DropConnect (Wan et al. 2013): each forward call convolves with the weight masked at random,
    one mask for the batch."""

    def forward(self, x):
        return self._conv_forward(x, self.weight * (torch.rand_like(self.weight) > 0.3), self.bias)


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
def test_a_weight_masked_at_random_in_the_forward_is_differentiated_under_its_mask(per_layer):
    # A replay would draw another mask (vmap refuses the draw); the computed weight's rule reads
    # the one the forward drew. The reference: one backward pass per sample under that mask.
    torch.manual_seed(0)
    model = nn.Sequential(DropConnectConv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(75, 2))
    x, target = torch.randn(6, 2, 5, 5), torch.randn(6, 2)
    torch.manual_seed(1)
    losses = regression(model(x), target)
    rows = [torch.autograd.grad(losses[i], trainable(model), retain_graph=True) for i in range(6)]
    grads = [torch.stack(column) for column in zip(*rows)]
    config = CONFIGS["gaussian"](clip_between(grads, per_layer), per_layer)
    want = dpsgd.privatize(grads, config, 4.5, M.NoiseGenerator(7))
    torch.manual_seed(1)
    got = book_kept(model, x, target, config, 4.5, M.NoiseGenerator(7))
    assert_same_update(got, want)
    masked = grads[0].reshape(6, -1).abs().sum(0) == 0  # the mask's zeros: no sample's gradient there
    assert 0 < int(masked.sum()) < masked.numel()


@pytest.mark.parametrize("mechanism", ["gaussian", "laplace"])
@pytest.mark.parametrize("case, in_form, by_ghost_norm", [
    ("standardised-conv", 3, 1), ("standardised-conv1d", 2, 0), ("conv-padded-itself", 1, 0),
    ("standardized-conv", 2, 0), ("standardized-conv1d", 2, 0), ("standardized-conv-twice", 1, 0)])
def test_the_standardised_form_gives_the_norms_where_it_holds(case, in_form, by_ghost_norm, mechanism, monkeypatch):
    # The form for each standardised convolution (a padded one's weight as it is: J = I is the form
    # too; a gain beside the weight too), not for the layer called twice (ConvTwice's inner); its
    # L2 norms by the ghost norm for the last convolution of "standardised-conv" (8 channels at
    # 2 x 3), from G_i(w) for the others; L1 norms (Laplace) from the per-sample gradients of the
    # parameters. The update is checked in compare().
    found, ghost = [], []
    check, norms = computed_weight.row_standardising_jacobian, computed_weight.ComputedWeightConvLayer._ghost_norms
    monkeypatch.setattr(computed_weight, "row_standardising_jacobian",
                        lambda *args: found.append(check(*args)) or found[-1])
    monkeypatch.setattr(computed_weight.ComputedWeightConvLayer, "_ghost_norms",
                        lambda self, *args: ghost.append(self) or norms(self, *args))
    compare(case, mechanism, per_layer=False)
    assert sum(j is not None for j in found) == in_form
    assert len(set(ghost)) == (by_ghost_norm if mechanism == "gaussian" else 0)


def test_the_ghost_norm_of_the_standardised_form_takes_g_i_w_where_its_difference_would_lose_digits(monkeypatch):
    # Inputs far from 0 (padded by reflection): each G_io lies along 1 but for ~1e-5 of its square,
    # which the ghost norm's difference would leave to rounding; those samples' norms come from
    # G_i(w). Against float64 per-sample gradients (the update's sums lose digits in float32 here
    # on any path: J^T of a sum lying along 1).
    model = nn.Sequential(standardised(nn.Conv2d, "std")(8, 8, 3, padding=1, padding_mode="reflect"), nn.Flatten())
    x = torch.randn(6, 8, 4, 4, generator=torch.Generator().manual_seed(2))
    x[:3] += 300.0
    target = torch.randn(6, 128, generator=torch.Generator().manual_seed(3))
    lost, found = [], []
    norms, ghost = computed_weight.standardised_squared_norms, computed_weight.ComputedWeightConvLayer._ghost_norms
    monkeypatch.setattr(computed_weight, "standardised_squared_norms",
                        lambda g, j: lost.append(g.shape[0]) or norms(g, j))
    monkeypatch.setattr(computed_weight.ComputedWeightConvLayer, "_ghost_norms",
                        lambda self, *args: found.append(ghost(self, *args)) or found[-1])
    book_kept(model, x, target, CONFIGS["gaussian"](1.0, False), 4.5, M.NoiseGenerator(7))
    weight = materialised_grads(copy.deepcopy(model).double(), x.double(), target.double())[0]
    # G_i(w) in float32 keeps 1e-7 |G_i| of the part off 1: ~1e-4 of these norms (without the guard: 2% off)
    torch.testing.assert_close(torch.cat([norms[0] for norms in found]), weight.flatten(1).square().sum(1),
                               rtol=1e-3, atol=0)
    assert lost == [3]


def _standardising_jacobian_of(phi, shape=(5, 4, 3, 3), seed=0):
    v = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).requires_grad_()
    return computed_weight.row_standardising_jacobian(phi(v), v), v


@pytest.mark.parametrize("shape", [(5, 4, 3, 3), (3, 64, 3, 3), (7, 2, 5)])
def test_a_standardisation_s_jacobian_is_the_scaled_projection_of_qiao_et_al(shape):
    # Population std without eps: J = (I - 1 1^T / n - u u^T) / sigma, the scaled projection
    # (r = 1 / sigma, lambda1 = lambdau = 0), against that closed form.
    dims = tuple(range(1, len(shape)))
    jacobian, v = _standardising_jacobian_of(
        lambda w: (w - w.mean(dims, keepdim=True)) / w.std(dims, keepdim=True, unbiased=False), shape)
    sigma = v.detach().double().std(dims, unbiased=False)
    torch.testing.assert_close(jacobian.scale, 1 / sigma, rtol=1e-5, atol=0)
    assert float(jacobian.basis_scales.abs().max()) < 1e-5 * float(jacobian.scale.min())


@pytest.mark.parametrize("phi, holds", [
    (STANDARDISATIONS["std"], True), (STANDARDISATIONS["batch-norm"], True), (STANDARDISATIONS["rsqrt"], True),
    (lambda w: 3 * w, True),
    (lambda w: w + 1e-3 * w.roll(1, 0), False),  # channels mixed by 0.1%
    (lambda w: STANDARDISATIONS["std"](w) + 1e-3 * w[:, :1].sum(), False),  # a rank-one term beside it
    (lambda w: w / torch.linalg.vector_norm(w, dim=(1, 2, 3), keepdim=True), False),  # weight norm
    (lambda w: w * (torch.arange(w.numel()).reshape(w.shape) % 3 > 0), False),  # a fixed DropConnect mask
    (lambda w: w.mean((1, 2, 3), keepdim=True).expand_as(w) + 0 * w, False)])  # constant rows: no direction u
@pytest.mark.parametrize("shape", [(5, 4, 3, 3), (3, 512, 3, 3)])  # rows of 36 and 4608 (the check's sums)
def test_the_standardised_form_is_taken_where_the_jacobian_has_it_and_only_there(phi, holds, shape):
    jacobian, v = _standardising_jacobian_of(phi, shape)
    assert (jacobian is not None) == holds
    if holds:  # and where it holds, it is J^T: against torch's vector-Jacobian product of random rows
        z = torch.randn(2, *v.shape, generator=torch.Generator().manual_seed(9))
        (want,) = torch.autograd.grad(phi(v), v, z, is_grads_batched=True)
        coefficients, rest = computed_weight._split(z.reshape(2, v.shape[0], -1).double(), jacobian.basis)
        got = jacobian.scale[:, None, None] * rest + torch.bmm(coefficients * jacobian.basis_scales[:, None],
                                                               jacobian.basis)
        torch.testing.assert_close(got.transpose(0, 1).reshape_as(want).float(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", sorted(STANDARDISATIONS))
def test_standardised_norms_are_those_of_the_vector_jacobian_products(form):
    # |J^T G_i|^2 of per-sample weight gradients, against the float64 product of torch's autograd;
    # G_i mostly along 1 (as after a ReLU) included.
    phi = STANDARDISATIONS[form]
    jacobian, v = _standardising_jacobian_of(phi, (6, 8, 3, 3))
    generator = torch.Generator().manual_seed(3)
    grads = torch.randn(5, *v.shape, generator=generator)
    grads[0] += 1e3
    v64 = v.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(phi(v64), v64, grads.double(), is_grads_batched=True)
    (got,) = computed_weight.standardised_squared_norms(grads, jacobian)
    torch.testing.assert_close(got, want.flatten(1).square().sum(1), rtol=1e-4, atol=0)


@pytest.mark.parametrize("rows_checked_at_a_time", [2, 6])
@pytest.mark.parametrize("gain_shape", [(6, 1, 1, 1), (6,)])
def test_a_gain_beside_the_standardised_weight_has_its_norms_from_the_parts_along_1_and_u(gain_shape,
                                                                                           rows_checked_at_a_time,
                                                                                           monkeypatch):
    # w = gain * standardised(v) (NF-Nets' form): |J^T G_i|^2 of v and of the gain against the
    # float64 products of torch's autograd; a gain mixing two channels is refused.
    monkeypatch.setattr(computed_weight, "_CHECKED_VALUES", 72 * rows_checked_at_a_time)
    v = torch.randn(6, 8, 3, 3, generator=torch.Generator().manual_seed(0)).requires_grad_()
    gain = (torch.rand(gain_shape, generator=torch.Generator().manual_seed(1)) + 0.5).requires_grad_()

    def phi(v, gain):
        return gain.reshape(6, 1, 1, 1) * STANDARDISATIONS["std"](v)

    jacobian = computed_weight.row_standardising_jacobian(phi(v, gain), v, (gain,))
    grads = torch.randn(5, *v.shape, generator=torch.Generator().manual_seed(3))
    v64, gain64 = v.detach().double().requires_grad_(), gain.detach().double().requires_grad_()
    want = torch.autograd.grad(phi(v64, gain64), (v64, gain64), grads.double(), is_grads_batched=True)
    for got, expected in zip(computed_weight.standardised_squared_norms(grads, jacobian), want, strict=True):
        torch.testing.assert_close(got, expected.flatten(1).square().sum(1), rtol=1e-4, atol=0)
    mixed = gain.reshape(6, 1, 1, 1) + 0.1 * gain.roll(1).reshape(6, 1, 1, 1)
    assert computed_weight.row_standardising_jacobian(mixed * STANDARDISATIONS["std"](v), v, (gain,)) is None


@requires_cuda
@pytest.mark.parametrize("case, mechanism", CASES_AND_MECHANISMS)
def test_every_layer_on_cuda_matches_the_materialised_update_on_the_cpu(case, mechanism):
    model, x, target = setting(case)
    grads = materialised_grads(model, x, target)
    config = CONFIGS[mechanism](clip_between(grads, False), False)
    want = dpsgd.privatize(grads, config, 4.5, M.NoiseGenerator(7))
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # float32 convolutions, as on the CPU
        got = book_kept(model.cuda(), x.cuda(), target.cuda(), config, 4.5, M.NoiseGenerator(7))
    assert all(g.is_cuda for g in got)
    assert_same_update([g.cpu() for g in got], want)


@pytest.mark.parametrize("ghost", [True, False], ids=["ghost-norm", "per-sample-gradient"])
@pytest.mark.parametrize("case", ["linear-sequence", "linear-twice", "conv1d", "conv2d", "conv-transpose",
                                  "conv-transpose-1d", "groupnorm"])
def test_both_sides_of_the_mixed_rule_match(case, ghost, monkeypatch):
    """Force every Linear-like layer onto one side of the mixed rule: both give the same update."""
    calls = []

    def rule(positions, inputs, outputs):
        calls.append((positions, inputs, outputs))
        return ghost

    monkeypatch.setattr(layers, "use_ghost_norm", rule)
    for per_layer in (False, True):
        compare(case, "gaussian", per_layer)
    assert calls


#: the cases with a module replayed per sample (FunctionalLayer), not only broadcast parameters
REPLAYED = ["fallback", "batchnorm-eval", "adapters", "position-modules",
            "mixture-of-experts"]


@pytest.mark.parametrize("forming", [layers.Forming.AFTER, layers.Forming.NEVER], ids=["whole", "chunked"])
@pytest.mark.parametrize("case", REPLAYED)
def test_a_replayed_module_gives_the_same_update_whole_or_in_chunks(case, forming, monkeypatch):
    """Every layer forms its per-sample gradients after the backward pass, or never whole: the
    replay's norms two samples at a time and its clipped sum by the same chunks replayed again;
    L2 flat and per layer, L1."""
    replayed = []
    monkeypatch.setattr(layers, "when_to_form", lambda per_sample, held: forming)
    monkeypatch.setattr(layers, "samples_per_chunk", lambda held, transient, **_: 2)
    sums = layers.FunctionalLayer.sums_by_parameter
    monkeypatch.setattr(layers.FunctionalLayer, "sums_by_parameter",
                        lambda self, *args: replayed.append(self.name) or sums(self, *args))
    for mechanism, per_layer in [("gaussian", False), ("vmf", True), ("laplace", False)]:
        compare(case, mechanism, per_layer)
    assert bool(replayed) == (forming is layers.Forming.NEVER)


@pytest.mark.parametrize("held, transient", [(16384, 16384), (10**6, 10), (100, 2**22), (100, 2**24), (4, 1)])
def test_a_chunk_on_a_gpu_holds_as_many_samples_as_its_budget_of_values(held, transient):
    """On a GPU a chunk is a few kernel launches of a block a sample: it takes as many samples as
    keep its transient within GPU_CHUNK_VALUES (the CIFAR CNN's 8 x 8 convolutions: the whole
    batch, not 8), and never fewer than the CPU's rule, which keeps it within what the layer holds."""
    cpu = layers.samples_per_chunk(held, transient)
    gpu = layers.samples_per_chunk(held, transient, on_gpu=True)
    assert gpu >= cpu
    if gpu > cpu:
        assert gpu * transient <= layers.GPU_CHUNK_VALUES < (gpu + 1) * transient
    assert layers.samples_per_chunk(held, 2 * 64 * 64 + 64 * 128, on_gpu=True) >= 512


@pytest.mark.parametrize("own_table", [False, True], ids=["embedding-weight", "own-parameter"])
def test_a_table_projected_without_the_batch_is_book_kept_through_its_projections(own_table, monkeypatch):
    """DeBERTa's relative positions (RelativeTable): the LayerNorm of the table and the table
    itself get each sample's gradient from the projections' (one vmapped backward pass of the
    region holding no batch), not from a replay of the module; a batch of one too, and an empty
    one (Poisson's: the noise alone, where no repeat's tiling tells the region)."""
    replays = []
    replay = layers.FunctionalLayer.per_sample_grads
    monkeypatch.setattr(layers.FunctionalLayer, "per_sample_grads",
                        lambda self, *args: replays.append(self.name) or replay(self, *args))
    for batch in (6, 1, 0):
        torch.manual_seed(0)
        model = RelativeTable(own_table)
        x = torch.randn(batch, 5, 4, generator=torch.Generator().manual_seed(1))
        target = torch.randn(batch, 5, 2, generator=torch.Generator().manual_seed(2))
        grads = materialised_grads(model, x, target) if batch else [x.new_zeros(0, *p.shape) for p in
                                                                   trainable(model)]
        config = CONFIGS["gaussian"](clip_between(grads, False) if batch else 1.0, False)
        want = dpsgd.privatize(grads, config, 4.0, M.NoiseGenerator(7))
        assert_same_update(book_kept(model, x, target, config, 4.0, M.NoiseGenerator(7)), want)
        assert replays == ([] if batch > 1 else [""])  # one sample: the module replayed, as cheap as a region


def test_a_table_mixed_with_the_batch_before_its_projections_is_refused():
    """A LayerNorm of a table plus the mean of the batch's keys: its output (8, 4) is no sample's,
    and the batch enters before the projections, so it is not a region without the batch:
    refused, naming the LayerNorm."""
    class Mixed(RelativeTable):
        def relative(self, table, x):
            return self.norm(table + self.key(x).mean())[None]

    torch.manual_seed(0)
    model = Mixed()
    x, target = torch.randn(6, 5, 4), torch.randn(6, 5, 2)
    config = CONFIGS["gaussian"](1.0, False)
    with pytest.raises(ValueError, match="module 'norm' .*saw a batch of 8"):
        book_kept(model, x, target, config, 4.0, M.NoiseGenerator(7))


def test_a_bias_an_mlp_makes_of_a_buffer_is_book_kept_through_the_ops_broadcasting_it(monkeypatch):
    """ContinuousBias (Swin v2's): the MLP's calls on the buffer of coordinates take each sample's
    output gradients from one vmapped backward pass of that region, from the add broadcasting its
    bias over the batch, and the logit scale its per-sample gradients from the product broadcasting
    it, so no module is replayed; flat and per layer, L2 and L1."""
    replays = []
    replay = layers.FunctionalLayer.per_sample_grads
    monkeypatch.setattr(layers.FunctionalLayer, "per_sample_grads",
                        lambda self, *args: replays.append(self.name) or replay(self, *args))
    for mechanism, per_layer in [("gaussian", False), ("vmf", True), ("laplace", True)]:
        compare("continuous-bias", mechanism, per_layer)
    assert replays == []


class Probed(MixtureOfExperts):
    """The mixture of experts running its router once more on the flattened tokens, that output
    unused (a probe)."""

    def forward(self, x):
        h = self.inp(x)
        self.router(h.reshape(-1, h.shape[-1]))
        return super().forward(x)


def test_a_call_whose_output_the_loss_does_not_use_is_left_out():
    """The probe's call gets no output gradient and is dropped after the backward pass; what the
    router keeps by call (the flattened batch of the call after it) follows the calls kept to
    their new places."""
    _, x, target = setting("mixture-of-experts")
    torch.manual_seed(0)
    model = Probed()
    config = dpsgd.DPSGDConfig(0.5, noise_multiplier=0.3)
    want = dpsgd.privatize(materialised_grads(model, x, target), config, 4.0, M.NoiseGenerator(1))
    assert_same_update(book_kept(model, x, target, config, 4.0, M.NoiseGenerator(1)), want)


def test_a_replay_whose_vmap_fails_past_the_first_chunk_takes_one_route_for_norms_and_sums(monkeypatch):
    """vmap failing on the second chunk of the norms' replay (a forward it cannot transform, met
    late): the module goes one sample at a time from then on, and its norms are replayed again
    that way, so that every chunk's norms come by the route its sum takes. Chunks of 2 of 6: the
    first chunk vmapped, the other two one sample at a time, then all three again that way for
    the norms and for the sums; the update is the materialised path's."""
    import torch.func

    monkeypatch.setattr(layers, "when_to_form", lambda per_sample, held: layers.Forming.NEVER)
    monkeypatch.setattr(layers, "samples_per_chunk", lambda held, transient, **_: 2)
    vmapped, one_at_a_time = [], []
    vmap = torch.func.vmap

    def failing_second(*args, **kwargs):
        transformed = vmap(*args, **kwargs)

        def run(*inputs):
            vmapped.append(len(vmapped))
            if len(vmapped) == 2:
                raise RuntimeError("a forward torch.func cannot transform")
            return transformed(*inputs)
        return run

    model, x, target = setting("fallback")
    config = dpsgd.DPSGDConfig(0.5, noise_multiplier=0.3)
    want = dpsgd.privatize(materialised_grads(model, x, target), config, 4.0, M.NoiseGenerator(1))
    monkeypatch.setattr(torch.func, "vmap", failing_second)
    original = layers.FunctionalLayer._one_at_a_time_grads
    monkeypatch.setattr(layers.FunctionalLayer, "_one_at_a_time_grads",
                        lambda self, *args, **kwargs: one_at_a_time.append(len(args[2][0]))
                        or original(self, *args, **kwargs))
    got = book_kept(model, x, target, config, 4.0, M.NoiseGenerator(1))
    assert len(vmapped) == 2 and one_at_a_time == [2] * (2 + 3 + 3)
    assert_same_update(got, want)


def test_a_replay_in_chunks_leaves_out_the_samples_it_drops(monkeypatch):
    """non_finite='drop' with the clipped sum by a second pass: a dropped sample's inputs and
    output gradients are zeroed before it (0 * NaN would reach the sum)."""
    monkeypatch.setattr(layers, "when_to_form", lambda per_sample, held: layers.Forming.NEVER)
    model, x, target = setting("fallback")
    x[2, 0] = float("nan")
    config = dpsgd.DPSGDConfig(0.5, noise_multiplier=0.3, non_finite="drop")
    want = dpsgd.privatize(materialised_grads(model, x, target), config, 4.0, M.NoiseGenerator(1))
    got = book_kept(model, x, target, config, 4.0, M.NoiseGenerator(1))
    assert all(bool(torch.isfinite(g).all()) for g in got)
    assert_same_update(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("kinds", [("dense", "dense"), ("ids", "dense"), ("dense", "ids"), ("ids", "ids")])
def test_the_cross_term_of_tied_layers_is_the_inner_product_of_their_gradients(kinds, dtype, monkeypatch):
    """tied.cross_term against the float64 inner product of the two per-sample gradients formed
    (one-hot rows for ids), a few samples at a time, and with no positions on one side."""
    monkeypatch.setattr(tied, "_GRAM_BUDGET", 100)  # 2 samples of 4 x 7 positions at a time
    generator, batch, rows, columns = torch.Generator().manual_seed(0), 5, 6, 3

    def factors(kind, positions):
        left = (torch.randint(0, rows, (batch, positions), generator=generator) if kind == "ids"
                else torch.randn(batch, positions, rows, generator=generator).to(dtype))
        return tied.Factors(left, torch.randn(batch, positions, columns, generator=generator).to(dtype))

    def formed(f):
        left = F.one_hot(f.left, rows).double() if f.one_hot else f.left.double()
        return torch.einsum("bsm,bsn->bmn", left, f.right.double())

    for first, second in [(factors(kinds[0], 4), factors(kinds[1], 7)), (factors(kinds[0], 0), factors(kinds[1], 3))]:
        want = (formed(first) * formed(second)).sum((1, 2))
        got = tied.cross_term(first, second)
        assert got.dtype == torch.float64 and got.shape == (batch,)
        torch.testing.assert_close(got, want, rtol=1e-12 if dtype == torch.float64 else 1e-5, atol=1e-5)


def test_the_mixed_rule_is_bu_et_al():
    assert layers.use_ghost_norm(1, 2, 3)  # 2 < 6
    assert not layers.use_ghost_norm(4, 4, 8)  # 32 = 32: not cheaper
    assert layers.use_ghost_norm(4, 4, 9)
    assert not layers.use_ghost_norm(64, 27, 32)  # a first conv layer over 8x8 outputs


@pytest.mark.parametrize("case, kind", [
    ("linear", layers.LinearLayer), ("conv2d", layers.ConvLayer), ("conv-transpose", layers.TransposedConvLayer),
    ("embedding", layers.EmbeddingLayer), ("embedding-bag", layers.EmbeddingBagLayer),
    ("layernorm", layers.LayerNormLayer), ("groupnorm", layers.GroupNormLayer), ("rmsnorm", layers.RMSNormLayer),
    ("transformers-conv1d", layers.TransposedLinearLayer), ("multihead-attention", attention.MultiheadAttentionLayer),
    ("fallback", layers.FunctionalLayer), ("position-modules", layers.LookupEmbeddingLayer),
    ("batchnorm-eval", layers.BatchNormLayer), ("parametrized", layers.FunctionalLayer),
    ("recurrent", recurrent.RecurrentLayer)])
def test_each_module_gets_its_rule(case, kind):
    model, _, _ = setting(case)
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(trainable(model), lr=0.1), dpsgd.DPSGDConfig(1.0),
                           expected_batch_size=2)
    assert any(type(layer) is kind for layer in bk.layers)
    owned = [id(p) for layer in bk.layers for p in layer.parameters]
    assert sorted(owned) == sorted(id(p) for p in trainable(model))
    if case == "parametrized":  # each computed weight's module is replayed whole, its parametrizations in it
        assert [(layer.name, type(layer)) for layer in bk.layers] == [(n, layers.FunctionalLayer)
                                                                       for n in ("0", "3", "5", "7")]


class SpectralTwice(nn.Module):
    """A spectral-normed Linear called twice a forward: in training mode each call takes one step
    of power iteration on its vectors u, v, in place, then divides the weight by u^T W v."""

    def __init__(self):
        super().__init__()
        self.inner = nn.utils.parametrizations.spectral_norm(nn.Linear(5, 5))
        self.out = nn.Linear(5, 2)
        with torch.no_grad():  # far from converged, so that each call moves them
            spectral = self.inner.parametrizations.weight[0]
            spectral._u.copy_(F.normalize(torch.randn(5), dim=0))
            spectral._v.copy_(F.normalize(torch.randn(5), dim=0))

    def forward(self, x):
        return self.out(torch.tanh(self.inner(torch.tanh(self.inner(x)))))


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
def test_a_spectral_norm_in_training_mode_is_replayed_with_the_vectors_of_each_call(per_layer):
    """Reference: one backward pass per sample, the model's state reset before each, so that each
    sample's forward takes the batch forward's power-iteration steps. The replay must use each
    call's vectors (not the last call's) and must not iterate again: the model's state after the
    step is the one a forward of the batch leaves."""
    torch.manual_seed(0)
    model = SpectralTwice().train()
    generator = torch.Generator().manual_seed(1)
    x, target = torch.randn(6, 5, generator=generator), torch.randn(6, 2, generator=generator)
    start = copy.deepcopy(model.state_dict())
    rows = [[] for _ in trainable(model)]
    for i in range(6):
        model.load_state_dict(start)
        for row, g in zip(rows, torch.autograd.grad(regression(model(x[i:i + 1]), target[i:i + 1]).sum(),
                                                    trainable(model))):
            row.append(g)
    after_forward = copy.deepcopy(model.state_dict())
    model.load_state_dict(start)
    grads = [torch.stack(row) for row in rows]
    config = CONFIGS["gaussian"](clip_between(grads, per_layer), per_layer)
    want = dpsgd.privatize(grads, config, 4.5, M.NoiseGenerator(7))
    assert_same_update(book_kept(model, x, target, config, 4.5, M.NoiseGenerator(7)), want)
    for name, value in model.state_dict().items():
        assert torch.equal(value, after_forward[name]), name


def test_the_deprecated_hook_based_spectral_norm_is_refused():
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.utils.spectral_norm(nn.Linear(4, 2)))
    with pytest.raises(ValueError, match=r"module '2' \(Linear\) has the deprecated torch.nn.utils.spectral_norm.*"
                                         r"use torch.nn.utils.parametrizations.spectral_norm"):
        make(model)


@pytest.mark.parametrize("case", ["linear-sequence", "conv1d", "conv2d", "embedding", "layernorm", "groupnorm",
                                  "rmsnorm", "transformers-conv1d", "multihead-attention", "fallback", "own-parameters",
                                  "shared-outputs", "relative-bias", "position-modules", "tied-embeddings",
                                  "tied-autoencoder", "standardised-conv"])
def test_autocast_to_bfloat16_gives_the_float32_update_to_bfloat16_precision(case):
    """Under autocast a layer's input and output gradient can have different dtypes, and the
    fallback recomputes under the autocast of its call: the update is float32 and within bfloat16
    rounding (2^-8 per operation) of the float32 materialised one."""
    model, x, target = setting(case)
    config = dpsgd.DPSGDConfig(clip_between(materialised_grads(model, x, target), False), noise_multiplier=0.0)
    want = dpsgd.privatize(materialised_grads(model, x, target), config, 6.0)
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(trainable(model), lr=0.0), config, expected_batch_size=6.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    got = bk.step(regression(out.float(), target))
    scale = max(float(w.abs().max()) for w in want)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=0.0, atol=0.08 * scale)


@pytest.mark.parametrize("mechanism", ["gaussian", "laplace"])  # L2: the clipped sum; L1: the norms' rows too
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_embedding_adds_its_tokens_in_float32(mechanism, dtype):
    # 3000 tokens of 5 ids a sample: rounding the sums to 8 or 11 bits at every add would be off by
    # far more than float32's accumulation error, and in the clip factors of the L1 norms as well.
    batch, length = 2, 3000
    generator = torch.Generator().manual_seed(8)
    model = nn.Embedding(5, 3).to(dtype)
    ids = torch.randint(0, 5, (batch, length), generator=generator)
    direction = torch.rand(batch, length, 3, generator=generator).to(dtype)  # g = direction: loss = <emb, g>
    grads = torch.stack([torch.zeros(5, 3, dtype=torch.float64).index_add_(0, i, d.double())
                         for i, d in zip(ids, direction)])
    norm_type = 1 if mechanism == "laplace" else 2
    norms = grads.flatten(1).norm(p=norm_type, dim=1)
    clip = float(norms.min()) / 2  # every sample clipped: its factor depends on its norm
    want = (grads * (clip / norms).view(-1, 1, 1)).sum(0) / batch
    # Laplace needs some noise: 1e-12 of the clip norm, far below the tolerance.
    config = dpsgd.DPSGDConfig(clip, mechanism, noise_multiplier=0.0 if mechanism == "gaussian" else 1e-12)
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.0), config, expected_batch_size=batch)
    (got,) = bk.step((model(ids).float() * direction.float()).sum((1, 2)))
    scale = float(grads.abs().sum((0, 1)).max())  # the largest total of |g| that one entry sums
    assert torch.all((got.double() - want).abs() <= 4 * length * 2.0**-24 * scale)


def test_secure_gaussian_noise_matches_on_the_same_key():
    model, x, target = setting("conv2d")
    grads = materialised_grads(model, x, target)
    config = dpsgd.DPSGDConfig(clip_between(grads, False), noise_multiplier=0.7)
    first, second = M.SecureNoiseGenerator(), M.SecureNoiseGenerator()
    second._key_words = list(first._key_words)  # the same ChaCha20 key: replay one stream on both paths
    want = dpsgd.privatize(grads, config, 3.0, first)  # 3: not a power of two, so the sum's grid matters
    got = book_kept(model, x, target, config, 3.0, second)
    assert_same_update(got, want)
    assert second._offset == first._offset


class TinyTransformer(nn.Module):
    """Token + position embeddings, nn.MultiheadAttention and hand-written causal attention from
    nn.Linear projections, LayerNorm, a Linear head."""

    def __init__(self, vocab=11, width=8, length=6):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width, padding_idx=0), nn.Embedding(length, width)
        self.mha = nn.MultiheadAttention(width, 2, batch_first=True)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        h = self.tokens(ids) + self.positions(positions)
        h = h + self.mha(h, h, h, need_weights=False)[0]
        q, k, v = self.qkv(self.norm1(h)).chunk(3, dim=-1)
        scores = (q @ k.transpose(1, 2)) / q.shape[-1] ** 0.5
        causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device).triu(1)
        h = h + self.proj(scores.masked_fill(causal, float("-inf")).softmax(-1) @ v)
        return self.head(self.norm2(h))


def next_token(logits, targets):
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)


def small_cnn():
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2),
                         nn.ReLU(), nn.Flatten(), nn.Linear(36, 3))


def data(kind, n, generator):
    if kind == "transformer":
        tokens = torch.randint(0, 11, (n, 7), generator=generator)
        return tokens[:, :-1], tokens[:, 1:], next_token
    images, labels = torch.randn(n, 1, 8, 8, generator=generator), torch.randint(0, 3, (n,), generator=generator)
    return images, labels, lambda out, y: F.cross_entropy(out, y, reduction="none")


def training_pair(kind, mechanism, per_layer, device, **config):
    """A transformer or CNN trained by the materialised path (DPOptimizer, on the CPU: the reference)
    and its copy on ``device`` by BookKeeping, both SGD with momentum, the same config (``config``:
    more of its fields) and noise stream, expected batch size 4; and 24 samples and their loss."""
    torch.manual_seed(3)
    reference = TinyTransformer() if kind == "transformer" else small_cnn()
    model = copy.deepcopy(reference).to(device)
    inputs, targets, loss = data(kind, 24, torch.Generator().manual_seed(4))
    clip = [0.3] * len(list(model.parameters())) if per_layer else 0.5
    config = CONFIGS[mechanism](clip, per_layer, **config)
    dp = dpsgd.DPOptimizer(torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.5), config, 4.0,
                           M.NoiseGenerator(11))
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5), config,
                           expected_batch_size=4.0, generator=M.NoiseGenerator(11))
    return reference, model, dp, bk, inputs, targets, loss


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("kind, mechanism, per_layer", [
    ("transformer", "gaussian", False), ("transformer", "vmf", True), ("cnn", "gaussian", True), ("cnn", "vmf", False)])
def test_training_with_poisson_batches_matches_the_materialised_path(kind, mechanism, per_layer, device):
    """Four steps of SGD with momentum on Poisson batches, one of them empty (once with a forward pass
    of zero samples, once without any): the same updates and the same parameters after every step.
    On CUDA: book-keeping and the batches on the GPU, the materialised reference on the CPU (the
    noise streams give the same bits on both)."""
    reference, model, dp, bk, inputs, targets, loss = training_pair(kind, mechanism, per_layer, device)
    sampler = torch.Generator(device).manual_seed(5)
    batches = [dpsgd.sample_batch(24, 4, "poisson", sampler), torch.arange(0), dpsgd.sample_batch(24, 4, "poisson",
                                                                                                   sampler), None]
    assert all(batch.device.type == device for batch in batches[::2])
    for batch in batches:
        if batch is None:  # an empty batch whose loop skips the forward pass
            batch, losses = torch.arange(0), torch.zeros(0, device=device)
        else:
            with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # float32 convolutions, as on the CPU
                losses = loss(model(inputs.to(device)[batch]), targets.to(device)[batch])
        batch = batch.cpu()
        if len(batch):
            grads = dpsgd.per_sample_gradients(reference, lambda out, y: loss(out, y).sum(), inputs[batch],
                                               targets[batch])
        else:  # torch.func cannot vmap nn.MultiheadAttention over zero samples
            grads = [torch.zeros(0, *p.shape) for p in reference.parameters()]
        want = dp.step(grads)
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            got = bk.step(losses)
        assert_same_update([g.cpu() for g in got], want)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-6)
    assert bk.steps == dp.steps == 4
    assert bk.privacy_report(24, 1e-5) == dp.privacy_report(24, 1e-5)


@requires_cuda
@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
def test_a_model_moved_to_cuda_between_steps_keeps_the_materialised_path(per_layer):
    """A step on the CPU, the model moved to the GPU (its optimizer's parameters with it), a step
    there: the clip norms the clip kernel reads follow it to the GPU, and both updates are the
    materialised path's. The fused clip op refuses clip norms on another device by name."""
    reference, model, dp, bk, inputs, targets, loss = training_pair("cnn", "gaussian", per_layer, "cpu")
    for device, rows in (("cpu", slice(0, 4)), ("cuda", slice(4, 9))):
        model.to(device)
        for state in bk.optimizer.state.values():  # the momentum, as a user moves it with the model
            state.update({k: v.to(device) for k, v in state.items() if isinstance(v, torch.Tensor)})
        grads = dpsgd.per_sample_gradients(reference, lambda out, y: loss(out, y).sum(), inputs[rows], targets[rows])
        want = dp.step(grads)
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # float32 convolutions, as on the CPU
            got = bk.step(loss(model(inputs[rows].to(device)), targets[rows].to(device)))
        assert_same_update([g.cpu() for g in got], want)
    grads = [torch.randn(3, 4, device="cuda")]
    with pytest.raises(ValueError, match="grads and clip_norms on one device"):
        torch.ops.privleak.clip_accumulate(grads, torch.ones(1, dtype=torch.float64), False, 0.0, [0, 0], 0, 1.0)


@pytest.mark.parametrize("given", ["losses", "none"])
def test_an_empty_batch_releases_the_noise_alone(given):
    model, _, _ = setting("linear")
    config = dpsgd.DPSGDConfig(1.0, noise_multiplier=2.0)
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.0), config, expected_batch_size=5.0,
                           generator=M.NoiseGenerator(2))
    got = bk.step(regression(model(torch.zeros(0, 5)), torch.zeros(0, 3)) if given == "losses" else None)
    noise = M.gaussian_noise(sum(p.numel() for p in model.parameters()), std=2.0, generator=M.NoiseGenerator(2))
    torch.testing.assert_close(torch.cat([g.flatten() for g in got]), noise / 5.0)


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
@pytest.mark.parametrize("mechanism", ["gaussian", "vmf"])
@pytest.mark.parametrize("case", ["linear-sequence", "conv2d", "embedding", "groupnorm", "fallback"])
def test_physical_batches_give_the_update_of_the_whole_batch(case, mechanism, per_layer):
    """accumulate() over physical batches of 2, 0 and 3 samples, then step() with the last one's
    losses or with none: the materialised update of all 6 samples at once, one noise draw."""
    model, x, target = setting(case)
    grads = materialised_grads(model, x, target)
    config = CONFIGS[mechanism](clip_between(grads, per_layer), per_layer)
    want = dpsgd.privatize(grads, config, 4.5, M.NoiseGenerator(7))
    for last in ("losses", "none"):
        bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.0), config, expected_batch_size=4.5,
                               generator=M.NoiseGenerator(7))
        for part in ((0, 2), (2, 2), (2, 5)):
            bk.accumulate(regression(model(x[slice(*part)]), target[slice(*part)]))
        tail = regression(model(x[5:]), target[5:])
        got = bk.step(tail) if last == "losses" else (bk.accumulate(tail), bk.step())[1]
        assert_same_update(got, want)
        assert bk.steps == 1
        bk.remove()


def test_a_resumed_run_continues_the_steps_and_the_noise_stream():
    """Three steps, the state saved; two more in new objects built from the saved state alone: the
    updates and the report of five steps uninterrupted. Taking the state between accumulate()
    and step() is refused (the accumulated sums are not in it)."""
    model, x, target = setting("conv2d")
    initial = copy.deepcopy(model.state_dict())

    def build(model):
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return dpsgd.BookKeeping(model, sgd, dpsgd.DPSGDConfig(0.5, noise_multiplier=0.8), expected_batch_size=4.0,
                                 generator=M.NoiseGenerator(11))

    def run(resume_at=None):
        model.load_state_dict(initial)
        net, bk, updates = model, build(model), []
        for step in range(5):
            if step == resume_at:
                saved = copy.deepcopy((net.state_dict(), bk.optimizer.state_dict(), bk.state_dict()))
                bk.remove()
                net = copy.deepcopy(model)
                bk = build(net)
                net.load_state_dict(saved[0])
                bk.optimizer.load_state_dict(saved[1])
                bk.load_state_dict(saved[2])
            part = slice(step % 3, step % 3 + 4)
            updates.append(bk.step(regression(net(x[part]), target[part])))
        bk.accumulate(regression(net(x[:2]), target[:2]))
        with pytest.raises(ValueError, match=r"state_dict\(\): physical batches have been accumulated"):
            bk.state_dict()
        return updates, bk

    whole, first = run()
    first.remove()  # its hooks off the model the second run trains
    resumed, second = run(resume_at=3)
    for a, b in zip(whole, resumed):
        assert_same_update(b, a)
    assert second.steps == 5 and second.privacy_report(60, 1e-5) == first.privacy_report(60, 1e-5)


def test_a_step_without_losses_after_a_forward_pass_with_grad_is_refused():
    model, x, target = setting("linear")
    alone = copy.deepcopy(model)
    want = make(alone, generator=M.NoiseGenerator(4)).step(regression(alone(x[:3]), target[:3]))
    bk = make(model, generator=M.NoiseGenerator(4))
    bk.accumulate(regression(model(x[:3]), target[:3]))
    model(x[3:])
    with pytest.raises(ValueError, match="step\\(\\) got no per_sample_losses, but the model ran a forward pass"):
        bk.step()
    with torch.no_grad():
        model(x[3:])  # evaluation records nothing
    assert_same_update(bk.step(), want)  # the accumulated batch; the refused forward pass is dropped


def test_the_optimizer_steps_with_the_update():
    model, x, target = setting("linear")
    before = [p.detach().clone() for p in model.parameters()]
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.3), dpsgd.DPSGDConfig(0.5),
                           expected_batch_size=6)
    update = bk.step(regression(model(x), target))
    for p, p0, u in zip(model.parameters(), before, update):
        torch.testing.assert_close(p.detach(), p0 - 0.3 * u)
        assert p.grad is None  # released after the step, as zero_grad(set_to_none=True) does


@pytest.mark.parametrize("non_finite", ["raise", "drop"])
def test_non_finite_samples_follow_the_config(non_finite):
    model, x, target = setting("conv2d")
    x[2, 0, 3, 3] = float("nan")
    x[4, 1, 0, 0] = float("inf")
    config = dpsgd.DPSGDConfig(0.5, noise_multiplier=0.3, non_finite=non_finite)
    grads = materialised_grads(model, x, target)
    if non_finite == "raise":
        for run in (lambda: dpsgd.privatize(grads, config, 4.0, M.NoiseGenerator(1)),
                    lambda: book_kept(model, x, target, config, 4.0, M.NoiseGenerator(1))):
            with pytest.raises(ValueError, match=re.escape("samples [2, 4]") + r".* are not finite \(or their norm "
                                                 r"beyond 1.8e19\); pass non_finite='drop'"):
                run()
        return
    want = dpsgd.privatize(grads, config, 4.0, M.NoiseGenerator(1))
    got = book_kept(model, x, target, config, 4.0, M.NoiseGenerator(1))
    assert all(bool(torch.isfinite(g).all()) for g in got)
    assert_same_update(got, want)


def test_finite_samples_are_those_with_finite_norms_even_when_their_total_overflows():
    assert bookkeeping.finite_samples(torch.tensor([[1.0, 2.0], [0.0, 3.0]], dtype=torch.float64)) is None
    big = torch.full((3, 2), 1e308, dtype=torch.float64)  # finite, their total is not
    assert bookkeeping.finite_samples(big) is None
    big[1, 1], big[2, 0] = float("nan"), float("inf")
    assert bookkeeping.finite_samples(big).tolist() == [True, False, False]
    one_column = torch.tensor([[1.0], [float("nan")]], dtype=torch.float64)
    assert bookkeeping.finite_samples(one_column).tolist() == [True, False]


def make(model, config=None, **kwargs):
    kwargs.setdefault("expected_batch_size", 4)
    return dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             config or dpsgd.DPSGDConfig(1.0), **kwargs)


def test_losses_that_are_not_per_sample_are_refused():
    model, x, target = setting("linear")
    bk = make(model)
    with pytest.raises(ValueError, match=r"per_sample_losses must be a 1-D tensor .*reduction='none'.*shape \(\)"):
        bk.step(regression(model(x), target).mean())
    with pytest.raises(ValueError, match=r"per_sample_losses must be a 1-D .*shape \(6, 1\)"):
        bk.step(regression(model(x), target).unsqueeze(1))
    with pytest.raises(TypeError, match="per_sample_losses must be a torch tensor, got list"):
        bk.step([1.0, 2.0])
    with pytest.raises(ValueError, match="per_sample_losses must come from the model's forward with grad"):
        bk.step(regression(model(x), target).detach())
    with pytest.raises(ValueError, match="per_sample_losses has 3 samples, but module '0' .* saw a batch of 6"):
        bk.step(regression(model(x), target)[:3])
    with pytest.raises(ValueError, match="per_sample_losses has 0 samples, but module '0' .* saw a batch of 6"):
        bk.step(regression(model(x), target)[:0])
    assert bk.steps == 0


def test_losses_no_layer_recorded_are_refused_with_the_reason():
    """Losses of a forward pass run before the build, of a batch already taken, of a forward pass
    before the last step (after another since: they were taken, the noise alone released), or
    after remove(): each error says which (all had said a parameter was used outside its module's
    forward)."""
    model, x, target = setting("linear")
    early = regression(model(x), target)
    bk = make(model)
    no_record = r"no layer of the model recorded a forward pass with grad since the last step"
    with pytest.raises(ValueError, match=no_record):
        bk.step(early)
    losses = regression(model(x), target)
    bk.step(losses)
    with pytest.raises(ValueError, match=no_record):
        bk.step(losses)
    stale = regression(model(x), target)  # losses of a batch that a step then passes over
    bk.step(regression(model(x), target))
    model(x[:2])  # a forward pass since (a metric): its calls had stood for the stale losses' uses
    with pytest.raises(ValueError, match=r"parameter '0.weight' is used 1 time\(s\) in the graph of "
                                         r"per_sample_losses, but its module's forward calls in that graph recorded "
                                         r"0.*before the last step"):
        bk.step(stale)
    assert bk.steps == 2
    bk.remove()
    with pytest.raises(ValueError, match=r"this BookKeeping was removed \(remove\(\) took its hooks off"):
        bk.step(regression(model(x), target))
    with pytest.raises(ValueError, match=r"this BookKeeping was removed"):
        bk.step()  # no losses: it had released the noise and stepped
    assert bk.steps == 2


def test_a_second_bookkeeping_on_a_hooked_model_is_refused_and_a_dropped_one_lets_go():
    """Two on one model each recorded every forward pass (only the last one's recorder saw an
    nn.MultiheadAttention's projections, whose update the first released as 0: a review's repro);
    one dropped without remove() kept recording, its records growing each step. Now a second is
    refused while the first lives, and a dropped one's hooks go with it."""
    model, x, target = setting("linear")
    first = make(model)
    with pytest.raises(ValueError, match=r"module '0' \(Linear\) has the hooks of another BookKeeping, built on this "
                                         r"model before and not removed: call remove\(\) on it first"):
        make(model)
    layers_of_first = weakref.ref(first.layers[0])
    del first  # dropped, not removed
    second = make(model)
    assert layers_of_first() is None  # collected, its hooks off the model
    assert all(len(m._forward_hooks) == 1 for m in model.modules() if isinstance(m, nn.Linear))
    second.remove()
    config = dpsgd.DPSGDConfig(1.0, noise_multiplier=0.0)
    want = dpsgd.privatize(materialised_grads(model, x, target), config, 4.0)
    assert_same_update(make(model, config).step(regression(model(x), target)), want)


def test_losses_of_another_model_are_refused_after_a_forward_pass_of_this_one():
    """A forward pass of the hooked model (a logging pass) beside losses of another (a teacher):
    they had been taken, and the step released the noise alone and counted a step."""
    model, x, target = setting("linear")
    teacher = copy.deepcopy(model)
    bk = make(model)
    model(x)
    with pytest.raises(ValueError, match="per_sample_losses does not depend on any of the model's trainable "
                                         "parameters"):
        bk.step(regression(teacher(x), target))
    assert bk.steps == 0


def test_a_release_that_would_overflow_float32_is_refused_as_the_materialised_path_refuses_it():
    model, x, target = setting("linear")
    config = dpsgd.DPSGDConfig(1e10, noise_multiplier=0.0)
    grads = materialised_grads(model, x, target)
    with pytest.raises(ValueError, match="overflow float32"):
        dpsgd.privatize(grads, config, 1e-30)
    bk = make(model, config, expected_batch_size=1e-30)
    with pytest.raises(ValueError, match=r"noise_std = 0.0 and batch_size = 1e-30 overflow float32"):
        bk.step(regression(model(x), target))
    assert bk.steps == 0 and all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_a_parameter_frozen_or_unfrozen_after_the_build_is_named():
    """Gradual unfreezing: the error names the parameter and the way out, which works: a new
    BookKeeping of the new set, the steps and the noise stream carried over."""
    model, x, target = setting("linear")
    model[0].bias.requires_grad_(False)
    bk = make(model, generator=M.NoiseGenerator(3))
    bk.step(regression(model(x), target))
    model[0].bias.requires_grad_(True)
    with pytest.raises(ValueError, match=r"parameter '0.bias' is trainable but was not among the model's trainable "
                                         r"parameters when BookKeeping was built \(unfrozen, replaced or added since\)"
                                         r".*call remove\(\) and build a new BookKeeping"):
        bk.step(regression(model(x), target))
    bk.remove()
    unfrozen = make(model, generator=M.NoiseGenerator(0))
    unfrozen.load_state_dict(bk.state_dict())
    unfrozen.step(regression(model(x), target))
    assert unfrozen.steps == 2
    model[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"parameter '0.weight' was frozen \(requires_grad=False\) after"):
        unfrozen.step(regression(model(x), target))
    with pytest.raises(ValueError, match=r"parameter '0.weight' was frozen"):
        unfrozen.step()  # an empty batch: the frozen parameter would be stepped with the noise
    assert unfrozen.steps == 2


def test_a_model_without_trainable_parameters_is_refused():
    with pytest.raises(ValueError, match="model has no trainable parameters"):
        dpsgd.BookKeeping(nn.ReLU(), torch.optim.SGD([nn.Parameter(torch.zeros(1))]), dpsgd.DPSGDConfig(1.0),
                          expected_batch_size=2)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="model has no trainable parameters"):
        dpsgd.BookKeeping(frozen, torch.optim.SGD([nn.Parameter(torch.zeros(1))]), dpsgd.DPSGDConfig(1.0),
                          expected_batch_size=2)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got function"):
        dpsgd.BookKeeping(lambda x: x, torch.optim.SGD([nn.Parameter(torch.zeros(1))]), dpsgd.DPSGDConfig(1.0),
                          expected_batch_size=2)


@pytest.mark.parametrize("to_script", [torch.jit.script, lambda m: torch.jit.trace(m, torch.randn(2, 4))],
                         ids=["script", "trace"])
def test_a_torchscript_module_is_refused(to_script):
    """No hook runs in a TorchScript forward: a traced model's step raised that its parameters were
    used outside their modules, a scripted one torch's own error at the hooks' registration."""
    model = to_script(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)))
    with pytest.raises(ValueError, match=r"model is a TorchScript module .*pass the Python module"):
        dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters()), dpsgd.DPSGDConfig(1.0), expected_batch_size=2)


@pytest.mark.parametrize("path", ["bookkeeping", "materialised"])
def test_an_optimizer_of_all_parameters_trains_the_unfrozen_ones(path):
    """SGD(model.parameters()) with some frozen, as LoRA users build it: the update of an optimizer
    of the trainable ones, the frozen weight left as it was, also where a backward pass before it
    was frozen left its .grad (the optimizer applied that gradient of the data, unclipped and
    without noise, at every step: a review's repro)."""
    updates = []
    for everything in (True, False):
        model, x, target = setting("linear-frozen-weight")
        model[0].weight.requires_grad_(True)
        regression(model(x), target).sum().backward()  # a non-private pass, then frozen
        model[0].weight.requires_grad_(False)
        frozen = model[0].weight.detach().clone()
        params = list(model.parameters() if everything else trainable(model))
        config = dpsgd.DPSGDConfig(0.3, noise_multiplier=0.5)
        optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        if path == "bookkeeping":
            bk = dpsgd.BookKeeping(model, optimizer, config, expected_batch_size=6, generator=M.NoiseGenerator(2))
            steps = [bk.step(regression(model(x), target)) for _ in range(2)]
        else:
            dp = dpsgd.DPOptimizer(optimizer, config, expected_batch_size=6, generator=M.NoiseGenerator(2))
            steps = [dp.step(materialised_grads(model, x, target)) for _ in range(2)]
        updates.append(steps)
        assert torch.equal(model[0].weight, frozen)
    for got, want in zip(*updates):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_other_arguments_are_checked_as_dpoptimizer_checks_them():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="optimizer must hold exactly the model's 2 trainable parameters"):
        dpsgd.BookKeeping(model, torch.optim.SGD([model.weight], lr=0.1), dpsgd.DPSGDConfig(1.0),
                          expected_batch_size=2)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        dpsgd.BookKeeping(model, None, dpsgd.DPSGDConfig(1.0), expected_batch_size=2)
    with pytest.raises(TypeError, match="config must be a DPSGDConfig"):
        make(model, config="gaussian")
    with pytest.raises(ValueError, match="expected_batch_size"):
        make(model, expected_batch_size=0)
    with pytest.raises(ValueError, match="sampling"):
        make(model, sampling="shuffle")
    with pytest.raises(ValueError, match="generator"):
        make(model, dpsgd.DPSGDConfig(1.0, "vmf", kappa=1.0), generator=M.SecureNoiseGenerator())


class Functional(nn.Module):
    """Uses its Linear's weight once more outside the Linear's forward, where no hook sees it, and
    its other Linear's weight only for its dtype."""

    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.out((self.lin(x) + F.linear(x, self.lin.weight)).to(self.out.weight.dtype))


class TiedNorms(nn.Module):
    """Two LayerNorms sharing their weight: a tie book-keeping has no factors for."""

    def __init__(self):
        super().__init__()
        self.embed, self.first, self.second = nn.Embedding(5, 3), nn.LayerNorm(3), nn.LayerNorm(3)
        self.second.weight = self.first.weight

    def forward(self, ids):
        return self.second(self.first(self.embed(ids)))


def test_a_module_without_parameters_of_its_own_that_reads_its_childs_is_replayed_with_it():
    """Functional reads lin's weight outside lin's forward (it had been refused): it is replayed
    per sample with lin's parameters, out keeps its rule, and the update is the materialised
    path's. Its first call settles it; a module that reads none loses its layer (Sequential
    names no child's parameter: no layer)."""
    torch.manual_seed(0)
    model = nn.Sequential(Functional(), nn.Tanh(), Functional())
    x, target = torch.randn(6, 3), torch.randn(6, 2)
    model[2].lin, model[2].out = nn.Linear(2, 2), nn.Linear(2, 2)
    model[2].forward = lambda h: model[2].out(model[2].lin(h).to(model[2].out.weight.dtype))  # reads none now
    grads = materialised_grads(model, x, target)
    config = dpsgd.DPSGDConfig(clip_between(grads, False), noise_multiplier=0.5)
    want = dpsgd.privatize(grads, config, 4.0, M.NoiseGenerator(3))
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(trainable(model), lr=0.0), config, expected_batch_size=4.0,
                           generator=M.NoiseGenerator(3))
    assert [layer.name for layer in bk.layers] == ["0", "0.lin", "0.out", "2", "2.lin", "2.out"]
    with pytest.warns(UserWarning, match=r"module '0' \(Functional\) reads the parameters of lin outside their "
                                         r"forwards: .* its layers \(out\) included$"):
        assert_same_update(bk.step(regression(model(x), target)), want)
    assert {layer.name: type(layer) for layer in bk.layers} == {
        "0": layers.FunctionalLayer, "0.out": layers.LinearLayer, "2.lin": layers.LinearLayer,
        "2.out": layers.LinearLayer}



class Gate(nn.Module):
    """A module whose forward calls a method of its own, ``_forward``, as ProphetNet's position
    embedding does."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1.0, 1.0, 9).view(3, 3))

    def forward(self, x):
        return self._forward(x)

    def _forward(self, x):
        return torch.tanh(F.linear(x, self.weight))


class CallsAMethod(nn.Module):
    """Calls its gate, then the gate's ``_forward`` (which runs without the gate's hooks), as
    ProphetNet's decoder calls its position embedding's."""

    def __init__(self):
        super().__init__()
        self.gate, self.out = Gate(), nn.Linear(3, 2)

    def forward(self, x):
        return self.out(self.gate(x) + self.gate._forward(2 * x))


def test_a_childs_method_other_than_forward_is_replayed_with_the_module_that_calls_it():
    """The gate's parameter used in its ``_forward``, called by the module that holds it (refused
    before: ProphetNet's): that module is replayed per sample with the gate, its other layer
    book-kept, and the update is the materialised path's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), CallsAMethod())
    x, target = torch.randn(6, 4), torch.randn(6, 2)
    grads = materialised_grads(model, x, target)
    config = dpsgd.DPSGDConfig(clip_between(grads, True), noise_multiplier=0.5, per_layer=True)
    want = dpsgd.privatize(grads, config, 4.0, M.NoiseGenerator(3))
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(trainable(model), lr=0.0), config, expected_batch_size=4.0,
                           generator=M.NoiseGenerator(3))
    assert direct_reads.children_read_directly(model[1]) == ["gate"]
    with pytest.warns(UserWarning, match=r"module '1' \(CallsAMethod\) reads the parameters of gate"):
        assert_same_update(bk.step(regression(model(x), target)), want)
    assert {layer.name: type(layer) for layer in bk.layers} == {
        "0": layers.LinearLayer, "1": layers.FunctionalLayer, "1.out": layers.LinearLayer}

def test_a_parameter_the_hooks_cannot_see_is_refused():
    x = torch.randn(4, 3)
    # A parameter used only functionally, outside every module, its module never called:
    unused = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    bk = make(unused)
    with pytest.raises(ValueError, match=r"parameter '1.weight' is used 1 time\(s\) .* recorded 0"):
        bk.step(F.linear(unused[0](x), unused[1].weight, unused[1].bias).sum(1))




class SelectiveScan(nn.Module):
    """A state-space mixer shaped as transformers' Mamba: parameters of its own (A_log, D) beside
    children it calls (in_proj, x_proj, out_proj) and children whose parameters its code reads,
    a causal depthwise convolution by ``self.conv1d.weight`` and a product by
    ``self.dt_proj.weight``; it reads out_proj's metadata, and its weight on a path not taken."""

    def __init__(self, width=4, inner=6, kernel=3, rank=2):
        super().__init__()
        self.in_proj, self.x_proj = nn.Linear(width, 2 * inner), nn.Linear(inner, rank)
        self.conv1d = nn.Conv1d(inner, inner, kernel, groups=inner, padding=kernel - 1)
        self.dt_proj, self.out_proj = nn.Linear(rank, inner), nn.Linear(inner, width)
        self.A_log = nn.Parameter(torch.linspace(-1.0, 0.5, inner))
        self.D = nn.Parameter(torch.linspace(0.5, 1.5, inner))
        self.fused_output = False

    def forward(self, h):  # (B, T, width)
        positions = h.shape[1]
        x, gate = self.in_proj(h).chunk(2, dim=-1)
        if self.out_proj.bias is not None and self.out_proj.weight.dtype == x.dtype:
            x = F.conv1d(x.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, padding=self.conv1d.padding,
                         groups=x.shape[-1])[..., :positions].transpose(1, 2)
        x = F.silu(x)
        dt = F.softplus(self.x_proj(x) @ self.dt_proj.weight.t() + self.dt_proj.bias)
        decay = torch.exp(-torch.exp(self.A_log) * dt)
        state, states = torch.zeros_like(x[:, 0]), []
        for t in range(positions):
            state = decay[:, t] * state + dt[:, t] * x[:, t]
            states.append(state)
        y = (torch.stack(states, 1) + x * self.D) * F.silu(gate)
        if self.fused_output:  # as a kernel's path that the forward does not take: the source reads out_proj's weight
            return F.linear(y, self.out_proj.weight, self.out_proj.bias)
        return self.out_proj(y)


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
def test_a_module_that_reads_its_childrens_parameters_replays_them_with_its_own(per_layer):
    """The mixer's conv1d and dt_proj, whose parameters its own code reads outside their forwards
    (no hook sees those uses: Mamba's, Qwen3.5's and Jamba's mixers had been refused), are replayed
    with the mixer's own parameters; the children it calls keep their rules, out_proj too, whose
    weight its source reads on a path that the first call's graph shows it did not take. The
    update is the materialised path's, at the first step and after."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), SelectiveScan(), nn.LayerNorm(4))
    batches = [(torch.randn(5, 7, 3), torch.randn(5, 7, 4)), (torch.randn(3, 6, 3), torch.randn(3, 6, 4))]
    grads = [materialised_grads(model, x, target) for x, target in batches]
    config = dpsgd.DPSGDConfig(clip_between(grads[0], per_layer), noise_multiplier=0.3, per_layer=per_layer)
    reference = M.NoiseGenerator(5)  # the same noise stream, step after step
    wants = [dpsgd.privatize(g, config, 4.0, reference) for g in grads]
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(trainable(model), lr=0.0), config, expected_batch_size=4.0,
                           generator=M.NoiseGenerator(5))
    assert {"1.conv1d", "1.dt_proj"} <= {layer.name for layer in bk.layers}  # until a call shows them read
    with pytest.warns(UserWarning, match=r"module '1' \(SelectiveScan\) .* layers \(in_proj, x_proj, out_proj\)"):
        for (x, target), want in zip(batches, wants):
            assert_same_update(bk.step(regression(model(x), target)), want)
    rules = {layer.name: type(layer) for layer in bk.layers}
    assert rules == {"0": layers.LinearLayer, "1": layers.FunctionalLayer, "1.in_proj": layers.LinearLayer,
                     "1.x_proj": layers.LinearLayer, "1.out_proj": layers.LinearLayer, "2": layers.LayerNormLayer}
    mixer = model[1]
    assert [id(p) for p in bk.layers[1].parameters] == [id(p) for p in (
        mixer.A_log, mixer.D, mixer.conv1d.weight, mixer.conv1d.bias, mixer.dt_proj.weight, mixer.dt_proj.bias)]


def weight_of(module):
    return module.weight


class ReadsOnlyByName(nn.Module):
    """Parameters of its own, and children whose parameters it names but whose values it does not
    read: a tie assigned in a method, a test for None, a dtype; and one whose weight a function
    handed the child reads, which the source does not show as ``self.<child>.<parameter>``."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.embed, self.head, self.gate, self.hidden = (nn.Embedding(5, 3), nn.Linear(3, 5, bias=False),
                                                         nn.Linear(3, 3), nn.Linear(3, 3))

    def tie(self):
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids) * self.scale
        if self.gate.bias is not None and self.gate.weight.dtype == h.dtype:
            h = self.gate(h)
        return self.head(h @ weight_of(self.hidden))


def test_only_a_read_of_a_childs_parameter_values_claims_the_child():
    """A module replayed for its own parameters claims the children whose parameters its code
    reads (direct_reads against the module's own source); names that read no values claim none,
    and a read by a function handed the child is refused at the step as any use the hooks cannot
    see."""
    model = ReadsOnlyByName()
    assert direct_reads.children_read_directly(model) == []
    assert direct_reads.children_read_directly(SelectiveScan()) == ["conv1d", "dt_proj", "out_proj"]
    bk = make(model)
    assert {layer.name for layer in bk.layers} == {"", "embed", "head", "gate", "hidden"}
    with pytest.raises(ValueError, match=r"parameter 'hidden.weight' is used 1 time\(s\) .* recorded 0"):
        bk.step(model(torch.tensor([[1, 2], [3, 4]])).sum((1, 2)))

def test_ties_without_factors_and_l1_norms_of_tied_parameters_are_refused():
    with pytest.raises(ValueError, match="parameter 'first.weight' belongs to modules 'first', 'second' \\(tied"):
        make(TiedNorms())
    model, _, _ = setting("tied-embeddings")
    with pytest.raises(ValueError, match=r"config: the Laplace mechanism clips L1 norms.*\(tokens.weight\)"):
        make(model, dpsgd.DPSGDConfig(1.0, "laplace", noise_multiplier=1.0))


class PositionsExponentiated(nn.Module):
    """Position embeddings of ids (1, T), exponentiated before they are added to the batch: the
    exponential, computed from parameters alone, is what the batch shares (a region bounded by
    the add)."""

    def __init__(self):
        super().__init__()
        self.positions, self.head = nn.Embedding(5, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.head(x + self.positions(torch.arange(x.shape[1], device=x.device)[None]).exp())


class PositionsMultiplied(PositionsExponentiated):
    """Position embeddings of ids (1, T) in a matrix product with the batch: no op the batch's
    per-sample gradients could come from."""

    def forward(self, x):
        table = self.positions(torch.arange(x.shape[1])[None])[0]
        return self.head(x + (x @ table.T) @ table)



class PositionsOfTheirOwnLength(PositionsExponentiated):
    """PositionsExponentiated with ids (T,), not (1, T): at B = T the table's dim 0 is the batch's."""

    def forward(self, x):
        return self.head(x + self.positions(torch.arange(x.shape[1])).exp())


@pytest.mark.parametrize("build, rows", [(PositionsOfTheirOwnLength, 5),
                                         (lambda: ContinuousBias(leading_one=False), 9)],
                         ids=["position-ids", "buffer-of-coordinates"])
def test_a_table_with_as_many_rows_as_the_batch_stays_a_table(build, rows):
    """A region's table whose dim 0 is the batch's size at one step (position ids (T,) at B = T;
    a buffer of 2T - 1 coordinates at B = 2T - 1) and another at the next: its layer calls, on
    inputs without grad, are asked whether they lie in a region whatever their dim 0, and are
    not read as rows of samples at B = rows (a review's repro: 0.09 off a largest update of 0.2,
    with the first sample's check passed at the batch before)."""
    torch.manual_seed(0)
    model = build()
    bk = make(model, dpsgd.DPSGDConfig(0.05, noise_multiplier=0.0), expected_batch_size=4.0)
    for batch in (4, rows):
        generator = torch.Generator().manual_seed(batch)
        x = torch.randn(batch, 5, model.head.in_features, generator=generator)
        target = torch.randn(model(x).shape, generator=generator)
        grads = materialised_grads(model, x, target)
        want = dpsgd.privatize(grads, bk.config, 4.0, M.NoiseGenerator(0))
        assert_same_update(bk.step(regression(model(x), target)), want)


def test_a_replayed_module_whose_output_has_no_batch_dim_is_refused():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.positions, self.head = nn.Linear(3, 3), OwnPositions(), nn.Linear(3, 2)

        def forward(self, x):
            h = self.inp(x)
            return self.head(h + self.positions(h).exp())

    model = Model()
    with pytest.raises(ValueError, match=r"module 'positions' \(OwnPositions\) returned an output of shape "
                                         r"\(1, 5, 3\), without the batch of 4 in dim 0"):
        make(model).step(model(torch.randn(4, 5, 3)).pow(2).sum((1, 2)))


def test_a_layer_output_shared_by_the_batch_other_than_added_is_refused():
    model = PositionsMultiplied()
    bk = make(model)
    with pytest.raises(ValueError, match=r"per_sample_losses has 4 samples, but module 'positions' \(Embedding\) saw "
                                         r"a batch of 1 .* its output is not one shared by the batch"):
        bk.step(model(torch.randn(4, 5, 3)).pow(2).sum((1, 2)))
    # A batch of one sample is an ordinary batch:
    assert len(bk.step(model(torch.randn(1, 5, 3)).pow(2).sum((1, 2)))) == 3


def test_a_shared_output_of_a_layer_whose_rule_takes_none_is_refused_as_such():
    """A convolution of a parameter image (1, C, H, W) multiplied into the batch: its output is
    shared by the batch, which the convolution rule does not take (the message had said it was
    not)."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.image = nn.Conv2d(3, 2, 3, padding=1), nn.Parameter(torch.randn(1, 3, 4, 4))

        def forward(self, x):
            return x * self.conv(self.image)

    model = Model()
    with pytest.raises(ValueError, match=r"module 'conv' \(Conv2d\) ran on inputs of dim 0 1, not the batch's 3, "
                                         r"and its output is shared by the batch .* its rule takes no shared input"):
        make(model).step(model(torch.randn(3, 2, 4, 4)).flatten(1).sum(1))


def test_an_unbatched_input_the_size_of_the_batch_is_told_apart_by_its_output():
    """A GroupNorm of an unbatched (N, C) input, N the batch's size, added to the batch: a layer
    whose rule takes dim 0 for samples would clip rows that are not samples; it is refused. The
    same model with that input batched trains. (A convolution's input without a batch is refused
    at its call.)"""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.head = nn.GroupNorm(1, 4), nn.Linear(4, 2)
            self.register_buffer("signal", torch.randn(4, 4))

        def forward(self, x, batched=False):
            signal = self.signal.expand(len(x), -1, -1) if batched else self.signal
            return self.head(torch.tanh(x + self.norm(signal)))

    model = Model()
    bk = make(model)
    x = torch.randn(4, 4, 4)
    with pytest.raises(ValueError, match=r"module 'norm' \(GroupNorm\) ran on inputs of dim 0 4, the batch's size, "
                                         r"but its output is broadcast over the batch"):
        bk.step(model(x).pow(2).sum((1, 2)))
    assert len(bk.step(model(x, batched=True).pow(2).sum((1, 2)))) == 4


@pytest.mark.parametrize("move, moved_out, dim_0_from", [
    (lambda x: x.transpose(0, -2), 2, 1), (lambda x: x.transpose(-1, 0), 2, 2), (lambda x: x.permute(-1, 0, 1), 2, 2),
    (lambda x: x.permute(1, 0, 2), 2, 1), (lambda x: x.transpose(1, 2), None, 0)])
def test_dims_saved_negative_are_read_as_negative(move, moved_out, dim_0_from):
    """A negative dim comes from autograd unsigned (-1 as 2^64 - 1, which modulo 3 is 0): the dim
    a transpose or permute moved out of dim 0 of a (2, 3, 4) tensor, and the input dim its output's
    dim 0 is, against the shapes torch gives."""
    x = torch.zeros(2, 3, 4, requires_grad=True)
    y = move(x)
    assert graph._moved_from_dim_0(y.grad_fn) == moved_out
    assert graph._dim_below(y.grad_fn, 0, y.ndim) == dim_0_from and x.shape[dim_0_from] == y.shape[0]


def test_a_batch_first_tensor_made_by_a_transpose_and_flattened_is_refused_where_t_is_b():
    """At T = B the transpose behind a batch-first attention's output (B, T, d) may as well have
    turned a batch-first tensor sequence-first: its flattened rows are refused (at T != B they are
    the batch, the "flattened-after-attention" case)."""
    torch.manual_seed(0)
    model = FlattenedAfterAttention()
    bk = make(model)
    with pytest.raises(ValueError, match=r"per_sample_losses has 4 samples, but module 'mix' \(Linear\) saw a batch "
                                         r"of 16.*16 = 4 x 4.*positions"):
        bk.step(model(torch.randn(4, 4, 3)).pow(2).sum((1, 2)))


@pytest.mark.parametrize("select", ["mask", "index", "index_select", "unsqueezed", "batch-mask", "batch-index",
                                    "dropped-out", "masked-select", "gathered"])
def test_tokens_selected_from_the_batch_are_refused_where_as_many_as_the_samples(select):
    """A Linear on some tokens of the batch (those not padding, those routed to an expert): where
    their count is not the batch's it was refused; where it is, each token was read as a sample
    (a review's mixture of experts: a sample's share 1.75 times C). Chosen from the batch
    flattened with its positions: by a mask, an index, index_select, or as transformers 4's
    Mixtral does, ``h[None, index].reshape(-1, d)``; or from the batch (B, T, d) itself, by a
    (B, T) mask or an index of samples and positions (1.49 times C, silently after a first step
    whose count was not the batch's); through dropout after the choice, by masked_select, or by a
    gather along dim 0 (a review of the first form: 1.41 times C)."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.expert = nn.Linear(3, 3), nn.Linear(3, 1)

        def forward(self, x, keep):
            hidden = self.inp(x)
            tokens = hidden.flatten(0, 1)
            index = keep.nonzero()[:, 0]
            sample, position = index // x.shape[1], index % x.shape[1]
            chosen = {"mask": lambda: tokens[keep], "index": lambda: tokens[index],
                      "index_select": lambda: tokens.index_select(0, index),
                      "unsqueezed": lambda: tokens[None, index].reshape(-1, 3),
                      "batch-mask": lambda: hidden[keep.view(x.shape[:2])],
                      "batch-index": lambda: hidden[sample, position],
                      "dropped-out": lambda: F.dropout(tokens[keep], 0.1),
                      "masked-select": lambda: tokens.masked_select(keep[:, None]).view(-1, 3),
                      "gathered": lambda: tokens.gather(0, index[:, None].expand(-1, 3))}[select]()
            return torch.zeros(len(tokens)).index_add(0, index, torch.tanh(self.expert(chosen))[:, 0]).view(4, 5)

    model = Model()
    bk = make(model)
    keep = torch.zeros(20, dtype=torch.bool)
    keep[[0, 1, 7, 12]] = True  # four tokens, the batch's four samples' count
    with pytest.raises(ValueError, match=r"module 'expert' \(Linear\) ran on 4 rows selected from the batch"):
        bk.step(model(torch.randn(4, 5, 3), keep).pow(2).sum(1))


@pytest.mark.parametrize("flattened", [True, False], ids=["flattened", "batch"])
def test_one_token_of_each_sample_selected_from_the_batch_is_its_row(flattened):
    """The last token of each sample, selected from the batch flattened with its positions, or
    from the batch by sample and position (pooling): row i is sample i's, and the layer on them
    trains as on the batch."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.head = nn.Linear(3, 3), nn.Linear(3, 2)

        def forward(self, x):
            hidden = torch.tanh(self.inp(x))
            if flattened:
                return self.head(hidden.flatten(0, 1)[torch.arange(len(x)) * x.shape[1] + x.shape[1] - 1])
            return self.head(hidden[torch.arange(len(x)), torch.full((len(x),), x.shape[1] - 1)])

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    assert_book_kept_as_materialised(Model(), torch.randn(4, 5, 3, generator=generator),
                                     torch.randn(4, 2, generator=generator))


#: ``h[o]`` by writes of h's rows: row j at position ``o.argsort()[j]``
WRITTEN = {
    "index_put": lambda h, o: torch.zeros_like(h).index_put_((o.argsort(),), h),
    "index_copy": lambda h, o: torch.zeros_like(h).index_copy(0, o.argsort(), h),
    "index_add": lambda h, o: torch.zeros_like(h).index_add(-2, o.argsort(), h),
    "scatter": lambda h, o: torch.zeros_like(h).scatter(0, o.argsort()[:, None].expand_as(h), h),
    "scatter_add": lambda h, o: torch.zeros_like(h).scatter_add(0, o.argsort()[:, None].expand_as(h), h),
}
#: h's rows in the order ``o`` (by a mask, in order for o in order) by pieces stacked or concatenated
COMBINED = {
    "stack": lambda h, o: torch.stack([h[i] for i in o.tolist()]),
    "stack-unbound": lambda h, o: torch.stack([rows[i] for rows in [h.unbind(0)] for i in o.tolist()]),
    "cat-slices": lambda h, o: torch.cat([h[i - len(h):][:1] for i in o.tolist()]),
    "cat-splits": lambda h, o: torch.cat([rows[i] for rows in [h.split(1)] for i in o.tolist()]),
    "cat-masks": lambda h, o: torch.cat([h[o < 2], h[o >= 2]]),
    "cat-unsqueezed": lambda h, o: torch.cat([torch.tanh(h[i])[None] for i in o.tolist()]),
    "vstack": lambda h, o: torch.vstack([h[i] for i in o.tolist()]),
    "stack-squeezed": lambda h, o: torch.stack([h[i:i + 1].squeeze(0) for i in o.tolist()]),
    "cat-index-selects": lambda h, o: torch.cat([h.index_select(0, o[:2]), h.index_select(0, o[2:])]),
    "cat-atans": lambda h, o: torch.cat([h[i:i + 1].atan() for i in o.tolist()]),  # an op of no list: it hid them
}


class Reordered(nn.Module):
    """Hidden states taken along dim 0 in an order of the data (sorted by the first feature) by
    ``take`` (index_select and gather along dim -2, an index of (B, 1): reviews found them
    missed), a Linear on them, and its outputs put back in order; or (``mixed``) each sample's
    hidden states added to those of the sample of its rank in that order (manifold mixup)."""

    def __init__(self, take):
        super().__init__()
        self.take, self.inp, self.out = take, nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        order = x[:, 0].argsort()
        take = {"index": lambda h, o: h[o], "index_select": lambda h, o: h.index_select(-2, o), "mixed": lambda h, o: h,
                "gather": lambda h, o: h.gather(-2, o[:, None].expand(-1, h.shape[1])),
                "column": lambda h, o: h[o[:, None]].squeeze(1), **WRITTEN, **COMBINED}[self.take]
        hidden = self.inp(x)
        if self.take == "mixed":
            hidden = hidden + hidden[order]
        return take(self.out(torch.tanh(take(hidden, order))), order.argsort())


@pytest.mark.parametrize("take", ["index", "index_select", "gather", "mixed", "column", *WRITTEN, *COMBINED])
def test_a_layer_s_rows_taken_in_another_order_are_refused_at_any_step(take):
    """A layer's rows taken in another order along the batch's dim: each row of a layer is read as
    the sample of its index, so the rows of the two Linears were clipped with other samples' (a
    review's repro: 1.41 times C in the second step, the first batch in order, which the first
    sample's check passed, as it passes one whose first sample stays in place). Refused wherever
    the order is not the batch's; in order, the model trains."""
    torch.manual_seed(0)
    model = Reordered(take)
    bk = make(model)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, generator=generator)
    in_order, first_in_place = x[x[:, 0].argsort()], x[x[:, 0].argsort()[[0, 2, 1, 4, 3]]]
    assert len(bk.step(model(in_order).pow(2).sum(1))) == 2 * 2
    for batch in (first_in_place, x.flip(0)):
        with pytest.raises(ValueError, match=r"rows computed from the output of module '(inp|out)' \(Linear\) are "
                                             r"taken along the batch's dim in another order"):
            bk.step(model(batch).pow(2).sum(1))
    assert not any(p.grad is not None for p in model.parameters())


class LabelTable(nn.Module):
    """Rows of a table of the labels' size, unit rows of a parameter, looked up by each sample's
    label (its first feature)."""

    def __init__(self, labels):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(labels, 3))

    def forward(self, x):
        return F.normalize(self.weight, dim=1)[x[:, 0].long()]


@pytest.mark.parametrize("labels", [4, 6], ids=["labels-B", "labels-not-B"])
def test_a_table_computed_without_the_batch_and_indexed_by_labels_is_no_reorder(labels):
    """A table's rows taken by labels along dim 0 are each sample's, whatever the table's size:
    where it is the batch's, the rows taken are no reorder of the batch (the table depends on no
    layer call), and the update is that of each sample's own backward pass."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.table, self.inp, self.out = LabelTable(labels), nn.Linear(3, 3), nn.Linear(3, 2)

        def forward(self, x):
            return self.out(torch.tanh(self.inp(x) * self.table(x)))

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, generator=generator)
    x[:, 0] = torch.tensor([3.0, 0.0, 3.0, 1.0])
    model, target = Model(), torch.randn(4, 2, generator=generator)
    grads = one_backward_per_sample(model, x, target)
    config = dpsgd.DPSGDConfig(clip_between(grads, False), noise_multiplier=0.0)
    want = dpsgd.privatize(grads, config, 4.0, M.NoiseGenerator(5))
    assert_same_update(book_kept(model, x, target, config, 4.0, M.NoiseGenerator(5)), want)


@pytest.mark.parametrize("length", [5, 4], ids=["T-not-B", "T-is-B"])
def test_a_batch_flattened_other_than_sample_by_sample_is_refused(length):
    """Hidden states (B, T, d) flattened position by position ((T, B, d) reshaped to (T B, d)) for
    a Linear: its rows are not the samples' in order. Refused also where T = B, though the
    reshaped tensor's dim 0 then has the batch's size."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.mix = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x):
            h = self.inp(x)
            return self.mix(h.transpose(0, 1).reshape(-1, 3)).view(h.shape[1], h.shape[0], 3).transpose(0, 1)

    model = Model()
    bk = make(model)
    with pytest.raises(ValueError, match=rf"per_sample_losses has 4 samples, but module 'mix' \(Linear\) saw a batch "
                                         rf"of {4 * length}"):
        bk.step(model(torch.randn(4, length, 3)).pow(2).sum((1, 2)))


class RelativePositionBias(nn.Module):
    """A table of the relative positions of a 2 x 2 window's pixels, (3, 3), indexed to (1, 4, 4):
    the scores' bias that every window shares (a module of parameters and no input: replayed)."""

    def __init__(self, scaled=False):
        super().__init__()
        self.table = nn.Parameter(torch.randn(3, 3) * 0.5)
        rows, columns = torch.arange(4) // 2, torch.arange(4) % 2
        self.register_buffer("dy", rows[:, None] - rows + 1)
        self.register_buffer("dx", columns[:, None] - columns + 1)
        self.register_buffer("scale", torch.tensor([[0.5], [1.0], [2.0]]) if scaled else None)

    def forward(self):  # ``scaled``: the table times a buffer first
        table = self.table if self.scale is None else self.table * self.scale
        return table[self.dy, self.dx][None]


class WindowAttention(nn.Module):
    """Swin-style attention within windows: the embedded batch (B, 4, 4, C) split into 2 x 2
    windows, (B nW, 4, C), or (``window_major``) the windows taken window by window, (nW B, 4, C);
    scores q k^T plus a relative-position bias that the windows share and a constant mask that
    differs between windows (as Swin's shifted windows'), softmax, times v, an output projection
    on the windows' rows, the windows' mean."""

    def __init__(self, window_major=False, scaled_bias=False):
        super().__init__()
        self.window_major = window_major
        self.embed, self.qkv, self.out, self.head = nn.Linear(3, 3), nn.Linear(3, 9), nn.Linear(3, 3), nn.Linear(3, 2)
        self.bias = RelativePositionBias(scaled_bias)

    def forward(self, x):  # (B, 4, 4, 3)
        batch = x.shape[0]
        windows = torch.tanh(self.embed(x)).view(batch, 2, 2, 2, 2, 3).transpose(2, 3)
        if self.window_major:
            windows = windows.permute(1, 2, 0, 3, 4, 5)
        windows = windows.reshape(-1, 4, 3)
        q, k, v = self.qkv(windows).chunk(3, -1)
        mask = torch.tensor([0.0, -1.0, 0.5, -2.0]).view(1, 4, 1, 1).expand(batch, 4, 4, 4).reshape(-1, 4, 4)
        scores = q @ k.transpose(1, 2) + (self.bias() + mask)
        return self.head(self.out(scores.softmax(-1) @ v).reshape(batch, -1, 3).mean(1))


@pytest.mark.parametrize("scaled_bias", [False, True], ids=["table", "table-times-a-buffer"])
def test_windows_of_each_sample_in_turn_are_the_batch_flattened(scaled_bias):
    """Swin's windows, (B nW, N, C), each sample's in turn (reshapes keep the order), through a
    batched product of scores and values (rows from the same rows of both) to the output
    projection, are the batch flattened: book-kept, and the position table shared by the windows
    (added with a constant mask; made of a table times a buffer, as a review found refused) takes
    the sum of its sample's windows' gradients. The update is
    that of each sample's own backward pass. Taken window by window, the windows are not each
    sample's rows in turn: refused."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    x, target = torch.randn(5, 4, 4, 3, generator=generator), torch.randn(5, 2, generator=generator)
    model = WindowAttention(scaled_bias=scaled_bias)
    grads = one_backward_per_sample(model, x, target)
    config = dpsgd.DPSGDConfig(clip_between(grads, False), noise_multiplier=0.0)
    want = dpsgd.privatize(grads, config, 5.0, M.NoiseGenerator(5))
    assert_same_update(book_kept(model, x, target, config, 5.0, M.NoiseGenerator(5)), want)
    with pytest.raises(ValueError, match=r"module 'qkv' \(Linear\) saw a batch of 20 .* is not the batch flattened"):
        book_kept(WindowAttention(window_major=True), x, target, config, 5.0, M.NoiseGenerator(5))


class ConstantBiased(nn.Module):
    """A parameter (4, 1) plus a constant (1, 2), its first two rows (a view of the sum) added to
    the batch."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(4, 1))
        self.register_buffer("m", torch.randn(1, 2))

    def forward(self, x):  # (B, 2, 2)
        return x + (self.p + self.m)[:2]


def test_a_parameter_broadcast_by_a_constant_then_viewed_gets_its_own_gradient():
    """A use passed on through an add of a constant that broadcasts the parameter: a view after it
    places the sum's elements, not the parameter's (a review's repro: 24% off silently, or an
    IndexError for a reshape). The update is that of each sample's own backward pass."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.biased, self.out = nn.Linear(3, 4), ConstantBiased(), nn.Linear(4, 2)

        def forward(self, x):
            return self.out(torch.tanh(self.biased(self.inp(x).view(-1, 2, 2))).view(-1, 4))

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    x, target = torch.randn(4, 3, generator=generator), torch.randn(4, 2, generator=generator)
    model = Model()
    grads = one_backward_per_sample(model, x, target)
    config = dpsgd.DPSGDConfig(clip_between(grads, False), noise_multiplier=0.0)
    want = dpsgd.privatize(grads, config, 4.0, M.NoiseGenerator(5))
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.0), config, expected_batch_size=4.0,
                           generator=M.NoiseGenerator(5), check_first_sample=False)
    assert_same_update(bk.step(regression(model(x), target)), want)


@pytest.mark.parametrize("form", ["plus-a-constant", "as-it-is", "of-an-input-with-grad"])
def test_rows_broadcast_from_the_batch_in_a_later_dim_are_not_the_batch_flattened(form):
    """A (1, B d) tensor holds the batch in dim 1: added to a (2 B, B d) tensor whose rows are the
    samples', the sum mixes every sample into every row (reviews' repros: 1.50 times C with the
    first sample's check off, 1.05 added as it is, or made from an input with grad, whose leaf is
    no parameter). It is not computed from parameters alone: the Linear on the sum is refused."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.wide, self.out = nn.Linear(3, 3), nn.Linear(3, 12), nn.Linear(6, 1)
            self.register_buffer("m", torch.zeros(4, 1))

        def forward(self, x):  # B = 2
            z = (x if form == "of-an-input-with-grad" else torch.tanh(self.inp(x))).reshape(1, 6)
            return self.out(torch.tanh(self.wide(x).reshape(4, 6) + (z if form == "as-it-is" else z + self.m)))

    torch.manual_seed(0)
    model = Model()
    bk = make(model, check_first_sample=False, expected_batch_size=2)
    x = torch.randn(2, 3, requires_grad=form == "of-an-input-with-grad")
    with pytest.raises(ValueError, match=r"module 'out' \(Linear\) saw a batch of 4 .* is not the batch flattened"):
        bk.step(model(x).view(2, 2).pow(2).sum(1))


class SequenceFirstMix(nn.Module):
    """A Linear run on the hidden states made sequence-first, (T, B, d), as code written for
    sequence-first layers does, between two batch-first ones; ``pool``: the head reads the mean
    over the positions, or the first position alone."""

    def __init__(self, pool="mean", width=4):
        super().__init__()
        self.inp, self.mix, self.head = nn.Linear(3, width), nn.Linear(width, width), nn.Linear(width, 2)
        self.pool = pool

    def forward(self, x):  # (B, T, 3)
        h = torch.tanh(self.mix(torch.tanh(self.inp(x)).transpose(0, 1))).transpose(0, 1)
        return self.head(h.mean(1) if self.pool == "mean" else h[:, 0])


class RelativeScores(nn.Module):
    """Scores of each position against a table of the positions, (T, d), or under a mask, (T, T),
    that the batch shares, scaled by a parameter of its own (replayed per sample)."""

    def __init__(self):
        super().__init__()
        self.query, self.log_scale = nn.Linear(3, 3), nn.Parameter(torch.tensor([0.1, -0.2, 0.3]))

    def forward(self, h, shared):
        q = self.query(h) * self.log_scale.exp()
        return q @ shared.T if shared.shape[1] == 3 else (q @ q.transpose(1, 2)) * shared


class SharedTableModel(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind, self.inp, self.scores, self.head = kind, nn.Linear(3, 3), RelativeScores(), nn.Linear(4, 2)

    def forward(self, x):  # (B, T, 3)
        positions = torch.arange(x.shape[1], dtype=x.dtype)
        shared = (torch.sin(positions[:, None] * torch.tensor([0.3, 0.7, 1.1])) if self.kind != "mask"
                  else (positions[:, None] >= positions).to(x.dtype))
        h = x if self.kind == "table-on-inputs" else torch.tanh(self.inp(x))  # the inputs: no autograd history
        return self.head(torch.tanh(self.scores(h, shared)).mean(1))


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize("kind", ["table", "mask", "table-on-inputs"])
def test_a_replayed_module_s_argument_the_batch_shares_is_not_cut_per_sample_where_t_is_b(kind, chunked,
                                                                                           monkeypatch):
    """A replayed module given a table of the positions (T, d) or a mask (T, T) the batch shares,
    at T = B: the replay cut it per sample as if it were the batch's (a review's repros: Funnel's
    relative-position parameters 2-7 times off, silently); now a replay whose gradients do not add
    up to the call's takes such arguments shared; also one a sample at a time (per-sample
    gradients too large to form whole: Funnel's attention at its real head size), which cut them
    unchecked (2-6 x 10^-3 off), and now decides from the sum of the per-sample gradients."""
    if chunked:
        monkeypatch.setattr(layers.FunctionalLayer, "_forming", lambda self, batch: layers.Forming.NEVER)
        monkeypatch.setattr(layers.FunctionalLayer, "_chunk_step", lambda self, batch: 1)
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*replay its whole forward per sample")
        assert_book_kept_as_materialised(SharedTableModel(kind), torch.randn(4, 4, 3, generator=generator),
                                         torch.randn(4, 2, generator=generator))


class LearnedSlopes(nn.Module):
    """ALiBi's bias with learned slopes, (H, 1, 1) times the distances (T, T), for a batch of 1: an
    op with the heads in dim 0, replayed, never read as samples."""

    def __init__(self):
        super().__init__()
        self.slopes = nn.Parameter(torch.linspace(0.1, 0.4, 4).view(4, 1, 1))

    def forward(self, length):
        positions = torch.arange(length, dtype=torch.float32)
        return (self.slopes * -(positions[:, None] - positions).abs())[None]


class WithLearnedSlopes(nn.Module):
    def __init__(self):
        super().__init__()
        self.qk, self.bias, self.head = nn.Linear(3, 8), LearnedSlopes(), nn.Linear(4, 2)

    def forward(self, x):  # (B, T, 3)
        q = self.qk(x).unflatten(2, (4, 2)).transpose(1, 2)
        return self.head((q @ q.transpose(-1, -2) + self.bias(x.shape[1])).softmax(-1).mean((2, 3)))


def test_a_broadcast_parameter_s_op_with_heads_in_dim_0_is_no_sample_row_at_a_first_batch_of_b_heads():
    """The first sample's check reads the rows of ops whose dim 0 the layer takes for the batch;
    one with the heads in dim 0 (learned ALiBi slopes at B = H) is replayed, not read so: it had
    been refused (a review of this change)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*replay its whole forward per sample")
        assert_book_kept_as_materialised(WithLearnedSlopes(), torch.randn(4, 5, 3, generator=generator),
                                         torch.randn(4, 2, generator=generator))


class KeepsItsState(nn.Module):
    """Adds the last position's output of its call before, kept on the module (RecurrentGemma's
    recurrent block keeps its state so): a replay of one sample meets the batch's state. Its scale
    is a diagonal matrix multiplying the batch, which no rule takes: replayed."""

    def __init__(self):
        super().__init__()
        self.log_scale, self.state = nn.Parameter(torch.zeros(3)), None

    def forward(self, h):
        out = h @ torch.diag(self.log_scale.exp())
        if self.state is not None:
            out = out + self.state.expand_as(out)
        self.state = out.detach()[:, -1:]
        return out


def test_a_replay_that_fails_inside_the_module_names_the_module():
    """torch's error from inside the replayed forward (RecurrentGemma's: "The expanded size of the
    tensor (1) must match the existing size (4)") comes as an error naming the module and why."""
    model = nn.Sequential(nn.Linear(3, 3), KeepsItsState(), nn.Linear(3, 2))
    bk = make(model, check_first_sample=False)
    with torch.no_grad():
        model(torch.randn(4, 5, 3))  # its state: the batch's
    with pytest.raises(ValueError, match=r"module '1' \(KeepsItsState\) is replayed per sample .* and its replay "
                                         r"failed \(.*\): its forward depends on something other than its parameters"):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*replay its whole forward per sample")
            bk.step(model(torch.randn(4, 5, 3)).pow(2).sum((1, 2)))


class SequenceFirstScale(nn.Module):
    """A layer scale multiplied into hidden states made sequence-first, (T, B, d): its product's
    dim 0 is the positions, which at T = B look like the batch."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(3, 3), nn.Linear(3, 2)
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):  # (B, T, 3)
        h = torch.tanh(self.inp(x)).transpose(0, 1)
        return self.head((h + self.gamma * torch.tanh(h)).transpose(0, 1).mean(1))


def test_a_broadcast_parameter_s_op_whose_dim_0_was_positions_is_replayed_from_then_on():
    """At T != B the layer scale's op on (T, B, d) has another dim 0 than the batch, and the model
    is replayed; at a later batch of B = T its dim 0 looked like the batch, and each position's
    gradient was clipped as a sample's (a review's repro: a sample's share 3.2 times C, no check
    after the first batch). Now replayed from the first such op on: the materialised path's update."""
    torch.manual_seed(0)
    model = SequenceFirstScale()
    config = dpsgd.DPSGDConfig(1e-3, noise_multiplier=0.0)
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.0), config, expected_batch_size=4)
    generator = torch.Generator().manual_seed(1)
    with pytest.warns(UserWarning, match="replay its whole forward per sample"):
        bk.step(regression(model(torch.randn(3, 4, 3, generator=generator)), torch.randn(3, 2, generator=generator)))
    x, target = torch.randn(4, 4, 3, generator=generator), torch.randn(4, 2, generator=generator)
    want = dpsgd.privatize(materialised_grads(model, x, target), config, 4.0)
    assert_same_update(bk.step(regression(model(x), target)), want)


def test_a_broadcast_parameter_s_op_whose_dim_0_is_positions_is_refused_at_a_first_batch_of_b_positions():
    """At a first batch of B = T the op's dim 0 looks like the batch: the first sample's check finds
    that sample's gradient in the other rows of the op's output, as it does in a layer's."""
    torch.manual_seed(0)
    model = SequenceFirstScale()
    bk = make(model)
    with pytest.raises(ValueError, match=r"the first sample's loss has a gradient in the other samples' rows of the "
                                         r"op MulBackward0 on parameter 'gamma'"):
        bk.step(regression(model(torch.randn(4, 4, 3)), torch.randn(4, 2)))


FIRST_SAMPLE_SPREAD = (r"the first sample's loss has a gradient in the other samples' rows of the output of module "
                       r"'{}' \(Linear\) .* where book-keeping reads each row as one sample's. Its layer reads a dim "
                       r"other than the batch as the samples \(a sequence-first \(T, B, \.\.\.\) input with T = B"
                       r".* depend on other samples")
FIRST_SAMPLE_NORM = (r"book-keeping gave the first sample's gradient of parameter '{}\.(weight|bias)' the norm .*, but "
                     r"the backward pass of that sample's loss alone gives it .*sequence-first \(T, B, \.\.\.\) "
                     r"input with T = B.* depend on other samples")


@pytest.mark.parametrize("mechanism", ["gaussian", "laplace"])
@pytest.mark.parametrize("pool", ["mean", "first"])
def test_a_layer_on_a_sequence_first_tensor_at_t_equal_b_is_found_by_its_first_sample(mechanism, pool):
    """At T = B the sequence-first input of 'mix' has the batch's size in dim 0, and neither its
    shape nor its graph tells its positions from samples (a batch-first attention's output is a
    transpose too): book-keeping took the positions for the samples and clipped the wrong
    gradients without a sign. The first batch's first sample, by the backward pass of its loss
    alone, now shows it (L2 and L1 norms): with the mean over positions, its loss has a gradient
    in the other rows of the output; with the first position, every sample's loss reads row 0
    only, and the norms show it. At T != B the shapes refuse it."""
    torch.manual_seed(0)
    model = SequenceFirstMix(pool)
    bk = make(model, dpsgd.DPSGDConfig(1.0, mechanism, noise_multiplier=1.0))
    with pytest.raises(ValueError, match=(FIRST_SAMPLE_SPREAD if pool == "mean" else FIRST_SAMPLE_NORM).format("mix")):
        bk.step(model(torch.randn(4, 4, 3)).pow(2).sum(1))
    with pytest.raises(ValueError, match=r"per_sample_losses has 4 samples, but module 'mix' \(Linear\) saw a "
                                         r"batch of 5"):
        bk.step(model(torch.randn(4, 5, 3)).pow(2).sum(1))


@pytest.mark.parametrize("seed", range(6))
def test_a_wide_sequence_first_layer_is_found_whatever_its_norms(seed):
    """A sequence-first Linear 512 wide on zero-mean activations: its positions' gradients have
    about the samples' norms, so a comparison of norms missed it in 4 to 7 seeds of 10. The first
    sample's loss has a gradient in the other rows of its output, which independent samples never
    give (exact zeros), so it is found at any width."""
    torch.manual_seed(seed)
    model = SequenceFirstMix("mean", width=512)
    bk = make(model)
    with pytest.raises(ValueError, match=FIRST_SAMPLE_SPREAD.format("mix")):
        bk.step(model(torch.randn(8, 8, 3)).pow(2).sum(1))


class Centred(nn.Module):
    """Hidden states centred over the batch by hand (h - h.mean(0)) where ``centred``: each loss
    then depends on every sample, which no per-sample clip bounds. The head's per-sample gradients
    are still its own (its input is the centred row); the first layer's are not."""

    def __init__(self):
        super().__init__()
        self.inp, self.head, self.centred = nn.Linear(3, 4), nn.Linear(4, 2), True

    def forward(self, x):
        h = self.inp(x)
        return self.head(torch.tanh(h - h.mean(0) if self.centred else h))


def test_a_model_that_mixes_its_samples_is_found_by_the_first_sample():
    torch.manual_seed(0)
    model = Centred()
    bk = make(model)
    with pytest.raises(ValueError, match=FIRST_SAMPLE_SPREAD.format("inp")):
        bk.step(model(torch.randn(4, 3)).pow(2).sum(1))


class Shifted(nn.Module):
    """Each sample's hidden state plus the one of the sample before it: the first sample's loss
    reads its own row only, but the second's reads the first's too."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.inp(x)
        return self.head(torch.tanh(h + torch.cat([torch.zeros_like(h[:1]), h[:-1]])))


@pytest.mark.parametrize("seed", range(4))
def test_a_loss_that_reads_the_first_sample_from_another_is_found_by_its_norms(seed):
    """No gradient of the first sample's loss reaches another row, so only the norms show that the
    second sample's loss reads the first's row: book-keeping gives 'inp' the gradient of both
    losses in that row as the first sample's, against that sample's own."""
    torch.manual_seed(seed)
    model = Shifted()
    bk = make(model)
    with pytest.raises(ValueError, match=FIRST_SAMPLE_NORM.format("inp")):
        bk.step(model(torch.randn(4, 3)).pow(2).sum(1))


def test_the_first_sample_is_checked_at_the_first_batch_only():
    """One backward pass more, at the first batch of a BookKeeping (every test comparing its update
    with the materialised path's has it, unchanged); a later batch is not checked, so a model
    that starts mixing samples after the first batch is not found."""
    torch.manual_seed(0)
    model = Centred()
    model.centred = False
    bk = make(model)
    passes = []
    bk._first_sample_norms = lambda losses, own=bk._first_sample_norms: passes.append(1) or own(losses)
    bk.step(model(torch.randn(4, 3)).pow(2).sum(1))
    model.centred = True
    bk.step(model(torch.randn(4, 3)).pow(2).sum(1))
    assert passes == [1]


def test_the_first_sample_s_check_can_be_left_out_and_gives_way_to_a_lack_of_memory(monkeypatch):
    """check_first_sample=False leaves the check out (the sequence-first layer goes unseen); a
    check that runs out of (GPU) memory warns, is skipped and not tried again, and the step goes
    on: here torch.autograd.backward, which only the check calls, raises torch's OOM error."""
    torch.manual_seed(0)
    model = SequenceFirstMix()
    x = torch.randn(4, 4, 3)
    assert len(make(model, check_first_sample=False).step(model(x).pow(2).sum(1))) == 6
    with pytest.raises(TypeError, match="check_first_sample must be True or False, got int 1"):
        make(model, check_first_sample=1)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    bk = make(model)
    monkeypatch.setattr(torch.autograd, "backward", out_of_memory)
    with pytest.warns(RuntimeWarning, match="check of the first sample .* ran out of GPU memory .* skipped"):
        assert len(bk.step(model(x).pow(2).sum(1))) == 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bk.step(model(x).pow(2).sum(1))


def test_the_first_sample_s_check_waits_for_a_batch_that_can_show_a_fault():
    """A first batch of one sample cannot show a mixing model, and one whose first sample's own
    gradients are not finite (0 x NaN of another sample's, whatever that sample's fate) shows
    nothing: the check waits for the next batch instead of passing."""
    torch.manual_seed(0)
    model = Centred()
    bk = make(model, dpsgd.DPSGDConfig(1.0, non_finite="drop"))
    bk.step(model(torch.randn(1, 3)).pow(2).sum(1))
    x = torch.randn(4, 3)
    x[2] = math.nan
    model.centred = False
    bk.step(model(x).pow(2).sum(1))  # sample 2 dropped; every gradient of sample 0's own pass is NaN
    model.centred = True
    with pytest.raises(ValueError, match=FIRST_SAMPLE_SPREAD.format("inp")):
        bk.step(model(torch.randn(4, 3)).pow(2).sum(1))


def test_the_first_sample_s_check_takes_an_empty_sequence_and_a_saturated_loss():
    """An empty context (ids of shape (B, 0)) gives its Embedding an empty output gradient, which
    the check passes over (it crashed on the largest of no values). A first sample whose loss is
    saturated (a margin of 80: its gradient is about 1e-35, whose square float32 rounds to 0, where
    the check's float64 does not) differs from its own backward pass by far under 2^-20 of the
    clip norm, which cannot move its clip factor: no alarm."""
    class Context(nn.Module):
        def __init__(self):
            super().__init__()
            self.context, self.head = nn.Embedding(10, 4), nn.Linear(3, 1)

        def forward(self, ids, x):
            return self.head(x).squeeze(1) + self.context(ids).sum((1, 2))

    torch.manual_seed(0)
    model = Context()
    bk = make(model)
    bk.step(model(torch.zeros(4, 0, dtype=torch.long), torch.randn(4, 3)).pow(2))
    assert bk._checked
    model = nn.Linear(2, 3)
    with torch.no_grad():
        model.bias.copy_(torch.tensor([80.0, 0.0, 0.0]))
    bk = make(model)
    losses = F.cross_entropy(model(torch.randn(4, 2)), torch.tensor([0, 1, 2, 0]), reduction="none")
    own = torch.autograd.grad(losses[0], model.bias, retain_graph=True)[0].double()
    assert 0 < own.norm() < 1e-30
    bk.step(losses)
    assert bk._checked


def test_the_first_sample_s_check_fires_no_parameter_hook_and_takes_sparse_gradients():
    """A gradient logger's hook (as wandb.watch's) would get the sample's unclipped gradient, and
    an optimizer run in the backward would step with it: the parameters' hooks are off during the
    check, back after it. A sparse Embedding's gradient is taken by its values. The update is the
    one without the check, bit for bit."""
    class Sparse(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(7, 4, sparse=True), nn.Linear(4, 2)

        def forward(self, ids):
            return self.head(self.embed(ids).mean(1))

    ids = torch.randint(0, 7, (4, 5), generator=torch.Generator().manual_seed(1))
    updates, seen = [], []
    for check in (True, False):
        torch.manual_seed(0)
        model = Sparse()
        bk = make(model, dpsgd.DPSGDConfig(0.1, noise_multiplier=0.0), check_first_sample=check)
        model.head.weight.register_hook(lambda grad: seen.append("tensor hook"))
        model.head.bias.register_post_accumulate_grad_hook(lambda p: seen.append("accumulate hook"))
        updates.append(bk.step(model(ids).pow(2).sum(1)))
    assert seen == []
    assert all(torch.equal(a, b) for a, b in zip(*updates))
    model(ids).pow(2).sum().backward()  # an ordinary backward still runs them
    assert sorted(seen) == ["accumulate hook", "tensor hook"]


class FlatteningRouter(nn.Module):
    """DeepSeek-V3's router in small: it flattens the hidden states (B, T, d) itself, computes its
    logits with the weight cast to float64 (DeepSeek's casts to float32, a cast in a bfloat16
    model), and returns them and its normalised top-2 weights gathered from their sigmoid, (B T,
    ...); ``mixed``: the weights from a softmax over the rows, which mixes the samples; ``rooted``:
    DeepSeek-V4's scores sqrt(softplus(logits)), clamped and shifted as MiniMax-M3's, and the top
    two taken as topk's values (DeepSeek-V2's)."""

    def __init__(self, width, experts, mixed, rooted=False):
        super().__init__()
        self.weight, self.mixed, self.rooted = nn.Parameter(torch.randn(experts, width) * 0.5), mixed, rooted

    def forward(self, hidden):
        logits = F.linear(hidden.view(-1, hidden.shape[-1]).double(), self.weight.type(torch.float64))
        if self.rooted:
            top = (F.softplus(logits).sqrt().clamp(max=10.0) + 1.0).topk(2, dim=-1).values
            return logits.float(), (top / top.sum(-1, keepdim=True) * 2.5).float()
        scores = logits.softmax(0) if self.mixed else logits.sigmoid()
        top = scores.gather(1, scores.topk(2, dim=-1).indices)
        return logits.float(), (top / (top.sum(-1, keepdim=True) + 1e-20) * 2.5).float()


class RoutedScale(nn.Module):
    """Hidden states scaled by a flattening router's first routing weight and its logits' mean."""

    def __init__(self, mixed=False, rooted=False):
        super().__init__()
        self.inp, self.router, self.head = nn.Linear(3, 4), FlatteningRouter(4, 3, mixed, rooted), nn.Linear(4, 2)

    def forward(self, x):
        h = self.inp(x)
        logits, weights = self.router(h)
        scale = (weights[:, :1] + logits.mean(-1, keepdim=True)).view(*h.shape[:2], 1)
        return self.head(torch.tanh(h * scale))


@pytest.mark.parametrize("rooted", [False, True], ids=["sigmoid", "softplus-topk"])
@pytest.mark.parametrize("mechanism, per_layer", [("gaussian", False), ("vmf", True)])
def test_a_module_that_flattens_the_batch_itself_is_replayed_by_sample(mechanism, per_layer, rooted):
    """A router that flattens its input (B, T, d) itself gives outputs (B T, ...) whose graph shows
    each row made from its own token (a Linear of a cast weight, a sigmoid, or a softplus, sqrt,
    clamp and shift, a gather of the top two or topk's values, a sum along the rows; the second
    kind of router was refused as not the batch flattened): the replay gives each sample its T
    rows, the update that of each sample's own backward pass. A softmax over the rows mixes the
    samples: the weights made from it are refused (the logits, a Linear of each row, are still
    read by sample)."""
    generator = torch.Generator().manual_seed(0)
    x, target = torch.randn(5, 6, 3, generator=generator), torch.randn(5, 6, 2, generator=generator)
    torch.manual_seed(0)
    model = RoutedScale(rooted=rooted)
    grads = one_backward_per_sample(model, x, target)
    config = CONFIGS[mechanism](clip_between(grads, per_layer), per_layer)
    want = dpsgd.privatize(grads, config, 4.0, M.NoiseGenerator(3))
    assert_same_update(book_kept(model, x, target, config, 4.0, M.NoiseGenerator(3)), want)
    mixed = RoutedScale(mixed=True)
    with pytest.raises(ValueError, match=r"module 'router' \(FlatteningRouter\) returned an output of shape \(30, 2\), "
                                         r"without the batch of 5"):
        make(mixed).step(regression(mixed(x), target))


def replays_counted(monkeypatch) -> list:
    """The batch sizes of the replays of FunctionalLayer from now on, one a call (a chunk's too)."""
    replays, replay = [], layers.FunctionalLayer.per_sample_grads
    monkeypatch.setattr(layers.FunctionalLayer, "per_sample_grads",
                        lambda self, batch, *chunk: replays.append(batch) or replay(self, batch, *chunk))
    return replays


def one_backward_per_sample(model, x, target):
    """(B, *shape) per trainable parameter: each sample's gradient by its own forward and backward."""
    params = trainable(model)
    rows = [torch.autograd.grad(regression(model(x[i:i + 1]), target[i:i + 1]).sum(), params) for i in range(len(x))]
    return [torch.stack(column) for column in zip(*rows)]


@pytest.mark.parametrize("mechanism, per_layer", [("gaussian", False), ("vmf", True), ("laplace", False)])
def test_a_module_torch_func_cannot_vmap_is_replayed_one_sample_at_a_time(mechanism, per_layer, monkeypatch):
    """Mixtral's eager experts (a loop over the experts, each on the tokens routed to it: shapes
    that depend on the data) give the update of each sample's own backward pass; the router beside
    them is vmapped."""
    torch.manual_seed(0)
    model = MixtureOfExperts(indexed=True)
    generator = torch.Generator().manual_seed(1)
    x, target = torch.randn(6, 5, 3, generator=generator), torch.randn(6, 5, 2, generator=generator)
    with pytest.raises(RuntimeError):  # the reference cannot be torch.func's
        materialised_grads(model, x, target)
    grads = one_backward_per_sample(model, x, target)
    config = CONFIGS[mechanism](clip_between(grads, per_layer), per_layer)
    want = dpsgd.privatize(grads, config, 4.5, M.NoiseGenerator(7))
    looped, replay = [], layers.FunctionalLayer._one_at_a_time_grads
    monkeypatch.setattr(layers.FunctionalLayer, "_one_at_a_time_grads",
                        lambda self, *args, **kwargs: looped.append(self.name) or replay(self, *args, **kwargs))
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(trainable(model), lr=0.0), config, expected_batch_size=4.5,
                           generator=M.NoiseGenerator(7))
    assert_same_update(bk.step(regression(model(x), target)), want)
    assert looped == ["experts"]
    bk.step(regression(model(x), target))
    assert looped == ["experts"] * 2  # vmap is not tried again


class TakenPositions(nn.Embedding):
    """A position embedding with a padding index, returning rows of its weight (Whisper's
    decoder's): a slice for the positions 1..T (the batch shares it), an index by position ids of
    the batch's shape, an index counting from the end (-1, -2, ...), or its lookup by
    F.embedding without its padding index, or nn.Embedding's lookup beside the position ids
    (ProphetNet's). Row 1 gets a gradient in each but the last (the padding index is
    nn.Embedding.forward's)."""

    def __init__(self, form):
        super().__init__(12, 4, padding_idx=1)
        self.form = form

    def forward(self, ids):
        positions = torch.arange(ids.shape[1])
        if self.form == "slice":
            return self.weight[1:ids.shape[1] + 1]
        if self.form == "from the end":
            return self.weight[-1 - positions]
        if self.form == "lookup":
            return F.embedding(positions.expand_as(ids) + ids % 2, self.weight)
        if self.form == "lookup and its ids":  # ProphetNet's
            return super().forward(positions.expand_as(ids) + ids % 2), positions
        return self.weight[positions.expand_as(ids) + ids % 2]


class WithTakenPositions(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.tokens, self.positions, self.head = nn.Embedding(9, 4), TakenPositions(form), nn.Linear(4, 2)

    def forward(self, ids):
        rows = self.positions(ids)
        return self.head(torch.tanh(self.tokens(ids) + (rows[0] if isinstance(rows, tuple) else rows)).mean(1))


@pytest.mark.parametrize("form", ["slice", "index", "from the end", "lookup", "lookup and its ids"])
def test_an_embedding_subclass_returning_rows_of_its_weight_is_book_kept(form):
    """``self.weight[a:b]`` (Whisper's decoder position embedding) or ``self.weight[ids]`` is the
    lookup of those rows' ids, a negative one counted from the end, with no padding index: the
    update is the one of a backward pass per sample (it was refused as other than a lookup; a
    review's repros of this: negative ids' rows dropped, 4-94% off, and the padding row's
    gradient dropped, 3-8% off, also for a lookup without the module's padding index). A lookup
    returned beside its ids is read as the lookup (refused before as a use the hooks did not see)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 9, (5, 6), generator=torch.Generator().manual_seed(1))
    assert_book_kept_as_materialised(WithTakenPositions(form), ids, torch.randn(5, 2))


def test_an_embedding_subclass_renormalising_its_weight_in_its_forward_is_refused():
    """F.embedding(ids, self.weight, max_norm=1.0) in a forward of its own, the module's max_norm
    None: the rows the batch looked up were renormalised in place, telling which tokens it held,
    outside the noise (a review's repro). Refused at the call, naming the module."""
    class Renormed(nn.Embedding):
        def forward(self, ids):
            return F.embedding(ids, self.weight, max_norm=1.0)

    torch.manual_seed(0)
    model = nn.Sequential(Renormed(9, 4), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight.mul_(10)
    bk = make(model)  # noqa: F841 (its hooks live as long as it does)
    with pytest.raises(ValueError, match=r"module '0' \(Renormed\) changed its weight in its forward call "
                                         r"\(F.embedding with max_norm"):
        model(torch.randint(0, 9, (4, 3)))


def test_an_embedding_subclass_returning_other_than_its_lookup_is_refused():
    class Doubled(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 2

    model = nn.Sequential(Doubled(5, 3), nn.Linear(3, 2))
    bk = make(model)  # noqa: F841 (its hooks live as long as it does)
    with pytest.raises(ValueError, match=r"module '0' \(Doubled\) is an nn.Embedding with a forward of its own that "
                                         r"returns something other than its lookup"):
        model(torch.randint(0, 5, (4, 3)))


class BufferWriter(nn.Module):
    """Its forward writes a buffer or an attribute, as ``write`` says: a call counter its output is
    divided by (a warm-up), kept as a buffer or as a Python int, an average of its outputs updated
    in place or assigned anew, a table written again with the values it holds (Phi-3's longrope
    ``inv_freq.copy_`` at every call), a cache made at the first call, a table read once and set
    to None, or a range of its outputs (a quantization observer's)."""

    def __init__(self, write):
        super().__init__()
        self.write, self.seen = write, 0
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("average", torch.zeros(4))
        self.register_buffer("table", torch.linspace(0.5, 1.5, 4))
        self.register_buffer("cache", None)

    def written(self, y):
        if self.write == "counter":
            self.calls += 1
            return y / self.calls
        if self.write == "attribute":
            self.seen += 1
            return y / self.seen
        if self.write == "same values":
            self.table.copy_(torch.linspace(0.5, 1.5, 4))
            return y * self.table
        if self.write == "cache":
            if self.cache is None:
                self.cache = torch.linspace(0.5, 1.5, 4)
            return y * self.cache
        if self.write == "set to None":
            if self.table is not None:
                y, self.table = y * self.table, None
            return y
        with torch.no_grad():
            if self.write == "in place":
                self.average.mul_(0.9).add_(0.1 * y.mean(0))
            elif self.write == "assigned":
                self.average = 0.9 * self.average + 0.1 * y.mean(0)
            elif self.write == "range":
                self.average = torch.maximum(self.average, y.detach().abs().amax(0))
        return y


class WritesBuffer(BufferWriter):
    """No rule (replayed): a parameter of its own, then :class:`BufferWriter`'s write."""

    def __init__(self, write):
        super().__init__(write)
        self.weight = nn.Parameter(torch.randn(4, 4) * 0.3)

    def forward(self, x):
        return self.written(torch.tanh(x @ self.weight))


def one_backward_per_sample_from(model, x, target):
    """Each sample's gradient by a forward and backward of its own on a copy of ``model`` (whose
    buffers each such call may write)."""
    rows = []
    for i in range(len(x)):
        alone = copy.deepcopy(model)
        rows.append(torch.autograd.grad(regression(alone(x[i:i + 1]), target[i:i + 1]).sum(), trainable(alone)))
    return [torch.stack(column) for column in zip(*rows)]


@pytest.mark.parametrize("write", ["counter", "attribute", "same values", "cache", "set to None", None])
def test_a_replayed_module_is_replayed_from_its_buffers_as_the_call_saw_them(write):
    """The replay ran the forward again per sample on the live buffers, and computed with them as
    it left them (a review's repro: a counter at 5 after a step of 4 samples). Each sample's
    replay now starts from copies of the buffers as the call found them, and from its attributes
    as the call found them where it changed them: where the call's writes do not depend on the
    batch (a counter, kept as a buffer or as an attribute, which was refused; a table written with
    the values it held; a cache made; a table set to None, which was replayed as None, 25% off),
    the update is the one of a backward pass per sample from the model as the batch found it, and
    the buffers are as the call left them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), WritesBuffer(write), nn.Linear(4, 2))
    config = dpsgd.DPSGDConfig(1e-3, noise_multiplier=0.0)
    bk = make(model, config, check_first_sample=False)
    for step in range(3):
        x, target = torch.randn(4, 4), torch.randn(4, 2)
        before = copy.deepcopy(model)
        want = dpsgd.privatize(one_backward_per_sample_from(before, x, target), config, 4.0, M.NoiseGenerator(5))
        called = copy.deepcopy(before)
        called(x)  # the buffers as the batch's call leaves them
        assert_same_update(bk.step(regression(model(x), target)), want)
        assert model[1].seen == called[1].seen
        for name, buffer in called.named_buffers():
            assert torch.equal(model.get_buffer(name), buffer), (step, name)


@pytest.mark.parametrize("write", ["in place", "assigned", "range"])
@pytest.mark.parametrize("replayed", [True, False])
def test_a_module_with_a_rule_of_the_fallback_that_writes_a_statistic_of_the_batch_is_refused(write, replayed):
    """A buffer written from the batch (a running average: a review's repro moved it from
    [-0.32, ...] to [12.37, ...] with one sample replaced; a range) is released outside the noise:
    refused at the call, naming the buffer, also where the call takes the broadcast rule and is
    not replayed (a review's repro: a LayerScale keeping an average trained); the buffers are as
    the call left them."""
    class Changes(WritesBuffer):
        def forward(self, x):
            return self.written(torch.tanh(x @ self.weight) if replayed else x * self.weight[0])  # a product

    model = nn.Sequential(nn.Linear(4, 4), Changes(write), nn.Linear(4, 2))
    bk = make(model, check_first_sample=False)  # noqa: F841 (its hooks live as long as it does)
    x = torch.randn(4, 4)
    called = copy.deepcopy(model)
    with torch.no_grad():
        called(x)
    with pytest.raises(ValueError, match=r"module '1' \(Changes\) changed a buffer in its forward call that may "
                                         r"depend on the batch: its buffer 'average' is left otherwise by the forward "
                                         r"run again on the first sample alone; .* released with the model outside"):
        model(x)
    assert all(torch.equal(model.get_buffer(n), b) for n, b in called.named_buffers())


class Unparametrized(BufferWriter):
    """No parameters: so no layer of book-keeping's. Its forward writes a buffer from the batch,
    a running standardiser's mean and variance (in place, or assigned), a mean made at the first
    call (a data-dependent initialisation); or a table of the positions made again for a longer
    sequence (a rotary embedding's cache), which does not depend on the batch; or
    :class:`BufferWriter`'s write."""

    def __init__(self, write):
        super().__init__(write)
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))
        self.register_buffer("positions", None)
        self.register_buffer("start", None)

    def forward(self, x):  # x: (B, T, 4)
        with torch.no_grad():
            if self.write == "in place":
                self.mean.mul_(0.5).add_(0.5 * x.mean((0, 1)))
                self.var.mul_(0.5).add_(0.5 * x.var((0, 1)))
            elif self.write == "assigned":
                self.mean = 0.5 * self.mean + 0.5 * x.mean((0, 1))
            elif self.write == "made at the first call" and self.start is None:
                self.start = x.mean((0, 1))
        if self.write in ("in place", "assigned"):
            return (x - self.mean) / self.var.sqrt()
        if self.write == "made at the first call":
            return x - self.start
        if self.write == "positions":
            if self.positions is None or len(self.positions) < x.shape[1]:
                self.positions = torch.linspace(0.5, 1.5, x.shape[1])
            return x * self.positions[:x.shape[1], None]
        return self.written(x)


@pytest.mark.parametrize("batch", [4, 1])
@pytest.mark.parametrize("write", ["in place", "assigned", "made at the first call", "observer"])
def test_a_module_without_parameters_that_writes_a_statistic_of_the_batch_is_refused(write, batch):
    """A module without parameters has no layer: a running standardiser before the first Linear
    trained, normalising each sample with the others' mean (a review's repro: one sample's removal
    moved the clipped sum by 1.21 C, and the mean went out with the model unnoised). Refused at the
    call, naming it and the buffer, at a batch of one too (the forward run again on that sample
    shifted by 1 leaves another mean); so is torch's MinMaxObserver of quantization-aware
    training."""
    observed = write == "observer"
    first = torch.ao.quantization.MinMaxObserver() if observed else Unparametrized(write)
    model = nn.Sequential(first, nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    bk = make(model, expected_batch_size=batch)  # noqa: F841 (its hooks live as long as it does)
    name = "min_val" if observed else "start" if write == "made at the first call" else "mean"
    kind = "MinMaxObserver" if observed else "Unparametrized"
    with pytest.raises(ValueError, match=rf"module '0' \({kind}\) changed a buffer in its forward call that may "
                                         rf"depend on the batch: its buffer '{name}' is left otherwise by the forward "
                                         r"run again on the (first|last) sample alone"):
        model(torch.randn(batch, 3, 4) * 3 + 1)


class ActNorm(nn.Module):
    """Glow's ActNorm as it is often written: its shift and scale set from the first batch
    through ``.data`` (a data-dependent initialisation), a flag buffer set then."""

    def __init__(self):
        super().__init__()
        self.loc, self.scale = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.ones(4))
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))

    def forward(self, x):
        if self.initialized.item() == 0:
            with torch.no_grad():
                self.loc.data.copy_(-x.mean(0))
                self.scale.data.copy_(1 / (x.std(0) + 1e-6))
                self.initialized.fill_(1)
        return self.scale * (x + self.loc)


class Counted(nn.Module):
    """A call counter with a child that counts its own calls."""

    def __init__(self, child):
        super().__init__()
        self.child = child
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.child(x)


class CountsCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return torch.tanh(x * self.weight) / self.calls


def test_a_forward_that_writes_its_parameters_from_the_batch_is_refused():
    """The flag is set alike for any batch, so the forward ran again to judge it, on the live
    parameters: the shift and scale went out as the last sample's, unnoised (a review's repro).
    The runs again are on copies; a forward that writes a parameter is refused, naming it, and
    the model's parameters are as the call left them."""
    model = nn.Sequential(ActNorm(), nn.Linear(4, 1))
    bk = make(model)  # noqa: F841 (its hooks live as long as it does)
    x = torch.randn(4, 4) * 3 + 1
    with pytest.raises(ValueError, match=r"module '0' \(ActNorm\) changed a buffer in its forward call that may "
                                         r"depend on the batch: its forward writes its parameter '(loc|scale)'"):
        model(x)
    torch.testing.assert_close(model[0].loc.detach(), -x.mean(0))


def test_a_statistic_of_the_batch_is_found_behind_a_shared_first_argument():
    """The run again took the batch's size from the first tensor argument, a (1, d) one the batch
    shares, and so ran the whole batch again (a review's repro); then from the largest, a shared
    table of more rows (a review's repro): each first dim among the arguments is cut in turn."""
    class Centred(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 1)
            self.register_buffer("mean", torch.zeros(4))

        def forward(self, offset, x):
            self.mean.mul_(0.5).add_(0.5 * x.detach().mean(0))
            return self.fc(x + offset - self.mean)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.centred, self.offset = Centred(), nn.Parameter(torch.zeros(1, 4))

        def forward(self, x):
            return self.centred(self.offset.detach(), x)

    model = Model()
    bk = make(model)  # noqa: F841 (its hooks live as long as it does)
    with pytest.raises(ValueError, match=r"module 'centred' \(Centred\) changed a buffer .*its buffer 'mean' is "
                                         r"left otherwise"):
        model(torch.randn(4, 4))


class InitialisesItsChild(nn.Module):
    """A flag buffer, and its child Linear's weight set from the first batch through ``.data``."""

    def __init__(self, outputs):
        super().__init__()
        self.lin = nn.Linear(256, outputs)
        self.register_buffer("initialised", torch.zeros((), dtype=torch.bool))

    def forward(self, x):
        if not self.initialised:
            with torch.no_grad():
                self.lin.weight.data.copy_(x.mean(0).expand_as(self.lin.weight) * 0.01)
                self.initialised.fill_(True)
        return self.lin(x)


@pytest.mark.parametrize("outputs", [16, 300], ids=["small", "over 2^16"])
def test_a_forward_that_initialises_a_child_s_weight_from_the_batch_is_refused(outputs):
    """A weight of over 2^16 elements is not copied for the runs again: its initialisation from the
    batch went unseen, and the runs wrote it from one sample (a review's repro). It is told written
    by its sums; refused either way, naming it."""
    model = nn.Sequential(InitialisesItsChild(outputs), nn.Tanh(), nn.Linear(outputs, 1))
    bk = make(model)  # noqa: F841 (its hooks live as long as it does)
    with pytest.raises(ValueError, match=r"module '0' \(InitialisesItsChild\) changed a buffer .*: its forward "
                                         r"writes its parameter 'lin.weight'"):
        model(torch.randn(4, 256))


class KeepsPositions(nn.Module):
    """Takes the batch x (B, 4) and a table (N, 4) the batch shares: a running mean of x, or a
    call counter that reads row B - 1 of the table."""

    def __init__(self, write):
        super().__init__()
        self.fc, self.write = nn.Linear(4, 1), write
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x, table):
        if self.write == "mean":
            self.mean.mul_(0.5).add_(0.5 * x.detach().mean(0))
            return self.fc(x - self.mean + table.mean(0))
        self.calls += 1
        return self.fc(x * table[x.shape[0] - 1] / self.calls)


@pytest.mark.parametrize("write", ["mean", "counter"])
def test_a_buffer_writer_given_a_shared_table_of_more_rows_than_the_batch_is_judged_on_the_batch(write):
    """The runs again cut the largest first dim, a shared table of 8 rows at a batch of 4: a
    running mean of the batch went out unseen, and a counter reading the table's row B - 1 was
    refused (the table cut to one row; a review's repros). Each first dim is cut in turn: the
    mean is refused, and the counter trains with each sample's update."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.keeps = KeepsPositions(write)
            self.register_buffer("table", torch.linspace(0.5, 1.5, 32).view(8, 4))

        def forward(self, x):
            return self.keeps(x, self.table)

    torch.manual_seed(0)
    model = Model()
    config = dpsgd.DPSGDConfig(1e-3, noise_multiplier=0.0)
    bk = make(model, config)
    x, target = torch.randn(4, 4), torch.randn(4, 1)
    if write == "mean":
        with pytest.raises(ValueError, match=r"module 'keeps' \(KeepsPositions\) changed a buffer .*its buffer "
                                             r"'mean' is left otherwise"):
            model(x)
        return
    for _ in range(2):
        rows = []
        for i in range(4):  # each sample alone, at the batch's row of the table
            alone = copy.deepcopy(model)
            out = alone.keeps.fc(x[i:i + 1] * alone.table[3] / (alone.keeps.calls + 1))
            rows.append(torch.autograd.grad(regression(out, target[i:i + 1]).sum(), trainable(alone)))
        want = dpsgd.privatize([torch.stack(c) for c in zip(*rows)], config, 4.0, M.NoiseGenerator(5))
        assert_same_update(bk.step(regression(model(x), target)), want)


def test_a_run_again_changes_no_child_of_the_module():
    """A parent's run again ran its children on their live buffers: a child's counter read 3
    after a step where plain training gives 1, the update 8-20% off, and a replayed child's
    backward failed (a review's repro). The update is each sample's backward pass from the model
    as the batch found it, and the counters are plain training's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Counted(CountsCalls()), nn.Linear(4, 2))
    config = dpsgd.DPSGDConfig(1e-3, noise_multiplier=0.0)
    bk = make(model, config)
    for step in range(3):
        x, target = torch.randn(4, 4), torch.randn(4, 2)
        want = dpsgd.privatize(one_backward_per_sample_from(copy.deepcopy(model), x, target), config, 4.0,
                               M.NoiseGenerator(5))
        assert_same_update(bk.step(regression(model(x), target)), want)
        assert model[1].calls == model[1].child.calls == step + 1


def test_quantization_aware_training_refuses_its_activation_observers_and_trains_without_them():
    """torch's fused fake-quantization writes the batch's range in place without moving the
    buffers' versions, from a replayed Linear's forward hook (a review's repro: the range went out
    unseen). Its activation observer is refused, naming it; its weights' observers, which read the
    weights alone, are not; with the observers off the model trains."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    model.qconfig = torch.ao.quantization.get_default_qat_qconfig("x86")
    model = torch.ao.quantization.prepare_qat(model.train())
    bk = make(model, dpsgd.DPSGDConfig(1e-3, noise_multiplier=0.0))
    x = torch.randn(4, 4)
    with pytest.raises(ValueError, match=r"module '0.activation_post_process' \(FusedMovingAvgObsFakeQuantize\) "
                                         r"changed a buffer .*: its buffer '(scale|zero_point)' is left otherwise"):
        model(x)
    model.apply(torch.ao.quantization.disable_observer)
    ranges = {name: b.clone() for name, b in model.named_buffers()  # the activations' (the weights' set at first use)
              if "weight" not in name and name.endswith(("min_val", "max_val"))}
    assert all(torch.isfinite(u).all() for u in bk.step(model(x).squeeze(1) ** 2))
    assert all(torch.equal(model.get_buffer(name), b) for name, b in ranges.items())


@pytest.mark.parametrize("write", ["counter", "attribute", "positions", "set to None"])
def test_a_module_without_parameters_whose_writes_do_not_depend_on_the_batch_trains(write):
    """A counter, a table of the positions made again for a longer sequence, a Python counter and
    a table read once are written alike by the batch and by each sample alone: they train, the
    update is each sample's backward pass from the model as the batch found it, clipped, and the
    buffers are as the batch's call leaves them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Unparametrized(write), nn.Linear(4, 2))
    config = dpsgd.DPSGDConfig(1e-3, noise_multiplier=0.0)
    bk = make(model, config)
    for length in (3, 5, 2):
        x, target = torch.randn(4, length, 4), torch.randn(4, length, 2)
        before = copy.deepcopy(model)
        want = dpsgd.privatize(one_backward_per_sample_from(before, x, target), config, 4.0, M.NoiseGenerator(5))
        called = copy.deepcopy(before)
        called(x)
        assert_same_update(bk.step(regression(model(x), target)), want)
        assert model[1].seen == called[1].seen
        assert all(torch.equal(model.get_buffer(n), b) for n, b in called.named_buffers())


def test_modes_that_couple_samples_or_cannot_be_replayed_are_refused():
    x = torch.randn(4, 3)
    batchnorm = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3, affine=False))
    bk = make(batchnorm)
    with pytest.raises(ValueError, match=r"module '1' \(BatchNorm1d\) is in training mode"):
        batchnorm(x)
    with torch.no_grad():
        batchnorm(x)  # evaluation in training mode trains nothing
    # without running statistics torch normalises by the batch in eval mode too (a review's repro: with the first
    # sample's check off, one sample removed moved the clipped sum by 1.34 C)
    untracked = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3, track_running_stats=False)).eval()
    bk = make(untracked, check_first_sample=False)
    with pytest.raises(ValueError, match=r"module '1' \(BatchNorm2d\) is without running statistics "
                                         r"\(track_running_stats=False\): it normalises with statistics of the whole"):
        untracked(torch.randn(4, 3, 2, 2))
    for affine in (False, True):  # its running statistics take the batch's, outside the noise (a review's repro)
        tracked = nn.Sequential(nn.Conv1d(3, 3, 1), nn.InstanceNorm1d(3, affine=affine, track_running_stats=True))
        bk = make(tracked)
        with pytest.raises(ValueError, match=r"module '1' \(InstanceNorm1d\) is in training mode with "
                                             r"track_running_stats=True: its forward writes the batch's statistics"):
            tracked(torch.randn(4, 3, 5))
        assert torch.equal(tracked[1].running_mean, torch.zeros(3))
        tracked.eval()
        bk.step(tracked(torch.randn(4, 3, 5)).sum((1, 2)))
    dropped = nn.Sequential(nn.Linear(3, 4), DroppedScale(4))
    bk = make(dropped)
    with pytest.raises(ValueError, match=r"module '1' \(DroppedScale\) .* random .*dropout '1.drop' in training"):
        bk.step(dropped(x).sum(1))
    dropped.eval()
    assert all(torch.isfinite(u).all() for u in bk.step(dropped(x).sum(1)))  # dropout is off in eval mode
    dropped = nn.Sequential(nn.Linear(3, 4), FunctionallyDropped(4))
    bk = make(dropped)
    with pytest.raises(ValueError, match=r"'1' \(FunctionallyDropped\) .* draws random numbers in its forward, "):
        bk.step(dropped(x).sum(1))
    dropped = MixtureOfExperts(indexed=True)  # replayed one sample at a time: the draws seen on the generator
    dropped.experts.register_forward_hook(lambda module, args, out: F.dropout(out, 0.2), prepend=True)
    bk = make(dropped)
    with pytest.raises(ValueError, match=r"'experts' \(Experts\) .* draws random numbers in its forward"):
        bk.step(dropped(torch.randn(4, 5, 3)).sum((1, 2)))
    with pytest.raises(ValueError, match="scale_grad_by_freq"):
        make(nn.Embedding(5, 2, scale_grad_by_freq=True))
    frozen = nn.Sequential(nn.Embedding(5, 2, scale_grad_by_freq=True).requires_grad_(False), nn.Linear(2, 1))
    make(frozen).step(frozen(torch.tensor([[1, 2], [3, 3]])).sum((1, 2)))  # no gradient to divide: accepted


class BagsOfWords(nn.Module):
    """torchtext's text classifier: an EmbeddingBag over each sample's tokens laid end to end, cut
    by offsets (with per-sample weights in mode "sum"), and a Linear."""

    def __init__(self, mode, padding_idx, include_last_offset):
        super().__init__()
        self.bag = nn.EmbeddingBag(9, 4, mode=mode, padding_idx=padding_idx, include_last_offset=include_last_offset)
        self.head = nn.Linear(4, 3)

    def forward(self, text, offsets, weights=None):
        return self.head(self.bag(text, offsets, per_sample_weights=weights))


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("mode, weighted, padding_idx, include_last_offset", [
    ("mean", False, None, False), ("mean", False, 0, True), ("sum", True, None, False), ("sum", False, 0, False)])
def test_an_embedding_bag_on_tokens_cut_by_offsets_is_book_kept(mode, weighted, padding_idx, include_last_offset,
                                                                 per_layer):
    """Each bag a sample (one of them empty, tokens repeated within and across bags, some at
    padding_idx): the update is the one of a backward pass per bag, each bag alone at offset 0.
    It was refused (the layer saw a batch of as many as the tokens)."""
    torch.manual_seed(0)
    model = BagsOfWords(mode, padding_idx, include_last_offset)
    lengths = [3, 0, 5, 2, 4]
    generator = torch.Generator().manual_seed(1)
    bags = [torch.randint(0, 4, (n,), generator=generator) for n in lengths]
    weights = [torch.rand(n, generator=generator) + 0.5 if weighted else None for n in lengths]
    target = torch.randn(len(bags), 3, generator=generator)

    def losses(bags, weights, target):
        starts = torch.tensor([0] + [len(b) for b in bags]).cumsum(0)
        offsets = starts if include_last_offset else starts[:-1]
        return regression(model(torch.cat(bags), offsets, torch.cat(weights) if weighted else None), target)

    params = trainable(model)
    rows = [torch.autograd.grad(losses([b], [w], target[i:i + 1]).sum(), params)
            for i, (b, w) in enumerate(zip(bags, weights))]
    grads = [torch.stack(column) for column in zip(*rows)]
    config = dpsgd.DPSGDConfig(clip_between(grads, per_layer), noise_multiplier=0.0, per_layer=per_layer)
    want = dpsgd.privatize(grads, config, 5.0, M.NoiseGenerator(5))
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(params, lr=0.0), config, expected_batch_size=5.0,
                           generator=M.NoiseGenerator(5))
    assert [type(layer) for layer in bk.layers] == [layers.EmbeddingBagLayer, layers.LinearLayer]
    assert_same_update(bk.step(losses(bags, weights, target)), want)


def test_an_embedding_bag_is_refused_where_its_bags_or_mode_are_not_the_rule_s():
    """Tokens after the last offset (include_last_offset=True) are in no bag: they were read as the
    last bag's, 31-63% off (a review's repro). Mode "max" set since BookKeeping was built was read
    as "sum", 154% off after the first step."""
    model = BagsOfWords("sum", None, include_last_offset=True)
    bk = make(model)  # noqa: F841 (its hooks live as long as it does)
    with pytest.raises(ValueError, match=r"module 'bag' \(EmbeddingBag\) has include_last_offset=True and got 7 "
                                         r"tokens, but its last offset is 5: the tokens after it are in no bag"):
        model(torch.arange(7) % 9, torch.tensor([0, 2, 5]))
    model.bag.mode = "max"
    with pytest.raises(ValueError, match=r"module 'bag' \(EmbeddingBag\) has mode='max', set since BookKeeping was "
                                         r"built"):
        model(torch.arange(5) % 9, torch.tensor([0, 2, 5]))


@pytest.mark.parametrize("kind", [nn.Embedding, nn.EmbeddingBag])
@pytest.mark.parametrize("trained", [True, False])
def test_an_embedding_that_renormalises_its_weights_in_place_is_refused(kind, trained):
    """max_norm renormalises in place the rows the batch's ids look up: which rows change is the
    data, outside the noise (a row only one sample looked up went from norm 4.71 to 1.02 with it in
    the batch, stayed at 4.70 without it). Refused by book-keeping and the materialised path,
    frozen too (its weights are released with the model)."""
    torch.manual_seed(0)
    model = nn.Sequential(kind(8, 3, max_norm=1.0).requires_grad_(trained), nn.Linear(3, 1))
    with pytest.raises(ValueError, match=rf"module '0' \({kind.__name__}\) has max_norm=1.0: its forward "
                                         "renormalises in place"):
        make(model)
    ids, target = torch.tensor([[1, 2], [3, 4]]), torch.zeros(2, 1)
    with pytest.raises(ValueError, match=rf"module '0' \({kind.__name__}\) has max_norm=1.0"):
        dpsgd.per_sample_gradients(model, lambda out, y: (out - y).pow(2).sum(), ids, target)
    if trained:  # set since BookKeeping was built: refused at the forward call (a review's repro took the step)
        model[0].max_norm = None
        bk = make(model)  # noqa: F841 (its hooks live as long as it does)
        model[0].max_norm = 1.0
        with pytest.raises(ValueError, match=rf"module '0' \({kind.__name__}\) has max_norm=1.0"):
            model(ids)


class Checkpointed(nn.Module):
    """An Embedding, a block of layers under activation checkpointing (``reentrant`` None: none),
    and a head: a transformer's usual layout."""

    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.embed = nn.Embedding(9, 4)
        self.block = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 4))
        self.head = nn.Linear(4, 3)

    def forward(self, ids):
        h = self.embed(ids)
        if self.reentrant is not None:
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=self.reentrant)
        else:
            h = self.block(h)
        return self.head(h)


def test_non_reentrant_activation_checkpointing_gives_the_update_without_it():
    torch.manual_seed(0)
    model = Checkpointed(reentrant=False)
    plain = copy.deepcopy(model)
    plain.reentrant = None
    generator = torch.Generator().manual_seed(1)
    x, target = ids((6, 5))(generator), torch.randn(6, 5, 3, generator=generator)
    grads = materialised_grads(plain, x, target)
    config = dpsgd.DPSGDConfig(clip_between(grads, False), noise_multiplier=0.7)
    want = dpsgd.privatize(grads, config, 6.0, M.NoiseGenerator(3))
    assert_same_update(book_kept(model, x, target, config, 6.0, M.NoiseGenerator(3)), want)


class CheckpointedConvolutions(nn.Module):
    """A block of convolutions with GroupNorms and a LayerScale-like channel scale (a parameter
    multiplied into the batch) under non-reentrant checkpointing, counting its forward runs."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(),
                                   nn.Conv2d(4, 4, 3, padding=1), nn.GroupNorm(2, 4))
        self.scale = ChannelScale(4)
        self.head = nn.Linear(4, 3)
        self.runs = 0

    def inner(self, x):
        self.runs += 1
        return self.scale(self.block(x))

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)
        return self.head(h.mean((2, 3)))


class ChannelScale(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, channels))

    def forward(self, x):
        return x * self.gamma.view(-1, 1, 1)


def test_checkpointed_group_norms_and_a_parameter_multiplied_into_the_batch_are_book_kept():
    """Under checkpointing, reading a GroupNorm's saved statistics in the forward recomputed the
    checkpointed region (a block with two ran 5 times, its extra runs' calls recorded), and the
    broadcast rule's node hook unpacked the product's saved factor, which checkpointing lets be
    unpacked once: the step crashed (CheckpointError; transformers' Llama with gradient
    checkpointing). The forward runs the block once, and the update is the one of a backward
    pass per sample."""
    torch.manual_seed(0)
    model = CheckpointedConvolutions()
    x, target = torch.randn(4, 2, 5, 5), torch.randn(4, 3)
    grads = one_backward_per_sample(model, x, target)
    config = dpsgd.DPSGDConfig(clip_between(grads, False), noise_multiplier=0.0)
    want = dpsgd.privatize(grads, config, 4.0, M.NoiseGenerator(3))
    bk = make(model, config, expected_batch_size=4.0, generator=M.NoiseGenerator(3))
    model.runs = 0
    losses = regression(model(x), target)
    assert model.runs == 1
    assert_same_update(bk.step(losses), want)


class SelfCheckpointed(nn.Module):
    """A block that checkpoints its own body, in which its parameter (a layer scale) is multiplied
    into the batch: its forward hook runs outside the checkpoint."""

    def __init__(self):
        super().__init__()
        self.fc, self.gamma = nn.Linear(4, 4), nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def body(self, x):
        return x + torch.tanh(self.fc(x)) * self.gamma

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)


def test_a_module_checkpointing_its_own_forward_around_its_parameter_s_product_is_book_kept():
    """Saved-tensor hooks were looked for at the module's forward hook, outside its checkpoint: the
    broadcast rule was taken, its node hook unpacked the product's saved factor, and the product's
    own backward could not (CheckpointError: a review's repro). A factor saved through hooks is
    now told by the saved tensor itself, and the module replayed; the update is the one of a
    backward pass per sample."""
    torch.manual_seed(0)
    model = nn.Sequential(SelfCheckpointed(), nn.Linear(4, 2))
    x, target = torch.randn(4, 4), torch.randn(4, 2)
    grads = one_backward_per_sample(model, x, target)
    config = dpsgd.DPSGDConfig(clip_between(grads, False), noise_multiplier=0.0)
    want = dpsgd.privatize(grads, config, 4.0, M.NoiseGenerator(3))
    assert_same_update(book_kept(model, x, target, config, 4.0, M.NoiseGenerator(3)), want)


def test_a_parameter_multiplied_into_the_batch_under_save_on_cpu_takes_the_broadcast_rule(monkeypatch):
    """save_on_cpu's saved tensors may be unpacked again: the product's factor is read, not
    replayed (any saved-tensor hooks in force took the replay, another forward and backward of the
    module, as checkpointing's must), and the update is the one of a backward pass per sample."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 1), ChannelScale(4), nn.Flatten(), nn.Linear(36, 2))
    x, target = torch.randn(4, 2, 3, 3), torch.randn(4, 2)
    grads = one_backward_per_sample(model, x, target)
    config = dpsgd.DPSGDConfig(clip_between(grads, False), noise_multiplier=0.0)
    want = dpsgd.privatize(grads, config, 4.0, M.NoiseGenerator(3))
    replays = replays_counted(monkeypatch)
    bk = make(model, config, expected_batch_size=4.0, generator=M.NoiseGenerator(3))
    with torch.autograd.graph.save_on_cpu():
        losses = regression(model(x), target)
    assert_same_update(bk.step(losses), want)
    assert replays == []


def test_a_shared_output_multiplied_into_the_batch_inside_a_checkpoint_is_refused():
    """A layer output the batch shares (a Linear of one conditioning vector, FiLM-style) takes
    each sample's gradient from the product's other factor, which a checkpoint lets be unpacked
    once, by the product's own backward: the step crashed (CheckpointError: a review's repro).
    Refused, naming the layer, before the backward; the same model without the checkpoint, or
    under ``save_on_cpu`` (whose saved tensors may be read twice), trains."""
    class Conditioned(nn.Module):
        def __init__(self, checkpointed):
            super().__init__()
            self.fc, self.film, self.checkpointed = nn.Linear(4, 4), nn.Linear(4, 4), checkpointed

        def body(self, x, condition):
            return torch.tanh(self.fc(x)) * self.film(condition)

        def forward(self, x, condition):
            if self.checkpointed:
                return torch.utils.checkpoint.checkpoint(self.body, x, condition, use_reentrant=False)
            return self.body(x, condition)

    x, target, condition = torch.randn(4, 4), torch.randn(4, 4), torch.randn(1, 4)
    for checkpointed, on_cpu in ((False, False), (False, True), (True, False)):
        model = Conditioned(checkpointed)
        bk = make(model)
        with torch.autograd.graph.save_on_cpu() if on_cpu else contextlib.nullcontext():
            losses = regression(model(x, condition), target)
        if checkpointed:
            with pytest.raises(ValueError, match=r"module 'film' \(Linear\) has an output that the batch shares, "
                                                 r"multiplied into the batch inside an activation checkpoint"):
                bk.step(losses)
        else:
            assert all(torch.isfinite(u).all() for u in bk.step(losses))
        bk.remove()


def test_reentrant_activation_checkpointing_is_refused():
    """Its forward runs without grad, so the hooks see nothing of the block: without the check its
    parameters got the noise alone (and the others' clip factors left out the block's norms)."""
    x = ids((4, 5))(torch.Generator().manual_seed(1))
    model = Checkpointed(reentrant=True)
    bk = make(model)
    with pytest.raises(ValueError, match=r"graph of per_sample_losses has reentrant activation checkpointing"):
        bk.step(model(x).pow(2).flatten(1).sum(1))
    # Nothing recorded below the block, so the backward to the recorded layers would not reach it:
    h = torch.randn(4, 5, 4, requires_grad=True)
    out = model.head(torch.utils.checkpoint.checkpoint(model.block, h, use_reentrant=True))
    with pytest.raises(ValueError, match=r"use_reentrant=False"):
        bk.step(out.pow(2).flatten(1).sum(1))


class RecomputedInBackward(torch.autograd.Function):
    """A block run without grad and run again in the backward pass, which backpropagates through it
    itself, filling its parameters' .grad (as Reformer's reversible layers do)."""

    @staticmethod
    def forward(ctx, x, block):
        ctx.save_for_backward(x)
        ctx.block = block
        with torch.no_grad():
            return block(x)

    @staticmethod
    def backward(ctx, grad):
        x = ctx.saved_tensors[0].detach().requires_grad_()
        with torch.enable_grad():
            torch.autograd.backward(ctx.block(x), grad)
        return x.grad, None


@pytest.mark.parametrize("check_first_sample", [True, False])
def test_parameters_a_custom_function_backpropagates_through_itself_are_refused(check_first_sample):
    """The block's uses are hidden from the losses' graph (its forward runs without grad): its
    parameters got the noise alone, silently without the first sample's check (a review's repro:
    Reformer's update 55% off). Its .grad, the batch's unclipped gradient, is not left behind."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    bk = make(model, check_first_sample=check_first_sample)
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"parameter '1.weight' got a .grad in the step's backward pass, from a "
                                         r"backward pass that something in the losses' graph runs itself"):
        bk.step(model[2](RecomputedInBackward.apply(model[0](x), model[1])).pow(2).sum(1))
    assert model[1].weight.grad is None and bk.steps == 0


@pytest.mark.parametrize("case, where", [
    ("multihead-attention", "the output of module '_orig_mod.attention' (MultiheadAttention)"),
    ("linear", "per_sample_losses"),
    ("position-modules", "the output of module '_orig_mod.shared' (LearnedPositions)")])
def test_a_forward_compiled_by_torch_compile_is_refused(case, where):
    """torch.compile (AOTAutograd, as its default backend inductor; "aot_eager" here needs no
    compiler) puts a compiled forward's ops in one autograd node: without the check an
    nn.MultiheadAttention's projections got the noise alone, silently (the in-place check, a
    position embedding's rule and the shared-output walk raised misleading errors on others). The
    same update uncompiled is test_every_layer_matches_the_materialised_update's."""
    torch._dynamo.reset()
    model, x, target = setting(case)
    compiled = torch.compile(model, backend="aot_eager")
    with pytest.raises(ValueError, match=rf"the graph of {re.escape(where)} has code compiled by torch.compile"):
        book_kept(compiled, x, target, CONFIGS["gaussian"](1.0, False), 4.5, M.NoiseGenerator(7))


class InPlaceResidual(nn.Module):
    """x += layer(x): the layer's recorded input changes after its forward call."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.head = inner, nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(x)
        h += self.inner(h)
        return self.head(h)


@pytest.mark.parametrize("inner", [nn.Linear(4, 4), Scale(4)], ids=["book-kept", "fallback"])
def test_an_input_changed_in_place_after_its_forward_is_refused(inner):
    """Autograd refuses a backward through a saved tensor changed in place; book-keeping reads its
    own recorded inputs in step(), and took the changed one silently."""
    model = InPlaceResidual(inner)
    bk = make(model)
    x = torch.randn(4, 4)
    with pytest.raises(ValueError, match=r"an input of module 'inner' \(\w+\) was modified in place"):
        bk.step(model(x).pow(2).sum(1))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):  # as plain torch
        model(x).pow(2).sum().backward()


class InPlaceOnOutput(nn.Module):
    """A layer whose output is a view of a result its forward made (a Linear with a bias on a
    sequence: addmm, then view, also one replayed for its weight_norm; an affine InstanceNorm:
    batch norm, then view), that output then
    changed in place: a residual ``h += x``, ``ReLU(inplace=True)``, a scale, a row of positions
    written."""

    CHANGES = {"residual": lambda h, x: h.add_(x), "relu": lambda h, x: nn.ReLU(inplace=True)(h),
               "scale": lambda h, x: h.mul_(2.0), "write": lambda h, x: h[:, 0].zero_()}
    LAYERS = {"linear": lambda: nn.Linear(4, 4), "instance-norm": lambda: nn.InstanceNorm1d(3, affine=True),
              "weight-normed-linear": lambda: nn.utils.parametrizations.weight_norm(nn.Linear(4, 4))}

    def __init__(self, change, layer="linear"):
        super().__init__()
        self.fc, self.head, self.change = self.LAYERS[layer](), nn.Linear(4, 2), self.CHANGES[change]

    def forward(self, x):
        h = self.fc(x)
        self.change(h, x)
        return self.head(h)


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("change", InPlaceOnOutput.CHANGES)
@pytest.mark.parametrize("layer", InPlaceOnOutput.LAYERS)
def test_a_layer_s_view_output_changed_in_place_is_book_kept(layer, change, per_layer):
    """The in-place op moved the output view's autograd history onto its base, the node whose
    gradient the layer had recorded left the graph, and the layer was refused as used out of its
    hooks' sight (a false refusal of an ordinary MLP); now the update is the one of a backward
    pass per sample."""
    torch.manual_seed(0)
    model = InPlaceOnOutput(change, layer)
    x, target = torch.randn(5, 3, 4), torch.randn(5, 3, 2)
    grads = one_backward_per_sample(model, x, target)
    config = dpsgd.DPSGDConfig(clip_between(grads, per_layer), noise_multiplier=0.0, per_layer=per_layer)
    want = dpsgd.privatize(grads, config, 5.0, M.NoiseGenerator(5))
    assert_same_update(book_kept(model, x, target, config, 5.0, M.NoiseGenerator(5)), want)


def test_a_view_output_that_a_global_hook_saw_first_is_not_aliased():
    """A global forward hook runs before the layer's hooks and sees the view itself: the output is
    handed on unchanged (an alias would have a version counter of its own, and the hook's use
    would reach the product around the node where book-keeping takes the gradient, a review's
    repro 37-60% off). Read out of place it is book-kept; changed in place it is refused."""
    penalty = []

    def record_penalty(module, args, output):
        if isinstance(module, nn.Linear) and module.out_features == 4:
            penalty.append(output.pow(2).mean((1, 2)))

    torch.manual_seed(0)
    x, target = torch.randn(5, 3, 4), torch.randn(5, 3, 2)

    def losses(model, x, target):
        penalty.clear()
        return regression(model(x), target) + penalty[0]

    handle = nn.modules.module.register_module_forward_hook(record_penalty)
    try:
        model = InPlaceOnOutput("scale")
        model.change = lambda h, x: None
        params = trainable(model)
        rows = [torch.autograd.grad(losses(model, x[i:i + 1], target[i:i + 1]).sum(), params) for i in range(5)]
        grads = [torch.stack(column) for column in zip(*rows)]
        config = dpsgd.DPSGDConfig(clip_between(grads, False), noise_multiplier=0.0)
        want = dpsgd.privatize(grads, config, 5.0, M.NoiseGenerator(5))
        bk = dpsgd.BookKeeping(model, torch.optim.SGD(params, lr=0.0), config, expected_batch_size=5.0,
                               generator=M.NoiseGenerator(5))
        for _ in range(2):  # the first sample's check runs at the first step only
            got = bk.step(losses(model, x, target))
        assert_same_update(got, want)
        model.change = InPlaceOnOutput.CHANGES["relu"]
        with pytest.raises(ValueError, match=r"the output of module 'fc' \(Linear\) was changed in place"):
            bk.step(losses(model, x, target))
    finally:
        handle.remove()


class ScaledView(nn.Module):
    """No rule (replayed): returns a view of the product it makes."""

    def __init__(self):
        super().__init__()
        self.log_scale = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return (x * self.log_scale.exp()).flatten(1)[:, :].view(x.shape)


@pytest.mark.parametrize("used_before", [False, True])
def test_a_replayed_module_s_view_output_changed_in_place_is_refused_as_such(used_before):
    """Where the output cannot be taken another way (a replayed module's forward is the user's),
    the refusal says what happened: the message blamed a use outside the module's forward, and
    where the output was also used before the change (``u = h * 3; h.relu_()``) the counts agreed
    and the update was 7% off (a review's repro)."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.scaled, self.head = ScaledView(), nn.Linear(4, 2)

        def forward(self, x):
            h = self.scaled(x)
            u = h * 3 if used_before else 0
            h.relu_()
            return self.head(h + u)

    model = Model()
    with pytest.raises(ValueError, match=r"the output of module 'scaled' \(ScaledView\) was changed in place after "
                                         r"its forward call .*view"):
        make(model).step(model(torch.randn(4, 3, 4)).pow(2).sum((1, 2)))


def test_a_layer_that_forms_its_rows_in_the_backward_lets_its_input_go():
    """A LayerNorm forms its per-sample gradients as the backward reaches it and drops its input:
    by the time the backward reaches the layer below, nothing of book-keeping's holds that input
    (the in-place check held it to the end of the step: CIFAR's peak 8 MB higher at B 64)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    bk = make(model)
    h = model[0](torch.randn(5, 3))
    out = model[1](h)
    (norm,) = [layer for layer in bk.layers if layer.module is model[1]]
    recorded = weakref.ref(norm.calls[0])
    alive = []
    h.register_hook(lambda grad: alive.append(recorded() is not None))
    bk.step(out.pow(2).sum(1))
    assert alive == [True, False]  # first the first sample's check, whose backward takes nothing


def test_a_layer_s_input_and_output_gradient_go_before_the_next_layer_s_sum():
    """The clip forms the layers' sums in turn, each after the layer before let go of its input
    and output gradient: nothing of book-keeping's holds them on (the ghost norms' inputs and the
    backward's results, held through the sums, added the model's activations to the clip's peak:
    69M transformer, B 8, 1.35x the non-private step's peak RSS)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # ghost norms at T = 3: 2 T^2 < 8 x 8
    bk = make(model)
    first, second = bk.layers
    held, alive = [], []

    def first_sums(factors, keep, norm_type, original=first.sums_by_parameter):
        held.extend(weakref.ref(t) for t in (first.calls[0], first.grads[0]))
        return original(factors, keep, norm_type)

    def second_sums(factors, keep, norm_type, original=second.sums_by_parameter):
        alive.extend(ref() is not None for ref in held)
        return original(factors, keep, norm_type)

    first.sums_by_parameter, second.sums_by_parameter = first_sums, second_sums
    bk.step(model(torch.randn(5, 3, 8)).pow(2).sum((1, 2)))
    assert alive == [False, False]


class BroadcastUses(nn.Module):
    """Parameters of the model itself beside its layers, used as ``use`` says: a class token cls
    (1, 1, 4) expanded over the batch and prepended, a position embedding p (1, 5, 4) (or repeated
    over the batch, as peft's prompt tuning repeats its prompts) or views of
    a longer one (1, 7, 4) and of a transposed one (4, 5), and a bias q (4,) added; p or q (or a
    view) multiplying the batch, shifted by a constant first (Gemma's RMSNorm: x * (1 + w)); a
    difference, product or quotient (by a tensor without grad) of parameters of one shape before
    the batch comes in (the op passes its output gradient on, times the other factor). A
    flip (no view), and a sum or product of parameters of different shapes before the batch
    comes in take the replay."""

    def __init__(self, use, dropout=0.0):
        super().__init__()
        self.use = use
        self.inp, self.out, self.drop = nn.Linear(3, 4), nn.Linear(4, 2), nn.Dropout(dropout)
        self.cls = nn.Parameter(torch.randn(1, 1, 4))
        self.p, self.q = nn.Parameter(torch.randn(1, 5, 4)), nn.Parameter(torch.randn(4))
        self.long, self.turned = nn.Parameter(torch.randn(1, 7, 4)), nn.Parameter(torch.randn(4, 5))

    def forward(self, x):
        h = torch.cat([self.cls.expand(len(x), -1, -1), self.drop(self.inp(x))], 1)
        h = {"add": lambda: h + self.p + self.q,
             "alpha": lambda: torch.add(h, self.p, alpha=2.5) - self.q,
             "subtrahend": lambda: torch.sub(self.p, h, alpha=0.5) + self.q,
             "twice": lambda: (h + self.p) * 0.5 + self.p + self.q,
             "slice": lambda: h + self.long[:, -5:] - self.long[:, 2:3] + self.q,
             "whole slice": lambda: h + self.p[:, :h.shape[1]] + self.q,
             "views": lambda: h + self.long[:, 1:][:, :5] + self.turned.t()[None] - self.q.unsqueeze(0)[0],
             "flip": lambda: h + self.p.flip(1) + self.q,
             "product": lambda: h * self.p + self.q,
             "products": lambda: self.q * (h * self.long[:, 2:] * self.p) - self.q,
             "shifted product": lambda: h * (1.0 + self.q) + self.p,
             "doubled": lambda: h + torch.sub(self.p, self.long[:, 2:], alpha=3.0) + self.p + self.q,
             "product of parameters": lambda: h + self.p * self.long[:, 2:] / self.long[:, 2:].detach().exp() + self.q,
             "repeat": lambda: h + self.p.repeat(len(h), 1, 1) + self.q.repeat(len(h), 1, 1),
             "tiled": lambda: h + self.p.repeat(len(h), 1, 1) + self.long[:, :5, :2].repeat(len(h), 1, 2) + self.q,
             "unbatched": lambda: h + (self.p + self.q),
             "unbatched product": lambda: h + self.p * self.q}[self.use]()
        return self.out(torch.tanh(h)).mean(1)


@pytest.mark.parametrize("use, replayed", [("add", False), ("alpha", False), ("subtrahend", False),
                                            ("twice", False), ("slice", False), ("whole slice", False),
                                            ("views", False), ("product", False), ("products", False),
                                            ("shifted product", False), ("doubled", False),
                                            ("product of parameters", False), ("repeat", False), ("tiled", True),
                                            ("flip", True), ("unbatched", True), ("unbatched product", True)])
def test_parameters_broadcast_over_the_batch_need_no_replay(use, replayed, monkeypatch):
    """Their per-sample gradients come from the ops' output gradients; any other use replays the
    model (with a warning naming the parameters); both give the materialised update."""
    torch.manual_seed(0)
    model = BroadcastUses(use)
    generator = torch.Generator().manual_seed(1)
    x, target = torch.randn(6, 4, 3, generator=generator), torch.randn(6, 2, generator=generator)
    grads = materialised_grads(model, x, target)
    config = dpsgd.DPSGDConfig(clip_between(grads, False), noise_multiplier=0.7)
    want = dpsgd.privatize(grads, config, 6.0, M.NoiseGenerator(5))
    replays = replays_counted(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = book_kept(model, x, target, config, 6.0, M.NoiseGenerator(5))
    assert_same_update(got, want)
    assert bool(replays) == replayed
    notes = [str(w.message) for w in caught if "replay its whole forward" in str(w.message)]
    assert len(notes) == replayed
    if replayed:
        assert re.search(r"module '' \(BroadcastUses\) has trainable parameters of its own \(cls, p, q, long, "
                         r"turned\) .* its layers \(inp, out\) included; put", notes[0])


class PositionTables(nn.Module):
    """A parameter made into a table over the positions, (T, d) or (T, T), with no batch in it,
    then added to the batch: expanded (p.expand(T, d)), scaling a fixed table (s * table[:T]), a
    learned distance penalty on attention scores (ALiBi's alpha * -|i - j|), or a learned scale
    of position embeddings (nanoGPT's wpe(arange(T)) * g); a table viewed as (1, T, d) first."""

    def __init__(self, use):
        super().__init__()
        self.use = use
        self.inp, self.out = nn.Linear(3, 4), nn.Linear(4, 2)
        self.wpe = nn.Embedding(8, 4)
        self.p, self.s, self.g = nn.Parameter(torch.randn(1, 4)), nn.Parameter(torch.ones(())), nn.Parameter(
            torch.rand(4) + 0.5)
        self.register_buffer("table", torch.randn(8, 4))

    def forward(self, x):
        h = self.inp(x)
        positions = h.shape[1]
        if self.use == "expanded":
            h = h + self.p.expand(positions, -1)
        elif self.use == "scaled table":
            h = h + self.s * self.table[:positions]
        elif self.use == "scaled table, viewed":
            h = h + (self.s * self.table[:positions])[None]
        elif self.use in ("scaled table, reciprocal", "scaled table, atan"):  # ops of no list of book-keeping's
            scaled = self.s * self.table[:positions]
            h = h + (scaled.abs().add(1).reciprocal() if self.use.endswith("reciprocal") else scaled.atan())
        elif self.use == "expanded, viewed":
            h = h + self.p.expand(positions, -1).unsqueeze(0)
        elif self.use == "distance penalty":
            distance = (torch.arange(positions)[None] - torch.arange(positions)[:, None]).abs().float()
            h = torch.softmax(h @ h.transpose(1, 2) + self.s * -distance, -1) @ h
        else:
            h = h + self.wpe(torch.arange(positions)) * self.g
        return self.out(torch.tanh(h)).mean(1)


@pytest.mark.parametrize("use", ["expanded", "scaled table", "distance penalty", "embedding scale",
                                 "scaled table, viewed", "expanded, viewed", "scaled table, reciprocal",
                                 "scaled table, atan"])
def test_a_parameter_s_table_over_the_positions_is_not_read_as_the_batch_where_t_is_b(use):
    """Its dim 0 is positions: at T = B the broadcast rule read them as samples (the op that
    made the table took the use, its output's dim 0 of the batch's size), each position clipped
    as a sample, and a sample's share of the update reached T times C. Now a use whose output an
    elementwise op above broadcasts over new leading dims (through views too: [None] had hidden
    it; through any op keeping its shape: a reciprocal or an atan had, a review's repro at 3 C)
    is no broadcast over the batch: the module is replayed, as at every other T. Without the
    first sample's check, which had caught these at a first batch of B = T."""
    torch.manual_seed(0)
    model = PositionTables(use)
    generator = torch.Generator().manual_seed(1)
    x, target = torch.randn(5, 5, 3, generator=generator), torch.randn(5, 2, generator=generator)
    grads = materialised_grads(model, x, target)
    config = dpsgd.DPSGDConfig(clip_between(grads, False), noise_multiplier=0.0)
    want = dpsgd.privatize(grads, config, 5.0, M.NoiseGenerator(5))
    bk = make(model, config, expected_batch_size=5.0, generator=M.NoiseGenerator(5), check_first_sample=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "module '' .* replay its whole forward")
        assert_same_update(bk.step(regression(model(x), target)), want)


class FlattenedScale(nn.Module):
    """A module's own scale multiplying the batch flattened with its positions, (B T, d)."""

    def __init__(self):
        super().__init__()
        self.gamma = nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, h):
        return h * self.gamma


def test_a_parameter_broadcast_over_the_flattened_batch_is_replayed():
    """The broadcast rule's rows of a call on the batch flattened with its positions are B T rows,
    one a position: the clip kernel refused them with a message of its own (B = 4, 24 rows). The
    call is replayed, its batch unflattened."""
    torch.manual_seed(0)
    model = nn.ModuleDict(dict(inp=nn.Linear(3, 4), scale=FlattenedScale(), out=nn.Linear(4, 2)))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = model

        def forward(self, x):
            h = self.layers["scale"](self.layers["inp"](x).reshape(-1, 4)).view(*x.shape[:2], 4)
            return self.layers["out"](torch.tanh(h)).mean(1)

    whole = Model()
    generator = torch.Generator().manual_seed(1)
    x, target = torch.randn(4, 6, 3, generator=generator), torch.randn(4, 2, generator=generator)
    assert_book_kept_as_materialised(whole, x, target)


def test_adapters_replay_only_the_module_using_its_parameters_otherwise(monkeypatch):
    """DoRA's magnitude (divided by the detached norms, then viewed as a row) and the
    ParameterList's scales take their ops' output gradients; the LoRA embedding, whose A and B are
    used by a lookup and a product, is replayed, the dropout it does not run no matter; the calls
    on the identity matrix get no gradient and are passed over."""
    replays = []
    replay = layers.FunctionalLayer.per_sample_grads
    monkeypatch.setattr(layers.FunctionalLayer, "per_sample_grads",
                        lambda self, batch, *chunk: replays.append(self.name) or replay(self, batch, *chunk))
    model = compare("adapters", "gaussian", per_layer=True)
    assert replays == ["embed"]
    assert model.embed.training and model.embed.unused.p > 0


def test_dropout_beside_broadcast_parameters_needs_no_replay():
    """Dropout cannot be replayed; with broadcast uses nothing is, and with others it is refused."""
    x = torch.randn(6, 4, 3)
    model = BroadcastUses("add", dropout=0.5)
    update = make(model).step(model(x).pow(2).sum(1))
    assert all(torch.isfinite(u).all() for u in update)
    model = BroadcastUses("unbatched", dropout=0.5)
    bk = make(model)
    with pytest.raises(ValueError, match=r"module '' \(BroadcastUses\) is recomputed .* random .*dropout 'drop'"):
        bk.step(model(x).pow(2).sum(1))


def test_a_layer_called_with_its_input_as_a_keyword_is_recorded():
    model, x, target = setting("linear")
    config = dpsgd.DPSGDConfig(0.3)
    want = dpsgd.privatize(materialised_grads(model, x, target), config, 6.0, M.NoiseGenerator(0))
    bk = make(model, config, expected_batch_size=6.0, generator=M.NoiseGenerator(0))
    out = model[2](input=torch.tanh(model[0](input=x)))
    assert_same_update(bk.step(regression(out, target)), want)


def test_remove_takes_the_hooks_off():
    model, x, target = setting("linear")
    bk = make(model)
    bk.remove()
    model(x)
    assert all(not layer.calls for layer in bk.layers)
    assert not any(m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("forming", list(layers.Forming), ids=lambda f: f.name.lower())
@pytest.mark.parametrize("case", ["conv1d", "conv2d", "conv-twice", "conv-transpose", "conv-transpose-1d",
                                  "groupnorm"])
def test_every_way_of_holding_a_convolution_matches(case, forming, monkeypatch):
    """On the per-sample side of the mixed rule a convolution forms its per-sample gradients in the
    backward pass (dropping its inputs) or after it, or keeps its inputs and output gradients for a
    weight-gradient convolution of the clipped sum: each gives the materialised update."""
    asked = []

    def when_to_form(per_sample, held):
        asked.append((per_sample, held))
        return forming

    monkeypatch.setattr(layers, "use_ghost_norm", lambda *sizes: False)
    monkeypatch.setattr(layers, "when_to_form", when_to_form)
    for mechanism in ("gaussian", "laplace"):
        for per_layer in (False, True):
            compare(case, mechanism, per_layer)
    assert asked


@pytest.mark.parametrize("saved", [True, False], ids=["forward-statistics", "normalised-again"])
def test_groupnorm_from_the_forward_statistics_or_normalising_again_matches(saved, monkeypatch):
    """GroupNorm's weight rows come from the mean and 1 / sigma its forward saved for the backward,
    or, where the forward saved none (another implementation), from x normalised again: both give
    the materialised update, and a plain nn.GroupNorm takes the first way."""
    if not saved:
        monkeypatch.setattr(layers.GroupNormLayer, "saved_statistics", ("_saved_nothing", "_saved_nothing"))
    seen = []
    record = layers.GroupNormLayer.record

    def spy(self, *args):
        outputs = record(self, *args)
        seen.extend(s is not None for s in self.statistics)
        return outputs

    monkeypatch.setattr(layers.GroupNormLayer, "record", spy)
    for mechanism in ("gaussian", "laplace"):
        for per_layer in (False, True):
            compare("groupnorm", mechanism, per_layer)
    assert seen and all(s == saved for s in seen)


class RepeatedInput(nn.Module):
    """A Linear on two positions of one input (a repeated token), their outputs weighed by scale
    and -(scale + 1) in the loss: the weight's gradient is that of the difference, (-1) x a^T, which
    the ghost norm's sum over the position pairs loses to cancellation as the scale grows."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, scale):
        h = self.linear(x.expand(-1, 2, -1))
        return (scale * h[:, 0]).sum(1) - ((scale + 1.0) * h[:, 1]).sum(1)


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_a_ghost_norm_that_cancels_is_clipped_to_its_clip_norm(check):
    """Four alike samples, no noise: the update is the sample's clipped gradient, of norm C = 1. The
    ghost norm's rounding error, relative to (sum_t |a_t| |g_t|)^2, came to the norm's size at a
    scale of 1e3 (the sample clipped at 0.58) and passed it at 1e4 (0, and 169 times C released).
    Vouched for (:func:`privleak.dpsgd.ghost_norm.vouched`), the update's norm is C, under it by the
    bound's 2^-4 at most; not over it: the samples whose norms were computed again in float64 are
    summed apart in float64 too (:func:`privleak.dpsgd.layers.clipped_weight_sum`), where the
    float32 GEMM, which cancels as the norm does, released 1 + 7e-4 at 1e4 and 1 + 1.1e-2 at 1e6.
    The first sample's check holds up to 1e5. At 1e6 the check's reference, that sample's own
    float32 backward pass, cancels too (scale x 2^-24 of the norm: 521.7 for 548.9 on an AMD EPYC
    with AVX-512, under the kernel's raised 558.4 by more than the check's margin), and the check
    is off, as its error message then says."""
    torch.manual_seed(0)
    x = torch.randn(1, 1, 4).expand(4, 1, 4) * 100
    for scale in (1e2, 1e3, 1e4, 1e5) + (() if check else (1e6,)):
        model = RepeatedInput()
        bk = make(model, dpsgd.DPSGDConfig(1.0, noise_multiplier=0.0), check_first_sample=check)
        released = torch.cat([u.flatten() for u in bk.step(model(x, scale))]).double().norm()
        assert 1 - 2.0**-5 <= released <= 1 + 2.0**-20, (scale, released)


@pytest.mark.parametrize("pixels", [True, False], ids=["pixel-gram", "patches"])
def test_a_convolution_s_ghost_norm_that_cancels_is_clipped_to_its_clip_norm(pixels, monkeypatch):
    """RepeatedInput for a convolution: its input constant over the pixels (every patch alike),
    the loss's weights scale * v and -scale * v over the 16 output positions, plus v at one (the
    gradient is that of v alone). Four alike samples, no noise: the update's norm is C, not over
    it, on either ghost-norm path: the samples whose norms were computed again in float64 (all
    of these, by a factor of 160 or more) have their weight gradient summed apart in float64, where
    the float32 one had released 1 + 7.5e-6 at a scale of 1e3 (patches)."""
    monkeypatch.setattr(ghost_norm, "pixel_gram_pays", lambda *sizes: pixels)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 1, 1, generator=generator).expand(4, 32, 6, 6)
    v = torch.randn(32, generator=generator)
    for scale in (1e2, 1e3, 1e4, 1e5):
        w = ((scale * v)[:, None] * torch.tensor([1.0, -1.0] * 8)).reshape(1, 32, 4, 4).repeat(4, 1, 1, 1)
        w[:, :, 3, 3] += v
        model = CancellingConv()
        bk = make(model, dpsgd.DPSGDConfig(1.0, noise_multiplier=0.0), check_first_sample=False)
        released = torch.cat([u.flatten() for u in bk.step(model(x, w))]).double().norm()
        assert 1 - 2.0**-4 <= released <= 1 + 2.0**-20, (scale, released)


@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "transposed"])
def test_a_clipped_sum_adds_the_samples_it_lost_apart_in_float64(transposed):
    """clipped_weight_sum with rows in ``lost``: those samples' terms by a float64 product, the
    others' by the float32 GEMM, a dropped sample (NaN) left out; against the float64 sum. Sample
    1's output gradients cancel to 1e-6 of their size over its two equal inputs: the float32 GEMM
    alone is off by 1.2% of the sum, the sum that takes it apart by 5e-8."""
    generator = torch.Generator().manual_seed(0)
    a, g = torch.randn(4, 2, 5, generator=generator), torch.randn(4, 2, 6, generator=generator)
    a[1, 1] = a[1, 0]
    g[1, 1] = -g[1, 0] + 1e-6 * torch.randn(6, generator=generator)
    g[1] *= 1e6
    a[3, 0, 0] = float("nan")
    factors, keep = torch.rand(4, generator=generator), torch.tensor([True, True, True, False])
    want = sum(factors[i].double() * g[i].double().T @ a[i].double() for i in range(3))
    want = want.T if transposed else want
    got = layers.clipped_weight_sum(a, g, factors, keep, 2, transposed=transposed, lost=[torch.tensor([1, 3])])
    alone = layers.clipped_weight_sum(a, g, factors, keep, 2, transposed=transposed)
    assert (got.double() - want).norm() <= 1e-6 * want.norm()
    assert (alone.double() - want).norm() >= 100 * (got.double() - want).norm()


class CancellingLinear(nn.Module):
    """A Linear whose output gradients are the loss's weights w: sum_t w_t . h_t."""

    def __init__(self, d, p):
        super().__init__()
        self.linear = nn.Linear(d, p, bias=False)

    def forward(self, x, w):
        return (self.linear(x) * w).sum((1, 2))


class CancellingConv(nn.Module):
    """A 3 x 3 convolution of 32 channels at 6 x 6 (no padding), weighted as CancellingLinear: its
    per-sample gradients are 5.5 times what it holds, so they are never formed whole
    (:func:`~privleak.dpsgd.layers.when_to_form`) and, under L1 norms, the norms come from them a
    few samples at a time."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(32, 32, 3, bias=False)

    def forward(self, x, w):
        return (self.conv(x) * w).sum((1, 2, 3))


class TanhConv(nn.Conv2d):
    """CancellingConv's convolution with the weight tanh(theta): a computed weight, not standardised
    (ComputedWeightConvLayer, norms from J^T G_i(w) a few samples at a time)."""

    def forward(self, x):
        return F.conv2d(x, torch.tanh(self.weight))


class CancellingEmbedding(nn.Module):
    """An Embedding weighted as CancellingLinear."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(4, 16)

    def forward(self, ids, w):
        return (self.embedding(ids) * w).sum((1, 2))


def _cancelling(kind, size, magnitude, generator):
    """Batch of 8 whose sample 0's inputs have entries of ``magnitude`` and output gradients that
    cancel over them exactly in float64 (orthogonal to the inputs' columns: a Linear's T x d
    inputs; a convolution's constant pixels, so every patch is alike, and gradients of mean 0
    over the positions), so its weight gradient is float32 rounding alone; the other samples'
    inputs are 0, so the update is sample 0's share (an Embedding's: one token at all 16 positions
    of sample 0, the others' output gradients 0)."""
    if kind == "embedding":
        ids = torch.zeros(8, 16, dtype=torch.long)
        ids[0] = 1
        w = torch.zeros(8, 16, 16, dtype=torch.float64)
        w[0] = torch.randn(16, 16, generator=generator, dtype=torch.float64) * magnitude
        return CancellingEmbedding(), ids, (w - w.mean(1, keepdim=True)).float()
    if kind == "linear":
        d, p, positions = size
        x = torch.zeros(8, positions, d, dtype=torch.float64)
        x[0] = torch.randn(positions, d, generator=generator, dtype=torch.float64) * magnitude
        w = torch.randn(8, positions, p, generator=generator, dtype=torch.float64)
        q = torch.linalg.qr(x[0])[0]
        w[0] -= q @ (q.T @ w[0])
        return CancellingLinear(d, p), x.float(), w.float()
    pixels = 12 if kind == "standardised" else 6  # at 12 x 12 the standardised form's G_i(w) come in chunks
    x = torch.zeros(8, 32, pixels, pixels)
    x[0] = (torch.randn(32, 1, 1, generator=generator) * magnitude).expand(32, pixels, pixels)
    w = torch.randn(8, 32, pixels - 2, pixels - 2, generator=generator, dtype=torch.float64)
    model = CancellingConv()
    if kind == "computed-weight":
        model.conv = TanhConv(32, 32, 3, bias=False)
    if kind == "standardised":  # its bias's gradient, the output gradients summed, cancels too
        model.conv = StandardizedConv2d(32, 32, 3)
    return model, x, (w - w.mean((2, 3), keepdim=True)).float()


@pytest.mark.parametrize("kind, mechanism", [("linear", "gaussian"), ("linear", "laplace"), ("conv", "laplace"),
                                             ("computed-weight", "gaussian"), ("standardised", "gaussian"),
                                             ("embedding", "gaussian"), ("embedding", "laplace")])
def test_a_gradient_formed_for_its_norm_is_the_one_its_sum_adds(kind, mechanism):
    """Where a layer's norms come from its per-sample gradients formed (a Linear at 2 T^2 >= d p
    or under L1 norms; a convolution's, or a computed weight's J^T G_i(w) or its standardised
    form's G_i(w), a few samples at a time; an Embedding's rows; a bias's rows), its clipped sum
    adds the same ones (:func:`privleak.dpsgd.layers.formed_sums`), so a sample's share of the
    update is at most C whatever cancels in its gradient. The sum was one GEMM over the batch (the
    convolution's weight gradient, J^T of it, the Embedding's of the scaled output gradients, the
    scaled output gradients summed), which rounds its own way: on gradients that are float32
    rounding alone (:func:`_cancelling`) sample 0's share reached 1.75 times C (Linear, L2), 2.19
    times (L1), 1.19 times (convolution, L1), 1.30 times (tanh weight, L2), 1.13 times
    (standardised weight with its gain and bias, L2) and 1.43 times (Embedding, L1) in these seeds;
    an Embedding's L2 norm was its ghost norm, the rows summed in float64, and its share reached
    2.74 times C."""
    shapes = [(2, 2, 4), (4, 4, 8), (8, 8, 16), (64, 64, 128)] if kind == "linear" else [None]
    config = dpsgd.DPSGDConfig(1.0, noise_multiplier=1e-12 if mechanism == "laplace" else 0.0, mechanism=mechanism)
    shares = []
    for size in shapes:
        for magnitude in (1e4, 1.7e7):
            for seed in range(6):
                model, x, w = _cancelling(kind, size, magnitude, torch.Generator().manual_seed(seed))
                bk = make(model, config, expected_batch_size=8, check_first_sample=False)
                update = torch.cat([u.flatten() for u in bk.step(model(x, w))]).double() * 8
                shares.append(float(update.norm(p=config.mechanism.clip_norm_type)))
    assert max(shares) <= 1 + 2.0**-14, max(shares)
    assert sum(share > 0.5 for share in shares) >= len(shares) // 2  # most are rounding larger than C, clipped


class SquaredWeightConv2d(nn.Conv2d):
    """A weight computed in ``_conv_forward`` (coremltools' custom-layer example), not in forward."""

    def _conv_forward(self, x, weight, bias):
        return super()._conv_forward(x, weight ** 2, bias)


class HandPaddedConv2d(nn.Conv2d):
    """Circular padding by hand in ``_conv_forward``, the module's padding left to it."""

    def _conv_forward(self, x, weight, bias):
        h, w = self.padding
        x = torch.cat([x[..., -w:], x, x[..., :w]], -1)
        return F.conv2d(torch.cat([x[..., -h:, :], x, x[..., :h, :]], -2), weight, bias, self.stride, 0,
                        self.dilation, self.groups)


@pytest.mark.parametrize("kind", [SquaredWeightConv2d, HandPaddedConv2d])
def test_a_convolution_of_its_own_in_conv_forward_takes_the_computed_weight_rule(kind):
    """Overriding ``_conv_forward`` is overriding the forward: read by the convolution rule with the
    module's padding and its parameter as the weight, the update was 1.28 and 0.54 off, relative."""
    torch.manual_seed(0)
    model = nn.Sequential(kind(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(75, 2))
    generator = torch.Generator().manual_seed(1)
    x, target = torch.randn(4, 2, 5, 5, generator=generator), torch.randn(4, 2, generator=generator)
    assert type(make(copy.deepcopy(model)).layers[0]) is computed_weight.ComputedWeightConvLayer
    assert_book_kept_as_materialised(model, x, target)


@pytest.mark.parametrize("conv, x", [(nn.Conv2d(3, 3, 3, padding=1), torch.randn(3, 5, 5)),
                                     (nn.Conv1d(3, 3, 3, padding=1), torch.randn(3, 7)),
                                     (nn.ConvTranspose1d(3, 3, 3), torch.randn(3, 7))], ids=["2d", "1d", "transposed"])
def test_a_convolution_of_an_input_without_a_batch_is_refused(conv, x):
    """torch convolves an input without a batch as one sample; with as many channels as the batch
    has samples, its rows had reached the kernels as samples, which failed with their own messages."""
    bk = make(nn.Sequential(conv))
    with pytest.raises(ValueError, match=rf"module '0' \({type(conv).__name__}\) got an input of shape "
                                         rf"\({', '.join(map(str, x.shape))}\), without a batch"):
        conv(x)
    assert not bk.layers[0].calls


@pytest.mark.parametrize("layer", [lambda: nn.Conv2d(2, 3, 3, padding=1), lambda: nn.Linear(5, 3)],
                         ids=["conv", "linear"])
def test_a_forward_hook_that_changes_a_layer_s_output_is_after_book_keeping_s(layer):
    """A hook registered before the build that returns o * 3 had run before book-keeping's, whose
    output gradients were then taken at the changed output, a third of the layer's own."""
    torch.manual_seed(0)
    model = nn.Sequential(layer(), nn.Tanh(), nn.Flatten(), nn.LazyLinear(2))
    model[0].register_forward_hook(lambda module, args, output: output * 3)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2, 5, 5, generator=generator) if isinstance(model[0], nn.Conv2d) else torch.randn(
        4, 6, 5, generator=generator)
    model(x)  # the lazy head's size
    assert_book_kept_as_materialised(model, x, torch.randn(4, 2, generator=generator))


@pytest.mark.parametrize("norm_type", [1, 2])
def test_the_norms_of_formed_gradients_are_the_clip_kernel_s_to_its_precision(norm_type):
    """Formed per-sample gradients' norms clip the very gradients their sum adds: norms under the
    exact ones let a sample past C. torch's float32 reduction of a whole row of 2.4M values
    erred by 3.5e-4 of its L1 norm and 4e-5 of its L2 norm, under (a Conv2d of 512 channels was
    released at 1 + 4e-4 times C); added 256 values at a time in float32 and the rest in float64,
    as the fused clip kernel adds its lanes, within 1e-6, as the kernel's own."""
    rows = torch.rand(3, 2_400_007, generator=torch.Generator().manual_seed(0)) * 2 - 1
    exact = torch.linalg.vector_norm(rows.double(), ord=norm_type, dim=1) ** norm_type
    for got in (layers.row_norms(rows, norm_type), layers.row_norms(rows.t().contiguous().t(), norm_type)):
        assert float(((got - exact) / exact).abs().max()) < 1e-6
    kernel = dpsgd.clip_and_accumulate([rows], 1.0, norm_type=norm_type).norms
    assert float(((kernel.double() ** norm_type - exact) / exact).abs().max()) < 1e-6


def _tied_and_cancelling(width: int, rest: float, seed: int):
    """An Embedding of rows of norm about 1.6e4 and the head tied to it, the hidden state mixed by
    a frozen matrix M = antisymmetric + ``rest`` I: the loss E[id]^T M E[id] has the gradient
    (M + M^T) E[id] = 2 ``rest`` E[id], while the embedding's and the head's own are 1 / ``rest``
    times that and cancel (a reviewer's construction). The model, its forward pass (the loss at
    id 3), and the exact norm of that gradient."""
    torch.manual_seed(seed)
    embed, head = nn.Embedding(16, width), nn.Linear(width, 16, bias=False)
    head.weight = embed.weight
    with torch.no_grad():
        embed.weight.mul_(2.0**14)
    antisymmetric = torch.randn(width, width)
    mixing = (antisymmetric - antisymmetric.T) / math.sqrt(2 * width) + rest * torch.eye(width)
    exact = ((mixing + mixing.T).double() @ embed.weight[3].detach().double()).norm()
    ids = torch.tensor([[3]])
    return (nn.ModuleDict(dict(embed=embed, head=head)),
            lambda: head(embed(ids) @ mixing.T).gather(2, ids.unsqueeze(2)).sum((1, 2)), exact)


def test_tied_layers_whose_gradients_cancel_are_clipped_to_the_clip_norm():
    """Tied layers whose gradients cancel (:func:`_tied_and_cancelling`): the cross term's float32
    products could not hold the rest, and the sample went unclipped, 2.8 times C. The total is
    vouched for by the cross terms' bound, and computed again in float64; that sample's clipped
    sum is then its layers' gradients added in float64, rounded once: each layer's float32 sum,
    added, had rounded the far larger gradients of each, and released it at 1 + 1.7e-5 times C
    (width 256, rest 1e-4, seed 2)."""
    released = []
    for width, rest, seed in itertools.product((64, 256), (1e-4, 1e-5), range(5)):
        model, forward, _ = _tied_and_cancelling(width, rest, seed)
        bk = make(model, dpsgd.DPSGDConfig(1.0, noise_multiplier=0.0), expected_batch_size=1,
                  check_first_sample=False)
        released.append(float(bk.step(forward())[0].double().norm()))
    assert 1 - 2.0**-5 <= min(released) and max(released) <= 1 + 2.0**-20, (min(released), max(released))


def test_tied_layers_whose_gradients_cancel_in_a_graph_s_capture_have_their_norm_raised():
    """Where no host read may wait (a graph's capture), the tied total of
    :func:`_tied_and_cancelling` is only raised by its bound: never under the exact one by more than 2^-7."""
    model, forward, exact = _tied_and_cancelling(64, 1e-5, 1)
    bk = make(model, dpsgd.DPSGDConfig(1.0, noise_multiplier=0.0), expected_batch_size=1, check_first_sample=False)
    _, norm_sums = bk._clipped_sums(forward(), 1.0, synced=False)
    assert norm_sums[0, 0] >= exact**2 * (1 - 2.0**-7)


def released_norm(model, per_sample_losses, clip_norm, per_layer=False) -> list:
    """The norms of one sample's update (L = 1, no noise): its clipped gradient, flat or per tensor."""
    bk = make(model, dpsgd.DPSGDConfig(clip_norm, noise_multiplier=0.0, per_layer=per_layer), expected_batch_size=1,
              check_first_sample=False)
    update = [u.double() for u in bk.step(per_sample_losses(model))]
    return [u.norm() for u in update] if per_layer else [torch.cat([u.flatten() for u in update]).norm()]


EXTREME_SCALES = {  # (layer, input shape, input scale, output-gradient scale); their gradients are of norm 1e-6 to 1e12
    "linear-tiny-input": (lambda: nn.Linear(4, 3, bias=False), (1, 4), 1e-24, 1e18),
    "linear-tiny-gradient": (lambda: nn.Linear(4, 3, bias=False), (1, 4), 1e18, 1e-24),
    "linear-huge-input": (lambda: nn.Linear(4, 3, bias=False), (1, 4), 1e20, 1e-10),
    "sequence-tiny-input": (lambda: nn.Linear(4, 3, bias=False), (1, 2, 4), 1e-24, 1e18),
    "sequence-tiny-gradient": (lambda: nn.Linear(4, 3, bias=False), (1, 2, 4), 1e18, 1e-24),
    "sequence-huge-input": (lambda: nn.Linear(4, 3, bias=False), (1, 2, 4), 1e20, 1e-10),
    "conv-tiny-input": (lambda: nn.Conv2d(16, 32, 3, bias=False), (1, 16, 5, 5), 1e-24, 1e18),
    "conv-tiny-gradient": (lambda: nn.Conv2d(16, 32, 3, bias=False), (1, 16, 5, 5), 1e18, 1e-24),
    "conv-huge-input": (lambda: nn.Conv2d(16, 32, 3, bias=False), (1, 16, 5, 5), 1e20, 1e-10),
}


@pytest.mark.parametrize("case", sorted(EXTREME_SCALES))
def test_a_sample_is_clipped_to_c_whatever_the_scales_of_its_factors(case):
    """A gradient g a^T of ordinary size whose input a and output gradient g are not: at 1e-24,
    a's squares underflow float32, and the ghost norm (and a rank-one norm |a| |g|) came out 0, the
    sample released unclipped at 13 to 2245 times C; at 1e20 they overflow, and a gradient of norm
    1e10 was refused as not finite. Clipped to C, as the materialised path clips it."""
    build, shape, input_scale, gradient_scale = EXTREME_SCALES[case]
    generator = torch.Generator().manual_seed(0)
    model = build()
    x = torch.randn(shape, generator=generator) * input_scale
    with torch.no_grad():
        weights = torch.randn(model(x).shape, generator=generator) * gradient_scale
    grads = dpsgd.per_sample_gradients(model, lambda out, w: (out * w).sum(), x, weights)
    norm = float(torch.cat([g.double().flatten() for g in grads]).norm())
    assert 1e-7 < norm < 1e13  # within float32's range, whatever its factors
    clip_norm = norm / 10
    assert float(dpsgd.privatize(grads, dpsgd.DPSGDConfig(clip_norm, noise_multiplier=0.0), 1)[0].double().norm()) \
        == pytest.approx(clip_norm, rel=1e-6)  # the reference: the materialised path
    (released,) = released_norm(model, lambda m: (m(x) * weights).flatten(1).sum(1), clip_norm)
    assert clip_norm * (1 - 2.0**-5) <= released <= clip_norm * (1 + 2.0**-20), (released / clip_norm)


@pytest.mark.parametrize("dtype", ["bfloat16-autocast", torch.bfloat16, torch.float16], ids=str)
def test_a_half_precision_sample_is_clipped_to_c(dtype):
    """One sample, each tensor clipped to C (per layer): a Linear on a sequence and a convolution
    in half precision, or under autocast. Their clipped sums had been bfloat16 products and GEMMs,
    rounding the sample's share by up to 2^-9 of itself: released at 1.0044 times C (1.0004 in
    float16), where the materialised path's float32 sum stays at C."""
    worst = 0.0
    for seed in range(6):
        generator = torch.Generator().manual_seed(seed)
        for model, x in ((nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)), torch.randn(1, 5, 8,
                                                                                                     generator=generator)),
                         (nn.Sequential(nn.Conv2d(3, 8, 3), nn.GELU(), nn.Conv2d(8, 4, 3)), torch.randn(1, 3, 8, 8,
                                                                                                       generator=generator))):
            autocast = dtype == "bfloat16-autocast"
            if not autocast:
                model, x = model.to(dtype), x.to(dtype)
            with torch.no_grad():
                weights = torch.randn(model(x).shape, generator=generator)

            def losses(m, x=x, weights=weights, autocast=autocast):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    out = m(x)
                return (out.float() * weights).flatten(1).sum(1)

            worst = max(worst, *(float(n) / 0.01 for n in released_norm(model, losses, 0.01, per_layer=True)))
    assert 1 - 2.0**-5 <= worst <= 1 + 2.0**-20, worst


def _legacy_precision_flags() -> tuple:
    """torch's legacy float32 precision getters, "raises" where they refuse a mix of the APIs."""
    flags = []
    for getter in (torch.get_float32_matmul_precision, lambda: torch.backends.cudnn.allow_tf32,
                   lambda: torch.backends.cuda.matmul.allow_tf32):
        try:
            flags.append(getter())
        except RuntimeError:
            flags.append("raises")
    return tuple(flags)


@pytest.mark.parametrize("api", ["new", "legacy"])
def test_the_clipped_sums_are_ieee_float32_and_the_user_s_precision_is_kept(api):
    """TF32 (cuDNN's convolutions by default, cuBLAS's GEMMs under set_float32_matmul_precision
    ("high")) or oneDNN's bfloat16 would round a clipped sum's inputs to 10 or 7 bits, past C: the
    norms and the sums are formed with every float32 precision flag "ieee" (a gradient formed for
    its norm is formed again for its sum, under the same flags), and the user's flags are as they
    were after the step. Set through torch's legacy API, the legacy getters read IEEE inside (a
    module replayed by the sums may read them; they raised for the mix of APIs)."""
    backends = {"cuda.matmul": torch.backends.cuda.matmul, "cudnn.conv": torch.backends.cudnn.conv,
                "cudnn.rnn": torch.backends.cudnn.rnn, "mkldnn.matmul": torch.backends.mkldnn.matmul,
                "mkldnn.conv": torch.backends.mkldnn.conv, "mkldnn.rnn": torch.backends.mkldnn.rnn}
    saved = {name: backend.fp32_precision for name, backend in backends.items()}
    saved_matmul = torch.get_float32_matmul_precision()
    seen = []

    def flags():
        return {name: backend.fp32_precision for name, backend in backends.items()}, _legacy_precision_flags()

    def spy(function):
        def spied(*args):
            seen.append((function.__name__, *flags()))
            return function(*args)
        return spied

    model, x, target = setting("linear")  # T = 1: each weight's clipped sum one GEMM
    try:
        if api == "new":
            for name, precision in zip(backends, ("tf32", "tf32", "ieee", "bf16", "bf16", "bf16")):
                backends[name].fp32_precision = precision
        else:
            torch.set_float32_matmul_precision("medium")  # oneDNN's matmul in bfloat16, cuBLAS's in TF32
        chosen = flags()
        assert "tf32" in chosen[0].values() and "bf16" in chosen[0].values()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(layers, "clipped_product", spy(layers.clipped_product))
            patch.setattr(layers, "row_norms", spy(layers.row_norms))
            make(model).step(regression(model(x), target))
        assert {name for name, _, _ in seen} == {"clipped_product", "row_norms"}
        assert all(flags == dict.fromkeys(backends, "ieee") for _, flags, _ in seen)
        inside = {legacy for _, _, legacy in seen}
        assert inside == {("highest", False, False) if api == "legacy" else ("highest", "raises", False)}
        assert flags() == chosen
    finally:
        torch.set_float32_matmul_precision(saved_matmul)
        for name, precision in saved.items():
            backends[name].fp32_precision = precision


def test_steps_in_threads_share_the_ieee_flags_and_the_last_out_puts_them_back():
    """Two threads' steps overlapping: the first out leaves the flags "ieee" for the other, still
    forming its sums (putting back its saved TF32 there let that step clip under it), and the last
    out puts back the user's flags (not the "ieee" that the second in had saved)."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with layers.ieee_float32():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second():
        first_in.wait(10)
        with layers.ieee_float32():
            second_in.set()
            first_out.wait(10)
            seen["inside after the first left"] = matmul.fp32_precision

    try:
        matmul.fp32_precision = "tf32"
        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert seen == {"inside after the first left": "ieee"}
        assert matmul.fp32_precision == "tf32"
    finally:
        matmul.fp32_precision = saved


def test_a_sample_whose_gradient_is_zero_is_not_computed_again_in_float64(monkeypatch):
    """A sample fitted exactly (or masked) has a ghost norm of 0 and a bound of the underflow term
    alone, below RAISED_ONLY: added, not computed again in float64 at every step, and the update
    is the materialised one."""
    again = []
    dense_again = ghost_norm._dense_again
    monkeypatch.setattr(ghost_norm, "_dense_again", lambda *args: again.append(args) or dense_again(*args))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))  # T 3: ghost norms (2 T^2 < d p)
    x, target = torch.randn(6, 3, 16), torch.randn(6, 3, 4)
    with torch.no_grad():  # fitted exactly by the step's own (batched) forward: their output gradients are 0
        target[[2, 4]] = model(x)[[2, 4]]
    grads = materialised_grads(model, x, target)
    config = dpsgd.DPSGDConfig(clip_between(grads, False), noise_multiplier=0.3)
    want = dpsgd.privatize(grads, config, 6.0, M.NoiseGenerator(2))
    assert_same_update(book_kept(model, x, target, config, 6.0, M.NoiseGenerator(2)), want)
    assert again == []
    monkeypatch.setattr(ghost_norm, "RAISED_ONLY", 0.0)  # the check sees the recomputation where it would run
    book_kept(model, x, target, config, 6.0, M.NoiseGenerator(2))
    assert again


@requires_cuda
def test_a_graph_replay_refuses_a_parameter_frozen_after_the_capture():
    """A replay runs none of the captured part's Python: the step checks the trainable parameters
    itself (a frozen weight had been stepped with the update)."""
    model, x, target = setting("linear")
    model, x, target = model.cuda(), x.cuda(), target.cuda()
    bk = make(model)
    step = bk.graphed(lambda x, t: regression(model(x), t), x, target)
    before = model[0].weight.detach().clone()
    model[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"parameter '0.weight' was frozen"):
        step(x, target)
    assert torch.equal(model[0].weight.detach(), before)


@requires_cuda
def test_a_sample_is_clipped_to_c_with_tf32_on():
    """On a GPU with TF32 on for cuDNN's convolutions (torch's default) and cuBLAS's GEMMs: one
    sample of a Linear on a sequence and of a convolution, each tensor clipped to C, never past it."""
    matmul, conv = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = "tf32"
    try:
        worst = 0.0
        for seed in range(6):
            generator = torch.Generator().manual_seed(seed)
            for model, x in ((nn.Linear(64, 64), torch.randn(1, 16, 64, generator=generator)),
                             (nn.Conv2d(32, 32, 3), torch.randn(1, 32, 12, 12, generator=generator))):
                model, x = model.cuda(), x.cuda()
                with torch.no_grad():
                    weights = torch.randn(model(x).shape, generator=generator).cuda()
                norms = released_norm(model, lambda m, x=x, w=weights: (m(x) * w).flatten(1).sum(1), 0.01,
                                      per_layer=True)
                worst = max(worst, *(float(n) / 0.01 for n in norms))
        assert 1 - 2.0**-5 <= worst <= 1 + 2.0**-20, worst
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = matmul, conv


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bfloat16-autocast"])
def test_groupnorm_on_nearly_constant_groups_has_the_gradient_of_its_own_backward(autocast):
    """Groups whose mean is large against their spread (a convolution's output offset by 100), and
    a blank first sample, whose groups (one channel each) are constant (its weight gradient is 0). GroupNorm's weight
    rows as torch's backward forms them, (sum_t x_t g_t - mu sum_t g_t) / sigma, cancel there, and
    1 / sigma magnifies what is left: under bfloat16 autocast 0.08 for the blank sample's 0, and
    the first sample's check (torch's own backward of that sample) refused the model in 10 seeds of
    10. The rows are sum_t (x_t - mu) g_t / sigma: the blank sample's 0 (mu is exactly its constant:
    torch's Welford means are exact there), and the check holds."""
    for seed in range(5):
        torch.manual_seed(seed)
        conv, norm, head = nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(4, 4), nn.Linear(4, 3)
        model = nn.ModuleList([conv, norm, head])
        bk = make(model, dpsgd.DPSGDConfig(1.0, noise_multiplier=1.0))
        x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 3, (4,))
        x[0] = 0
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = head(norm(conv(x) + 100.0).mean((2, 3)))
        layer = next(layer for layer in bk.layers if layer.module is norm)
        weight_rows = layer.weight_rows(0, layer.calls[0], torch.randn(4, 4, 8, 8))
        assert weight_rows[0].abs().max() <= 2.0**-20 * weight_rows[1:].abs().max()  # 7e-4 to 6e-3 before
        bk.step(F.cross_entropy(out.float(), y, reduction="none"))


@pytest.mark.parametrize("ghost", [True, False], ids=["ghost-norm", "per-sample-gradient"])
@pytest.mark.parametrize("case", ["conv1d", "conv2d", "conv-transpose"])
def test_a_convolution_taken_a_few_samples_at_a_time_matches(case, ghost, monkeypatch):
    """A convolution that keeps its inputs forms its patches (ghost norms) or per-sample gradients
    (norms) a few samples at a time: chunks of 4, 2 and 1 of the batch of 6 give the same update."""
    monkeypatch.setattr(layers, "use_ghost_norm", lambda *sizes: ghost)
    monkeypatch.setattr(layers, "when_to_form", lambda per_sample, held: layers.Forming.NEVER)
    for size in (4, 2, 1):
        monkeypatch.setattr(layers, "samples_per_chunk", lambda held, transient, size=size, **_: size)
        compare(case, "gaussian", False)


def test_the_backward_asks_autograd_only_for_the_lowest_layer_outputs():
    """bookkeeping.lowest: an edge is left out when another is reached below its node; every
    layer's tensor hook still fires, on a chain and on a branch beside it."""
    x = torch.randn(3, requires_grad=True)
    chain_low = x * 2.0
    chain_high = chain_low.exp()
    branch = x.sin()
    edges = [get_gradient_edge(t) for t in (chain_high, chain_low, branch)]
    loss, parents = (chain_high + branch).sum(), {}
    graph.count_uses([loss.grad_fn], [], parents=parents)
    assert bookkeeping.lowest(edges, parents) == [edges[1], edges[2]]
    seen = []
    for name, t in [("chain_high", chain_high), ("chain_low", chain_low), ("branch", branch)]:
        t.register_hook(lambda g, name=name: seen.append(name))
    torch.autograd.grad(loss, bookkeeping.lowest(edges, parents))
    assert sorted(seen) == ["branch", "chain_high", "chain_low"]


def test_a_transposed_convolution_with_an_output_padding_past_its_stride_is_refused():
    """Its output gradient's convolution would be longer than its input (torch allows an output
    padding below the dilation): refused, naming the module; with output_size= below the stride it
    trains."""
    model = nn.Sequential(nn.ConvTranspose2d(2, 2, 3, stride=1, dilation=2, output_padding=1))
    bk = make(model)  # noqa: F841 (its hooks live as long as it does)
    with pytest.raises(ValueError, match=r"module '0' \(ConvTranspose2d\) has an output padding of at least"):
        model(torch.randn(4, 2, 5, 5))
    up = nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1)
    x, target = torch.randn(4, 2, 5, 5), torch.randn(4, 3, 10, 10)
    want = [torch.stack(column) for column in zip(*[
        torch.autograd.grad(regression(up(x[i:i + 1], output_size=[10, 10]), target[i:i + 1]).sum(),
                            list(up.parameters())) for i in range(4)])]
    config = dpsgd.DPSGDConfig(clip_between(want, False), noise_multiplier=0.5)
    expected = dpsgd.privatize(want, config, 4.0, M.NoiseGenerator(3))
    bk = dpsgd.BookKeeping(up, torch.optim.SGD(up.parameters(), lr=0.0), config, expected_batch_size=4.0,
                           generator=M.NoiseGenerator(3))
    assert_same_update(bk.step(regression(up(x, output_size=[10, 10]), target)), expected)
