"""Every Triton kernel as a GPU build compiles it, on a machine without a GPU.

The CPU tests interpret the kernels, which compiles none of them, and the interpreter has no
approximate logarithm: it takes ``tl.log`` where the GPU takes ``lg2.approx``. So here calls that
cover the loss family, the teachers, the cross-entropy and the dtypes launch the kernels
(interpreted); each distinct launch's signature, constexprs and options is recorded, and a process
without the interpreter compiles every one for an H100/H200 (sm_90, through PTX and ptxas). The
passes that take a logarithm per element must use the approximate one. The kernels' numbers are
tested on the GPU (``tests/test_gpu_family.py``, ``tests/test_gpu.py``).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from harness import make_inputs, run  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

TOPK = {"target_format": "topk_log_probs", "k": 4}
# In half precision the logits GEMM is the library's own (statistics or exponents in its
# epilogue): by TMA in float16; bfloat16 is interpreted without it (``triton_logits``).
# name: (make_inputs keywords, run keywords); N = 24 rows, H = 32, V = 256 unless given.
CALLS: dict[str, tuple[dict, dict]] = {
    "forward probs": ({}, {}),
    "forward log_probs, hard, T": ({"target_format": "log_probs"}, {"weight_hard_loss": 0.5, "temperature": 2.0}),
    "reverse probs, hard": ({}, {"beta": 1.0, "weight_hard_loss": 0.5}),
    "reverse logits, capped": (
        {"target_format": "logits"},
        {"beta": 1.0, "softcap": 20.0, "teacher_softcap": 30.0, "logit_scale": 0.5, "weight_hard_loss": 0.5},
    ),
    "jsd probs": ({}, {"beta": 0.5}),
    "jsd logits, hard": ({"target_format": "logits"}, {"beta": 0.5, "weight_hard_loss": 0.5}),
    "teacher head": ({"target_format": "hidden", "teacher_bias": True}, {}),
    "top-k bin, hard, bf16": ({**TOPK, "dtype": "bfloat16"}, {"weight_hard_loss": 0.5}),
    "top-k renormalize, fp16": ({**TOPK, "dtype": "float16"}, {"topk_tail": "renormalize"}),
    "cross-entropy, bf16": ({"dtype": "bfloat16"}, {"fn": "cross_entropy"}),
    "cross-entropy, smoothing, bias": ({"bias": True}, {"fn": "cross_entropy", "label_smoothing": 0.1}),
    "jsd, bf16": ({"dtype": "bfloat16"}, {"beta": 0.5}),
    "fp16, upstream 2": ({"dtype": "float16"}, {"upstream": 2.0}),
}

# (kernel, constexprs it must have): the passes with a logarithm per element. Reverse KL's
# statistics and JSD's mixture-sums pass on probabilities (log p; JSD also log m), the forward KL's
# finish on probabilities (log p for the loss), JSD's finish on logits (log m only).
LOGARITHMS = {
    "stats reverse probs": ("_stats_kernel", {"FORMAT": 0, "REV": True}),
    "mixture sums jsd probs": ("_mixture_sums_kernel", {"FORMAT": 0}),
    "finish forward probs": ("_finish_kernel", {"FORMAT": 0, "KIND": 0}),
    "finish jsd logits": ("_finish_kernel", {"FORMAT": 2, "KIND": 2}),
}

_TYPES = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
    torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
}  # fmt: skip


def _type(value: object) -> str:
    """The signature type of a run-time argument, as Triton spells it."""
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if hasattr(value, "block_shape") and hasattr(value, "base"):  # a tensor descriptor (TMA)
        return f"tensordesc<{_TYPES[value.base.dtype]}[{', '.join(map(str, value.block_shape))}]>"
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no signature type for {type(value).__name__}")


def _launch(fn, args: tuple, kwargs: dict) -> dict:
    """One launch as the compiler takes it: the kernel's module and name, signature, constexprs
    and the launch options (``num_warps``, ``num_stages``)."""
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args, strict=False)) | {k: v for k, v in kwargs.items() if k in params}
    signature, constexprs = {}, {}
    for name, param in params.items():
        value = bound.get(name, param.default)
        if "constexpr" in str(param.annotation) or value is None:
            signature[name] = "constexpr"
            constexprs[name] = getattr(value, "value", value)
        else:
            signature[name] = _type(value)
    options = {k: v for k, v in kwargs.items() if k not in params}
    return {"module": fn.__module__, "name": fn.__name__, "signature": signature, "constexprs": constexprs,
            "options": options}  # fmt: skip


@pytest.fixture(scope="module")
def launches() -> list[dict]:
    """The distinct launches of ``CALLS`` through ``torch_kl``'s Triton backend."""
    seen: dict[str, dict] = {}
    interpreted = InterpretedFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launch = _launch(self.fn, args, kwargs)
        seen.setdefault(json.dumps(launch, sort_keys=True), launch)
        return interpreted(self, *args, grid=grid, warmup=warmup, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InterpretedFunction, "run", record)
        for inputs, options in CALLS.values():
            run("torch/triton", make_inputs(24, 32, 256, **inputs), **options)
    return list(seen.values())


SCRIPT = textwrap.dedent(
    """
    import importlib, json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    counts = []
    for launch in json.loads(sys.stdin.read()):
        kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
        src = ASTSource(kernel, signature=launch["signature"], constexprs=launch["constexprs"])
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=launch["options"]).asm["ptx"]
        counts.append(ptx.count("lg2.approx"))
    print(json.dumps(counts))
    """
)


@pytest.fixture(scope="module")
def lg2_counts(launches: list[dict]) -> list[int]:
    """Each launch compiled for sm_90 without the interpreter: the ``lg2.approx`` in its PTX."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], input=json.dumps(launches), env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.fail(f"compiling the Triton kernels for sm_90 failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_kernel_is_launched_and_compiles_for_sm_90(launches: list[dict], lg2_counts: list[int]) -> None:
    names = {launch["name"] for launch in launches}
    # every row pass, the fused logits GEMM, the factored path's kernels, top-k's and the rescale
    want = {
        "_stats_kernel", "_mixture_sums_kernel", "_finish_kernel", "_logits_kernel", "_topk_kernel", "_scale_kernel"
    }  # fmt: skip
    assert want <= names, sorted(want - names)
    assert len(lg2_counts) == len(launches)


@pytest.mark.parametrize("case", list(LOGARITHMS))
def test_a_logarithm_per_element_is_the_approximate_one_on_the_gpu(
    launches: list[dict], lg2_counts: list[int], case: str
) -> None:
    name, constexprs = LOGARITHMS[case]
    counts = [
        count
        for launch, count in zip(launches, lg2_counts, strict=True)
        if launch["name"] == name and constexprs.items() <= launch["constexprs"].items()
    ]
    assert counts, f"{case}: not launched by CALLS"
    assert min(counts) > 0, f"{case}: no lg2.approx in the sm_90 PTX (the exact logf is ~30 instructions)"
