"""``torch_kl.parallel.LinearLossParallel`` on a 2-rank gloo ``DeviceMesh`` (run by torch_worker.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module
from torch_problems import DEVICE, check, problem, rows_of, run

import torch_kl
from torch_kl.parallel import LinearLossParallel

STYLE_CASES: dict[str, Callable[[int, int], None]] = {}
TOL = 2e-5


def _case(fn):
    STYLE_CASES[f"style_{fn.__name__}"] = fn
    return fn


def _leaf(a: torch.Tensor, mesh, placement) -> DTensor:
    return distribute_tensor(a, mesh, [placement]).requires_grad_()


def _keeps_uneven_shard_grads(mesh) -> bool:
    """Whether this torch gives an uneven ``Shard``'s gradient back sharded through ``to_local()``
    (torch 2.11 gives it back as ``Replicate``, without torch_kl involved)."""
    x = distribute_tensor(torch.ones(1, 3, 2, device=DEVICE), mesh, [Shard(1)]).requires_grad_()
    x.to_local().sum().backward()
    return tuple(x.grad.placements) == (Shard(1),)


@_case
def kl_dtensors(rank: int, world: int) -> None:
    """DTensor rows Shard(1) (T = 7: 4 and 3 rows; 8: 4 and 4 where torch loses an uneven
    shard's gradient placement), Replicate head: global loss and gradients."""
    mesh = init_device_mesh(DEVICE.type, (world,))
    n = 14 if _keeps_uneven_shard_grads(mesh) else 16
    p = problem(n=n, lead=2, bias=True, ignored=(4, 5, 6, 12))
    opts = dict(chunk_size=3, temperature=1.5)
    want_loss, want = run(p, opts)
    module = parallelize_module(torch_kl.FusedLinearKLDivLoss(**opts), mesh, LinearLossParallel(sequence_dim=1))
    x, w, b = _leaf(p["x"], mesh, Shard(1)), _leaf(p["weight"], mesh, Replicate()), _leaf(p["bias"], mesh, Replicate())
    t, lab = (distribute_tensor(p[k], mesh, [Shard(1)]) for k in ("target", "labels"))
    loss = module(x, w, t, labels=lab, bias=b)
    value = float(loss.full_tensor())
    loss.backward()
    grads = {"x": x.grad.full_tensor(), "weight": w.grad.full_tensor(), "bias": b.grad.full_tensor()}
    assert isinstance(loss, DTensor) and tuple(loss.placements) == (Partial(),), loss
    assert tuple(w.grad.placements) == (Partial(),), w.grad.placements
    assert tuple(x.grad.placements) == (Shard(1),), x.grad.placements
    check("loss", value, want_loss, TOL)
    for k, g in grads.items():
        check(f"grad_{k}", g, want[k], TOL)


@_case
def kl_replicated_rows_local_output(rank: int, world: int) -> None:
    """Rows given as a Replicate DTensor are sharded by the style; use_local_output gives the
    share; a plain head's gradient is summed over the ranks."""
    mesh = init_device_mesh(DEVICE.type, (world,))
    p = problem(n=12, lead=None, ignored=(1, 7, 8))
    want_loss, want = run(p, {})
    module = parallelize_module(
        torch_kl.FusedLinearKLDivLoss(), mesh, LinearLossParallel(sequence_dim=0, use_local_output=True)
    )
    x = _leaf(p["x"], mesh, Replicate())
    w = p["weight"].clone().requires_grad_()
    share = module(
        x, w, distribute_tensor(p["target"], mesh, [Replicate()]), p["labels"][:6] if rank == 0 else p["labels"][6:]
    )
    share.backward()
    total = share.detach().clone()
    torch.distributed.all_reduce(total)
    assert not isinstance(share, DTensor)
    check("sum of shares", float(total), want_loss, TOL)
    check("grad_weight", w.grad, want["weight"], TOL)
    check("grad_x", x.grad.full_tensor(), want["x"], TOL)


@_case
def kl_plain_head(rank: int, world: int) -> None:
    """The recipe's call: DTensor rows, the plain weight and bias of an ``nn.Linear`` head; every
    rank's ``.grad`` is the global gradient (summed over the ranks, as a Partial one would be),
    the module's input unchanged."""
    mesh = init_device_mesh(DEVICE.type, (world,))
    p = problem(n=8, lead=2, bias=True, ignored=(2, 5))
    want_loss, want = run(p, {"temperature": 2.0})
    module = parallelize_module(torch_kl.FusedLinearKLDivLoss(temperature=2.0), mesh, LinearLossParallel())
    head = torch.nn.Linear(p["weight"].shape[1], p["weight"].shape[0], device=DEVICE)
    with torch.no_grad():
        head.weight.copy_(p["weight"]), head.bias.copy_(p["bias"])
    x = _leaf(p["x"], mesh, Shard(1))
    t, lab = (distribute_tensor(p[k], mesh, [Shard(1)]) for k in ("target", "labels"))
    loss = module(x, head.weight, t, lab, bias=head.bias)
    check("loss", float(loss.full_tensor()), want_loss, TOL)
    loss.backward()
    check("grad_weight", head.weight.grad, want["weight"], TOL)
    check("grad_bias", head.bias.grad, want["bias"], TOL)
    check("grad_x", x.grad.full_tensor(), want["x"], TOL)
    check("weight", head.weight.detach(), p["weight"], 0.0)


@_case
def kl_row_weights_and_row_losses(rank: int, world: int) -> None:
    """A DTensor ``row_weight`` is sharded like the rows; ``return_row_losses=True`` gives the
    global loss as a Partial DTensor and this rank's rows' losses as a plain tensor."""
    mesh = init_device_mesh(DEVICE.type, (world,))
    p = problem(n=8, lead=2, ignored=(2, 5))
    p["row_weight"] = torch.linspace(0.5, 2.0, 8, device=DEVICE).reshape(2, 4)
    want_loss, want = run(p, {})
    _, want_rows = torch_kl.fused_linear_kl_div(**p, return_row_losses=True)
    module = parallelize_module(torch_kl.FusedLinearKLDivLoss(return_row_losses=True), mesh, LinearLossParallel())
    x, w = _leaf(p["x"], mesh, Shard(1)), _leaf(p["weight"], mesh, Replicate())
    t, lab, rw = (distribute_tensor(p[k], mesh, [Shard(1)]) for k in ("target", "labels", "row_weight"))
    loss, rows = module(x, w, t, lab, row_weight=rw)
    assert isinstance(loss, DTensor) and tuple(loss.placements) == (Partial(),), loss
    assert not isinstance(rows, DTensor) and rows.shape == (2, 2), rows
    check("loss", float(loss.full_tensor()), want_loss, TOL)
    check("row_losses", rows, want_rows[:, 2 * rank : 2 * rank + 2], TOL)
    loss.backward()
    check("grad_weight", w.grad.full_tensor(), want["weight"], TOL)
    check("grad_x", x.grad.full_tensor(), want["x"], TOL)


@_case
def jsd_module(rank: int, world: int) -> None:
    """FusedLinearJSDLoss (teacher hidden states and head), return_soft_hard_loss=True."""
    mesh = init_device_mesh(DEVICE.type, (world,))
    p = problem("hidden", n=10, lead=2, ignored=(0, 1, 7))
    opts = dict(beta=0.4, weight_hard_loss=0.3, weight_soft_loss=0.7, chunk_size=2, return_soft_hard_loss=True)
    ref = torch_kl.FusedLinearJSDLoss(**opts)
    xs, ws = p["x"].clone().requires_grad_(), p["weight"].clone().requires_grad_()
    want = ref(xs, ws, p["target"], p["teacher_weight"], p["labels"])
    want[0].backward()
    module = parallelize_module(torch_kl.FusedLinearJSDLoss(**opts), mesh, LinearLossParallel(sequence_dim=1))
    x, w = _leaf(p["x"], mesh, Shard(1)), _leaf(p["weight"], mesh, Replicate())
    t, lab = (distribute_tensor(p[k], mesh, [Shard(1)]) for k in ("target", "labels"))
    got = module(x, w, t, distribute_tensor(p["teacher_weight"], mesh, [Replicate()]), lab)
    values = [float(g.full_tensor()) for g in got]
    got[0].backward()
    gx, gw = x.grad.full_tensor(), w.grad.full_tensor()
    for name, g, e in zip(("loss", "soft", "hard"), values, want, strict=True):
        check(name, g, float(e), TOL)
    check("grad_x", gx, xs.grad, TOL)
    check("grad_weight", gw, ws.grad, TOL)


@_case
def cross_entropy_module(rank: int, world: int) -> None:
    mesh = init_device_mesh(DEVICE.type, (world,))
    p = problem(n=9, ignored=(5, 6))
    want_loss, want = run(p, {"label_smoothing": 0.1}, fn=torch_kl.fused_linear_cross_entropy)
    module = parallelize_module(
        torch_kl.FusedLinearCrossEntropyLoss(label_smoothing=0.1), mesh, LinearLossParallel(sequence_dim=0)
    )
    mine = rows_of(p, rank, 5, False)
    x = mine["x"].clone().requires_grad_()  # plain tensors: this rank's rows already
    w = _leaf(p["weight"], mesh, Replicate())
    loss = module(x, w, mine["labels"])
    value = float(loss.full_tensor())
    loss.backward()
    gw = w.grad.full_tensor()
    check("loss", value, want_loss, TOL)
    check("grad_x", x.grad, rows_of(want, rank, 5, False)["x"], TOL)
    check("grad_weight", gw, want["weight"], TOL)


@_case
def refusals(rank: int, world: int) -> None:
    mesh = init_device_mesh(DEVICE.type, (world,))
    p = problem()
    module = parallelize_module(torch_kl.FusedLinearKLDivLoss(), mesh, LinearLossParallel(sequence_dim=0))
    sharded_head = distribute_tensor(p["weight"], mesh, [Shard(0)])
    try:
        module(p["x"], sharded_head, p["target"], p["labels"])
    except ValueError as e:
        assert "weight:" in str(e) and "FSDP2" in str(e), e
    else:
        raise AssertionError("a Shard(0) head was accepted")
    for bad, needle in (
        (lambda: LinearLossParallel(sequence_dim=-1), "sequence_dim"),
        (
            lambda: parallelize_module(
                torch_kl.FusedLinearKLDivLoss(vocab_group=mesh.get_group()), mesh, LinearLossParallel()
            ),
            "vocab_group",
        ),
    ):
        try:
            bad()
        except ValueError as e:
            assert needle in str(e), e
        else:
            raise AssertionError(f"no ValueError about {needle}")
    try:
        parallelize_module(torch.nn.Linear(2, 2), mesh, LinearLossParallel())
    except TypeError as e:
        assert "FusedLinearKLDivLoss" in str(e), e
    else:
        raise AssertionError("a Linear was accepted")
