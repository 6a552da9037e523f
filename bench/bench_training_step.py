"""The whole DP-SGD training step: privleak's book-keeping against the non-private step, privleak's
materialised path and Opacus, in one run.

    python bench/bench_training_step.py [--quick] [--models paper-cnn cifar-cnn transformer large]
                                        [--skip-large] [--device cpu|cuda] [--threads 1] [--max-gb 16]
                                        [--batches 64 256] [--physical 16] [--profile] [--memory-in-process]
                                        [--check-every-step]

A step is forward, backward, clipping, noise and the optimizer step (SGD) on one batch, clip norm
1, noise multiplier 1, flat clipping. Sides: "non-private" is plain torch (mean loss, backward,
step: the floor); "materialised" is privleak's per-sample gradients (torch.func) and DPOptimizer;
"book-keeping" is privleak.dpsgd.BookKeeping (ghost norms, one backward, no per-sample
gradients); "opacus hooks" and "opacus ghost" are Opacus's PrivacyEngine.make_private with
grad_sample_mode "hooks" (per-sample gradients from hooks) and "ghost" (ghost clipping, two
backward passes). On a GPU two more: "book-keeping graphed" is BookKeeping.graphed (forward,
backward and clip replayed from a CUDA graph, the noise and the optimizer step eager), and
"non-private graphed" the non-private step captured whole in a CUDA graph (torch's whole-network
capture: the floor for a graphed step). --check-every-step adds "book-keeping checked",
BookKeeping with check_every_step=True (one more backward pass a step, of the losses weighted at
random). Every side gets its own copy of the same initial model and the same batch.

Models: the paper's CNN (privleak.models.PaperNetwork, 28x28 images), a CIFAR-style CNN of about
0.8M parameters (Conv2d + GroupNorm + Linear on 32x32x3), a 2-layer transformer of about 2.3M
parameters (d 256, 4 heads, sequence 64, attention written with nn.Linear), the same transformer
built from torch's nn.TransformerEncoderLayer (nn.MultiheadAttention, dropout 0.1, no causal mask:
Opacus trains it as its DPMultiheadAttention, which refuses the is_causal hint nn.TransformerEncoder
gives with one), a DCGAN-style generator of nn.ConvTranspose2d layers (0.1M, codes 4 x 4 x 64 to
images 32 x 32 x 3, squared error), a wide ResNet (WRN-16-4 with GroupNorm, 2.75M; "wrn-16-4-ws": its
convolutions weight-standardised, nn.Conv2d subclasses computing their weight), a 69M
transformer (d 768, 8 layers, sequence 128), and Hugging Face's GPT-2 small (124M), a LLaMA-style
model of its size, OPT-125m, and GPT-2 small frozen with LoRA adapters (peft; sequence 128;
transformers needed); --skip-large leaves these out. Only when named in --models: "mamba", Mamba
(3.8M, sequence 64), whose mixers book-keeping replays per sample, and "deberta", DeBERTa-v3's
attention (5.3M, sequence 128).
"tiny-transformer" (only when named in --models) is the transformer's layers at d 16, 2 heads,
sequence 8: with almost no arithmetic its step time is the host's cost per op and Python's, which is
what a small model's step is on a GPU (the host launches the kernels faster than they run only for
large ones). "params" counts the trainable parameters. A side that cannot train a model says what it
raised.

Times: the sides run in turns, --rounds rounds of calls lasting about 50 ms each
(bench/_measure.seconds_by_round); each side reports its median, and its ratio to non-private as
the median over rounds of the two sides' times in the same round (a shared machine's speed
drifts between rounds). Peak memory: each side runs --memory-steps steps in a fresh
process, the median of --memory-repeats such processes; on the CPU the growth of peak RSS
(VmHWM, reset after building the model, data and wrappers) over the RSS then, with glibc's
malloc mapping every block of 128 KiB or more on its own (FIXED_MALLOC), on a GPU
torch.cuda.max_memory_allocated over what was allocated before the steps. "after step 1": the
ratio of the peaks of the later steps over the memory in use after the first, the parameters'
.grad freed, which leaves out what the first step makes for good on every side alike (caches,
workspaces). On a GPU, --memory-in-process measures each side in this process instead, one after
another, each on a model of its own built afresh, after the timing (max_memory_allocated counts
the tensors alive, whatever the process did before, so the fresh process, seconds of CUDA's start
for each side, buys nothing there; the workspaces the timing made are then in the base, as
"after step 1" leaves them out). A side whose
per-sample gradients (B x P floats, materialised and Opacus hooks) would pass --max-gb is not
run. --quick runs the smallest settings with few repeats, as a smoke test. --physical N takes
each batch in physical batches of N samples, as a logical batch too large for memory is taken:
non-private torch accumulates the gradients of the batch's mean loss, book-keeping calls
accumulate() per physical batch and step() once (the other sides are not run). --profile adds
what each side's step asks of the host: the ATen ops it dispatches ("ops", views included, each
a call into torch's dispatcher), and on a GPU the kernels it launches and the GPU's busy time a
step (torch.profiler; a step whose busy time is a small part of its wall time is bound by the
host's Python and launches).
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import warnings

import privleak
import torch
import torch.nn.functional as F
from _measure import cpu_name, ratio_by_round, seconds, seconds_by_round, table
from privleak import dpsgd
from privleak.models import PaperNetwork
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

CLIP, SIGMA, LR = 1.0, 1.0, 0.05
SIDES = ("non-private", "materialised", "book-keeping", "opacus hooks", "opacus ghost")
GRAPHED = ("non-private graphed", "book-keeping graphed")  #: CUDA graph replays, run on a GPU only
CHECKED = "book-keeping checked"  #: BookKeeping(check_every_step=True), with --check-every-step
MATERIALISING = ("materialised", "opacus hooks")  # sides that hold B x P per-sample gradients


class CifarCNN(nn.Module):
    """Three stages of two 3x3 convolutions with GroupNorm, average pooling, then two Linear layers."""

    def __init__(self, classes: int = 10):
        super().__init__()
        layers, channels = [], 3
        for width in (32, 64, 128):
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.GroupNorm(8, width), nn.ReLU(),
                       nn.Conv2d(width, width, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2)]
            channels = width
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(128 * 4 * 4, 256), nn.ReLU(), nn.Linear(256, classes))

    def forward(self, x):
        return self.classifier(self.features(x))


class StandardizedConv2d(nn.Conv2d):
    """Weight standardisation (Qiao et al. 2019): each output channel's weights centred and scaled
    to unit variance before the convolution, as De et al. 2022 train their wide ResNets."""

    def forward(self, x):
        w = self.weight
        w = (w - w.mean((1, 2, 3), keepdim=True)) / (w.std((1, 2, 3), keepdim=True) + 1e-5)
        return self._conv_forward(x, w, self.bias)


class WideResidualBlock(nn.Module):
    """Pre-activation residual block of a wide ResNet: GroupNorm, ReLU, 3x3 convolution, twice; a
    1x1 convolution on the shortcut where the width or the stride changes."""

    def __init__(self, channels: int, width: int, stride: int, conv=nn.Conv2d):
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(16, channels), nn.GroupNorm(16, width)
        self.conv1 = conv(channels, width, 3, stride, 1, bias=False)
        self.conv2 = conv(width, width, 3, 1, 1, bias=False)
        self.shortcut = (conv(channels, width, 1, stride, bias=False)
                         if stride != 1 or channels != width else nn.Identity())

    def forward(self, x):
        x = F.relu(self.norm1(x))
        return self.shortcut(x) + self.conv2(F.relu(self.norm2(self.conv1(x))))


class WideResNet(nn.Module):
    """WRN-16-4 on 32x32x3 images (2.75M parameters), GroupNorm of 16 groups in place of BatchNorm:
    the wide ResNets De et al. 2022 ("Unlocking High-Accuracy Differentially Private Image
    Classification through Scale") train on CIFAR-10 with DP-SGD (their best result with 40
    layers), at 16 layers of width 4; with ``conv=StandardizedConv2d``, their weight
    standardisation."""

    def __init__(self, depth: int = 16, widen: int = 4, classes: int = 10, conv=nn.Conv2d):
        super().__init__()
        blocks, channels = [conv(3, 16, 3, padding=1, bias=False)], 16
        for stage, width in enumerate((16 * widen, 32 * widen, 64 * widen)):
            for block in range((depth - 4) // 6):
                blocks.append(WideResidualBlock(channels, width, 2 if stage and not block else 1, conv))
                channels = width
        self.features = nn.Sequential(*blocks, nn.GroupNorm(16, channels), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


class LSTMClassifier(nn.Module):
    """A text classifier as Opacus's DPLSTM tutorial builds one: token embeddings, an LSTM, a Linear
    head on its last hidden state (Opacus's sides take its DPLSTM in place of the nn.LSTM)."""

    def __init__(self, vocab: int = 10000, width: int = 64, hidden: int = 128, classes: int = 2):
        super().__init__()
        self.embed, self.lstm = nn.Embedding(vocab, width), nn.LSTM(width, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, ids):
        return self.head(self.lstm(self.embed(ids))[1][0][-1])


class BagOfWords(nn.Module):
    """torchtext's text classifier (its AG News tutorial's TextClassificationModel): the mean of
    the tokens' embeddings by nn.EmbeddingBag, a Linear head; the samples' tokens laid end to end
    and cut by offsets, as the tutorial's collate function gives them (Opacus's EmbeddingBag
    sampler takes that form only)."""

    def __init__(self, vocab: int = 20000, width: int = 64, classes: int = 4):
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(vocab, width, mode="mean"), nn.Linear(width, classes)

    def forward(self, ids):
        offsets = torch.arange(0, ids.numel(), ids.shape[1], device=ids.device)
        return self.head(self.bag(ids.flatten(), offsets))


class Block(nn.Module):
    """Pre-norm transformer block, causal self-attention from nn.Linear projections."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        # Written out (no scaled_dot_product_attention): torch.func's vmap, which the materialised
        # side needs, has no batching rule for the fused CPU kernel.
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        mask = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        attention = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, length, width))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, length: int):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(length, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids).contiguous()  # Opacus views it
        return self.head(self.norm(self.blocks(self.tokens(ids) + self.positions(positions))))


class TorchTransformer(nn.Module):
    """The transformer as torch's own layers build it: nn.TransformerEncoder of pre-norm
    nn.TransformerEncoderLayer (nn.MultiheadAttention, torch's default dropout 0.1), an encoder
    without a causal mask (Opacus's DPMultiheadAttention refuses the is_causal hint given with one)."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, length: int):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(length, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids).contiguous()
        return self.head(self.norm(self.blocks(self.tokens(ids) + self.positions(positions))))


def generator() -> nn.Module:
    """A DCGAN-style image generator, 4 x 4 x 64 codes to 32 x 32 x 3 images by nn.ConvTranspose2d
    layers (0.1M parameters), trained to reconstruct images (an autoencoder's decoder)."""
    return nn.Sequential(nn.ConvTranspose2d(64, 64, 4, 2, 1), nn.GroupNorm(8, 64), nn.ReLU(),
                         nn.ConvTranspose2d(64, 32, 4, 2, 1), nn.GroupNorm(8, 32), nn.ReLU(),
                         nn.ConvTranspose2d(32, 3, 4, 2, 1), nn.Tanh())


class HuggingFaceLM(nn.Module):
    """A Hugging Face causal language model as users build it, returning its logits, random weights
    from its config (nothing is downloaded), dropout off so that every side computes the same
    function. "gpt2": GPT-2 small (124M parameters: transformers' Conv1D projections, the head
    tied to the token embedding, position embeddings of position ids (1, T)). "llama": a
    LLaMA-style model of GPT-2 small's size (12 layers, d 768, 4 key-value heads of 12, SwiGLU
    2048, vocabulary 32000, tied head; RMSNorm modules of its own, rotary positions). "opt": OPT's
    125M configuration (its MLP on the hidden states flattened to (B T, d), learned position
    embeddings that make their ids from the attention mask, tied head). "gpt2-lora": GPT-2 small
    frozen, LoRA adapters by peft (rank 8, alpha 16) on every projection (c_attn, c_proj, c_fc:
    1.2M trainable parameters), the way large models are fine-tuned with DP. "mixtral": a
    mixture of experts as Mixtral builds it (8 layers, d 512, 8 heads of which 4 key-value, 8
    experts of SwiGLU 1024, the top 2 per token, vocabulary 32000: 140M parameters, 101M of them
    the experts'; its routers and experts are replayed by book-keeping). "mamba": Mamba as transformers
    builds it (4 layers, d 256, state 16, vocabulary 8000: 3.8M parameters), its selective scan in
    torch (no mamba-ssm kernels); book-keeping replays each mixer per sample with the conv1d and
    dt_proj whose weights its code reads, and book-keeps its projections. "deberta": a sequence
    classifier with DeBERTa-v3's attention (4 layers, d 256, 4 heads, vocabulary 8000: 5.3M
    parameters; relative positions in 64 log buckets each side, LayerNormed, projected by the query
    and key Linears); book-keeping takes the position table's and its LayerNorm's per-sample
    gradients through those projections."""

    def __init__(self, kind: str):
        super().__init__()
        import transformers

        transformers.logging.set_verbosity_error()
        if kind in ("gpt2", "gpt2-lora"):
            self.lm = transformers.GPT2LMHeadModel(transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0,
                                                                           attn_pdrop=0.0))
            if kind == "gpt2-lora":
                import peft

                self.lm = peft.get_peft_model(self.lm, peft.LoraConfig(
                    r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["c_attn", "c_proj", "c_fc"],
                    fan_in_fan_out=True))
        elif kind == "mixtral":
            self.lm = transformers.MixtralForCausalLM(transformers.MixtralConfig(
                vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512))
        elif kind == "mamba":
            self.lm = transformers.MambaForCausalLM(transformers.MambaConfig(
                vocab_size=8000, hidden_size=256, state_size=16, num_hidden_layers=4, expand=2, conv_kernel=4))
        elif kind == "deberta":
            self.lm = transformers.DebertaV2ForSequenceClassification(transformers.DebertaV2Config(
                vocab_size=8000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                max_position_embeddings=128, relative_attention=True, position_buckets=64, max_relative_positions=128,
                pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm", share_att_key=True,
                position_biased_input=False, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2))
        elif kind == "opt":
            self.lm = transformers.OPTForCausalLM(transformers.OPTConfig(dropout=0.0, attention_dropout=0.0))
        else:
            self.lm = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=True))

    def forward(self, ids):
        return self.lm(ids).logits


class SequenceLoss(nn.Module):
    """Cross-entropy of next-token logits (B, T, V), per sample the mean over its tokens; ``reduction``
    as torch's losses have it (Opacus's ghost clipping sets it to "none")."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, logits, targets):
        per_sample = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)
        return {"none": per_sample, "sum": per_sample.sum(), "mean": per_sample.mean()}[self.reduction]


class ImageLoss(nn.Module):
    """Squared error of images, per sample the mean over its pixels; ``reduction`` as torch's."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, out, targets):
        per_sample = (out - targets).square().flatten(1).mean(1)
        return {"none": per_sample, "sum": per_sample.sum(), "mean": per_sample.mean()}[self.reduction]


def codes_and_images(code, image):
    def make(batch, generator):
        return torch.randn(batch, *code, generator=generator), torch.rand(batch, *image, generator=generator) * 2 - 1
    return make


def images(shape, classes):
    def make(batch, generator):
        return torch.randn(batch, *shape, generator=generator), torch.randint(0, classes, (batch,), generator=generator)
    return make


def labelled_tokens(vocab, length, classes):
    def make(batch, generator):
        return (torch.randint(0, vocab, (batch, length), generator=generator),
                torch.randint(0, classes, (batch,), generator=generator))
    return make


def tokens(vocab, length):
    def make(batch, generator):
        ids = torch.randint(0, vocab, (batch, length + 1), generator=generator)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return make


#: name: (builder, data, criterion class, batches, quick batches)
MODELS = {
    "paper-cnn": (lambda: PaperNetwork(), images((1, 28, 28), 10), nn.CrossEntropyLoss, (64, 256), (64,)),
    "cifar-cnn": (lambda: CifarCNN(), images((3, 32, 32), 10), nn.CrossEntropyLoss, (64, 128), ()),
    "transformer": (lambda: Transformer(1500, 256, 2, 4, 64), tokens(1500, 64), SequenceLoss, (32, 64), (32,)),
    "wrn-16-4": (lambda: WideResNet(), images((3, 32, 32), 10), nn.CrossEntropyLoss, (64, 128), ()),
    "wrn-16-4-ws": (lambda: WideResNet(conv=StandardizedConv2d), images((3, 32, 32), 10), nn.CrossEntropyLoss,
                    (32, 64), ()),
    "generator": (generator, codes_and_images((64, 4, 4), (3, 32, 32)), ImageLoss, (64, 256), ()),
    "torch-transformer": (lambda: TorchTransformer(1500, 256, 2, 4, 64), tokens(1500, 64), SequenceLoss, (32, 64), ()),
    "large": (lambda: Transformer(8000, 768, 8, 12, 128), tokens(8000, 128), SequenceLoss, (8, 32), ()),
    "lstm": (lambda: LSTMClassifier(), labelled_tokens(10000, 50, 2), nn.CrossEntropyLoss, (64, 256), ()),
    "bag-of-words": (lambda: BagOfWords(), labelled_tokens(20000, 64, 4), nn.CrossEntropyLoss, (64, 256), ()),
    "tiny-transformer": (lambda: Transformer(50, 16, 2, 2, 8), tokens(50, 8), SequenceLoss, (2, 16), (2,)),
    "gpt2": (lambda: HuggingFaceLM("gpt2"), tokens(50257, 128), SequenceLoss, (8,), ()),
    "llama": (lambda: HuggingFaceLM("llama"), tokens(32000, 128), SequenceLoss, (8,), ()),
    "opt": (lambda: HuggingFaceLM("opt"), tokens(50272, 128), SequenceLoss, (8,), ()),
    "gpt2-lora": (lambda: HuggingFaceLM("gpt2-lora"), tokens(50257, 128), SequenceLoss, (8,), ()),
    "mixtral": (lambda: HuggingFaceLM("mixtral"), tokens(32000, 128), SequenceLoss, (8,), ()),
    "mamba": (lambda: HuggingFaceLM("mamba"), tokens(8000, 64), SequenceLoss, (8,), ()),
    "deberta": (lambda: HuggingFaceLM("deberta"), labelled_tokens(8000, 128, 2), nn.CrossEntropyLoss, (16,), ()),
}
LARGE = ("large", "gpt2", "llama", "opt", "gpt2-lora", "mixtral")  #: left out by --skip-large and --quick
#: run only when named in --models: the host-bound tiny transformer, Mamba (its selective scan a Python loop over
#: the positions in transformers' torch path: about 4 s a non-private step at sequence 64, B 8, one thread) and DeBERTa
ON_REQUEST = ("tiny-transformer", "mamba", "deberta")


def make_side(side: str, model: nn.Module, criterion_class, batch: int, x: torch.Tensor, physical: int = 0,
              y: torch.Tensor | None = None):
    """A function running one training step of ``side`` on ``model`` (which it owns) and the batch;
    with ``physical``, the batch in physical batches of that many samples (non-private: gradient
    accumulation of the batch's mean loss; book-keeping: accumulate()). The graphed sides capture
    their step on the example batch ``x``, ``y``."""
    criterion = criterion_class()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    if side == "non-private graphed":
        return graphed_torch_step(model, optimizer, criterion, x, y)
    if physical and side not in ("non-private", "book-keeping"):
        raise ValueError(f"--physical: only the non-private and book-keeping sides take physical batches, not {side}")
    if side == "non-private" and physical:
        total = criterion_class(reduction="sum")

        def step(x, y):
            optimizer.zero_grad(set_to_none=True)
            for xs, ys in zip(x.split(physical), y.split(physical)):
                (total(model(xs), ys) / batch).backward()
            optimizer.step()
        return step
    if side == "non-private":
        def step(x, y):
            optimizer.zero_grad(set_to_none=True)
            criterion(model(x), y).backward()
            optimizer.step()
        return step
    config = dpsgd.DPSGDConfig(CLIP, noise_multiplier=SIGMA)
    if side == "materialised":
        dp = dpsgd.DPOptimizer(optimizer, config, batch)
        one = criterion_class(reduction="sum")
        return lambda x, y: dp.step(dpsgd.per_sample_gradients(model, one, x, y))
    if side in ("book-keeping", "book-keeping graphed", CHECKED):
        bk = dpsgd.BookKeeping(model, optimizer, config, expected_batch_size=batch, check_every_step=side == CHECKED)
        per_sample = criterion_class(reduction="none")
        if side == "book-keeping graphed":
            with warnings.catch_warnings():  # of Poisson batches larger than the graph: every batch here has B samples
                warnings.simplefilter("ignore")
                return bk.graphed(lambda x, y: per_sample(model(x), y), x, y)
        if not physical:
            return lambda x, y: bk.step(per_sample(model(x), y))

        def step(x, y):
            for xs, ys in zip(x.split(physical), y.split(physical)):
                bk.accumulate(per_sample(model(xs), ys))
            return bk.step()
        return step
    from opacus.validators import ModuleValidator

    if not ModuleValidator.is_valid(model):  # an nn.LSTM: Opacus trains its DPLSTM instead
        model = ModuleValidator.fix(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    return opacus_step(side, model, optimizer, criterion, x, batch)


def opacus_step(side: str, model: nn.Module, optimizer, criterion, x: torch.Tensor, batch: int):
    """One step of Opacus's make_private (grad_sample_mode the side's second word) on ``model``
    (for several processes, wrapped in its DPDDP), for batches of ``batch`` samples like ``x``; a
    side ending in "+ privleak" swaps in privleak's optimizer (``from_opacus``, Gaussian noise)."""
    from opacus import PrivacyEngine

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:1].expand(4 * batch, *x.shape[1:])),
                                         batch_size=batch)
    mode = side.split()[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus warns about secure RNG and the accountant
        made = PrivacyEngine().make_private(module=model, optimizer=optimizer, criterion=criterion, data_loader=loader,
                                            noise_multiplier=SIGMA, max_grad_norm=CLIP, poisson_sampling=False,
                                            grad_sample_mode=mode)
    wrapped, dp_optimizer = made[0], made[1]
    if side.endswith("+ privleak"):
        from privleak.opacus_interop import PrivleakDPOptimizer

        dp_optimizer = PrivleakDPOptimizer.from_opacus(dp_optimizer)
    loss_fn = made[2] if mode == "ghost" else criterion

    def step(x, y):
        dp_optimizer.zero_grad(set_to_none=True)
        loss_fn(wrapped(x), y).backward()
        dp_optimizer.step()
    return step


def graphed_torch_step(model: nn.Module, optimizer, criterion, x: torch.Tensor, y: torch.Tensor):
    """The non-private step (forward, backward, optimizer step) captured whole in a CUDA graph, as
    torch's documentation captures a whole network: the floor of a graphed step."""
    inputs, targets = x.clone(), y.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            criterion(model(inputs), targets).backward()
            optimizer.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        criterion(model(inputs), targets).backward()
        optimizer.step()

    def step(x, y):
        inputs.copy_(x)
        targets.copy_(y)
        graph.replay()
    return step


def setting(name: str, batch: int, device: str):
    build, data, criterion_class, _, _ = MODELS[name]
    torch.manual_seed(0)
    model = build().to(device)
    x, y = data(batch, torch.Generator().manual_seed(1))
    return model, x.to(device), y.to(device), criterion_class


def needs_gb(model: nn.Module, batch: int) -> float:
    return batch * sum(p.numel() for p in model.parameters() if p.requires_grad) * 4 / 2**30


class _OpCount(TorchDispatchMode):
    """Counts the ATen ops dispatched (views included: each is a call into torch's dispatcher)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def host_profile(fn, device: str, steps: int = 5) -> dict:
    """What a side's step asks of the host: ATen ops dispatched a step, and on a GPU the kernels
    launched a step and the GPU's busy time a step (its kernels' time, from torch.profiler). A small
    model's GPU step is bound by the host (Python and launches) where the busy time is a small part
    of the step's wall time."""
    with _OpCount() as counter:
        fn()
    found = {"ops": counter.count}
    if device == "cuda":
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                fn()
            torch.cuda.synchronize()
        events = prof.events()
        launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                                                       "cuLaunchKernelEx"))
        busy = sum(e.time_range.elapsed_us() for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        found.update(launches=launches / steps, busy_ms=busy / steps / 1e3)
    return found


def status_bytes(field: str) -> int:
    """A size from /proc/self/status (VmRSS: resident now, VmHWM: its peak), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> None:
    """Set VmHWM to the current RSS (Linux 4.0+), so the peak counts from here."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def start_peak(device: str) -> int:
    """Reset the peak to the memory in use now, and return that."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    reset_peak_rss()
    return status_bytes("VmRSS")


def peak_since_start(device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return status_bytes("VmHWM")


def measure_peak(side: str, name: str, batch: int, device: str, steps: int, physical: int) -> dict:
    """Peak memory of ``steps`` steps of one side on a model built afresh, over the memory in use
    with the model built ("peak", the issue's measure) and over the memory in use after the first
    step ("later": what a step adds once the first has made what stays for good, such as library
    caches or cuBLAS's workspace, which are the same on every side). The parameters' .grad go
    before that base: torch's optimizers keep them between steps where book-keeping frees its
    update, and in the base they would leave P floats out of one side only."""
    model, x, y, criterion_class = setting(name, batch, device)
    if side in GRAPHED:  # the capture allocates the step's memory (the graph's pool): from before it
        base = start_peak(device)
        step = make_side(side, model, criterion_class, batch, x, physical, y)
    else:
        step = make_side(side, model, criterion_class, batch, x, physical, y)
        base = start_peak(device)
    step(x, y)
    first = peak_since_start(device) - base
    for p in model.parameters():
        p.grad = None
    after_first = start_peak(device)
    for _ in range(steps - 1):
        step(x, y)
    later = peak_since_start(device)
    return {"peak": max(first, later - base), "later": later - after_first}


def child(side: str, name: str, batch: int, device: str, steps: int, physical: int) -> None:
    """:func:`measure_peak` in this fresh process, printed as JSON."""
    print(json.dumps(measure_peak(side, name, batch, device, steps, physical)))


# glibc's malloc serves a large block from the heap once a block that size was freed (its mmap
# threshold moves up), and keeps freed heap for later: when that happens within a run varied the
# CIFAR CNN's peak RSS at B 128 by 20% between fresh processes of the same side (198-240 MiB
# non-private). A fixed threshold maps every block of 128 KiB or more and unmaps it when freed, so
# peak RSS follows the tensors alive (three processes agreed to 0.2%); the same for every side.
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def peak_memory(side: str, name: str, batch: int, args) -> dict:
    """:func:`child`'s peaks, each the median over --memory-repeats fresh processes (allocator and
    thread-pool state still move peak RSS by a little from run to run); with --memory-in-process,
    :func:`measure_peak` once in this process, what the sides before it left freed first."""
    if args.memory_in_process:
        gc.collect()  # Opacus's hooks keep their module in reference cycles
        if args.device == "cuda":
            torch.cuda.empty_cache()
        return measure_peak(side, name, batch, args.device, args.memory_steps, args.physical)
    command = [sys.executable, __file__, "--child", side, name, str(batch), "--device", args.device,
               "--threads", str(args.threads), "--memory-steps", str(args.memory_steps), "--physical",
               str(args.physical)]
    runs = []
    for _ in range(args.memory_repeats):
        done = subprocess.run(command, capture_output=True, text=True, check=True,
                              env={**os.environ, **FIXED_MALLOC})
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=[n for n in MODELS if n not in ON_REQUEST], choices=list(MODELS))
    parser.add_argument("--skip-large", action="store_true", help="leave out the 69M-parameter transformer")
    parser.add_argument("--quick", action="store_true", help="smoke run: the smallest settings, few repeats")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1, help="torch's and privleak's CPU threads")
    parser.add_argument("--max-gb", type=float, default=16.0, help="skip sides whose per-sample gradients pass this")
    parser.add_argument("--memory-steps", type=int, default=4)
    parser.add_argument("--memory-repeats", type=int, default=3, help="fresh processes per side; their median")
    parser.add_argument("--no-memory", action="store_true", help="time only")
    parser.add_argument("--memory-in-process", action="store_true",
                        help="on a GPU: each side's peak measured in this process, not a fresh one per side "
                             "(on a CPU peak RSS would keep what the allocator kept from the sides before)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of timing, the sides in turns")
    parser.add_argument("--check-every-step", action="store_true",
                        help=f'add "{CHECKED}": book-keeping with check_every_step=True')
    parser.add_argument("--physical", type=int, default=0,
                        help="take each batch in physical batches of this many samples (non-private and "
                             "book-keeping sides only)")
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes instead of each model's own")
    parser.add_argument("--profile", action="store_true",
                        help="also each side's ATen ops a step and, on a GPU, its kernel launches and GPU busy time")
    parser.add_argument("--child", nargs=3, metavar=("SIDE", "MODEL", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_in_process and args.device != "cuda":
        parser.error("--memory-in-process is for --device cuda: on a CPU, peak RSS keeps what the allocator kept "
                     "from the sides before")
    torch.set_num_threads(args.threads)
    privleak.set_num_threads(args.threads)  # privleak's kernels (ghost norms, noise) get the same cores
    # Opacus's hooks fire with no input requiring grad (the first layer's): torch says so every step.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    if args.child:
        side, name, batch = args.child
        child(side, name, int(batch), args.device, args.memory_steps, args.physical)
        return
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    # torch's precision settings as the user has them, for every side (cuDNN's TF32 is on by default)
    where = (f"{torch.cuda.get_device_name()}, cuDNN TF32 {torch.backends.cudnn.allow_tf32}, matmul TF32 "
             f"{torch.backends.cuda.matmul.allow_tf32}"
             if args.device == "cuda" else f"{cpu_name()}, {torch.get_num_threads()} torch threads")
    print(f"torch {torch.__version__}, {where}; clip {CLIP}, noise multiplier {SIGMA}, flat clipping\n")
    names = [n for n in args.models if not (n in LARGE and (args.skip_large or args.quick))]
    rows = []
    for name in names:
        batches = args.batches or (MODELS[name][4] if args.quick else MODELS[name][3])
        for batch in batches:
            model, x, y, criterion_class = setting(name, batch, args.device)
            every = SIDES + (GRAPHED if args.device == "cuda" else ()) + ((CHECKED,) if args.check_every_step else ())
            sides = [s for s in every if s not in MATERIALISING or needs_gb(model, batch) <= args.max_gb]
            if args.physical:
                sides = ["non-private", "book-keeping", *([CHECKED] if args.check_every_step else [])]
            steps, failed = {}, {}
            for side in sides:  # a side that cannot train the model says why (Opacus on GPT-2)
                try:
                    steps[side] = make_side(side, copy.deepcopy(model), criterion_class, batch, x, args.physical, y)
                    steps[side](x, y)
                except Exception as error:  # the row shows what the library raised
                    failed[side] = f"fails: {type(error).__name__}: {str(error).splitlines()[0][:70]}"
                    steps.pop(side, None)
            sides = [s for s in sides if s not in failed]
            fns = {s: (lambda step=steps[s]: step(x, y)) for s in sides}
            # Enough calls a round that one lasts about 50 ms (a small model's step is a few ms).
            once = seconds(fns["non-private"], repeat=3, sync=sync)
            rounds, repeat = (2, 2) if args.quick else (args.rounds, max(3, math.ceil(0.05 / once)))
            by_round = seconds_by_round(fns, rounds=rounds, repeat=repeat, sync=sync)
            times = {s: statistics.median(t) for s, t in by_round.items()}
            hosts = {s: host_profile(fns[s], args.device) for s in sides} if args.profile else {}
            del steps, fns  # the children measure on the same GPU
            if args.device == "cuda":
                torch.cuda.empty_cache()
            memory = {} if args.no_memory else {s: peak_memory(s, name, batch, args) for s in sides}
            params = sum(p.numel() for p in model.parameters() if p.requires_grad)
            for side in every:
                row = {"model": name, "params": f"{params / 1e6:.2f}M", "batch": batch, "side": side}
                if side in failed:
                    row["ms"] = failed[side]
                elif side not in times:
                    row["ms"] = ("not with --physical" if args.physical else
                                 f"skipped: B x P = {needs_gb(model, batch):.1f} GB")
                else:
                    row["ms"] = f"{times[side] * 1e3:.1f}"
                    row["x non-private"] = f"{ratio_by_round(by_round, side, 'non-private'):.2f}x"
                    if side in hosts:
                        host = hosts[side]
                        row["ops"] = str(host["ops"])
                        if "launches" in host:
                            row["launches"] = f"{host['launches']:.0f}"
                            row["GPU busy ms"] = f"{host['busy_ms']:.2f}"
                    if side in memory:
                        peaks, floor = memory[side], memory["non-private"]
                        row["peak MiB"] = f"{peaks['peak'] / 2**20:.0f}"
                        row["mem x non-private"] = f"{peaks['peak'] / max(floor['peak'], 1):.2f}x"
                        row["after step 1"] = f"{peaks['later'] / max(floor['later'], 1):.2f}x"
                rows.append(row)
            profiled = ["ops", "launches", "GPU busy ms"] if args.device == "cuda" else ["ops"]
            profiled = profiled if args.profile else []
            print(table(rows[-len(every):], ["model", "params", "batch", "side", "ms", "x non-private", *profiled,
                                             "peak MiB", "mem x non-private", "after step 1"]), flush=True)
            print()


if __name__ == "__main__":
    main()
