"""Diagnostics behind benchmarks/RESULTS.md's analysis (GPU only): the row kernel alone on one
chunk, and ``torch_kl`` at several chunk sizes, each beside the three-GEMM floor.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/diagnose.py
"""

from __future__ import annotations

import torch
import triton

import torch_kl
from fused_kl.contract import Options
from torch_kl import kernel

N, H, V = 8192, 4096, 128256


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median")


def main() -> None:
    dt = torch.bfloat16
    x = torch.randn(N, H, device="cuda", dtype=dt)
    w = (torch.randn(V, H, device="cuda") * 0.02).to(dt)
    t = torch.softmax(torch.randn(N, V, device="cuda"), -1).to(dt)
    z = torch.empty(N, V, device="cuda", dtype=dt)

    def floor() -> None:
        torch.mm(x, w.t(), out=z)
        torch.mm(z, w)
        torch.mm(z.t(), x)

    f0 = median_ms(floor)
    print(f"floor (3 GEMMs, N={N}): {f0:.2f} ms")
    rows = 2048
    opts = Options("batchmean", -100, 1.0, 1e-10, "probs", 1.0, None, None, "triton")
    loss = torch.empty(N, device="cuda")
    scale = torch.ones(2, device="cuda")
    for block_v in (2048, 4096):
        ms = median_ms(lambda b=block_v: kernel.kl_rows(z[:rows], t, None, scale, loss, 0, opts, b, True))
        moved = rows * V * 2 * 5  # z read twice, target read twice, dL/dz written once
        print(f"row kernel, {rows} rows, BLOCK_V={block_v}: {ms:.3f} ms = {moved / ms / 1e9:.2f} TB/s")
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    for chunk in (None, 1024, 4096, 8192):

        def step(c=chunk) -> None:
            xx.grad = ww.grad = None
            torch_kl.fused_linear_kl_div(xx, ww, t, chunk_size=c).backward()

        ms = median_ms(step)
        print(f"torch_kl chunk_size={chunk}: {ms:.2f} ms = {ms / f0:.3f} x floor")


if __name__ == "__main__":
    main()
