"""``python -m benchmarks.distill_hf``: one distillation training step of Hugging Face models, per loss.

A Llama-3.2-1B-shaped student learns from a Llama-3.2-3B-shaped teacher: configs written out here,
random weights, bf16, SDPA attention, no gradient checkpointing. A step is both models' forward (the
teacher frozen, under ``no_grad``), the student's backward and AdamW's step. Every loss is the forward
KL(teacher ‖ student) averaged over all tokens: ``ours``, ``torch_kl.transformers.distillation_loss``;
``unfused``, both models' ``.logits``, their float32 ``log_softmax`` and ``F.kl_div``; ``liger`` and
``liger-chunked`` (CUDA only, where liger-kernel is installed): Liger's ``transformers.LigerFusedLinearJSD``
and ``chunked_loss.LigerFusedLinearJSDLoss`` at ``beta`` 0 on both bodies' hidden states and heads.

Per row: the median time of ``STEPS`` steps after a warm-up step, the allocator's peak during them
(weights and AdamW's state included), and the warm-up step's loss (every row starts from the same
weights and tokens). A row that runs out of memory is marked OOM, one that fails is marked and
printed, and the run goes on. On one H200, from the repository root (32768 tokens: 4 × 8192):

    python -m benchmarks.distill_hf --tokens 8192,32768 --seq-len 8192 --out distill_out

``--quick`` runs tiny models on the CPU in seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fused_kl_cli.cli import prepare_environment

from . import report
from .impls import Skip, liger_module
from .measure import GIB, failure_status, release

STEPS = 5  # timed steps per row, after one warm-up step
TIMING = f"median of {STEPS} steps after 1 warm-up step; CUDA events on a GPU, the wall clock on CPU"

LossFn = Callable[[nn.Module, nn.Module, torch.Tensor], torch.Tensor]


def llama(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int) -> dict[str, int]:
    """The ``LlamaConfig`` fields that decide the compute; the others keep their defaults."""
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, intermediate_size=intermediate)  # fmt: skip


# Llama-3.2-1B and -3B; --quick: tiny models of the same family.
FULL = {"student": llama(2048, 16, 32, 8, 8192), "teacher": llama(3072, 28, 24, 8, 8192), "vocab": 128256}
QUICK = {"student": llama(64, 2, 4, 2, 128), "teacher": llama(96, 3, 4, 2, 192), "vocab": 512}


def build_model(shape: dict[str, int], vocab: int, device: torch.device, seed: int) -> nn.Module:
    """A randomly initialised bf16 Llama causal LM, the same weights for the same seed."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=vocab, tie_word_embeddings=True, use_cache=False, **shape)
    torch.manual_seed(seed)
    with device:
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")


def ours(student: nn.Module, teacher: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    from torch_kl.transformers import distillation_loss

    return distillation_loss(student, teacher, input_ids)


def unfused(student: nn.Module, teacher: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The loss as users write it on the models' own outputs."""
    logits = student(input_ids=input_ids).logits
    with torch.no_grad():
        teacher_logits = teacher(input_ids=input_ids).logits
    log_q = F.log_softmax(logits.float().flatten(0, 1), dim=-1)
    log_p = F.log_softmax(teacher_logits.float().flatten(0, 1), dim=-1)
    return F.kl_div(log_q, log_p, reduction="batchmean", log_target=True)


def _liger(module: str, on_gpu: bool) -> Any:
    if not on_gpu:
        raise Skip("Liger's kernels need a CUDA GPU")
    return liger_module(module)


def _on_hidden_states(loss: Callable[..., torch.Tensor]) -> LossFn:
    """A loss given the student's hidden states and head and the teacher's, ``[B*T, H]`` each."""

    def run(student: nn.Module, teacher: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = student.model(input_ids=input_ids).last_hidden_state.flatten(0, 1)
        with torch.no_grad():
            teacher_hidden = teacher.model(input_ids=input_ids).last_hidden_state.flatten(0, 1)
        return loss(hidden, student.lm_head.weight, teacher_hidden, teacher.lm_head.weight)

    return run


def liger(on_gpu: bool) -> LossFn:
    jsd = _liger("liger_kernel.transformers", on_gpu).LigerFusedLinearJSD(jsd_beta=0.0)
    return _on_hidden_states(lambda x, w, xt, wt: jsd(x, w, xt, wt, None))


def liger_chunked(on_gpu: bool) -> LossFn:
    chunked = _liger("liger_kernel.chunked_loss", on_gpu)
    jsd = chunked.LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.0)
    # Its labels only mask rows (and feed the hard term, weighted 0 here): all rows kept.
    return _on_hidden_states(lambda x, w, xt, wt: jsd(x, w, xt, wt, torch.zeros_like(x[:, 0], dtype=torch.long)))


# Each gives its loss on this device, or raises Skip.
IMPLS: dict[str, Callable[[bool], LossFn]] = {
    "ours": lambda on_gpu: ours, "unfused": lambda on_gpu: unfused, "liger": liger, "liger-chunked": liger_chunked
}  # fmt: skip


def _step_ms(step: Callable[[], Any], on_gpu: bool) -> float:
    if not on_gpu:
        start = time.perf_counter()
        step()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def measure_row(loss_fn: LossFn, models: dict[str, Any], batch: int, seq: int, on_gpu: bool) -> dict[str, Any]:
    """Warm-up step (its loss reported), then ``STEPS`` timed steps and their peak memory."""
    device = torch.device("cuda" if on_gpu else "cpu")
    student = build_model(models["student"], models["vocab"], device, seed=0).train()
    teacher = build_model(models["teacher"], models["vocab"], device, seed=1).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.randint(models["vocab"], (batch, seq), generator=generator).to(device)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-5)

    def step() -> torch.Tensor:
        loss = loss_fn(student, teacher, input_ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    loss = step().item()  # also makes AdamW's state: the timed steps' peak includes it
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = [_step_ms(step, on_gpu) for _ in range(STEPS)]
    peak = torch.cuda.max_memory_allocated() / GIB if on_gpu else None
    return {"ms": statistics.median(times), "peak_gib": peak, "loss": loss}


def run_row(name: str, models: dict[str, Any], batch: int, seq: int, on_gpu: bool) -> dict[str, Any]:
    """The measured fields of one row, or its status; never raises."""
    try:
        return {"status": "ok", **measure_row(IMPLS[name](on_gpu), models, batch, seq, on_gpu)}
    except Exception as e:
        return failure_status(name, e)


def _cell(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table: one line per (tokens, implementation), the time also relative to ours at those tokens."""
    ours_ms = {r["tokens"]: r.get("ms") for r in rows if r["impl"] == "ours"}
    lines = ["| impl | tokens | batch × seq | step ms | × ours | peak GiB | loss | status |", "|" + " --- |" * 8]
    for r in rows:
        ms, ref = r.get("ms"), ours_ms.get(r["tokens"])
        cells = (
            r["impl"], str(r["tokens"]), f"{r['batch']} × {r['seq']}", _cell(ms, ".1f"),
            _cell(ms / ref if ms is not None and ref else None, ".2f"), _cell(r.get("peak_gib"), ".1f"),
            _cell(r.get("loss"), ".6g"), r["status"],
        )  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _positive_ints(text: str) -> list[int]:
    items = [item for item in text.split(",") if item]
    if not items or not all(item.isdigit() and int(item) > 0 for item in items):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return [int(item) for item in items]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.distill_hf",
        description="Step time and peak memory of distilling a Llama-3.2-1B-shaped student from a "
        "3B-shaped teacher with the fused loss, the unfused loss and Liger's.",
    )
    parser.add_argument("--tokens", type=_positive_ints, help="tokens per step (default 8192,32768; quick 64,128)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default 8192; quick 64)")
    parser.add_argument("--impls", type=lambda text: [name for name in text.split(",") if name], default=list(IMPLS),
                        help=f"comma-separated subset of {','.join(IMPLS)} (default all)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny models on the CPU: a smoke test in seconds")
    parser.add_argument("--out", type=Path, default=Path("distill_out"), help="where distill_hf.json/.md go")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.impls) - set(IMPLS))
    if unknown or not args.impls:
        parser.error(f"--impls: unknown {', '.join(unknown) or '(none)'}; expected some of {', '.join(IMPLS)}")
    args.tokens = args.tokens or ([64, 128] if args.quick else [8192, 32768])
    if args.seq_len is not None and args.seq_len <= 0:
        parser.error(f"--seq-len: expected a positive integer, got {args.seq_len}")
    args.seq_len = args.seq_len or (64 if args.quick else 8192)
    ragged = [t for t in args.tokens if t > args.seq_len and t % args.seq_len]
    if ragged:
        parser.error(f"--tokens: {ragged} exceed --seq-len {args.seq_len} without being multiples of it")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    on_gpu = torch.cuda.is_available() and not args.quick
    prepare_environment(on_gpu)  # before torch_kl imports triton
    models = QUICK if args.quick else FULL
    config = models | {"dtype": "bfloat16", "attention": "sdpa", "optimizer": "AdamW", "seq_len": args.seq_len}
    meta = report.describe(torch.cuda.get_device_name() if on_gpu else "cpu", config, TIMING)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    total = len(args.tokens) * len(args.impls)
    for tokens in args.tokens:
        seq = min(tokens, args.seq_len)
        for name in args.impls:
            row = {"impl": name, "tokens": tokens, "batch": tokens // seq, "seq": seq}
            print(f"[{len(rows) + 1}/{total}] {name}, {tokens} tokens: ", end="", flush=True)
            row |= run_row(name, models, row["batch"], seq, on_gpu)
            release()  # outside run_row, where no exception it caught holds the row's tensors
            measured = (f"{k} {row[k]:.6g}" for k in ("ms", "peak_gib", "loss") if row.get(k) is not None)
            print(", ".join((row["status"], *measured)), flush=True)
            rows.append(row)
            payload = json.dumps({"meta": meta, "rows": rows}, indent=1, ensure_ascii=False)
            (args.out / "distill_hf.json").write_text(payload + "\n", encoding="utf-8")
    table = markdown(rows)
    (args.out / "distill_hf.md").write_text(table, encoding="utf-8")
    print(table, end="")
    print(f"wrote {args.out / 'distill_hf.json'} and {args.out / 'distill_hf.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
