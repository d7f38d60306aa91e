"""``torch_kl.transformers`` on tiny random transformers models (float32, CPU): ``fuse_loss`` gives the
unpatched model's loss and every parameter's gradient, ``distillation_loss`` the loss on both models'
own ``.logits``."""

from __future__ import annotations

import copy
import os

import pytest

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F
import transformers
from torch import nn

from torch_kl.transformers import distillation_loss, fuse_loss

SMALL = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
# name -> (config class, model class, config extras); the vocabularies are odd and even, softcaps small
# enough to bite, the logit scales far from 1.
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(vocab_size=131)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(vocab_size=160)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(vocab_size=97)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(vocab_size=128, head_dim=8)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(vocab_size=131, head_dim=8, final_logit_softcapping=1.5)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(vocab_size=99, head_dim=8, final_logit_softcapping=2.0)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(vocab_size=131, logit_scale=4.0)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(vocab_size=101, logits_scaling=0.25)),
}
ATOL = 1e-6


def tiny(name: str, seed: int = 0, **overrides: object) -> nn.Module:
    config_cls, model_cls, extra = MODELS[name]
    config = getattr(transformers, config_cls)(**{**SMALL, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float()
    with torch.no_grad():  # random init gives near-uniform logits; sharper ones make the transforms matter
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def batch(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right padding on the second row, a prompt masked with -100 on the first."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (3, 10), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[0, :4] = -100
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def loss_and_grads(model: nn.Module, **inputs: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**inputs).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.detach(), grads


def assert_same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], parameters: int) -> None:
    assert got.keys() == want.keys() and len(want) == parameters
    for name, g in want.items():
        # float32 round-off scales with the gradient's size: absolute tolerance 1e-5 of its largest entry
        atol = 1e-5 * g.abs().max().item()
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fused_loss_and_every_gradient_equal_the_unpatched_models(name: str) -> None:
    model = tiny(name)
    fused = fuse_loss(copy.deepcopy(model), backend="torch")
    inputs = batch(model.config.vocab_size)
    for num_items in (None, torch.tensor(11)):
        extra = {} if num_items is None else {"num_items_in_batch": num_items}
        want, g_want = loss_and_grads(model, **inputs, **extra)
        got, g_got = loss_and_grads(fused, **inputs, **extra)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=ATOL)
        assert_same_grads(g_got, g_want, len(list(model.parameters())))


def test_fused_loss_follows_the_models_logit_transform() -> None:
    """The softcap changes the loss: a fused loss that ignored it would fail the test above."""
    inputs = batch(131)
    capped = tiny("gemma2")(**inputs).loss
    uncapped = tiny("gemma2", final_logit_softcapping=None)(**inputs).loss
    assert abs(capped.item() - uncapped.item()) > 0.1


def test_with_labels_there_are_no_logits_and_without_labels_the_forward_is_the_models() -> None:
    model = tiny("llama")
    fused = fuse_loss(copy.deepcopy(model))
    inputs = batch(131)
    assert fused(**inputs).logits is None
    without = {k: v for k, v in inputs.items() if k != "labels"}
    out, want = fused(**without), model(**without)
    assert out.loss is None
    torch.testing.assert_close(out.logits, want.logits, rtol=0, atol=0)


def test_a_head_bias_reaches_the_loss_and_gets_its_gradient() -> None:
    model = tiny("qwen2")
    model.lm_head = nn.Linear(32, 97, bias=True)
    with torch.no_grad():
        model.lm_head.bias.normal_(0.0, 2.0)
    fused = fuse_loss(copy.deepcopy(model))
    want, g_want = loss_and_grads(model, **batch(97))
    got, g_got = loss_and_grads(fused, **batch(97))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=ATOL)
    assert "lm_head.bias" in g_want
    assert_same_grads(g_got, g_want, len(list(model.parameters())))


def test_logits_to_keep_and_shift_labels_line_up_as_in_the_unpatched_model() -> None:
    model = tiny("mistral")
    fused = fuse_loss(copy.deepcopy(model))
    inputs = batch(160)
    labels = inputs.pop("labels")
    kept = dict(inputs, labels=labels[:, -4:], logits_to_keep=4)
    torch.testing.assert_close(fused(**kept).loss, model(**kept).loss, rtol=1e-5, atol=ATOL)
    shifted = dict(inputs, labels=labels, shift_labels=torch.roll(labels, -2, dims=1))
    torch.testing.assert_close(fused(**shifted).loss, model(**shifted).loss, rtol=1e-5, atol=ATOL)


def test_return_dict_false_gives_the_loss_first() -> None:
    model = tiny("llama")
    fused = fuse_loss(copy.deepcopy(model))
    out = fused(**batch(131), return_dict=False)
    assert isinstance(out, tuple)
    torch.testing.assert_close(out[0], model(**batch(131)).loss, rtol=1e-5, atol=ATOL)


def test_options_reach_the_loss() -> None:
    model = tiny("cohere")
    inputs = batch(131)
    fused = fuse_loss(copy.deepcopy(model), label_smoothing=0.2, chunk_size=7)
    logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
    targets = F.pad(inputs["labels"], (0, 1), value=-100)[:, 1:]
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=0.2)
    torch.testing.assert_close(fused(**inputs).loss, want, rtol=1e-5, atol=ATOL)


def test_patching_again_replaces_the_options_and_a_deep_copy_runs_itself() -> None:
    model = tiny("llama")
    inputs = batch(131)
    plain = model(**inputs).loss
    fuse_loss(model, label_smoothing=0.3)
    smoothed = model(**inputs).loss
    fuse_loss(model)
    torch.testing.assert_close(model(**inputs).loss, plain, rtol=1e-5, atol=ATOL)
    assert abs(smoothed.item() - plain.item()) > 1e-3
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.zero_()  # uniform logits: loss log(V), if the copy's forward runs the copy
    torch.testing.assert_close(twin(**inputs).loss, torch.tensor(131.0).log(), rtol=1e-5, atol=ATOL)


def test_a_model_it_cannot_patch_raises_type_error_naming_what_is_missing() -> None:
    base = tiny("llama").model
    with pytest.raises(TypeError, match=r"nn\.Linear LM head"):
        fuse_loss(base)
    with pytest.raises(TypeError, match=r"nn\.Linear LM head"):
        fuse_loss(nn.Linear(4, 4))
    custom = tiny("llama")
    custom.loss_function = lambda *a, **k: torch.tensor(0.0)
    with pytest.raises(TypeError, match="ForCausalLMLoss"):
        fuse_loss(custom)
    with pytest.raises(TypeError, match="softcap"):
        fuse_loss(tiny("llama"), softcap=3.0)
    with pytest.raises(TypeError, match="unknown option 'label_smothing'"):
        fuse_loss(tiny("llama"), label_smothing=0.1)
    with pytest.raises(TypeError, match="no base model"):
        distillation_loss(HeadOnly(), tiny("llama"), torch.ones(1, 2, dtype=torch.long))


class HeadOnly(nn.Module):
    """A head and a config, but no body under the head."""

    def __init__(self) -> None:
        super().__init__()
        self.config = transformers.LlamaConfig(**SMALL, vocab_size=131)
        self.lm_head = nn.Linear(32, 131)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head


def divergence(log_q: torch.Tensor, log_p: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-row generalized JSD, the unfused formula: forward KL at beta=0, reverse KL at beta=1."""
    q, p = log_q.exp(), log_p.exp()
    if beta == 0.0:
        return (p * (log_p - log_q)).sum(-1)
    if beta == 1.0:
        return (q * (log_q - log_p)).sum(-1)
    log_m = torch.log(beta * p + (1 - beta) * q)
    return beta * (p * (log_p - log_m)).sum(-1) + (1 - beta) * (q * (log_q - log_m)).sum(-1)


def loss_on_logits(student, teacher, inputs, beta, temperature, hard, use_labels=True) -> torch.Tensor:
    """The distillation loss on both models' own ``.logits`` (transforms included), batchmean."""
    body = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    logits = student(**body).logits
    with torch.no_grad():
        t_logits = teacher(**body).logits
    keep = inputs["attention_mask"] == 1
    if use_labels:
        targets = inputs["labels"][:, 1:]
        keep = keep[:, :-1] & (targets != -100)
        logits, t_logits = logits[:, :-1], t_logits[:, :-1]
    log_q = F.log_softmax(logits[keep] / temperature, dim=-1)
    log_p = F.log_softmax(t_logits[keep] / temperature, dim=-1)
    loss = divergence(log_q, log_p, beta).mean()
    if hard:
        loss = (1 - hard) * loss + hard * F.cross_entropy(logits[keep], targets[keep])
    return loss


# (beta, temperature, weight of the hard term): forward KL, JSD, reverse KL, and a hard term.
DISTILLATION_CASES = [(0.0, 1.0, 0.0), (0.5, 2.0, 0.0), (1.0, 1.0, 0.0), (0.5, 1.0, 0.4)]


@pytest.mark.parametrize(("beta", "temperature", "hard"), DISTILLATION_CASES)
def test_distillation_loss_and_gradients_equal_the_loss_on_both_models_logits(
    beta: float, temperature: float, hard: float
) -> None:
    """A softcapped student (Gemma-2) and a logit-scaled, wider teacher (Cohere) of one vocabulary."""
    student = tiny("gemma2", seed=1)
    teacher = tiny("cohere", seed=2, hidden_size=48, num_attention_heads=4).eval()
    inputs = batch(131, seed=3)
    options = dict(beta=beta, temperature=temperature, weight_hard_loss=hard, weight_soft_loss=1 - hard)
    got = distillation_loss(student, teacher, inputs["input_ids"], attention_mask=inputs["attention_mask"],
                            labels=inputs["labels"], **options)  # fmt: skip
    got.backward()
    g_got = {n: p.grad.clone() for n, p in student.named_parameters()}
    student.zero_grad()
    want = loss_on_logits(student, teacher, inputs, beta, temperature, hard)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=ATOL)
    assert_same_grads(g_got, {n: p.grad for n, p in student.named_parameters()}, len(g_got))
    assert all(p.grad is None for p in teacher.parameters())


def test_distillation_without_labels_keeps_every_unpadded_position() -> None:
    student, teacher = tiny("llama", seed=1), tiny("llama", seed=2, hidden_size=48).eval()
    inputs = batch(131, seed=4)
    got = distillation_loss(student, teacher, inputs["input_ids"], attention_mask=inputs["attention_mask"], beta=0.5)
    want = loss_on_logits(student, teacher, inputs, 0.5, 1.0, 0.0, use_labels=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=ATOL)
    with pytest.raises(ValueError, match="labels are required"):
        distillation_loss(student, teacher, inputs["input_ids"], weight_hard_loss=0.5)
    with pytest.raises(ValueError, match="attention_mask"):
        distillation_loss(student, teacher, inputs["input_ids"], attention_mask=inputs["attention_mask"][:, :-1])
    with pytest.raises(TypeError, match="teacher_softcap"):
        distillation_loss(student, teacher, inputs["input_ids"], teacher_softcap=2.0)
