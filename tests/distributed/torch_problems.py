"""Inputs and single-device results for the distributed torch checks (imported by the ranks).

Every rank builds the same full problem from a seed, runs it on one device, then runs its
own shard with a group and compares: the rows layout after summing the ranks' losses and
head gradients, the vocabulary layout directly (every rank holds the full loss and ``grad_x``).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

import torch_kl

DENSE = ("probs", "log_probs", "logits")
# "cuda": the ranks run on NCCL, one GPU each (by hand on a GPU machine; the tests use gloo).
DEVICE = torch.device(os.environ.get("FUSED_KL_DIST_DEVICE", "cpu"))


def problem(
    fmt: str = "probs",
    *,
    n: int = 12,
    h: int = 8,
    v: int = 16,
    k: int = 5,
    ht: int = 6,
    bias: bool = False,
    seed: int = 0,
    lead: int | None = None,
    ignored: tuple[int, ...] | None = (6, 7, 9, 10),
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Full inputs; rows ``ignored`` get label -100 (by default most of them in rank 1's rows;
    None: no labels).
    ``lead`` = B reshapes the rows to ``[B, n / B]``."""
    g = torch.Generator().manual_seed(seed)
    p: dict = {
        "x": torch.randn(n, h, generator=g).to(dtype),
        "weight": (torch.randn(v, h, generator=g) * 2 / h**0.5).to(dtype),
    }
    if bias:
        p["bias"] = torch.randn(v, generator=g).to(dtype)
    raw = torch.randn(n, v, generator=g) * 2
    if fmt == "probs":
        p["target"] = raw.softmax(-1)
    elif fmt == "log_probs":
        p["target"] = raw.log_softmax(-1)
    elif fmt == "logits":
        p["target"] = raw
    elif fmt == "hidden":
        p["target"] = torch.randn(n, ht, generator=g).to(dtype)
        p["teacher_weight"] = (torch.randn(v, ht, generator=g) * 2 / ht**0.5).to(dtype)
        p["teacher_bias"] = torch.randn(v, generator=g).to(dtype)
    elif fmt == "topk_log_probs":
        idx = torch.rand(n, v, generator=g).argsort(-1)[:, :k]  # distinct, spread over the whole vocabulary
        t = raw.log_softmax(-1).gather(1, idx)
        t[::3, -1] = float("-inf")  # padding
        p["target"], p["target_indices"] = t, idx
    if ignored is not None:  # None: no labels
        labels = torch.randint(0, v, (n,), generator=g)
        labels[list(ignored)] = -100
        p["labels"] = labels
    if lead is not None:
        for key in ("x", "target", "labels", "target_indices"):
            if key in p:
                p[key] = p[key].reshape(lead, n // lead, *p[key].shape[1:])
    return {k: a.to(DEVICE) for k, a in p.items()}


def init(rank: int, world: int, store: str) -> None:
    """gloo on the CPU, or NCCL with one GPU a rank where ``DEVICE`` is CUDA."""
    if DEVICE.type != "cuda":
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        return
    torch.cuda.set_device(rank)
    # The rank's GPU named up front: NCCL then need not guess it (and warn) at the first barrier.
    torch.distributed.init_process_group(
        "nccl", init_method=f"file://{store}", rank=rank, world_size=world, device_id=torch.device("cuda", rank)
    )


def finish() -> None:
    """Tear the group down and leave without the interpreter's teardown, which can abort a gloo
    rank after a complete run (``benchmarks/scaling_torch.py``'s did, twice in CI)."""
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(p: dict, options: dict, *, fn=None, **layout) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and the gradients of ``x``, ``weight``, ``bias`` (leaves made here)."""
    fn = fn or torch_kl.fused_linear_kl_div
    leaves = {k: p[k].detach().clone().requires_grad_() for k in ("x", "weight", "bias") if k in p}
    rest = {k: a for k, a in p.items() if k not in leaves}
    args = {**rest, **leaves}
    if fn is torch_kl.fused_linear_cross_entropy:
        args.pop("target", None)
    loss = fn(**args, **options, **layout)
    loss.backward()
    return float(loss.detach()), {k: a.grad for k, a in leaves.items()}


def rows_of(p: dict, rank: int, split: int, lead: bool) -> dict:
    """Rank 0's rows are ``[:split]`` (along the sequence with ``lead``), rank 1's the rest."""
    sl = slice(0, split) if rank == 0 else slice(split, None)
    out = dict(p)
    for key in ("x", "target", "labels", "target_indices"):
        if key in p:
            out[key] = p[key][:, sl] if lead else p[key][sl]
    return out


def vocab_slice(rank: int, world: int, v: int) -> slice:
    return slice(rank * v // world, (rank + 1) * v // world)


def vocab_of(p: dict, rank: int, world: int, fmt: str) -> dict:
    """This rank's contiguous ``V / G`` slice of the head, its bias and teacher head, and of the
    ``V`` axis of a dense target; ``x``, labels and top-k teachers replicated."""
    sl = vocab_slice(rank, world, p["weight"].shape[0])
    out = dict(p)
    for key in ("weight", "bias", "teacher_weight", "teacher_bias"):
        if key in p:
            out[key] = p[key][sl]
    if fmt in DENSE:
        out["target"] = p["target"][..., sl]
    return out


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    denom = float(want.norm())
    return float((got - want).norm()) / (denom if denom > 0 else 1.0)


def check(what: str, got: float | torch.Tensor, want: float | torch.Tensor, tol: float) -> None:
    if isinstance(want, float):
        err = abs(got - want) / max(abs(want), 1e-2)  # type: ignore[operator]
    else:
        err = rel(got, want)  # type: ignore[arg-type]
    assert np.isfinite(err) and err <= tol, f"{what}: error {err:.3g} > {tol} (got {got}, want {want})"
