"""Check an installed fused-kl from outside the source tree: ``python smoke.py REPO`` (run by .ci/wheel).

Every package of the distribution imports from where the distribution is installed (never from
REPO) and reports the distribution's version; each ships its ``py.typed``; the requirements of the
``torch`` and ``jax`` extras are met; a tiny loss in each framework, on the CPU, equals the unfused one.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from pathlib import Path

from packaging.requirements import Requirement

DISTRIBUTION = "fused-kl"
EXTRAS = ("torch", "jax")


def package_names(dist: importlib.metadata.Distribution) -> list[str]:
    """Every package (a folder with an ``__init__.py``) the distribution installed, parents first."""
    inits = [f for f in dist.files or () if f.name == "__init__.py"]
    return sorted(".".join(f.parts[:-1]) for f in inits)


def check_packages(dist: importlib.metadata.Distribution, repo: Path) -> None:
    names = package_names(dist)
    top = sorted({n.split(".")[0] for n in names})
    assert {"fused_kl", "torch_kl", "jax_kl", "fused_kl_cli"} <= set(top), f"packages missing from the wheel: {top}"
    site = Path(str(dist.locate_file(""))).resolve()
    for name in names:
        where = Path(importlib.import_module(name).__file__).resolve()
        assert not where.is_relative_to(repo), f"{name} imported from the source tree ({where}), not the wheel"
        assert where.is_relative_to(site), f"{name} imported from {where}, outside {site}"
    for name in top:
        module = importlib.import_module(name)
        assert module.__version__ == dist.version, f"{name}.__version__ {module.__version__} != {dist.version}"
        assert (Path(module.__file__).parent / "py.typed").is_file(), f"{name} has no py.typed marker"
    print(f"{len(names)} packages import from the wheel: {', '.join(top)} {dist.version}")


def check_requirements(dist: importlib.metadata.Distribution) -> None:
    for line in dist.requires or ():
        requirement = Requirement(line)
        marker = requirement.marker
        if marker is not None and not any(marker.evaluate({"extra": e}) for e in ("", *EXTRAS)):
            continue
        installed = importlib.metadata.version(requirement.name)
        assert requirement.specifier.contains(installed, prereleases=True), f"{requirement}: {installed} installed"


def check_torch_loss() -> None:
    import torch

    import torch_kl

    torch.manual_seed(0)
    x = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(16, 8, requires_grad=True)
    teacher = torch.softmax(torch.randn(6, 16), -1)
    labels = torch.tensor([1, 2, -100, 3, 4, 5])
    loss = torch_kl.fused_linear_kl_div(x, weight, teacher, labels, temperature=2.0)
    loss.backward()
    keep = labels != -100
    log_q = torch.log_softmax(x[keep] @ weight.T / 2.0, -1)
    expected = torch.nn.functional.kl_div(log_q, teacher[keep], reduction="batchmean")
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    grad_x = torch.autograd.grad(expected, x)[0]
    torch.testing.assert_close(x.grad, grad_x, rtol=1e-4, atol=1e-6)
    print(f"torch_kl: loss {loss.item():.6f} and grad_x equal the unfused ones")


def check_jax_loss() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_kl

    rng = np.random.default_rng(0)
    x, weight = jnp.asarray(rng.normal(size=(6, 8)), jnp.float32), jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
    teacher = jax.nn.softmax(jnp.asarray(rng.normal(size=(6, 16)), jnp.float32), -1)

    def unfused(x: jax.Array) -> jax.Array:
        log_q = jax.nn.log_softmax(jnp.dot(x, weight.T, precision="highest") / 2.0, -1)
        return jnp.sum(teacher * (jnp.log(teacher) - log_q)) / x.shape[0]

    def fused(x: jax.Array) -> jax.Array:
        return jax_kl.fused_linear_kl_div(x, weight, teacher, temperature=2.0)

    loss, grad_x = jax.jit(jax.value_and_grad(fused))(x)
    np.testing.assert_allclose(loss, unfused(x), rtol=1e-5)
    np.testing.assert_allclose(grad_x, jax.grad(unfused)(x), rtol=1e-4, atol=1e-6)
    print(f"jax_kl: loss {float(loss):.6f} and grad_x equal the unfused ones")


def main() -> None:
    repo = Path(sys.argv[1]).resolve()
    assert not Path.cwd().resolve().is_relative_to(repo), "run the smoke test from outside the source tree"
    os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX starts: the smoke test runs on the CPU
    dist = importlib.metadata.distribution(DISTRIBUTION)
    check_packages(dist, repo)
    check_requirements(dist)
    check_torch_loss()
    check_jax_loss()


if __name__ == "__main__":
    main()
