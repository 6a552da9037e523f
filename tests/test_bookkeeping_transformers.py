"""dpsgd.BookKeeping on Hugging Face models as users build them (random weights from a small
config, nothing downloaded): GPT-2 (transformers' Conv1D projections, the output head tied to the
token embedding, position embeddings of position ids (1, T) shared by the batch), a LLaMA-style
model (RMSNorm modules of its own, weight times the normalised batch; rotary positions; tied
head), Gemma (its RMSNorm the batch times 1 + weight), BERT, T5 (a relative position bias of
buckets (T, T) added to every layer's scores), BART (learned position embeddings that make their
own ids, (B, T) in the encoder and (1, T) in the decoder), Falcon (FalconLinear) and OPT (its MLP on
the hidden states flattened to (B T, d); position ids from the attention mask), mixtures of
experts (Mixtral, Qwen2-MoE, GPT-OSS, DeepSeek-V3, GLM-4-MoE, NemotronH: experts book-kept,
routers replayed on each sample's tokens, flattened before the router or by it); and LoRA,
DoRA, a LoRA embedding, LoRA on parameters and prompt tuning by peft on some of them. The
reference is independent of book-keeping and of torch.func: each sample's gradient from its own
backward pass (on a batch of one; with LoRA's dropout, through the batch's forward), through
dpsgd.privatize with the same config and noise stream."""
import copy

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers
from privleak import dpsgd
from privleak import mechanisms as M
from privleak.dpsgd import experts as experts_rule
from privleak.dpsgd import layers
from test_graphed_step import HostReads

VOCAB = 50


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
        pad_token_id=0))


def gemma():
    return transformers.GemmaForCausalLM(transformers.GemmaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=16, bos_token_id=0, eos_token_id=0,
        pad_token_id=0))


def bert():
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2,
        pad_token_id=0))


def bert_mlm():  # its head holds the decoder's bias too (decoder.bias = self.bias): refused as tied before
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0))


def t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


def bart():
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=16, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, scale_embedding=True, pad_token_id=0, bos_token_id=0,
        eos_token_id=0, decoder_start_token_id=0, forced_eos_token_id=None))


def falcon():
    return transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, hidden_dropout=0.0,
        attention_dropout=0.0, bos_token_id=0, eos_token_id=0))


def opt():
    return transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=16, word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0, pad_token_id=0,
        bos_token_id=0, eos_token_id=0))


def mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, num_local_experts=4, num_experts_per_tok=2,
        bos_token_id=0, eos_token_id=0, pad_token_id=0))


def qwen2_moe():
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        shared_expert_intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
        num_experts=4, num_experts_per_tok=2, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def gpt_oss():
    return transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["full_attention"] * 2, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def deepseek_v3():  # its router flattens (B, T, d) itself: sigmoid scores, groups of experts, a scaling factor
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=0, routed_scaling_factor=2.5, q_lora_rank=None,
        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, max_position_embeddings=16,
        bos_token_id=0, eos_token_id=0, pad_token_id=0))


def glm4_moe():  # DeepSeek-V3's router, partial rotary positions, a dense first layer
    return transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=16,
        bos_token_id=0, eos_token_id=0, pad_token_id=0))


def nemotron_h():  # attention and mixture-of-experts layers; the router as DeepSeek-V3's, ReLU^2 experts
    return transformers.NemotronHForCausalLM(transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=4, hybrid_override_pattern="*E*E", num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
        moe_shared_expert_intermediate_size=8, n_group=1, topk_group=1, max_position_embeddings=16,
        bos_token_id=0, eos_token_id=0, pad_token_id=0))



def mamba():  # a selective state-space mixer: its conv1d and dt_proj read by the mixer's own code
    return transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=3,
        time_step_rank=4, pad_token_id=0, bos_token_id=0, eos_token_id=0))


def qwen3_5():  # a gated delta net (linear attention, its conv1d read so), then full attention
    return transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=4,
        linear_value_head_dim=4, linear_conv_kernel_dim=3, layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=16, tie_word_embeddings=True, pad_token_id=0, bos_token_id=0, eos_token_id=0))


def deberta_v2(share_att_key=True):  # DeBERTa-v3's attention: relative positions LayerNormed, in log buckets
    return transformers.DebertaV2ForSequenceClassification(transformers.DebertaV2Config(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2,
        pad_token_id=0, relative_attention=True, position_buckets=4, max_relative_positions=16,
        pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm", share_att_key=share_att_key,
        position_biased_input=False))


def padding_of(ids):
    """Each sample's attention mask: its first 4 + id_0 mod 6 tokens."""
    return (torch.arange(ids.shape[1])[None] < 4 + ids[:, :1] % 6).long()


def translate(model, ids):
    """Sequence to sequence, the source padded: the ids back, one token on (teacher forcing)."""
    logits = model(input_ids=ids, attention_mask=padding_of(ids), decoder_input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def next_token(model, ids):
    logits = model(ids).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def next_token_uncached(model, ids):
    """next_token without the cache that a causal LM otherwise fills (a mixer's convolution
    state, which its replay per sample cannot share with the batch's call)."""
    logits = model(ids, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def fill_in(model, ids):
    """Masked language modelling: each token from its sequence with its first token masked."""
    return F.cross_entropy(model(ids.index_fill(1, torch.tensor([0]), 1)).logits.transpose(1, 2), ids,
                           reduction="none").mean(1)


def classify(model, ids):
    return F.cross_entropy(model(ids).logits, ids[:, 0] % 2, reduction="none")


MODELS = {"gpt2": (gpt2, next_token), "llama": (llama, next_token), "gemma": (gemma, next_token),
          "bert": (bert, classify), "bert-mlm": (bert_mlm, fill_in),
          "t5": (t5, translate), "bart": (bart, translate), "falcon": (falcon, next_token),
          "opt": (opt, next_token)}
#: mixtures of experts: their experts book-kept, their routers replayed per sample
MIXTURES = {"mixtral": (mixtral, next_token), "qwen2-moe": (qwen2_moe, next_token), "gpt-oss": (gpt_oss, next_token),
            "deepseek-v3": (deepseek_v3, next_token), "glm4-moe": (glm4_moe, next_token),
            "nemotron-h": (nemotron_h, next_token)}
ROUTERS = {"mixtral": "gate", "qwen2-moe": "gate", "gpt-oss": "router", "deepseek-v3": "gate", "glm4-moe": "gate",
           "nemotron-h": "gate"}
#: the shape of the ids: (5, 12); T5's and BART's also (5, 5), where T5's relative position buckets (T, T) have
#: the batch's size in dim 0 (only their output, added to the batch's attention scores, tells them apart)
SHAPES = [(name, (5, 12)) for name in MODELS] + [("t5", (5, 5)), ("bart", (5, 5))]


def one_sample_at_a_time(model, losses, ids):
    """(B, *shape) per parameter: each sample's gradient by its own backward pass."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [torch.autograd.grad(losses(model, ids[i:i + 1]).sum(), params) for i in range(len(ids))]
    return [torch.stack(column) for column in zip(*rows)]


@pytest.fixture(autouse=True)
def quiet_transformers():
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)


def assert_the_update_of(grads, model, losses, mechanism, per_layer, monkeypatch, replayed=(), atol=1e-6):
    """BookKeeping's step on the losses ``losses()`` gives privatize's update of the per-sample
    gradients ``grads`` (same config, same noise stream), to ``atol`` times the update's largest
    element, and replays no module per sample but those named ``replayed`` (by the end of their
    names)."""
    order = 1 if mechanism == "laplace" else 2
    norms = torch.stack([g.flatten(1).double().norm(p=order, dim=1) for g in grads], 1)
    # a parameter whose gradients are rounding (BART's at T = 5: 1e-15, below the clip norms taken) gets 1e-9
    clip = ([max(float(c), 1e-9) for c in norms.median(0).values] if per_layer
            else float(norms.norm(p=order, dim=1).median()))
    noise = {"gaussian": {"noise_multiplier": 0.2}, "vmf": {"kappa": 50.0}, "laplace": {"noise_multiplier": 0.7}}
    config = dpsgd.DPSGDConfig(clip, mechanism, per_layer=per_layer, **noise[mechanism])
    want = dpsgd.privatize(grads, config, 4.0, M.NoiseGenerator(7))
    params = [p for p in model.parameters() if p.requires_grad]
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(params, lr=0.0), config, expected_batch_size=4.0,
                           generator=M.NoiseGenerator(7))
    replays = []
    replay = layers.FunctionalLayer.per_sample_grads
    monkeypatch.setattr(layers.FunctionalLayer, "per_sample_grads",
                        lambda self, batch, *chunk: replays.append(self.name) or replay(self, batch, *chunk))
    got = bk.step(losses())
    assert sorted(name.rsplit(".", 1)[-1] for name in set(replays)) == sorted(replayed)  # a call per chunk
    scale = max(float(w.abs().max()) for w in want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=atol * scale)
    return bk


@pytest.mark.parametrize("mechanism, per_layer", [("gaussian", False), ("vmf", True)])
@pytest.mark.parametrize("name, shape", SHAPES)
def test_a_hugging_face_model_gets_the_update_of_its_per_sample_gradients(name, shape, mechanism, per_layer,
                                                                          monkeypatch):
    """The same update, and no module replayed per sample: every parameter is book-kept, or (the
    LLaMA and Gemma models' RMSNorm weights) taken from the product's output gradient times its
    other factor; a layer output the batch shares (GPT-2's and BART's position embeddings, T5's
    relative position bias, under the padding and causal masks of scaled dot-product attention)
    takes each sample's gradient from the ops adding it to the batch."""
    build, losses = MODELS[name]
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(1, VOCAB, shape, generator=torch.Generator().manual_seed(1))
    grads = one_sample_at_a_time(model, losses, ids)
    bk = assert_the_update_of(grads, model, lambda: losses(model, ids), mechanism, per_layer, monkeypatch)
    if name != "bert":  # the head is the token embedding's weight, clipped as one parameter
        assert len(bk._tied) == 1 and model.get_output_embeddings().weight is model.get_input_embeddings().weight



#: mixers whose own code reads their children's parameters (a causal convolution by self.conv1d.weight): replayed
#: (and the gated delta net's gated RMSNorm, called on the batch flattened with its positions and heads)
MIXERS = {"mamba": (mamba, ("mixer", "mixer")), "qwen3.5": (qwen3_5, ("linear_attn", "norm"))}


@pytest.mark.parametrize("mechanism, per_layer", [("gaussian", False), ("vmf", True)])
@pytest.mark.parametrize("name", MIXERS)
def test_a_state_space_or_linear_attention_mixer_is_replayed_with_the_children_it_reads(name, mechanism, per_layer,
                                                                                       monkeypatch):
    """Mamba's mixer and Qwen3.5's gated delta net pass their conv1d's weight to a causal
    convolution of their own (refused before as a use the hooks cannot see): each is replayed per
    sample with those children, the projections it calls book-kept, and the update is that of the
    per-sample gradients."""
    build, replayed = MIXERS[name]
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(1, VOCAB, (5, 8), generator=torch.Generator().manual_seed(1))
    grads = one_sample_at_a_time(model, next_token_uncached, ids)
    with pytest.warns(UserWarning, match="replay its whole forward per sample"):
        bk = assert_the_update_of(grads, model, lambda: next_token_uncached(model, ids), mechanism, per_layer,
                                  monkeypatch, replayed=replayed)
    mixers = [layer for layer in bk.layers if layer.name.endswith(replayed[0])]
    assert mixers and all("conv1d" in layer.read_children for layer in mixers)
    assert len(bk._tied) == 1


@pytest.mark.parametrize("shape", [(5, 12), (8, 6), (1, 12)], ids=["batch", "batch-of-table-rows", "one-sample"])
@pytest.mark.parametrize("share_att_key", [True, False], ids=["shared-projections", "position-projections"])
@pytest.mark.parametrize("mechanism, per_layer", [("gaussian", False), ("vmf", True)])
def test_deberta_s_relative_positions_are_book_kept_through_the_layers_projecting_them(shape, share_att_key,
                                                                                     mechanism, per_layer, monkeypatch):
    """DeBERTa-v2/v3: the encoder reads its relative position table's weight, LayerNorms it, and
    each layer projects it by its query and key Linears (or position Linears of its own) and
    tiles the projection over the batch (``repeat(B, 1, 1)``) beside the queries and keys. The
    projections take each sample's output gradient from the tiling; the LayerNorm and the table
    theirs through the projections (one vmapped backward pass of that region, which holds no
    batch), with no replay but of the encoder at one sample (where it costs one backward pass). A
    batch of 8, the table's rows (2 x 4 position buckets), does not make the table look like one."""
    torch.manual_seed(0)
    model = deberta_v2(share_att_key)
    ids = torch.randint(1, VOCAB, shape, generator=torch.Generator().manual_seed(1))
    grads = one_sample_at_a_time(model, classify, ids)
    assert_the_update_of(grads, model, lambda: classify(model, ids), mechanism, per_layer, monkeypatch,
                         replayed=("encoder",) if shape[0] == 1 else ())


def test_a_mixer_replayed_beside_the_cache_it_fills_is_refused_saying_to_train_without_it():
    """Qwen3.5 called as a causal LM fills a cache with each layer's convolution state: the batch's
    call leaves the whole batch's there, and a replay of one sample cannot run on it."""
    torch.manual_seed(0)
    model = qwen3_5()
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.1), dpsgd.DPSGDConfig(1.0),
                           expected_batch_size=4.0)
    ids = torch.randint(1, VOCAB, (3, 6), generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match="replay its whole forward"), pytest.raises(
            ValueError, match=r"'model.layers.0.linear_attn' \(Qwen3_5GatedDeltaNet\) is replayed per sample .*"
                              r"a cache passed in: call a Hugging Face model with use_cache=False"):
        bk.step(next_token(model, ids))

@pytest.mark.parametrize("experts", ["grouped_mm", "batched_mm", "eager"])
@pytest.mark.parametrize("name", MIXTURES)
def test_a_mixture_of_experts_gets_the_update_of_its_per_sample_gradients(name, experts, monkeypatch):
    """Mixtral, Qwen2-MoE and GPT-OSS trained whole, with each of transformers' implementations of
    the experts (the grouped or batched matrix products over all experts, or the eager loop over
    them): the experts (3D weights, GPT-OSS's stored transposed with biases and its gate and up
    interleaved) book-kept from each sample's tokens routed to each expert; the routers (a weight
    of their own, on the tokens flattened to (B T, d), returning their logits beside the routing
    weights made from them) replayed with each sample's T tokens; the rest (attention, GPT-OSS's
    attention sinks, Qwen's shared expert on the flattened tokens) book-kept."""
    build, losses = MIXTURES[name]
    torch.manual_seed(0)
    model = build()
    model.set_experts_implementation(experts)
    ids = torch.randint(1, VOCAB, (5, 12), generator=torch.Generator().manual_seed(1))
    grads = one_sample_at_a_time(model, losses, ids)
    assert_the_update_of(grads, model, lambda: losses(model, ids), "gaussian", False, monkeypatch,
                         replayed=(ROUTERS[name],) * 2)


@pytest.mark.parametrize("name", MIXTURES)
def test_experts_that_sort_one_token_a_sample_by_expert_are_no_reorder_of_the_batch(name, monkeypatch):
    """Top-1 routing of one token a sample: the grouped_mm experts sort the tokens by expert (their
    rows the batch's, in another order) inside their own forward, which their rule reads by
    routing; the check of rows taken out of order passes over it (a review found it refused), and
    the update is that of each sample's own backward pass."""
    build, _ = MIXTURES[name]
    torch.manual_seed(0)
    model = build()
    model.config.num_experts_per_tok = 1
    if name == "deepseek-v3":
        model.config.n_group = model.config.topk_group = 1
    torch.manual_seed(0)
    model = type(model)(model.config)
    model.set_experts_implementation("grouped_mm")
    ids = torch.randint(1, VOCAB, (5, 1), generator=torch.Generator().manual_seed(1))

    def losses(model, ids):  # each sample's label a function of its token
        return F.cross_entropy(model(ids).logits[:, -1], (7 * ids[:, 0] + 3) % VOCAB, reduction="none")
    grads = one_sample_at_a_time(model, losses, ids)
    assert_the_update_of(grads, model, lambda: losses(model, ids), "gaussian", False, monkeypatch,
                         replayed=(ROUTERS[name],) * 2)


@pytest.mark.parametrize("mechanism, per_layer", [("vmf", True), ("laplace", False), ("laplace", True)])
@pytest.mark.parametrize("name", MIXTURES)
def test_the_experts_per_layer_and_l1_norms_are_those_of_their_per_sample_gradients(name, mechanism, per_layer,
                                                                                    monkeypatch):
    """Per-layer clipping (each expert projection's weight and bias its own clip factors) and L1
    norms (the Laplace mechanism: each (sample, expert) group's gradient formed, a group at a time)."""
    build, losses = MIXTURES[name]
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(1, VOCAB, (5, 12), generator=torch.Generator().manual_seed(1))
    grads = one_sample_at_a_time(model, losses, ids)
    assert_the_update_of(grads, model, lambda: losses(model, ids), mechanism, per_layer, monkeypatch,
                         replayed=(ROUTERS[name],) * 2)


class ExpertsBlock(torch.nn.Module):
    """A mixture-of-experts block of transformers' parts on a (B, T, 16) batch: a linear layer,
    Mixtral's router on the flattened tokens, ``experts`` (4 of them, 2 a token), ``calls`` times
    (the same router and experts), a linear head."""

    def __init__(self, experts, calls=1):
        super().__init__()
        self.calls = calls
        self.gate = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(
            transformers.MixtralConfig(hidden_size=16, num_local_experts=4, num_experts_per_tok=2))
        self.embed, self.experts, self.head = torch.nn.Linear(16, 16), experts, torch.nn.Linear(16, 3)
        with torch.no_grad():  # transformers' modules leave their weights to the model's initialisation
            for p in self.parameters():
                p.normal_(0, 0.5)

    def forward(self, x):
        x = self.embed(x)
        for _ in range(self.calls):
            tokens = x.reshape(-1, x.shape[-1])
            _, weights, index = self.gate(tokens)
            x = torch.tanh(self.experts(tokens, index, weights).view(x.shape))
        return self.head(x)


def nemotron_h_experts():  # no gate: up, ReLU^2, down
    return transformers.models.nemotron_h.modeling_nemotron_h.NemotronHExperts(transformers.NemotronHConfig(
        hidden_size=16, n_routed_experts=4, moe_intermediate_size=8, num_experts_per_tok=2))


def mixtral_experts():
    return transformers.models.mixtral.modeling_mixtral.MixtralExperts(transformers.MixtralConfig(
        hidden_size=16, intermediate_size=8, num_local_experts=4))


class CancellingExperts(torch.nn.Module):
    """Mixtral's experts, every token routed to experts 0 and 1 with weight 1/2, after an identity
    map (the flattened batch's graph), the loss weighing their outputs by w."""

    def __init__(self):
        super().__init__()
        self.experts = mixtral_experts()
        self.experts.config._experts_implementation = "eager"
        with torch.no_grad():
            for p in self.experts.parameters():
                p.normal_(0, 0.5)
        self.embed = torch.nn.Linear(16, 16, bias=False)
        self.embed.weight.data = torch.eye(16)
        self.embed.weight.requires_grad_(False)

    def forward(self, x, w):
        tokens = self.embed(x).reshape(-1, 16)
        index, weights = torch.tensor([[0, 1]]).expand(len(tokens), 2), torch.full((len(tokens), 2), 0.5)
        return (self.experts(tokens, index, weights).view(x.shape) * w).sum((1, 2))


def test_an_expert_gradient_formed_for_its_norm_is_the_one_its_sum_adds():
    """Under L1 norms each (sample, expert) group's gradient is formed for its norm, and the sum adds
    the same ones (test_bookkeeping's test of that name): sample 0 one token at all 16 positions,
    the loss's weights of mean 0 over them (entries up to 1e4), so the down projection's gradient
    of each of its experts cancels to float32 rounding; the other samples' inputs are 0. Summed
    by one product per expert, sample 0's share reached 1.16 times C in these seeds; now C."""
    config = dpsgd.DPSGDConfig(1.0, noise_multiplier=1e-12, mechanism="laplace")
    shares = []
    for magnitude in (1e2, 1e4):
        for seed in range(6):
            generator = torch.Generator().manual_seed(seed)
            x = torch.zeros(8, 16, 16)
            x[0] = torch.randn(1, 16, generator=generator).expand(16, 16)
            w = torch.zeros(8, 16, 16, dtype=torch.float64)
            w[0] = torch.randn(16, 16, generator=generator, dtype=torch.float64) * magnitude
            torch.manual_seed(seed)
            model = CancellingExperts()
            bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.1), config, expected_batch_size=8,
                                   check_first_sample=False)
            losses = model(x.requires_grad_(), (w - w.mean(1, keepdim=True)).float())
            shares.append(float(torch.cat([u.flatten() for u in bk.step(losses)]).double().norm(p=1)) * 8)
    assert max(shares) <= 1 + 2.0**-14, max(shares)
    assert sum(share > 0.5 for share in shares) >= len(shares) // 2


def test_an_expert_group_whose_ghost_norm_cancels_is_summed_apart_in_float64():
    """Four alike samples of two equal tokens, their outputs weighed by scale c and -(scale + 1) c
    in the loss (test_bookkeeping's RepeatedInput, routed to experts 0 and 1): each (sample,
    expert) group's gradient is the difference, which its ghost norm's sum over the pairs of
    tokens loses to cancellation, and the norm is computed again in float64. The group's pairs
    are then summed in float64 too, where the float32 product per expert, which cancels as the
    norm does, released 1 + 9.3e-4 times C in these seeds; now C."""
    config = dpsgd.DPSGDConfig(1.0, noise_multiplier=0.0)
    released = []
    for seed in range(3):
        for scale in (1e2, 1e3, 1e4, 1e5, 1e6):
            generator = torch.Generator().manual_seed(seed)
            x = torch.randn(1, 1, 16, generator=generator).expand(4, 2, 16).contiguous()
            c = torch.randn(1, 1, 16, generator=generator)
            w = torch.cat([scale * c, -(scale + 1) * c], 1).expand(4, 2, 16)
            torch.manual_seed(seed)
            model = CancellingExperts()
            bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.1), config, expected_batch_size=4,
                                   check_first_sample=False)
            released.append(float(torch.cat([u.flatten() for u in bk.step(model(x.requires_grad_(), w))]).double()
                                  .norm()))
    assert 1 - 2.0**-4 <= min(released) and max(released) <= 1 + 2.0**-20, (min(released), max(released))


def keep_pairs(monkeypatch, kept):
    """Whether the experts keep their recomputed pairs from the norms for the sums (where they are
    no larger than the parameters), or make them again, whatever their size."""
    monkeypatch.setattr(experts_rule._Routed, "size", lambda self: 0 if kept else float("inf"))


@pytest.mark.parametrize("kept", [True, False], ids=["pairs-kept", "pairs-recomputed"])
@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
@pytest.mark.parametrize("length, calls", [(1, 1), (40, 1), (6, 2)])
@pytest.mark.parametrize("kind", [nemotron_h_experts, mixtral_experts])
def test_experts_book_kept_on_one_token_a_long_sequence_or_twice(kind, length, calls, experts, kept, monkeypatch):
    """Experts without a gate (NemotronH's), one token a sample (no positions flattened: each
    sample's gradients rank one per expert), 40 tokens a sample, whose (sample, expert) groups of
    about 20 rows are past the mixed rule's line (2 T^2 >= d p: the groups' gradients formed, a few
    groups at a time), and the experts used twice in a step (a sample's gradient of an expert is
    the sum over both calls' rows). An experts module in expert-parallel mode is not this rule's:
    it is replayed."""
    keep_pairs(monkeypatch, kept)
    torch.manual_seed(0)
    module = kind()
    module.config._experts_implementation = experts
    model = ExpertsBlock(module, calls)
    x = torch.randn(6, length, 16, generator=torch.Generator().manual_seed(2))
    target = torch.randint(0, 3, (6, length), generator=torch.Generator().manual_seed(3))

    def losses(model, x=x, target=target):
        return F.cross_entropy(model(x).transpose(1, 2), target, reduction="none").mean(1)

    rows = [torch.autograd.grad(losses(model, x[i:i + 1], target[i:i + 1]).sum(), list(model.parameters()))
            for i in range(len(x))]
    grads = [torch.stack(column) for column in zip(*rows)]
    assert type(layers.layer_for("experts", module)) is experts_rule.ExpertsLayer
    # Twice through the router and experts, float32 rounding reaches 1.5e-6 of the update's scale (in float64 the
    # two sides agree to float32's rounding of the update).
    assert_the_update_of(grads, model, lambda: losses(model), "gaussian", False, monkeypatch, replayed=("gate",),
                         atol=1e-6 * 5 ** (calls - 1))
    module._is_expert_parallel = True
    assert type(layers.layer_for("experts", module)) is layers.FunctionalLayer


@pytest.mark.parametrize("kept", [True, False], ids=["pairs-kept", "pairs-recomputed"])
def test_experts_leave_out_the_samples_they_drop(kept, monkeypatch):
    """non_finite='drop': a sample with a NaN input is left out of the experts' clipped sums
    (its pairs taken out of those kept from the norms, or not recomputed: 0 * NaN would reach the
    sums)."""
    keep_pairs(monkeypatch, kept)
    torch.manual_seed(0)
    model = ExpertsBlock(mixtral_experts())
    x = torch.randn(5, 6, 16, generator=torch.Generator().manual_seed(2))
    x[3, 2, 0] = float("nan")
    params = list(model.parameters())
    rows = [torch.autograd.grad(model(x[i:i + 1]).square().mean(), params) for i in range(len(x))]
    config = dpsgd.DPSGDConfig(0.5, noise_multiplier=0.3, non_finite="drop")
    want = dpsgd.privatize([torch.stack(column) for column in zip(*rows)], config, 4.0, M.NoiseGenerator(1))
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(params, lr=0.0), config, expected_batch_size=4.0,
                           generator=M.NoiseGenerator(1))
    got = bk.step(model(x).square().mean((1, 2)))
    assert all(bool(torch.isfinite(g).all()) for g in got)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def lora(**adapters):
    """A fresh LoRA config (get_peft_model writes into the one it is given)."""
    return lambda: peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "lora_dropout": 0.25, **adapters})


#: case: model, peft's config (made fresh), the modules replayed per sample
PEFT = {
    "gpt2": ("gpt2", lora(target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True), ()),  # Conv1D bases
    "llama": ("llama", lora(target_modules="all-linear"), ()),
    "bert": ("bert", lora(target_modules=["query", "value"], modules_to_save=["classifier"]), ()),
    "t5": ("t5", lora(target_modules=["q", "v", "wi", "wo"]), ()),
    # DoRA: each adapted layer's output rescaled by a magnitude over its weights' (detached) norms
    "llama-dora": ("llama", lora(target_modules=["q_proj", "v_proj", "down_proj"], use_dora=True), ()),
    # LoRA on the token embedding: A and B in ParameterDicts, used by a lookup and a product
    "gpt2-embedding": ("gpt2", lora(target_modules=["wte", "c_attn"], fan_in_fan_out=True), ("wte",)),
    # prompt tuning: virtual tokens' embeddings of ids (1, n), repeated over the batch; the classifier trained
    "bert-prompt": ("bert", lambda: peft.PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=3), ()),
    # LoRA on Mixtral's router and experts' weights (parameters, not modules: peft's ParamWrapper adds B A to
    # them by a parametrization, which torch.func cannot transform): replayed one sample at a time
    "mixtral-all-linear": ("mixtral", lora(target_modules="all-linear", lora_dropout=0.0), ("gate", "experts") * 2),
    "mixtral-experts": ("mixtral", lora(target_modules=["q_proj"], target_parameters=["experts.gate_up_proj",
                                                                                      "experts.down_proj"],
                                        lora_dropout=0.0), ("experts",) * 2),
}


@pytest.mark.parametrize("mechanism, per_layer", [("gaussian", False), ("vmf", True)])
@pytest.mark.parametrize("case", PEFT)
def test_peft_adapters_get_the_update_of_their_per_sample_gradients(case, mechanism, per_layer, monkeypatch):
    """DP fine-tuning with peft: the base model frozen; LoRA's A and B (nn.Linear) book-kept, its
    dropout in training mode; DoRA's magnitudes from their products with the batch; a LoRA
    embedding replayed (its A and B are no layer's), its dropout unused; prompt tuning's
    embedding of the virtual tokens from the repeat over the batch. The reference sees the same
    dropout masks: one forward of the batch, seeded as book-keeping's is, then each sample's
    gradient by its own backward pass through it (its loss depends on its sample alone)."""
    name, config, replayed = PEFT[case]
    build, losses = {**MODELS, **MIXTURES}[name]
    torch.manual_seed(0)
    model = peft.get_peft_model(build(), config())
    with torch.no_grad():  # B (an embedding's A) starts at 0, which would leave the other without gradient
        for zero in (p for n, p in model.named_parameters() if "lora_B" in n or "lora_embedding" in n):
            zero.normal_(0, 0.1)
    params = [p for p in model.parameters() if p.requires_grad]
    assert 0 < len(params) < len(list(model.parameters()))
    ids = torch.randint(1, VOCAB, (5, 12), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(3)
    batch_losses = losses(model, ids)
    rows = [torch.autograd.grad(loss, params, retain_graph=True) for loss in batch_losses]
    grads = [torch.stack(column) for column in zip(*rows)]
    torch.manual_seed(3)
    assert_the_update_of(grads, model, lambda: losses(model, ids), mechanism, per_layer, monkeypatch, replayed)


def swin():
    return transformers.SwinForImageClassification(transformers.SwinConfig(
        image_size=16, patch_size=2, num_channels=3, embed_dim=8, depths=[2, 1], num_heads=[2, 2], window_size=4,
        mlp_ratio=2.0, num_labels=3, drop_path_rate=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def swinv2():  # cosine attention times a learned logit scale; a bias made by an MLP of a buffer of coordinates
    return transformers.Swinv2ForImageClassification(transformers.Swinv2Config(
        image_size=16, patch_size=2, num_channels=3, embed_dim=8, depths=[2, 1], num_heads=[2, 2], window_size=2,
        mlp_ratio=2.0, num_labels=3, drop_path_rate=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def mobilevit():  # its BatchNorms in eval mode: their statistics frozen
    return transformers.MobileViTForImageClassification(transformers.MobileViTConfig(
        image_size=16, num_channels=3, hidden_sizes=[16, 16, 16], neck_hidden_sizes=[8, 8, 8, 8, 8, 8, 16],
        num_attention_heads=2, num_labels=3, expand_ratio=2.0, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0)).eval()


#: vision models whose attention runs on the batch flattened with windows or patches, (B nW, N, C), and the
#: modules they replay (each of Swin's position tables; MobileViT's BatchNorms, in eval mode)
WINDOWED = {"swin": (swin, lambda model: ("relative_position_bias",) * 3), "swinv2": (swinv2, lambda model: ()),
            "mobilevit": (mobilevit, lambda model: tuple(name.rsplit(".", 1)[-1] for name, module in
                                                         model.named_modules()
                                                         if isinstance(module, torch.nn.BatchNorm2d)))}


@pytest.mark.parametrize("mechanism, per_layer", [("gaussian", False), ("laplace", True)])
@pytest.mark.parametrize("name", WINDOWED)
def test_attention_on_windows_of_each_sample_in_turn_is_book_kept(name, mechanism, per_layer, monkeypatch):
    """Swin attends within windows, its batch (B, H, W, C) reshaped to (B nW, ws ws, C) (shifted
    by a roll in every other block), the attention's output projection on the product of its
    scores and values, and a relative-position bias table, indexed to (heads, N, N), added to the
    scores of every window (with a constant mask in the shifted blocks); MobileViT attends across
    the patches, its feature map unfolded to (B P, N, C). The rows are each sample's in turn (a
    reshape keeps the order; ops on later dims and a batched product of two such tensors keep
    the rows), so the projections are book-kept and Swin's table takes the sum of its sample's
    windows' gradients. Both were refused before (the output projection's rows not proven the
    samples'). Swin v2 normalises queries and keys (cosine attention: a norm along the last dim,
    clamped), multiplies the scores by exp(clamp(logit scale)), and adds 16 sigmoid(.) of a table
    that an MLP makes of its buffer of coordinates, indexed: that region, without the batch, takes
    each sample's gradients through the ops broadcasting it over the windows (no replay)."""
    build, replayed = WINDOWED[name]
    torch.manual_seed(0)
    model = build()
    images = torch.randn(5, 3, 16, 16, generator=torch.Generator().manual_seed(1))

    def losses(model, x):
        return F.cross_entropy(model(pixel_values=x).logits, x[:, 0, 0, 0].gt(0).long(), reduction="none")
    grads = one_sample_at_a_time(model, losses, images)
    assert_the_update_of(grads, model, lambda: losses(model, images), mechanism, per_layer, monkeypatch,
                         replayed=replayed(model))


def test_swin_under_bfloat16_autocast_gets_its_update_to_bfloat16_precision():
    """Under autocast the relative-position bias plus the shifted windows' mask is cast to
    bfloat16 before it meets the scores: the sum is shared through the cast (a review found Swin
    refused there). The update is the float32 per-sample reference's to bfloat16's precision."""
    def losses(model, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(pixel_values=x).logits
        return F.cross_entropy(logits.float(), x[:, 0, 0, 0].gt(0).long(), reduction="none")

    torch.manual_seed(0)
    model = swin()
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    grads = one_sample_at_a_time(model, losses, images)
    config = dpsgd.DPSGDConfig(1e-3, noise_multiplier=0.0)
    want = dpsgd.privatize(grads, config, 4.0, M.NoiseGenerator(7))
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.0), config, expected_batch_size=4.0,
                           generator=M.NoiseGenerator(7))
    for got, reference in zip(bk.step(losses(model, images)), want):
        assert float((got - reference).norm()) <= 3e-2 * float(reference.norm()) + 1e-12


@pytest.mark.filterwarnings("ignore:max_batch=.* a Poisson batch:UserWarning")  # a graph of 5 for L = 4
@pytest.mark.parametrize("name", ["gpt2", "llama", "gemma", "bert", "falcon", "opt"])
def test_a_graphed_step_reads_nothing_on_the_host_and_gets_the_update(name):
    """BookKeeping.graphed with a graph of 5 samples, on a batch of 3 (padded with copies of its
    first): privatize's update of the 3 samples' per-sample gradients, and its captured part reads
    no tensor on the host, so a CUDA graph can capture it (T5's and BART's own forward does:
    transformers' checks of their attention masks)."""
    build, losses = MODELS[name]
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(1, VOCAB, (5, 12), generator=torch.Generator().manual_seed(1))
    grads = one_sample_at_a_time(model, losses, ids[:3])
    config = dpsgd.DPSGDConfig(0.5, noise_multiplier=0.2, non_finite="drop")
    want = dpsgd.privatize(grads, config, 4.0, M.NoiseGenerator(7))
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.0), config, expected_batch_size=4.0,
                           generator=M.NoiseGenerator(7))
    step = bk.graphed(lambda ids: losses(model, ids), ids)
    with HostReads() as captured:
        step._clipped_sums()
    assert captured.seen == []
    got = step(ids[:3])
    scale = max(float(w.abs().max()) for w in want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6 * scale)


@pytest.mark.parametrize("name", ["llama", "gemma", "gpt2"])
def test_gradient_checkpointing_gives_the_update_of_each_sample_alone(name):
    """transformers' gradient checkpointing (non-reentrant): Llama's and Gemma's RMSNorm weights,
    products with the batch, took the broadcast rule, whose node hooks read the product's other
    factor, a saved tensor that checkpointing recomputes and lets be unpacked once: the step
    crashed (CheckpointError) for any Llama (a review's repro). Under saved-tensor hooks such a
    module is replayed instead; its update is the one of a backward pass per sample."""
    build, losses = MODELS[name]
    torch.manual_seed(0)
    model = build()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(1, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
    grads = one_sample_at_a_time(model, losses, ids)
    config = dpsgd.DPSGDConfig(1e-3, noise_multiplier=0.0)
    want = dpsgd.privatize(grads, config, 4.0, M.NoiseGenerator(7))
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(model.parameters(), lr=0.0), config, expected_batch_size=4.0,
                           generator=M.NoiseGenerator(7))
    scale = max(float(w.abs().max()) for w in want)
    for got, reference in zip(bk.step(losses(model, ids)), want):
        torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-6 * scale)


def llama_dynamic_rope():
    """Its rotary frequencies made again for a sequence longer than 8 positions, and reset below."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=8, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    return transformers.LlamaForCausalLM(config)


def phi3_longrope():
    """Its rotary factors switched at 8 positions, copied into its frequencies at every call."""
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, original_max_position_embeddings=8, resid_pdrop=0.0,
        embd_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                         "long_factor": [2.0] * 4, "original_max_position_embeddings": 8}))


class Mapped(torch.nn.Module):
    """A (d, d) map of a frozen language model's token embeddings: a module with no rule, whose
    replay runs the model, its rotary embedding included."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm.requires_grad_(False)
        self.map = torch.nn.Parameter(torch.eye(16) + 0.01 * torch.randn(16, 16))

    def forward(self, ids):
        return self.lm(inputs_embeds=self.lm.get_input_embeddings()(ids) @ self.map)


@pytest.mark.parametrize("wrapped", [False, True], ids=["alone", "replayed"])
@pytest.mark.parametrize("build", [llama_dynamic_rope, phi3_longrope])
def test_rotary_embeddings_that_write_their_frequencies_get_the_update_of_each_sample_alone(build, wrapped):
    """A rotary embedding writes its frequencies in the forward: dynamic RoPE makes them again past
    its length and keeps that length as an attribute, longrope copies in the factors of the
    batch's length. Neither depends on the samples, so neither is refused (inside a replayed
    module longrope was refused as the batch's length crossed its switch), and a replay finds
    the frequencies and the length as the call did (dynamic RoPE's replay read the length the
    call left: 1e-4 off). Lengths cross the switch both ways."""
    torch.manual_seed(0)
    model = Mapped(build()) if wrapped else build()
    model.train()
    config = dpsgd.DPSGDConfig(1e-3, noise_multiplier=0.0)
    bk = dpsgd.BookKeeping(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0),
                           config, expected_batch_size=4.0, generator=M.NoiseGenerator(7))
    for step, length in enumerate((6, 12, 16, 6)):
        ids = torch.randint(1, VOCAB, (4, length), generator=torch.Generator().manual_seed(step))
        want = dpsgd.privatize(one_sample_at_a_time(copy.deepcopy(model), next_token, ids), config, 4.0,
                               M.NoiseGenerator(7))
        got = bk.step(next_token(model, ids))
        scale = max(float(w.abs().max()) for w in want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6 * scale)


def test_whisper_gets_the_update_of_each_sample_alone():
    """Whisper (a convolutional audio encoder, a decoder whose position embedding returns
    ``self.weight[a:b]``, the rows of its positions, which the batch shares: it was refused as an
    nn.Embedding returning other than its lookup): the update of each sample's backward pass."""
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=8,
        max_target_positions=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, suppress_tokens=None,
        begin_suppress_tokens=None)).train()
    generator = torch.Generator().manual_seed(1)
    features, labels = torch.randn(4, 8, 16, generator=generator), torch.randint(3, VOCAB, (4, 5), generator=generator)

    def losses(model, ids):
        logits = model(input_features=features[ids], decoder_input_ids=labels[ids]).logits
        return F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[ids][:, 1:], reduction="none").mean(1)

    samples = torch.arange(4)
    config = dpsgd.DPSGDConfig(1e-3, noise_multiplier=0.0)
    want = dpsgd.privatize(one_sample_at_a_time(model, losses, samples), config, 4.0, M.NoiseGenerator(7))
    bk = dpsgd.BookKeeping(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0), config,
                           expected_batch_size=4.0, generator=M.NoiseGenerator(7))
    got = bk.step(losses(model, samples))
    scale = max(float(w.abs().max()) for w in want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6 * scale)
