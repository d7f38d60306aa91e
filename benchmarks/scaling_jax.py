"""``python -m benchmarks.scaling``'s JAX measurement, in its own process (on CPU the host
devices must be forced before JAX starts): ``jax_kl`` under ``jit(grad)`` on one device, then on a
mesh of ``world`` devices with the rows sharded (``batch_axis``, N rows per device) and with the
vocabulary sharded (``vocab_axis``, N rows, a ``V / world`` slice of the head per device).

With global arrays the gradient of the replicated head is replicated, so the rows layout includes
the all-reduce of ``grad_weight``; the same layout inside the caller's ``shard_map`` leaves each
device its own ``grad_weight``, as torch_kl does with DDP (timed too, and the all-reduce alone)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_kl

from .measure import Timing, time_ms
from .shapes import parse_head


def _median_ms(fn: Callable[..., Any], args: tuple, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    return time_ms("jax", lambda: fn(*args), Timing(reps=reps, rep_ms=0.0, warmup_ms=0.0), on_gpu=False)


def measure(world: int, n: int, head: str, reps: int) -> dict[str, float]:
    devices = jax.devices()[:world]
    if len(devices) < world:
        raise SystemExit(f"--world {world}: JAX sees {len(devices)} device(s)")
    on_gpu = devices[0].platform == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    shape = parse_head(head)
    h, v = shape.h, shape.v
    keys = jax.random.split(jax.random.key(1234), 3)
    weight = (jax.random.normal(keys[0], (v, h)) * h**-0.5).astype(dtype)
    x = jax.random.normal(keys[1], (world * n, h)).astype(dtype)
    teacher = jax.nn.softmax(jax.random.normal(keys[2], (world * n, v)), -1).astype(dtype)
    mesh = Mesh(np.array(devices), ("d",))

    def grads(**layout):
        return jax.jit(jax.grad(lambda x, w, t: jax_kl.fused_linear_kl_div(x, w, t, **layout), argnums=(0, 1)))

    def inside_grads(x, w, t):  # per-device gradients, reduced by the caller (as DDP does)
        f = jax.grad(lambda x, w, t: jax_kl.fused_linear_kl_div(x, w, t, batch_axis="d"), argnums=(0, 1))
        return jax.shard_map(f, mesh=mesh, in_specs=(P("d", None), P(None, None), P("d", None)),
                             out_specs=(P("d", None), P("d", None)), check_vma=False)(x, w, t)  # fmt: skip

    def psum(a):
        return jax.shard_map(lambda a: lax.psum(a, "d"), mesh=mesh, in_specs=P("d", None), out_specs=P(None, None),
                             check_vma=False)(a)  # fmt: skip

    def put(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    one = jax.device_put((x[:n], weight, teacher[:n]), devices[0])
    rows = (put(x, P("d", None)), put(weight, P(None, None)), put(teacher, P("d", None)))
    vocab = (put(x[:n], P(None, None)), put(weight, P("d", None)), put(teacher[:n], P(None, "d")))
    per_device_grads = put(jnp.tile(weight, (world, 1)), P("d", None))  # one [V, H] per device
    return {
        "one_device_ms": _median_ms(grads(), one, reps),
        "rows_ms": _median_ms(grads(mesh=mesh, batch_axis="d"), rows, reps),
        "rows_local_ms": _median_ms(jax.jit(inside_grads), rows, reps),
        "all_reduce_grad_weight_ms": _median_ms(jax.jit(psum), (per_device_grads,), reps),
        "vocab_ms": _median_ms(grads(mesh=mesh, vocab_axis="d"), vocab, reps),
        "grad_weight_gib_one_device": v * h * jnp.dtype(dtype).itemsize / 2**30,
        "grad_weight_gib_vocab": v // world * h * jnp.dtype(dtype).itemsize / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for name in ("world", "n", "reps"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--head", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.write_text(json.dumps(measure(args.world, args.n, args.head, args.reps)))


if __name__ == "__main__":
    main()
