"""One rank of the distributed torch checks: ``python torch_worker.py RANK WORLD STORE OUT``.

``test_torch_distributed.py`` starts two of these on gloo (CPU). Each runs every case of
``CASES`` and writes ``{case: None or the traceback}`` to ``OUT/rank<RANK>.json``. A case runs
all its collectives before its first assertion, so one rank failing a comparison does not
leave the other waiting in a collective.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable

import torch
from torch_problems import DENSE, DEVICE, check, finish, init, problem, rows_of, run, vocab_of, vocab_slice

import torch_kl

CASES: dict[str, Callable[[int, int], None]] = {}

# (name, target format, problem keywords, loss options); each runs rows- and vocab-sharded.
MATRIX = [
    ("forward_probs_bias", "probs", dict(bias=True), dict(chunk_size=3)),
    ("forward_rank1_all_ignored", "probs", dict(ignored=(5, 6, 7, 8, 9, 10, 11)), dict(chunk_size=4)),
    ("no_labels_logits", "logits", dict(ignored=None, bias=True), dict(temperature=0.8, chunk_size=5)),
    ("nothing_kept", "log_probs", dict(ignored=tuple(range(12))), dict(reduction="sum")),
    ("reverse_log_probs_sum", "log_probs", dict(lead=2), dict(beta=1.0, reduction="sum", chunk_size=5)),
    (
        "reverse_logits_hard",
        "logits",
        dict(),
        dict(beta=1.0, weight_hard_loss=0.5, temperature=2.0, teacher_temperature=1.5, chunk_size=5),
    ),
    ("jsd_logits_mean", "logits", dict(), dict(beta=0.5, reduction="mean", temperature=2.0, teacher_temperature=1.5)),
    (
        "hard_smoothing_softcap",
        "probs",
        dict(bias=True),
        dict(
            weight_hard_loss=0.7,
            weight_soft_loss=0.4,
            label_smoothing=0.1,
            softcap=3.0,
            logit_scale=1.3,
            temperature=1.5,
            chunk_size=5,
        ),
    ),
    (
        "topk_bin_hard",
        "topk_log_probs",
        dict(),
        dict(topk_tail="bin", weight_hard_loss=0.5, label_smoothing=0.2, chunk_size=5),
    ),
    ("topk_renormalize", "topk_log_probs", dict(k=7), dict(topk_tail="renormalize", temperature=0.7)),
    ("topk_drop_softcap", "topk_log_probs", dict(bias=True), dict(topk_tail="drop", softcap=2.0)),
    (
        "hidden_jsd",
        "hidden",
        dict(bias=True),
        dict(beta=0.3, teacher_softcap=4.0, teacher_logit_scale=0.8, chunk_size=4),
    ),
    ("bfloat16_forward", "probs", dict(dtype=torch.bfloat16), dict(accum_dtype=torch.float32)),
    ("cross_entropy", None, dict(), dict(label_smoothing=0.1, softcap=4.0)),
    # bfloat16 without smoothing: the Triton backend factors dL/dz, each vocabulary slice its own E
    ("cross_entropy_bf16", None, dict(dtype=torch.bfloat16, h=16, v=32), dict(logit_scale=30.0, chunk_size=5)),
    ("topk_bf16", "topk_log_probs", dict(dtype=torch.bfloat16, h=16, v=32), dict(weight_hard_loss=0.5, chunk_size=5)),
]
BACKENDS = ("torch", "triton")


def case(name: str):
    def register(fn):
        CASES[name] = fn
        return fn

    return register


def _group():
    return torch.distributed.group.WORLD


def _all_sum(a: torch.Tensor) -> torch.Tensor:
    a = a.detach().clone()
    torch.distributed.all_reduce(a)
    return a


def _layouts(name: str, fmt: str | None, pkw: dict, options: dict, backend: str) -> None:
    def body(rank: int, world: int) -> None:
        fn = torch_kl.fused_linear_cross_entropy if fmt is None else torch_kl.fused_linear_kl_div
        opts = {**options, "backend": backend} if fmt is None else {**options, "target_format": fmt, "backend": backend}
        tol = 2e-2 if pkw.get("dtype") == torch.bfloat16 else 2e-5
        p = problem(fmt or "probs", **pkw)
        want_loss, want = run(p, opts, fn=fn)
        lead = pkw.get("lead") is not None
        # Rows: rank 0 holds 5 rows (2 of each sequence with lead), rank 1 the rest.
        split = 2 if lead else 5
        mine = rows_of(p, rank, split, lead)
        share, got = run(mine, opts, fn=fn, batch_group=_group())
        total = float(_all_sum(torch.tensor(share, device=DEVICE)))
        head = {k: _all_sum(g) for k, g in got.items() if k != "x"}
        # Vocabulary: contiguous V / G slices of the head (and the V axis of a dense target).
        vloss, vgot = run(vocab_of(p, rank, world, fmt or "probs"), opts, fn=fn, vocab_group=_group())
        # Only comparisons from here on.
        check("rows: sum of the ranks' losses", total, want_loss, tol)
        check("rows: grad_x of this rank's rows", got["x"], rows_of(want, rank, split, lead)["x"], tol)
        for k, g in head.items():
            check(f"rows: summed grad_{k}", g, want[k], tol)
        if "nothing_kept" in name:
            assert share == 0.0 and all(float(g.abs().max()) == 0 for g in got.values()), "n = 0: not exactly 0"
        check("vocab: loss", vloss, want_loss, tol)
        check("vocab: grad_x", vgot["x"], want["x"], tol)
        vs = vocab_slice(rank, world, p["weight"].shape[0])
        for k in ("weight", "bias"):
            if k in vgot:
                check(f"vocab: grad_{k} slice", vgot[k], want[k][vs], tol)
        assert fmt not in DENSE or vocab_of(p, rank, world, fmt)["target"].shape[-1] == p["weight"].shape[0] // world

    return body


for _name, _fmt, _pkw, _options in MATRIX:
    for _backend in BACKENDS:
        CASES[f"{_name}[{_backend}]"] = _layouts(_name, _fmt, _pkw, _options, _backend)


@case("empty_row_shard")
def _empty_row_shard(rank: int, world: int) -> None:
    """Rank 0 holds no rows at all: it still joins the count of kept rows; its gradients are 0."""
    for backend in BACKENDS:
        p = problem(bias=True)
        want_loss, want = run(p, {"backend": backend})
        share, got = run(rows_of(p, rank, 0, False), {"backend": backend}, batch_group=_group())
        total, gw = float(_all_sum(torch.tensor(share, device=DEVICE))), _all_sum(got["weight"])
        check("sum of the ranks' losses", total, want_loss, 2e-5)
        check("summed grad_weight", gw, want["weight"], 2e-5)
        assert got["x"].shape[0] == (0 if rank == 0 else 12), got["x"].shape


def _with_rows(p: dict, row_weight: torch.Tensor, **layout) -> tuple[float, torch.Tensor, dict]:
    """Loss, row losses and gradients of a weighted JSD with a hard term and a z-loss."""
    leaves = {k: p[k].detach().clone().requires_grad_() for k in ("x", "weight", "bias")}
    rest = {k: a for k, a in p.items() if k not in leaves}
    loss, rows = torch_kl.fused_linear_kl_div(
        **rest, **leaves, row_weight=row_weight, return_row_losses=True, target_format="logits", beta=0.5,
        weight_hard_loss=0.5, z_loss_weight=0.1, chunk_size=4, **layout,
    )  # fmt: skip
    loss.backward()
    return float(loss.detach()), rows, {k: a.grad for k, a in leaves.items()}


@case("row_weights_and_row_losses")
def _row_weights(rank: int, world: int) -> None:
    """Rows sharded: each rank passes its rows' weights and gets its rows' losses; vocabulary
    sharded: every rank gets the full rows' losses."""
    p = problem("logits", bias=True)
    w = torch.rand(p["x"].shape[0], generator=torch.Generator().manual_seed(3)).to(DEVICE) * 2
    want_loss, want_rows, want = _with_rows(p, w)
    mine = slice(0, 5) if rank == 0 else slice(5, None)
    share, rows, got = _with_rows(rows_of(p, rank, 5, False), w[mine], batch_group=_group())
    total, head = float(_all_sum(torch.tensor(share, device=DEVICE))), {k: _all_sum(got[k]) for k in ("weight", "bias")}
    vloss, vrows, vgot = _with_rows(vocab_of(p, rank, world, "logits"), w, vocab_group=_group())
    check("rows: sum of the ranks' losses", total, want_loss, 2e-5)
    check("rows: this rank's row losses", rows, want_rows[mine], 2e-5)
    check("rows: grad_x of this rank's rows", got["x"], want["x"][mine], 2e-5)
    for k, g in head.items():
        check(f"rows: summed grad_{k}", g, want[k], 2e-5)
    check("vocab: loss", vloss, want_loss, 2e-5)
    check("vocab: row losses", vrows, want_rows, 2e-5)
    check("vocab: grad_x", vgot["x"], want["x"], 2e-5)


@case("compiled")
def _compiled(rank: int, world: int) -> None:
    """``torch.compile(fullgraph=True)`` with either group gives the eager call's loss and
    gradients (the ranks' comparison of their calls is skipped there, as documented)."""
    p = problem(bias=True)
    shards = {"batch_group": rows_of(p, rank, 5, False), "vocab_group": vocab_of(p, rank, world, "probs")}
    for backend in BACKENDS:
        for layout, shard in shards.items():
            options = {"backend": backend, layout: _group()}
            compiled = torch.compile(torch_kl.fused_linear_kl_div, backend="aot_eager", fullgraph=True)
            want_loss, want = run(shard, options)
            got_loss, got = run(shard, options, fn=compiled)
            check(f"{layout}, {backend}: compiled loss", got_loss, want_loss, 1e-6)
            for k, g in got.items():
                check(f"{layout}, {backend}: compiled grad_{k}", g, want[k], 1e-6)


def _raises(fn, *needles: str) -> None:
    try:
        fn()
    except ValueError as e:
        missing = [n for n in needles if n not in str(e)]
        assert not missing, f"error lacks {missing}: {e}"
        return
    raise AssertionError(f"no ValueError (expected one saying {needles})")


def _call(p: dict, **kw):
    return lambda: torch_kl.fused_linear_kl_div(**p, **kw)


@case("validation")
def _validation(rank: int, world: int) -> None:
    p = problem(v=17)
    g = _group()
    sl = slice(0, 9) if rank == 0 else slice(9, None)  # V = 17 over 2 ranks: 9 and 8 rows
    uneven = {**p, "weight": p["weight"][sl], "target": p["target"][:, sl]}
    _raises(_call(uneven, vocab_group=g), "weight:", "divisible")
    p = problem()
    narrow = {**p, "x": p["x"][:, :7], "weight": p["weight"][:, :7]} if rank == 1 else p
    _raises(_call(narrow, batch_group=g), "x:", "disagree on H", "[8, 7]")
    short = {**p, "x": p["x"][:-1], "target": p["target"][:-1], "labels": p["labels"][:-1]} if rank == 1 else p
    _raises(_call(vocab_of(short, rank, world, "probs"), vocab_group=g), "x:", "disagree on N")
    _raises(_call(p, batch_group=g, reduction="sum" if rank else "batchmean"), "batch_group:", "options")
    # One rank's own arguments are rejected: it raises its error, the other says which rank.
    _raises(_call(p, batch_group=g, temperature=-1.0 if rank else 1.0), "temperature:" if rank else "rank(s) [1]")
    t = problem("topk_log_probs")
    bad = {**t, "target_indices": t["target_indices"] + 100} if rank == 0 else t
    _raises(
        _call(vocab_of(bad, rank, world, "topk_log_probs"), target_format="topk_log_probs", vocab_group=g),
        "rank(s) [0]" if rank else "target_indices:",
    )
    _raises(_call(p, batch_group=g, backend="jax"), "backend:", "one device")
    _raises(_call(p, vocab_group=g, batch_group=g), "batch_group, vocab_group:")
    frozen = {**p, "x": p["x"].clone().requires_grad_(rank == 0)}  # grad_x on rank 0 only: its all-reduce would hang
    _raises(_call(vocab_of(frozen, rank, world, "probs"), vocab_group=g), "vocab_group:", "options")
    # The group is still in step: a good call works.
    vloss, _ = run(vocab_of(p, rank, world, "probs"), {}, vocab_group=g)
    check("vocab loss after the errors", vloss, run(p, {})[0], 2e-5)


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    init(rank, world, store)
    from torch_style_cases import STYLE_CASES

    results: dict[str, str | None] = {}
    only = sys.argv[5:]  # case names, for running a few by hand
    for name, fn in {**CASES, **STYLE_CASES}.items():
        if only and name not in only:
            continue
        try:
            fn(rank, world)
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    finish()


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    main()
