"""What the distribution ships, read from pyproject.toml and the source tree, without building it.

Building and installing the wheel, and importing it from outside the tree, is .ci/wheel's job; these
checks catch the same mistakes earlier: a package the discovery misses, a version that disagrees,
a missing ``py.typed``, an example's library leaking into what a user of the loss installs.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from setuptools import find_packages

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Packages of the repository that are not the library: they stay out of the wheel.
NOT_SHIPPED = ("benchmarks", "tests")


def _shipped() -> list[str]:
    find = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
    return sorted(find_packages(str(ROOT), include=find["include"]))


def _top_level() -> list[str]:
    return sorted({name.split(".")[0] for name in _shipped()})


def test_discovery_ships_every_package_of_the_tree_but_benchmarks_and_tests() -> None:
    everything = find_packages(str(ROOT))
    library = sorted(p for p in everything if p.split(".")[0] not in NOT_SHIPPED)
    assert _shipped() == library
    assert {"fused_kl", "torch_kl", "torch_kl.backends", "jax_kl", "jax_kl.backends", "fused_kl_cli"} <= set(library)


def test_every_top_level_package_reports_the_single_version() -> None:
    version_attr = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    module, _, name = version_attr.rpartition(".")
    version = getattr(importlib.import_module(module), name)
    for package in _top_level():
        assert importlib.import_module(package).__version__ == version, package


def test_every_top_level_package_ships_a_py_typed_marker() -> None:
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["*"]
    missing = [p for p in _top_level() if not (ROOT / p / "py.typed").is_file()]
    assert not missing


def test_the_examples_libraries_are_not_dependencies_of_the_loss() -> None:
    project = PYPROJECT["project"]
    extras = project["optional-dependencies"]
    heavy = {"transformers", "trl", "datasets", "flax", "google-tunix"}
    for group in ("torch", "jax", "jax-cuda"):
        names = {_name(r) for r in [*project["dependencies"], *extras[group]]}
        assert not names & heavy, group
    assert {_name(r) for r in extras["examples"]} >= {"transformers", "trl", "datasets", "flax"}


def test_no_dependency_has_an_upper_bound() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    requirements = [*PYPROJECT["project"]["dependencies"], *(r for group in extras.values() for r in group)]
    capped = [r for r in requirements if "<" in r.split(";")[0]]
    assert not capped


def _name(requirement: str) -> str:
    for stop in "<>=!;[ ~":
        requirement = requirement.split(stop)[0]
    return requirement.strip().lower()
