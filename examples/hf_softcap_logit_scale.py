"""Gemma-2's ``final_logit_softcapping`` and Cohere's ``logit_scale``, fused.

Both models post-process the head's output before the softmax: Gemma-2 computes
``cap * tanh((h @ W.T) / cap)``, Cohere ``logit_scale * (h @ W.T)``. A fused loss sees only the
hidden states and the head weight, so it must be told (``softcap=`` / ``logit_scale=``); a fused
loss that ignores the transform computes the loss of a different model (the reason a fused
kernel without softcap support cannot be used on these models). This example checks, on tiny
random models, that the loss on ``last_hidden_state`` + ``lm_head.weight`` with the model's
setting equals the loss on the model's own ``.logits`` (which include the transform), value and
gradient with respect to the hidden states, and that leaving the setting out gives another value.

Runs on CPU in seconds; nothing is downloaded.

    python examples/hf_softcap_logit_scale.py
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F
from transformers import CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM, PreTrainedModel

import torch_kl

VOCAB, SEQ, BATCH = 512, 12, 2
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    attn_implementation="eager",
)


def divergence(log_q: torch.Tensor, log_p: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-row generalized JSD (TRL GKD's): forward KL at beta=0, reverse KL at beta=1."""
    q, p = log_q.exp(), log_p.exp()
    if beta == 0.0:
        return (p * (log_p - log_q)).sum(-1)
    if beta == 1.0:
        return (q * (log_q - log_p)).sum(-1)
    log_m = torch.log(beta * p + (1 - beta) * q)
    return beta * (p * (log_p - log_m)).sum(-1) + (1 - beta) * (q * (log_q - log_m)).sum(-1)


def head_input_and_logits(model: PreTrainedModel, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own forward: the tensor entering ``lm_head`` (grad retained) and ``.logits``."""
    seen: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        logits = model(input_ids=input_ids).logits
    finally:
        hook.remove()
    seen[0].retain_grad()
    return seen[0], logits


def check(
    name: str,
    model: PreTrainedModel,
    teacher_log_p: torch.Tensor,
    labels: torch.Tensor,
    beta: float,
    temperature: float,
    **transform: float,
) -> None:
    """``transform`` is the fused loss's ``softcap=`` or ``logit_scale=``, read off the model's config."""
    input_ids = labels.clamp_min(1)
    keep = labels != -100

    # Reference: the model's own .logits (transform included), float32, unfused.
    h_ref, logits = head_input_and_logits(model, input_ids)
    log_q = F.log_softmax(logits.float() / temperature, dim=-1)
    rows = divergence(log_q[keep], teacher_log_p[keep], beta)
    ref = rows.sum() / keep.sum()
    ref.backward()

    # Fused: the same hidden states, the head weight, the transform as an argument.
    h = h_ref.detach().clone().requires_grad_(True)
    kw = dict(target_format="log_probs", beta=beta, temperature=temperature)
    fused = torch_kl.fused_linear_kl_div(h, model.lm_head.weight, teacher_log_p, labels, **kw, **transform)
    fused.backward()
    without = torch_kl.fused_linear_kl_div(h.detach(), model.lm_head.weight, teacher_log_p, labels, **kw)

    err = (h.grad - h_ref.grad).abs().max().item() / h_ref.grad.abs().max().item()
    print(
        f"{name} {transform} beta={beta}: reference {ref.item():.6f}  fused {fused.item():.6f}  "
        f"grad_h rel. err {err:.1e}  | fused without it {without.item():.6f}"
    )
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-4, atol=1e-7)
    assert abs(without.item() - ref.item()) > 0.05 * ref.item(), f"{name}: omitting {transform} should matter"


def main() -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    labels = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    labels[1, -4:] = -100  # padding: ignored rows
    teacher_log_p = F.log_softmax(3.0 * torch.randn(BATCH, SEQ, VOCAB, generator=gen), dim=-1)

    # Gemma-2: logits = cap * tanh(z / cap). A small cap and a sharper head so the cap bites.
    gemma = Gemma2ForCausalLM(Gemma2Config(**SMALL, head_dim=16, final_logit_softcapping=4.0)).float()
    with torch.no_grad():
        gemma.lm_head.weight.mul_(20.0)  # tied to the embedding, as in Gemma
    for beta in (0.0, 0.5):
        check(
            "Gemma2ForCausalLM", gemma, teacher_log_p, labels, beta, 1.0, softcap=gemma.config.final_logit_softcapping
        )

    # Cohere: logits = logit_scale * z.
    cohere = CohereForCausalLM(CohereConfig(**SMALL, logit_scale=0.125)).float()
    with torch.no_grad():
        cohere.lm_head.weight.mul_(20.0)
    for beta in (0.0, 1.0):
        check("CohereForCausalLM", cohere, teacher_log_p, labels, beta, 2.0, logit_scale=cohere.config.logit_scale)
    print("OK")


if __name__ == "__main__":
    main()
