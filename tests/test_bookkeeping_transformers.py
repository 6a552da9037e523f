"""dpsgd.BookKeeping on Hugging Face models as users build them (random weights from a small
config, nothing downloaded): GPT-2 (transformers' Conv1D projections, the output head tied to the
token embedding, position embeddings of position ids (1, T) shared by the batch), a LLaMA-style
model (RMSNorm modules of its own, weight times the normalised batch; rotary positions; tied
head), Gemma (its RMSNorm the batch times 1 + weight) and BERT. The reference is
independent of book-keeping and of torch.func: each sample's gradient from its own backward pass
on a batch of one, through dpsgd.privatize with the same config and noise stream."""
import pytest
import torch
import torch.nn.functional as F
import transformers
from privleak import dpsgd
from privleak import mechanisms as M
from privleak.dpsgd import layers

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


def next_token(model, ids):
    logits = model(ids).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def classify(model, ids):
    return F.cross_entropy(model(ids).logits, ids[:, 0] % 2, reduction="none")


MODELS = {"gpt2": (gpt2, next_token), "llama": (llama, next_token), "gemma": (gemma, next_token),
          "bert": (bert, classify)}


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


@pytest.mark.parametrize("mechanism, per_layer", [("gaussian", False), ("vmf", True)])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_hugging_face_model_gets_the_update_of_its_per_sample_gradients(name, mechanism, per_layer, monkeypatch):
    """The same update, and no module replayed per sample: every parameter is book-kept, or (the
    LLaMA and Gemma models' RMSNorm weights) taken from the product's output gradient times its
    other factor."""
    build, losses = MODELS[name]
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(1, VOCAB, (5, 12), generator=torch.Generator().manual_seed(1))
    grads = one_sample_at_a_time(model, losses, ids)
    norms = torch.stack([g.flatten(1).double().norm(dim=1) for g in grads], 1)
    clip = [float(c) for c in norms.median(0).values] if per_layer else float(norms.norm(dim=1).median())
    config = (dpsgd.DPSGDConfig(clip, noise_multiplier=0.2, per_layer=per_layer) if mechanism == "gaussian"
              else dpsgd.DPSGDConfig(clip, "vmf", kappa=50.0, per_layer=per_layer))
    want = dpsgd.privatize(grads, config, 4.0, M.NoiseGenerator(7))
    params = [p for p in model.parameters() if p.requires_grad]
    bk = dpsgd.BookKeeping(model, torch.optim.SGD(params, lr=0.0), config, expected_batch_size=4.0,
                           generator=M.NoiseGenerator(7))
    replays = []
    replay = layers.FunctionalLayer.per_sample_grads
    monkeypatch.setattr(layers.FunctionalLayer, "per_sample_grads",
                        lambda self, batch: replays.append(self.name) or replay(self, batch))
    got = bk.step(losses(model, ids))
    assert not replays
    scale = max(float(w.abs().max()) for w in want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6 * scale)
    if name != "bert":  # the head is the token embedding's weight, clipped as one parameter
        assert len(bk._tied) == 1 and model.get_output_embeddings().weight is model.get_input_embeddings().weight
