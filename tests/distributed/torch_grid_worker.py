"""One of four ranks on a 2 x 2 grid, rows and vocabulary sharded together (``batch_group`` and
``vocab_group``): ``python torch_grid_worker.py RANK 4 STORE OUT``, started by
``test_torch_distributed.py``. Rank ``2 * i + j`` holds row shard ``i`` and vocabulary slice ``j``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch_problems import DEVICE, check, finish, init, problem, rows_of, run, vocab_of, vocab_slice

CASES: dict[str, Callable[..., None]] = {}
MATRIX = [
    ("forward_probs_bias", "probs", dict(chunk_size=3)),
    ("topk_bin_hard", "topk_log_probs", dict(weight_hard_loss=0.5, label_smoothing=0.1, chunk_size=4)),
    ("hidden_jsd_hard", "hidden", dict(beta=0.5, weight_hard_loss=0.3, softcap=3.0)),
]


def _grid_case(fmt: str, options: dict, backend: str) -> Callable[..., None]:
    def body(rank: int, batch_groups: list, vocab_groups: list) -> None:
        i, j = divmod(rank, 2)
        opts = {**options, "target_format": fmt, "backend": backend}
        p = problem(fmt, bias=True)
        want_loss, want = run(p, opts)
        mine = vocab_of(rows_of(p, i, 5, False), j, 2, fmt)
        share, got = run(mine, opts, batch_group=batch_groups[j], vocab_group=vocab_groups[i])
        total = torch.tensor(share, device=DEVICE)
        dist.all_reduce(total, group=batch_groups[j])
        head = {k: got[k].clone() for k in ("weight", "bias")}
        for g in head.values():
            dist.all_reduce(g, group=batch_groups[j])
        check("sum of the row shards' losses", float(total), want_loss, 2e-5)
        check("grad_x of this row shard", got["x"], rows_of(want, i, 5, False)["x"], 2e-5)
        sl = vocab_slice(j, 2, p["weight"].shape[0])
        for k, g in head.items():
            check(f"grad_{k}: summed over the row shards, this vocabulary slice", g, want[k][sl], 2e-5)

    return body


for _name, _fmt, _options in MATRIX:
    for _backend in ("torch", "triton"):
        CASES[f"grid_{_name}[{_backend}]"] = _grid_case(_fmt, _options, _backend)


def _grid_validation(rank: int, batch_groups: list, vocab_groups: list) -> None:
    """Rank 0 alone rejects its arguments: all four ranks raise (rank 3 shares no group with it),
    and the grid is still in step afterwards."""
    i, j = divmod(rank, 2)
    p = vocab_of(rows_of(problem(), i, 5, False), j, 2, "probs")
    groups = dict(batch_group=batch_groups[j], vocab_group=vocab_groups[i])
    try:
        run(p, {"temperature": -1.0 if rank == 0 else 1.0}, **groups)
    except ValueError as e:
        want = "temperature:" if rank == 0 else "rank"
        assert want in str(e), e
    else:
        raise AssertionError("no ValueError")
    run(p, {}, **groups)


CASES["grid_validation"] = _grid_validation


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    assert world == 4
    init(rank, world, store)
    vocab_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # one per row shard
    batch_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # one per vocabulary slice
    results: dict[str, str | None] = {}
    for name, fn in CASES.items():
        try:
            fn(rank, batch_groups, vocab_groups)
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    finish()


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    main()
