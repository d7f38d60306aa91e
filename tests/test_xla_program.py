"""What XLA is given of a ``jax_kl`` step on a GPU, read from its CUDA lowering on a machine
without one: the properties XLA's buffer assignment needs to keep one ``[chunk, V]`` buffer per
chunk. Where they fail, XLA copies the logits that a kernel writes ``dL/dz`` over (one more
``[chunk, V]`` buffer per chunk) or keeps every chunk's logits alive to the end of the step."""

from __future__ import annotations

import dataclasses
import re

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from harness import jax_pallas_on_hopper  # noqa: E402


@dataclasses.dataclass(frozen=True)
class _Op:
    type: str
    opcode: str
    operands: list[str]
    attributes: str


def _tuple_type_end(text: str) -> int:
    """Where the tuple type that ``text`` starts with ends."""
    depth = 0
    for end, ch in enumerate(text, 1):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return end
    return len(text)


def _hlo_ops(text: str) -> dict[str, _Op]:
    """Each instruction of an HLO module's text by name."""
    ops = {}
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?([\w.\-]+) = (.*)", re.sub(r"/\*.*?\*/", "", line))
        if not m:
            continue
        rest = m.group(2)
        end = _tuple_type_end(rest) if rest.startswith("(") else 0
        call = re.match(r"\s*([^\s(]+\s+)?([\w\-]+)\(([^)]*)\)(.*)", rest[end:])
        if call:
            operands = [a.strip() for a in call.group(3).split(",") if a.strip()]
            ops[m.group(1)] = _Op(rest[:end] + (call.group(1) or ""), call.group(2), operands, call.group(4))
    return ops


def _lowered(loss, *shapes) -> dict[str, _Op]:
    """The CUDA lowering of ``grad(loss)`` with respect to its second argument (the head)."""
    lowered = jax.jit(jax.grad(loss, argnums=1)).trace(*shapes).lower(lowering_platforms=("cuda",))
    return _hlo_ops(lowered.as_text(dialect="hlo"))


def _ancestors(ops: dict[str, _Op], name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for a in ops[todo.pop()].operands:
            if a in ops and a not in seen:
                seen.add(a)
                todo.append(a)
    return seen


def _overwritten_values(ops: dict[str, _Op], name: str) -> tuple[list[str], set[str]]:
    """The values whose buffer the in-place kernel ``name`` writes over (its aliased operand and,
    back through barriers, the value that made that buffer), and the tuples that pass it to a
    barrier (they read nothing)."""
    at = re.search(r"output_to_operand_aliasing=\{\{[\d,]*\}: \((\d+)", ops[name].attributes)
    value = ops[name].operands[int(at.group(1))]
    chain, passing = [value], set()
    while ops[value].opcode == "get-tuple-element":
        barrier = ops[ops[value].operands[0]]
        if barrier.opcode != "opt-barrier" or ops[barrier.operands[0]].opcode != "tuple":
            break  # an output of a kernel or a GEMM: its buffer is made there
        passing.add(barrier.operands[0])
        index = int(re.search(r"index=(\d+)", ops[value].attributes).group(1))
        value = ops[barrier.operands[0]].operands[index]
        chain.append(value)
    return chain, passing


def _late_readers(ops: dict[str, _Op]) -> list[str]:
    """Instructions that read a buffer an in-place kernel writes over and do not come before that
    kernel: XLA keeps a copy of the buffer for them."""
    users: dict[str, list[str]] = {}
    for name, op in ops.items():
        for a in op.operands:
            users.setdefault(a, []).append(name)
    late = []
    for name, op in ops.items():
        if op.opcode != "custom-call" or "output_to_operand_aliasing" not in op.attributes:
            continue
        before = _ancestors(ops, name)
        chain, passing = _overwritten_values(ops, name)
        late += [u for v in chain for u in users.get(v, []) if u not in before | passing | {name}]
    return late


@pytest.mark.parametrize("v", [8192, 8291])  # one part; an aligned part and the columns left
@pytest.mark.parametrize("kind", ["cross_entropy", "topk", "forward"])
def test_what_reads_the_logits_comes_before_the_kernel_that_overwrites_them(kind: str, v: int) -> None:
    """Every reader of a chunk's logits (the label's logit, a top-k teacher's columns) comes
    before ``finish`` writes ``dL/dz`` over them, and every reader of the ``grad_weight``
    accumulator before the add into it."""
    import jax_kl

    backend = jax_pallas_on_hopper()
    x, w = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16), jax.ShapeDtypeStruct((v, 256), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((512,), jnp.int32)
    if kind == "cross_entropy":
        ops = _lowered(lambda x, w, y: jax_kl.fused_linear_cross_entropy(x, w, y, chunk_size=256, backend=backend),
                       x, w, labels)  # fmt: skip
    else:
        topk = kind == "topk"
        target = jax.ShapeDtypeStruct((512, 8) if topk else (512, v), jnp.float32)
        idx = jax.ShapeDtypeStruct((512, 8), jnp.int32)

        def kl_loss(x, w, y, target, idx):
            return jax_kl.fused_linear_kl_div(
                x, w, target, y, weight_hard_loss=0.5, chunk_size=256, backend=backend,
                target_format="topk_log_probs" if topk else "probs", target_indices=idx if topk else None,
            )  # fmt: skip

        ops = _lowered(kl_loss, x, w, labels, target, idx)
    in_place = [op for op in ops.values() if "output_to_operand_aliasing" in op.attributes]
    assert len(in_place) >= 3  # finish in both chunks, the add of the second chunk's grad_weight
    assert _late_readers(ops) == []
