"""TRL's GKD trainer with ``torch_kl.FusedLinearJSDLoss`` as its fused generalized-JSD loss.

What TRL does (read from its ``GKDTrainer`` source, ``trl/experimental/gkd/gkd_trainer.py``;
``trl/trainer/gkd_trainer.py`` in older releases):

* TRL 0.22 to 1.0: with ``GKDConfig(use_liger_kernel=True)`` the trainer builds
  ``self.liger_jsd_loss = LigerFusedLinearJSDLoss(beta=args.beta, ignore_index=-100,
  temperature=args.temperature, compiled=False)``: Liger's default weights, 0.5 hard CE + 0.5
  soft, at the *sampling* temperature, unlike the unfused path (pure JSD at temperature 1).
* By TRL 1.4 the same call has ``weight_hard_loss=0.0, weight_soft_loss=1.0`` and no
  ``temperature``, to match the unfused path; by 1.8 the attribute is ``self.liger_loss``.
  TRL 1.13 replaced Liger's class with its own ``trl.losses.FusedLinearJSDLoss``; TRL 1.14
  removed the fused path from ``GKDTrainer`` (``use_liger_kernel`` no longer changes its loss;
  TRL points to its ``DistillationTrainer`` for a chunked loss).
* In every version with the fused path, ``compute_loss`` runs the *bodies* (``get_decoder()``),
  takes ``last_hidden_state[:, :-1]`` of student and teacher, builds
  ``true_labels = where(labels != -100, input_ids, -100)[:, 1:]`` and calls
  ``loss_fn(student_input=, student_weight=, teacher_input=, teacher_weight=, true_labels=,
  student_bias=, teacher_bias=)`` with the heads from ``get_output_embeddings()``; 1.13 also
  rescales by ``n_valid_local / num_items_in_batch`` under gradient accumulation.

So swapping an attribute works only on the TRL versions that have it (and then Liger must be
installed, since ``use_liger_kernel=True`` also patches the model with Liger's kernels). This
example instead subclasses ``GKDTrainer`` and overrides ``compute_loss`` with that same call on
``torch_kl.FusedLinearJSDLoss``, which works on any TRL whose ``GKDTrainer`` has the
``compute_loss(model, inputs, return_outputs, num_items_in_batch)`` hook, Liger or not, CPU or
GPU. It checks that the fused loss and gradients equal TRL's own unfused ``compute_loss`` (the
full-logits ``generalized_jsd_loss``) on a collated batch, then trains a few GKD steps, with
on-policy generation by the student (``lmbda=0.5``), on tiny random Llamas.

Nothing needs the network: the models come from configs, the tokenizer is a word-level
``tokenizers`` object built in memory with a small chat template (TRL's default collator,
``DataCollatorForChatML``, applies it), and the dataset is an in-memory ``datasets.Dataset``.
GKDTrainer needs ``processing_class`` (a tokenizer with a pad token) and instantiated models; given
a model *name* instead it would download it. ``GKDConfig`` defaults to ``bf16=True`` (bf16
autocast, on the CPU too) and ``gradient_checkpointing=True``; both are turned off here so that
the comparison is float32 and the run quick. With bf16 on, note that ``prepare_model`` wraps the
teacher's ``forward`` in autocast, which a call of its ``get_decoder()`` (TRL's fused path and
this one) bypasses: the teacher body then runs in float32 there, in bf16 on the unfused path.

Tested with TRL 1.8 to 1.16 (the comparison needs an unfused ``compute_loss`` that honours
``num_items_in_batch``, which TRL 1.4 and older do not).

    python examples/trl_gkd_jsd.py
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import random
import tempfile
from typing import Any

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import ModelOutput

from torch_kl import FusedLinearJSDLoss

try:  # recent TRL keeps GKD under experimental
    from trl.experimental.gkd import GKDConfig, GKDTrainer
except ImportError:  # older TRL
    from trl import GKDConfig, GKDTrainer

WORDS = [f"w{i}" for i in range(120)]
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "user", "assistant", ":"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


class FusedGKDTrainer(GKDTrainer):
    """``GKDTrainer`` whose loss is the fused generalized JSD: no ``[B, T, V]`` logits, student's
    or teacher's. Configured as TRL 1.x configured Liger's (pure JSD at temperature 1, TRL's
    ``beta``), so it computes what TRL's unfused ``compute_loss`` computes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fused_jsd_loss = FusedLinearJSDLoss(
            beta=self.args.beta, ignore_index=-100, compiled=False, weight_hard_loss=0.0, weight_soft_loss=1.0
        )

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        student = self.accelerator.unwrap_model(model)
        teacher = self.accelerator.unwrap_model(self.teacher_model)
        teacher.eval()
        body_inputs = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False)
        # Single process here; under DDP/FSDP route the student's body through the wrapper (TRL 1.13 does so
        # with `trl.models.utils._ForwardRedirection`) so that its hooks fire.
        s_hidden = student.get_decoder()(**body_inputs).last_hidden_state
        with torch.no_grad():
            t_hidden = teacher.get_decoder()(**body_inputs).last_hidden_state
        true_labels = torch.where(inputs["labels"] != -100, inputs["input_ids"], -100)[:, 1:]
        s_head, t_head = student.get_output_embeddings(), teacher.get_output_embeddings()
        loss = self.fused_jsd_loss(
            student_input=s_hidden[:, :-1], student_weight=s_head.weight,
            teacher_input=t_hidden[:, :-1], teacher_weight=t_head.weight, true_labels=true_labels,
            student_bias=getattr(s_head, "bias", None), teacher_bias=getattr(t_head, "bias", None),
        )  # fmt: skip
        if num_items_in_batch is not None:  # "batchmean" over this batch -> over the accumulated batches
            loss = loss * (true_labels != -100).sum() / torch.as_tensor(num_items_in_batch, device=loss.device)
        return (loss, ModelOutput(last_hidden_state=s_hidden)) if return_outputs else loss


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
        calls: list[int] = []
        trainer.fused_jsd_loss.register_forward_hook(lambda *_: calls.append(1))
        trainer.train()
        n_calls = len(calls)
        with torch.no_grad():
            after = trainer.compute_loss(student, dict(inputs)).item()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print("logged training losses:", " ".join(f"{x:.4f}" for x in logged))
    print(f"held-out batch: fused JSD {before:.4f} before training, {after:.4f} after {args.max_steps} steps")
    assert n_calls == args.max_steps, f"the fused loss ran {n_calls} times in {args.max_steps} steps"
    assert len(logged) == args.max_steps and all(torch.isfinite(torch.tensor(logged))), logged
    assert after < 0.9 * before, "training should reduce the loss on the held-out batch"
    print("OK")


if __name__ == "__main__":
    main()
