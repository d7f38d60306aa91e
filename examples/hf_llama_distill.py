"""Distil a tiny Llama student from a bigger Llama teacher with ``target_format="hidden"``.

Neither model materialises its ``[B, T, V]`` logits in the fused path: the student's body gives
hidden states, the loss applies ``student.lm_head.weight`` chunk by chunk, and the teacher enters
as *its* hidden states plus *its* head (``teacher_weight=``), so the teacher logits never exist
either. The example checks the loss value and every student gradient against the plain KL on the
models' own ``.logits`` (full forward, float32), shows that ``torch_kl.transformers.distillation_loss``
makes the same call in one line, then trains a few steps.

Runs on CPU in seconds with random weights from small configs; nothing is downloaded.

    python examples/hf_llama_distill.py
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import torch_kl
from torch_kl.transformers import distillation_loss

VOCAB, TEMPERATURE, HARD = 256, 2.0, 0.25


def tiny_llama(hidden: int, layers: int, heads: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=64,
        tie_word_embeddings=False, pad_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    return LlamaForCausalLM(config).float()


def make_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Right-padded token ids; ``labels`` are the ids with -100 on padding (the ignored rows)."""
    lengths = [16, 11, 7]
    input_ids = torch.randint(1, VOCAB, (len(lengths), max(lengths)), generator=gen)
    attention_mask = torch.zeros_like(input_ids)
    for row, n in enumerate(lengths):
        attention_mask[row, :n] = 1
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def fused_loss(
    student: LlamaForCausalLM, teacher: LlamaForCausalLM, batch: dict[str, torch.Tensor], hard: float = HARD
) -> torch.Tensor:
    """The fused path: bodies only, heads passed as weights. Position t predicts token t + 1."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    hidden = student.model(input_ids=ids, attention_mask=mask).last_hidden_state
    with torch.no_grad():
        t_hidden = teacher.model(input_ids=ids, attention_mask=mask).last_hidden_state
    return torch_kl.fused_linear_kl_div(
        hidden[:, :-1], student.lm_head.weight, t_hidden[:, :-1], batch["labels"][:, 1:],
        target_format="hidden", teacher_weight=teacher.lm_head.weight,
        temperature=TEMPERATURE, weight_hard_loss=hard,
    )  # fmt: skip


def reference_loss(
    student: LlamaForCausalLM, teacher: LlamaForCausalLM, batch: dict[str, torch.Tensor], hard: float = HARD
) -> torch.Tensor:
    """The unfused loss on the models' own ``.logits``: KL(teacher || student) at ``TEMPERATURE``
    per kept position, averaged over kept positions, plus ``hard`` times the cross-entropy."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = student(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    with torch.no_grad():
        t_logits = teacher(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    keep = labels != -100
    log_q = F.log_softmax(logits[keep] / TEMPERATURE, dim=-1)
    log_p = F.log_softmax(t_logits[keep] / TEMPERATURE, dim=-1)
    soft = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
    return soft + hard * F.cross_entropy(logits[keep], labels[keep])


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def check_against_logits(student: LlamaForCausalLM, teacher: LlamaForCausalLM, batch: dict[str, torch.Tensor]) -> None:
    for hard in (0.0, HARD):
        student.zero_grad()
        fused = fused_loss(student, teacher, batch, hard)
        fused.backward()
        g_fused = grads(student)
        student.zero_grad()
        ref = reference_loss(student, teacher, batch, hard)
        ref.backward()
        g_ref = grads(student)
        student.zero_grad()
        print(f"weight_hard_loss={hard}: fused {fused.item():.6f}  reference on .logits {ref.item():.6f}")
        torch.testing.assert_close(fused, ref.float(), rtol=1e-5, atol=1e-6)
        assert g_fused.keys() == g_ref.keys() and len(g_ref) == len(list(student.parameters())), "missing grads"
        worst = 0.0
        for name, g in g_ref.items():
            torch.testing.assert_close(g_fused[name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
            worst = max(worst, (g_fused[name] - g).abs().max().item() / max(g.abs().max().item(), 1e-12))
        print(f"  {len(g_ref)} student gradients match (worst max-abs error / max-abs grad: {worst:.1e})")
    assert all(p.grad is None for p in teacher.parameters()), "the teacher must get no gradient"


def main() -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    student = tiny_llama(hidden=32, layers=2, heads=4)
    teacher = tiny_llama(hidden=64, layers=3, heads=4).eval().requires_grad_(False)
    with torch.no_grad():  # a peakier teacher than random init gives, so there is something to learn
        teacher.lm_head.weight.mul_(8.0)
    batch = make_batch(gen)
    n_kept = int((batch["labels"][:, 1:] != -100).sum())
    print(
        f"student {sum(p.numel() for p in student.parameters())} params, teacher "
        f"{sum(p.numel() for p in teacher.parameters())}; V={VOCAB}, {n_kept} kept positions"
    )

    check_against_logits(student, teacher, batch)
    one_line = distillation_loss(student, teacher, batch["input_ids"], attention_mask=batch["attention_mask"],
                                 labels=batch["labels"], temperature=TEMPERATURE, weight_hard_loss=HARD)  # fmt: skip
    torch.testing.assert_close(one_line, fused_loss(student, teacher, batch), rtol=1e-6, atol=1e-7)
    print(f"distillation_loss(student, teacher, ...) in one line: {one_line.item():.6f}, the same")

    opt = torch.optim.AdamW(student.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        opt.zero_grad()
        loss = fused_loss(student, teacher, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 5 == 0 or step == 29:
            print(f"step {step:2d}  loss {losses[-1]:.4f}")
    assert losses[-1] < 0.7 * losses[0], f"loss did not go down enough: {losses[0]:.4f} -> {losses[-1]:.4f}"
    print("OK")


if __name__ == "__main__":
    main()
