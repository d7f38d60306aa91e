"""The ``fused-kl`` command line (also ``python -m fused_kl_cli``).

Subcommands:

* ``demo``: a small distillation run with both frameworks and both bridges; their loss curves must agree.
* ``check``: every backend of both registries against the float64 reference (``fused_kl.reference``).

The benchmark is not a subcommand: ``python -m benchmarks.bench`` from the repository root.
Importing this module sets nothing; :func:`main` prepares the environment before a command runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Sequence
from pathlib import Path


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
        "from the same start on the same batches, check the first step against the float64 reference, "
        "compare the loss curves and plot them.",
    )
    demo.add_argument("--steps", type=_positive_int, default=200, help="training steps (default: %(default)s)")
    demo.add_argument(
        "--out", type=Path, default=Path("fused_kl_demo.png"), help="PNG of the curves (default: %(default)s)"
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of the data, teacher and student (default: 0)")

    check = commands.add_parser(
        "check",
        help="self-test every backend available here against the float64 reference",
        description="Run every backend of torch_kl's and jax_kl's registries on small problems and compare "
        "the loss and gradients with fused_kl.reference (float64). Exit code 1 if an available backend fails.",
    )
    check.add_argument("--seed", type=int, default=0, help="seed of the random problems (default: 0)")
    return parser


def prepare_environment(on_gpu: bool | None = None) -> None:
    """Set what Triton and JAX read when they start, before either is imported (``main`` here,
    and the benchmarks); ``on_gpu``: whether an NVIDIA GPU is to be used (None: whether one is there).

    Without an NVIDIA GPU the Triton kernels can only run in Triton's interpreter; and torch and
    JAX share the process, so JAX must not take most of the GPU's memory up front. JAX's platform
    is left to JAX (``check`` runs its backends wherever JAX runs). Values the caller set already
    are kept.
    """
    if not (shutil.which("nvidia-smi") is not None if on_gpu is None else on_gpu):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fused-kl``; return the exit code."""
    args = build_parser().parse_args(argv)
    prepare_environment()
    if args.command == "demo":
        from . import demo

        return demo.main(steps=args.steps, out=args.out, seed=args.seed)
    from . import check

    return check.main(seed=args.seed)
