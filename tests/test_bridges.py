"""The bridges (``fused_kl_bridges``): each framework's autograd around the other framework's
kernels asks that framework's driver for the gradients it needs and no more (a frozen head makes
no ``grad_weight``), and gets the right ``grad_x``; and the frameworks stay apart: importing
``torch_kl`` (any of its modules) loads no ``jax_kl``, and the other way round."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_kl
import jax_kl.driver
import torch_kl
import torch_kl.driver
from fused_kl.loss import Loss, Teacher
from fused_kl.options import Needs, RunOptions
from fused_kl_bridges import pallas_for_torch
from jax_kl.backends import resolve
from jax_kl.layout import SINGLE
from jax_kl.teachers import TeacherArrays

N, H, V = 6, 8, 24


def _problem(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, H), dtype=np.float32)
    w = rng.standard_normal((V, H), dtype=np.float32) / 2
    target = rng.dirichlet(np.ones(V), N).astype(np.float32)
    labels = rng.integers(0, V, N)
    return x, w, target, labels


def _spy(monkeypatch: pytest.MonkeyPatch, module, seen: list) -> None:
    """Record ``(needs, out's keys)`` of each call of ``module.forward``, the driver entry a bridge calls."""
    real = module.forward

    def forward(*args, **kwargs):
        seen.append((args[9], sorted(kwargs.get("out") or ())))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "forward", forward)


@pytest.mark.parametrize("frozen", [True, False])
def test_pallas_bridge_asks_jax_for_the_gradients_torch_needs(monkeypatch: pytest.MonkeyPatch, frozen: bool) -> None:
    x, w, target, _ = _problem(0)
    want_x = torch.tensor(x, requires_grad=True)
    torch_kl.fused_linear_kl_div(want_x, torch.tensor(w), torch.tensor(target), backend="torch").backward()

    seen: list = []
    _spy(monkeypatch, jax_kl.driver, seen)
    pallas_for_torch._jitted.clear_cache()  # traced again: the spy sees the call
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=not frozen)
    torch_kl.fused_linear_kl_div(xt, wt, torch.tensor(target), backend="pallas").backward()

    assert [needs for needs, _ in seen] == [Needs(x=True, weight=not frozen)]
    assert (wt.grad is None) is frozen
    torch.testing.assert_close(xt.grad, want_x.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("frozen", [True, False])
def test_triton_bridge_asks_torch_for_the_gradients_jax_needs(monkeypatch: pytest.MonkeyPatch, frozen: bool) -> None:
    x, w, target, labels = _problem(1)
    argnums = 0 if frozen else (0, 1)

    def grads(backend: str):
        loss = lambda x, w: jax_kl.fused_linear_kl_div(
            x, w, jnp.asarray(target), jnp.asarray(labels), weight_hard_loss=0.5, backend=backend
        )
        return jax.grad(loss, argnums=argnums)(jnp.asarray(x), jnp.asarray(w))

    want = grads("xla")
    seen: list = []
    _spy(monkeypatch, torch_kl.driver, seen)
    got = grads("triton")

    wanted = Needs(x=True, weight=not frozen)
    outputs = ["grad_x", "loss", "row_losses"] if frozen else ["grad_weight", "grad_x", "loss", "row_losses"]
    assert seen == [(wanted, outputs)]
    want_x, got_x = (want, got) if frozen else (want[0], got[0])
    np.testing.assert_allclose(np.asarray(got_x), np.asarray(want_x), rtol=1e-5, atol=1e-6)


def test_jax_driver_makes_no_grad_weight_for_a_frozen_head() -> None:
    """The Pallas bridge's program returns no ``grad_weight`` (not one computed and then dropped)."""
    x, w, target, _ = _problem(2)
    loss = Loss(teacher=Teacher("probs", 1.0))
    outs = jax_kl.driver.forward(
        jnp.asarray(x), jnp.asarray(w), None, TeacherArrays(jnp.asarray(target)), None, None, loss, RunOptions(),
        SINGLE, Needs(x=True), resolve("xla"),
    )  # fmt: skip
    assert outs[2] is not None and outs[2].shape == (N, H)
    assert outs[3] is None and outs[4] is None


def _loaded_after_importing(package: str, other: str) -> list[str]:
    """The modules of ``other`` loaded in a fresh interpreter by importing ``package`` and then
    every module in it (a module whose optional dependency is missing is passed over)."""
    code = f"""
import importlib, json, pkgutil, sys
import {package}
ours = ("fused_kl", "torch_kl", "jax_kl", "fused_kl_bridges")
for info in pkgutil.walk_packages({package}.__path__, "{package}."):
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in ours:
            raise
print(json.dumps(sorted(n for n in sys.modules if n.split(".")[0] == "{other}")))
"""
    env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("package", "other"), [("torch_kl", "jax_kl"), ("jax_kl", "torch_kl")])
def test_importing_one_framework_loads_none_of_the_other(package: str, other: str) -> None:
    assert _loaded_after_importing(package, other) == []
