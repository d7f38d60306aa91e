"""TRL's GKD trainer with the fused generalized-JSD loss: ``torch_kl.trl.FusedGKDTrainer``.

``FusedGKDTrainer`` is TRL's ``GKDTrainer`` (``trl.experimental.gkd`` from TRL 1.14, top-level ``trl``
before) whose ``compute_loss`` is ``torch_kl.transformers.distillation_loss``: the student's and the
teacher's bodies, their heads as weights, TRL's ``beta`` at temperature 1, the rows whose next label is
not -100 — what TRL's unfused ``compute_loss`` (the full-logits ``generalized_jsd_loss``) computes,
without either model's ``[B, T, V]`` logits. TRL 1.13 and older had a fused path through Liger's (then
TRL's own) ``FusedLinearJSDLoss`` behind ``use_liger_kernel=True``; 1.14 removed it, and the subclass
needs neither Liger nor that flag.

The example checks that the fused loss and gradients equal TRL's own unfused ``compute_loss`` on a
collated batch (with and without ``num_items_in_batch``), then trains a few GKD steps, with on-policy
generation by the student (``lmbda=0.5``), on tiny random Llamas.

Nothing needs the network: the models come from configs, the tokenizer is a word-level
``tokenizers`` object built in memory with a small chat template (TRL's default collator,
``DataCollatorForChatML``, applies it), and the dataset is an in-memory ``datasets.Dataset``.
``GKDConfig`` defaults to ``bf16=True`` and ``gradient_checkpointing=True``; both are turned off here
so that the comparison is float32 and the run quick.

    python examples/trl_gkd_jsd.py
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import random
import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from torch_kl.trl import FusedGKDTrainer, GKDTrainer

try:  # TRL keeps GKD under experimental from 1.14
    from trl.experimental.gkd import GKDConfig
except ImportError:
    from trl import GKDConfig

WORDS = [f"w{i}" for i in range(120)]
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "user", "assistant", ":"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def word_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=64,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_llama(tok: PreTrainedTokenizerFast, hidden: int, layers: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


def chat_dataset(n: int, seed: int) -> Dataset:
    rnd = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(rnd.choice(WORDS) for _ in range(k))

    rows = [
        {
            "messages": [
                {"role": "user", "content": words(rnd.randint(2, 6))},
                {"role": "assistant", "content": words(rnd.randint(3, 8))},
            ]
        }
        for _ in range(n)
    ]
    return Dataset.from_list(rows)


def check_against_trl(trainer: FusedGKDTrainer, inputs: dict[str, torch.Tensor]) -> None:
    """The fused ``compute_loss`` against TRL's own (unfused, full logits) one: value and gradients."""
    model = trainer.model
    results = []
    for compute in (GKDTrainer.compute_loss, FusedGKDTrainer.compute_loss):
        for nib in (None, 40):
            model.zero_grad()
            loss = compute(trainer, model, dict(inputs), num_items_in_batch=nib)
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    model.zero_grad()
    names = [n for n, _ in model.named_parameters()]
    for (ref, g_ref), (fused, g_fused), nib in zip(results[:2], results[2:], (None, 40), strict=True):
        print(f"num_items_in_batch={nib}: TRL unfused {ref.item():.6f}  fused {fused.item():.6f}")
        torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-6)
        for name, a, b in zip(names, g_fused, g_ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    print(f"  all {len(names)} student gradients match TRL's")


def main() -> None:
    random.seed(0)
    torch.manual_seed(0)
    tok = word_tokenizer()
    student, teacher = tiny_llama(tok, 32, 2), tiny_llama(tok, 64, 3)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(6.0)  # a peakier teacher than random init, so there is something to learn
    with tempfile.TemporaryDirectory() as out:
        args = GKDConfig(
            output_dir=out, report_to="none", use_cpu=True, save_strategy="no", per_device_train_batch_size=4,
            max_steps=8, learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1, max_length=48,
            beta=0.5, lmbda=0.5, max_new_tokens=6, temperature=0.9, seed=0, dataloader_num_workers=0,
            disable_tqdm=True, bf16=False, gradient_checkpointing=False,  # TRL defaults both to True
        )  # fmt: skip
        trainer = FusedGKDTrainer(
            model=student,
            teacher_model=teacher,
            args=args,
            train_dataset=chat_dataset(32, seed=0),
            processing_class=tok,
        )
        batch = trainer.data_collator([chat_dataset(4, seed=1)[i] for i in range(4)])
        inputs = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        print(
            f"batch: input_ids {tuple(inputs['input_ids'].shape)}, "
            f"{int((inputs['labels'][:, 1:] != -100).sum())} completion tokens, V={len(tok)}"
        )
        check_against_trl(trainer, inputs)

        with torch.no_grad():
            before = trainer.compute_loss(student, dict(inputs)).item()
        trainer.train()
        with torch.no_grad():
            after = trainer.compute_loss(student, dict(inputs)).item()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print("logged training losses:", " ".join(f"{x:.4f}" for x in logged))
    print(f"held-out batch: fused JSD {before:.4f} before training, {after:.4f} after {args.max_steps} steps")
    assert len(logged) == args.max_steps and all(torch.isfinite(torch.tensor(logged))), logged
    assert after < 0.9 * before, "training should reduce the loss on the held-out batch"
    print("OK")


if __name__ == "__main__":
    main()
