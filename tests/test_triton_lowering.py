"""The Triton row kernels as a GPU build compiles them, on a machine without a GPU.

The CPU tests interpret the kernels, and the interpreter has no approximate logarithm: it takes
``tl.log`` where the GPU takes ``lg2.approx``. So here, in a process without the interpreter,
the passes that take a logarithm per element are compiled for an H100/H200 (sm_90, through
PTX and ptxas) and their PTX must use the approximate logarithm. Their numbers are tested on
the GPU (``tests/test_gpu_family.py``, ``tests/test_gpu.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

# (kernel, its constexprs): reverse KL's statistics and JSD's value pass on probabilities (log p;
# JSD also log m), the forward KL's finish on probabilities (log p for the loss), JSD's finish on
# logits (log m only).
CASES = {
    "stats reverse probs": ("_stats_kernel", dict(FORMAT=0, HARD=True, HARD_LSE=False, MASS=False, REV=True)),
    "value jsd probs": ("_value_kernel", dict(FORMAT=0)),
    "finish forward probs": ("_finish_kernel", dict(FORMAT=0, KIND=0, HARD=False, HARD_LSE=False, WRITE_GRAD=True)),
    "finish jsd logits": ("_finish_kernel", dict(FORMAT=2, KIND=2, HARD=True, HARD_LSE=True, WRITE_GRAD=True)),
}

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from torch_kl.backends import triton_phases

    def ptx(kernel, constexprs):
        sig = {}
        for name in kernel.arg_names:
            if name in constexprs:
                sig[name] = "constexpr"
            elif name == "y_ptr":
                sig[name] = "*i64"
            elif name in ("z_ptr", "t_ptr"):
                sig[name] = "*bf16"
            elif name.endswith("_ptr"):
                sig[name] = "*fp32"
            elif name in ("V", "z_stride", "t_stride_r", "t_stride_c"):
                sig[name] = "i32"
            else:
                sig[name] = "fp32"
        src = ASTSource(kernel, signature=sig, constexprs=constexprs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8)).asm["ptx"]

    counts = {}
    for case, (name, constexprs) in json.loads(sys.argv[1]).items():
        common = dict(CAPPED=False, T_CAPPED=False, TILE_R=8, TILE_C=128)
        text = ptx(getattr(triton_phases, name), {**common, **constexprs})
        counts[case] = text.count("lg2.approx")
    print(json.dumps(counts))
    """
)


@pytest.fixture(scope="module")
def lg2_counts() -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(CASES)], env=env, capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        pytest.fail(f"compiling the row kernels for sm_90 failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_a_logarithm_per_element_is_the_approximate_one_on_the_gpu(lg2_counts: dict[str, int], case: str) -> None:
    assert lg2_counts[case] > 0, f"{case}: no lg2.approx in the sm_90 PTX (the exact logf is ~30 instructions)"
