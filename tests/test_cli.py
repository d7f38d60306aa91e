"""The command line, in-process: ``check``, a short ``demo``, and ``bench``'s pass-through."""

from __future__ import annotations

import re
import sys
import types

import matplotlib.image
import numpy as np
import pytest

import fused_kl
from fused_kl import check, cli

# A line of the demo's curve table: the step, then the four runs' losses.
CURVE_ROW = re.compile(r"\s*\d+(\s+\d+\.\d+){4}\s*")


def test_check_passes_every_available_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check"]) == 0
    out = capsys.readouterr().out
    assert "0 failed" in out
    for backend in check.BACKENDS:
        assert backend in out


def test_check_fails_on_a_wrong_or_broken_backend(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    def broken(backend: str, p: check.Problem):
        raise RuntimeError("kernel crashed")

    def wrong(backend: str, p: check.Problem):
        want = check.reference(p)
        return "cpu", {k: v * 1.01 for k, v in want.items()}

    monkeypatch.setattr(check, "_run_torch", broken)
    monkeypatch.setattr(check, "_run_jax", wrong)
    assert cli.main(["check"]) == 1
    out = capsys.readouterr().out
    assert "RuntimeError: kernel crashed" in out
    assert "0 passed, 6 failed" in out


def test_demo_curves_agree_and_plot(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "curves.png"
    assert cli.main(["demo", "--steps", "20", "--out", str(png)]) == 0
    image = matplotlib.image.imread(png)  # decodes, so a valid PNG
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and image.ndim == 3
    rows = np.array([line.split() for line in capsys.readouterr().out.splitlines() if CURVE_ROW.fullmatch(line)])
    assert rows[:, 0].astype(int).tolist() == [1, 20]
    curves = rows[:, 1:].astype(float)
    np.testing.assert_allclose(curves, np.repeat(curves[:, :1], 4, axis=1), rtol=1e-3)


def test_bench_gets_the_remaining_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    fake = types.ModuleType("fused_kl.bench")
    fake.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "fused_kl.bench", fake)
    monkeypatch.setattr(fused_kl, "bench", fake, raising=False)
    assert cli.main(["bench", "--rows", "8", "extra", "--help"]) == 3
    assert seen == [["--rows", "8", "extra", "--help"]]


@pytest.mark.parametrize("argv", [["demo", "--steps", "0"], ["demo", "--stepz", "3"], ["check", "x"], []])
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2


def test_bench_quick_writes_table_json_and_plot(tmp_path) -> None:
    import json

    from fused_kl import bench

    argv = ["--quick", "--heads", "32x256", "--n", "64", "--impls", "floor", "torch_kl", "jax_kl"]
    assert bench.main([*argv, "--out-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["impl"] for r in rows] == ["floor", "torch_kl", "jax_kl"]
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in rows), rows
    assert rows[0]["x_floor"] == 1.0 and all(r["x_floor"] > 0 for r in rows)
    assert all(r["err_grad_weight"] < 1e-2 for r in rows[1:]), rows
    assert "torch_kl" in (tmp_path / "results.md").read_text()
    assert matplotlib.image.imread(tmp_path / "bench.png").shape[0] > 100
