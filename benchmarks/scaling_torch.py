"""One rank of ``python -m benchmarks.scaling``'s torch measurement (started by it, one process
per device): ``torch_kl`` alone on this rank's device, then rows sharded (``batch_group``, N rows
per rank) and vocabulary sharded (``vocab_group``, a ``V / world`` slice of the head per rank),
the vocabulary slice's local work without collectives, and the collectives alone. Every rank runs
the same calls the same number of times (no adaptive repetition: a collective must never wait
for a rank that stopped), so the timings are medians of a fixed count."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import torch_kl
from fused_kl.plan import default_chunk_rows
from fused_kl.rows import STATS

from .shapes import parse_head


def _median_ms(step: Callable[[], object], reps: int, device: torch.device) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    step()  # warm-up: compiles, allocates
    sync()
    times = []
    for _ in range(reps):
        dist.barrier()
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(rank: int, world: int, n: int, head: str, reps: int) -> dict[str, float | list[int]]:
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    shape = parse_head(head)
    h, v = shape.h, shape.v
    share = v // world
    g = torch.Generator(device).manual_seed(1234)  # the same head and teacher on every rank
    weight = (torch.randn(v, h, generator=g, device=device) * h**-0.5).to(dtype)
    x_shared = torch.randn(n, h, generator=g, device=device).to(dtype)
    teacher = torch.softmax(torch.randn(n, v, generator=g, device=device), -1).to(dtype)
    mine = torch.Generator(device).manual_seed(rank)  # rows sharded: this rank's own rows
    x_own = torch.randn(n, h, generator=mine, device=device).to(dtype)
    w_slice = weight[rank * share : (rank + 1) * share].contiguous()
    t_slice = teacher[:, rank * share : (rank + 1) * share].contiguous()
    group = dist.group.WORLD

    def step(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, **layout: object) -> Callable[[], None]:
        leaves = (x.detach().requires_grad_(), w.detach().requires_grad_())

        def run() -> None:
            for leaf in leaves:
                leaf.grad = None
            torch_kl.fused_linear_kl_div(*leaves, t, **layout).backward()

        return run

    grad_x = torch.empty(n, h, dtype=dtype, device=device)
    stats = torch.empty(default_chunk_rows(n, share, torch.finfo(dtype).bits // 8), len(STATS), device=device)
    return {
        "one_device_ms": _median_ms(step(x_own, weight, teacher), reps, device),
        "rows_ms": _median_ms(step(x_own, weight, teacher, batch_group=group), reps, device),
        "vocab_local_ms": _median_ms(step(x_shared, w_slice, t_slice), reps, device),
        "vocab_ms": _median_ms(step(x_shared, w_slice, t_slice, vocab_group=group), reps, device),
        "all_reduce_grad_x_ms": _median_ms(lambda: dist.all_reduce(grad_x), reps, device),
        "all_reduce_stats_ms": _median_ms(lambda: dist.all_reduce(stats), reps, device),
        # Rows sharded: what DDP then adds to reduce grad_weight (torch_kl leaves it to DDP/FSDP).
        "all_reduce_grad_weight_ms": _median_ms(lambda: dist.all_reduce(weight), reps, device),
        "stats_shape": list(stats.shape),
        "grad_weight_gib_one_device": v * h * weight.element_size() / 2**30,
        "grad_weight_gib_vocab": share * h * weight.element_size() / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for name in ("rank", "world", "n", "reps"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--head", required=True)
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    store = dist.FileStore(str(args.store), args.world)
    if torch.cuda.is_available():
        torch.cuda.set_device(args.rank)
        # The rank's GPU named up front: NCCL then need not guess it (and warn) at the barrier.
        device = torch.device("cuda", args.rank)
        dist.init_process_group("nccl", store=store, rank=args.rank, world_size=args.world, device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world)
    try:
        result = measure(args.rank, args.world, args.n, args.head, args.reps)
        args.out.write_text(json.dumps(result))
        # Every rank done before any tears the group down: a rank still in a collective when its
        # peer destroys the group may abort at exit.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown: gloo's threads may outlive the group, and joining
    # them at exit can abort a rank whose result is already written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
