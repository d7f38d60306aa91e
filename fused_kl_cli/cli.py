"""The ``fused-kl`` command line (also ``python -m fused_kl``).

Subcommands:

* ``demo``: a small distillation run with both frameworks and both bridges; their loss curves must agree.
* ``check``: every backend available here against a float64 NumPy reference.
* ``bench``: benchmarks, handled by ``fused_kl.bench``.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

# Both are read when triton / JAX start, so they are set before anything imports them. Without
# an NVIDIA GPU the Triton kernel can only run in its interpreter; and torch and JAX share this
# process, so JAX must not take most of the GPU's memory up front.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``fused-kl`` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="fused-kl", description="Fused LM head + KL divergence loss for PyTorch and JAX."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="distil a random teacher with jax_kl, torch_kl and both bridges; check that the curves agree",
        description="Train one student four ways (jax_kl, torch_kl, torch_kl→Pallas, jax_kl→Triton) "
        "from the same start on the same batches, compare the loss curves and plot them.",
    )
    demo.add_argument("--steps", type=_positive_int, default=200, help="training steps (default: %(default)s)")
    demo.add_argument(
        "--out", type=Path, default=Path("fused_kl_demo.png"), help="PNG of the curves (default: %(default)s)"
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of the data, teacher and student (default: 0)")

    check = commands.add_parser(
        "check",
        help="self-test every backend available here against a float64 reference",
        description="Run every backend of torch_kl and jax_kl on a small problem and compare the loss "
        "and gradients with a float64 NumPy reference. Exit code 1 if an available backend fails.",
    )
    check.add_argument("--seed", type=int, default=0, help="seed of the random problem (default: 0)")

    # Its options belong to fused_kl.bench, which parses them itself (``fused-kl bench --help``).
    commands.add_parser("bench", add_help=False, help="benchmarks (see: fused-kl bench --help)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fused-kl``; return the exit code."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from . import bench

        return bench.main(rest) or 0
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "demo":
        from . import demo

        return demo.main(steps=args.steps, out=args.out, seed=args.seed)
    from . import check

    return check.main(seed=args.seed)
