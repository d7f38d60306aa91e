"""Where ``torch_kl``'s time above the floor goes (GPU only; what it measured backs the chunk size
in docs/design-notes.md): the row kernel alone on one chunk at several tile shapes, and
``torch_kl`` at several chunk sizes, each as a ratio to the three-GEMM floor timed just before
and after it (the card's clock drifts with its temperature).

    XLA_PYTHON_CLIENT_PREALLOCATE=false python -m benchmarks.diagnose   # from the repository root
"""

from __future__ import annotations

import functools

import torch

import torch_kl
from benchmarks.measure import Timing, time_against_floor, time_ms
from fused_kl import rowmath
from fused_kl.loss import Loss, Teacher
from fused_kl.plan import plan_chunks
from torch_kl.backends import resolve

N, H, V = 8192, 4096, 128256
TIMING = Timing(reps=15, rep_ms=300.0, warmup_ms=25.0)
median_ms = functools.partial(time_ms, "torch", timing=TIMING, on_gpu=True)


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

    x_floor = functools.partial(time_against_floor, "torch", floor_step=floor, timing=TIMING, on_gpu=True)

    print(f"floor (3 GEMMs, N={N}): {median_ms(floor):.2f} ms")
    rows = plan_chunks(N, V, 2, None).chunk_rows
    # The row phases of the forward KL on one chunk (stats, then dL/dz over the logits), as the
    # chunk driver runs them; the per-row coefficients between the two are computed once.
    phases = resolve("triton", torch.device("cuda")).phases
    loss = Loss(teacher=Teacher("probs", 1.0))
    zc, tc = z[:rows], t[:rows]
    keep = torch.ones(rows, dtype=torch.bool, device="cuda")
    weights = rowmath.loss_weights(keep.sum(dtype=torch.float32), loss, V, False, torch)
    stats = phases.stats(zc, tc, None, loss, (16, 128))
    coefs = rowmath.coefficients(stats, rowmath.grad_scales(keep, None, weights, loss, torch), None, None, loss, torch)

    def row_phases(tile: tuple[int, int]) -> None:
        phases.stats(zc, tc, None, loss, tile)
        phases.finish(zc, tc, None, coefs, loss, V, tile, True)

    for tile in ((16, 128), (32, 128), (16, 256)):
        ms = median_ms(lambda tl=tile: row_phases(tl))
        moved = rows * V * 2 * 5  # z read twice, target read twice, dL/dz written once
        print(f"row kernel, {rows} rows, tile {tile}: {ms:.3f} ms = {moved / ms / 1e9:.2f} TB/s")
    # The GEMMs alone, cut into chunks as the driver cuts them: the grad_weight accumulator is
    # read and written once more per chunk after the first (beta = 1 GEMMs).
    gw, gx = torch.empty_like(w), torch.empty_like(x)
    for chunk in (rows, 4096, N):

        def chunked(c=chunk) -> None:
            for s in range(0, N, c):
                zc = z[: min(c, N - s)]
                torch.mm(x[s : s + c], w.t(), out=zc)
                torch.mm(zc, w, out=gx[s : s + c])
                if s == 0:
                    torch.mm(zc.t(), x[s : s + c], out=gw)
                else:
                    gw.addmm_(zc.t(), x[s : s + c])

        ms, ratio = x_floor(chunked)
        print(f"GEMMs alone in chunks of {chunk} rows: {ms:.2f} ms = {ratio:.3f} x floor")
    ce = Loss(weight_hard=1.0, weight_soft=0.0)
    labels = torch.randint(0, V, (rows,), device="cuda")
    ce_stats = phases.stats(zc, None, labels, ce, (16, 128))
    ce_weights = rowmath.loss_weights(keep.sum(dtype=torch.float32), ce, V, False, torch)
    ce_scales = rowmath.grad_scales(keep, None, ce_weights, ce, torch)
    ce_coefs = rowmath.coefficients(ce_stats, ce_scales, None, None, ce, torch)

    def ce_phases() -> None:
        phases.stats(zc, None, labels, ce, (16, 128))
        phases.finish(zc, None, labels, ce_coefs, ce, V, (16, 128), True)

    ms = median_ms(ce_phases)
    print(f"cross-entropy row kernels, {rows} rows: {ms:.3f} ms = {rows * V * 2 * 3 / ms / 1e9:.2f} TB/s")
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    for chunk in (None, 1024, 4096, 8192):

        def step(c=chunk) -> None:
            xx.grad = ww.grad = None
            torch_kl.fused_linear_kl_div(xx, ww, t, chunk_size=c).backward()

        ms, ratio = x_floor(step)
        print(f"torch_kl chunk_size={chunk}: {ms:.2f} ms = {ratio:.3f} x floor")


if __name__ == "__main__":
    main()
