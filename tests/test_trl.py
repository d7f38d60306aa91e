"""``torch_kl.trl`` on tiny random Llamas (CPU, float32, offline): each fused trainer's loss and
gradients equal its TRL base class's own loss at step 0, and a few training steps run with finite losses."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import random
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import torch_kl.trl as fused_trl

try:  # where TRL keeps GKD since 1.14
    from trl.experimental.gkd import GKDConfig
except ImportError:
    from trl import GKDConfig

WORDS = [f"w{i}" for i in range(60)]
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "user", "assistant", ":"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)
QUICK = dict(
    report_to="none", use_cpu=True, save_strategy="no", per_device_train_batch_size=4, max_steps=3,
    learning_rate=1e-2, logging_steps=1, seed=0, dataloader_num_workers=0, disable_tqdm=True, bf16=False,
    gradient_checkpointing=False, temperature=0.9,
)  # fmt: skip


def word_tokenizer(padding_side: str = "right") -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        model_max_length=64, padding_side=padding_side,
    )  # fmt: skip
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_llama(tok: PreTrainedTokenizerFast, hidden: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    with torch.no_grad():  # sharper than random init, so the divergence is far from 0
        model.lm_head.weight.mul_(6.0)
    return model


def words(rnd: random.Random, k: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(k))


def chats(n: int, seed: int) -> Dataset:
    rnd = random.Random(seed)
    return Dataset.from_list([
        {"messages": [{"role": "user", "content": words(rnd, rnd.randint(2, 5))},
                      {"role": "assistant", "content": words(rnd, rnd.randint(3, 6))}]}
        for _ in range(n)
    ])  # fmt: skip


def compare(reference, fused, model: torch.nn.Module, nums: tuple) -> None:
    """``reference(num)`` and ``fused(num)`` give losses: equal values and student gradients."""
    for num in nums:
        runs = []
        for compute in (reference, fused):
            model.zero_grad()
            loss = compute(num)
            loss.backward()
            runs.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        (want, g_want), (got, g_got) = runs
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for a, b in zip(g_got, g_want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item())
    model.zero_grad()


def logged_losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_fused_gkd_trainer_matches_trls_unfused_loss_and_trains(tmp_path: Path) -> None:
    tok = word_tokenizer()
    student, teacher = tiny_llama(tok, 32, seed=0), tiny_llama(tok, 48, seed=1)
    args = GKDConfig(output_dir=str(tmp_path), max_length=40, beta=0.5, lmbda=0.5, max_new_tokens=4, **QUICK)
    trainer = fused_trl.FusedGKDTrainer(
        model=student, teacher_model=teacher, args=args, train_dataset=chats(12, seed=0), processing_class=tok,
        loss_options={"chunk_size": 16},
    )  # fmt: skip
    batch = trainer.data_collator([chats(4, seed=1)[i] for i in range(4)])
    inputs = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    compare(
        lambda num: fused_trl.GKDTrainer.compute_loss(trainer, student, dict(inputs), num_items_in_batch=num),
        lambda num: trainer.compute_loss(student, dict(inputs), num_items_in_batch=num),
        student,
        (None, torch.tensor(23)),
    )
    trainer.train()
    losses = logged_losses(trainer)
    assert len(losses) == args.max_steps and all(torch.isfinite(torch.tensor(losses))), losses


@pytest.mark.skipif(not hasattr(fused_trl, "DistillationTrainer"), reason="this TRL has no supported one")
def test_fused_distillation_trainer_matches_trls_chunked_loss_and_trains(tmp_path: Path) -> None:
    from trl import DistillationConfig

    tok = word_tokenizer(padding_side="left")
    student, teacher = tiny_llama(tok, 32, seed=0), tiny_llama(tok, 48, seed=1)
    rnd = random.Random(0)
    prompts = Dataset.from_list([{"prompt": words(rnd, rnd.randint(2, 5))} for _ in range(12)])
    args = DistillationConfig(output_dir=str(tmp_path), max_completion_length=4, beta=0.5, **QUICK)
    trainer = fused_trl.FusedDistillationTrainer(
        model=student, teacher_model=teacher, args=args, train_dataset=prompts, processing_class=tok
    )
    gen = torch.Generator().manual_seed(2)
    completion_mask = torch.ones(3, 5, dtype=torch.long)
    completion_mask[1, 3:] = 0
    prompt_mask = torch.ones(3, 4, dtype=torch.long)
    prompt_mask[2, :2] = 0  # left padding
    inputs = {
        "prompt_ids": torch.randint(7, len(tok), (3, 4), generator=gen), "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(7, len(tok), (3, 5), generator=gen), "completion_mask": completion_mask,
    }  # fmt: skip
    compare(
        lambda num: fused_trl.DistillationTrainer._compute_loss(trainer, student, inputs, num)[0],
        lambda num: trainer._compute_loss(student, inputs, num)[0],
        student,
        (None, torch.tensor(17.0)),
    )
    trainer.train()
    losses = logged_losses(trainer)
    assert len(losses) == args.max_steps and all(torch.isfinite(torch.tensor(losses))), losses


def test_loss_options_reach_the_fused_loss(tmp_path: Path) -> None:
    """A misspelt option fails at the first loss, naming it: the options are not dropped."""
    tok = word_tokenizer()
    args = GKDConfig(output_dir=str(tmp_path), max_length=40, **QUICK)
    trainer = fused_trl.FusedGKDTrainer(
        model=tiny_llama(tok, 32, 0), teacher_model=tiny_llama(tok, 32, 1), args=args, processing_class=tok,
        train_dataset=chats(4, seed=0), loss_options={"chunk_sise": 8},
    )  # fmt: skip
    batch = trainer.data_collator([chats(2, seed=1)[i] for i in range(2)])
    inputs = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(TypeError, match="chunk_sise"):
        trainer.compute_loss(trainer.model, inputs)
