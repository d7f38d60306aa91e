"""The command line (``fused_kl_cli``: ``check``, a short ``demo``) and the benchmark's quick run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

import jax_kl.backends
from fused_kl_cli import check, cli

ROOT = Path(__file__).resolve().parents[1]
# A line of the demo's curve table: the step, then the four runs' losses.
CURVE_ROW = re.compile(r"\s*\d+(\s+\d+\.\d+){4}\s*")
ENV_VARS = ("TRITON_INTERPRET", "XLA_PYTHON_CLIENT_PREALLOCATE", "JAX_PLATFORMS")


def _registry_ids() -> list[str]:
    from jax_kl.backends import REGISTRY as JAX
    from torch_kl.backends import REGISTRY as TORCH

    return [f"torch/{name}" for name in TORCH] + [f"jax/{name}" for name in JAX]


def test_importing_the_cli_and_the_benchmark_changes_no_environment() -> None:
    code = (
        "import os, sys; before = dict(os.environ)\n"
        "import fused_kl_cli, fused_kl_cli.cli, fused_kl_cli.check, fused_kl_cli.demo, fused_kl_cli.__main__\n"
        "import benchmarks.bench\n"
        "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())\n"
        "assert 'jax' not in sys.modules and 'triton' not in sys.modules, 'imported at import time'\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=300)


def test_main_prepares_the_environment_before_the_command_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cli.shutil, "which", lambda cmd: None)  # no nvidia-smi: interpret Triton
    seen = {}
    monkeypatch.setattr(check, "main", lambda seed: seen.update({k: os.environ.get(k) for k in ENV_VARS}) or 7)
    assert cli.main(["check", "--seed", "3"]) == 7
    assert seen == {"TRITON_INTERPRET": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "JAX_PLATFORMS": None}


def test_module_entry_point_lists_the_commands() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fused_kl_cli", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "demo" in result.stdout and "check" in result.stdout


def test_check_passes_every_available_backend(capsys: pytest.CaptureFixture[str]) -> None:
    ids = _registry_ids()
    assert list(check.backends()) == ids  # both registries, nothing repeated by hand
    assert cli.main(["check"]) == 0
    out = capsys.readouterr().out
    # The Mosaic GPU kernels need a Hopper GPU: elsewhere the check skips them, saying why.
    away = [b for b in ids if b == "jax/pallas_mosaic" and jax_kl.backends.mosaic_missing() is not None]
    assert f"{len(ids) - len(away)} passed, 0 failed, {len(away)} skipped" in out
    for backend in ids:
        result = "skipped" if backend in away else "pass"
        assert re.search(rf"^{re.escape(backend)}\s+\S+\s+{result}\s", out, re.MULTILINE), (backend, out)
    for case in check.CASES:
        assert case.name in out


def test_check_fails_on_a_wrong_or_broken_backend(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    def broken(backend: str, case: check.Case, p: check.Problem):
        raise RuntimeError("kernel crashed")

    def wrong(backend: str, case: check.Case, p: check.Problem):
        return "cpu", {k: v * 1.01 for k, v in check.expected(case, p).items()}

    monkeypatch.setattr(check, "_run_torch", broken)
    monkeypatch.setattr(check, "_run_jax", wrong)
    assert cli.main(["check"]) == 1
    out = capsys.readouterr().out
    assert "RuntimeError: kernel crashed" in out
    assert f"0 passed, {len(check.backends())} failed" in out


def test_check_catches_a_small_error_in_one_case(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Exact everywhere but the top-k case's grad_weight, 1e-4 off: above the tolerance, so a failure."""

    def nearly(backend: str, case: check.Case, p: check.Problem):
        want = check.expected(case, p)
        if case.name == "topk":
            want["grad_weight"] = want["grad_weight"] * (1 + 1e-4)
        return "cpu", want

    monkeypatch.setattr(check, "_run_torch", nearly)
    monkeypatch.setattr(check, "_run_jax", nearly)
    monkeypatch.setattr(check, "backends", lambda: {"torch/one": "a fake", "jax/other": "another"})
    assert cli.main(["check"]) == 1
    out = capsys.readouterr().out
    assert "0 passed, 2 failed" in out
    assert out.count("topk: error 1.0") == 2, out


def test_check_skips_an_unavailable_backend(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from fused_kl.checks import BackendUnavailable

    def unavailable(backend: str, case: check.Case, p: check.Problem):
        raise BackendUnavailable(backend, "no such device here")

    monkeypatch.setattr(check, "_run_torch", unavailable)
    monkeypatch.setattr(check, "backends", lambda: {"torch/gone": "a fake"})
    assert cli.main(["check"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^torch/gone\s+-\s+skipped\s.*no such device here", out, re.MULTILINE), out


def test_demo_curves_agree_and_plot(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "curves.png"
    assert cli.main(["demo", "--steps", "20", "--out", str(png)]) == 0
    image = matplotlib.image.imread(png)  # decodes, so a valid PNG
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and image.ndim == 3
    out = capsys.readouterr().out
    assert "first step against the float64 reference" in out
    rows = np.array([line.split() for line in out.splitlines() if CURVE_ROW.fullmatch(line)])
    assert rows[:, 0].astype(int).tolist() == [1, 20]
    curves = rows[:, 1:].astype(float)
    np.testing.assert_allclose(curves, np.repeat(curves[:, :1], 4, axis=1), rtol=1e-3)


@pytest.mark.parametrize("argv", [["demo", "--steps", "0"], ["demo", "--stepz", "3"], ["check", "x"], ["bench"], []])
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2


def test_bench_lists_every_registry_backend() -> None:
    from benchmarks.impls import build

    names = list(build())
    assert names[0] == "floor"
    variants = {
        "torch_kl/triton-cublas-logits", "torch_kl/triton-unfactored", "torch_kl/triton-unchecked",
        "torch_kl/triton-whole-vocab-gemms", "jax_kl/pallas-cublas", "jax_kl/pallas_triton-cublas",
        "torch_kl/triton+row-weights", "torch_kl/triton+z-loss", "jax_kl/pallas+row-weights", "jax_kl/pallas+z-loss",
        "jax_kl/pallas-whole-vocab", "jax_kl/pallas-xla-phases", "torch_kl/triton-label-in-dz",
        "jax_kl/pallas-label-in-dz", "jax_kl/pallas-xla-add", "jax_kl/pallas-unfactored",
        "jax_kl/pallas-xla-label-rows",
    }  # fmt: skip
    assert variants <= set(names)
    backends = [n for n in names if "_kl/" in n and n not in variants]
    assert [n.replace("torch_kl/", "torch/").replace("jax_kl/", "jax/") for n in backends] == _registry_ids()


@pytest.mark.parametrize("mode", ["kl", "jsd", "topk", "ce"])
def test_liger_chunked_anchor_takes_only_a_teacher_head(mode: str) -> None:
    """Liger's chunked JSD loss needs the teacher's hidden states and head: other modes skip it
    with the reason (before importing Liger, which the CPU machine lacks)."""
    from benchmarks.impls import Skip, _liger_chunked
    from benchmarks.modes import MODES

    with pytest.raises(Skip, match="takes a teacher head"):
        _liger_chunked(MODES[mode])


@pytest.mark.parametrize("mode", ["kl", "hidden", "reverse-hidden", "topk", "ce", "ce-smooth"])
def test_bench_quick_writes_table_json_and_plot(tmp_path, mode: str) -> None:
    from benchmarks import bench, unfused

    impls = ["floor", "eager", "xla", "torch_kl/torch", "jax_kl/xla"]
    argv = ["--quick", "--mode", mode, "--heads", "32x256", "--n", "64", "--impls", *impls]
    assert bench.main([*argv, "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["meta"]["config"]["mode"] == mode
    assert "out_dir" not in result["meta"]["config"]  # the record names no machine path
    rows = {r["impl"]: r for r in result["rows"]}
    assert list(rows) == impls
    measured = [r for name, r in rows.items() if name != "xla" or mode in unfused.JAX]
    assert all(r["status"] == "ok" and r["ms"] > 0 and r["x_floor"] > 0 for r in measured), measured
    if mode not in unfused.JAX:
        assert rows["xla"]["status"].startswith("skipped")
    assert rows["floor"]["x_floor"] == 1.0 and rows["floor"]["err_grad_weight"] is None
    # bf16 gradients against the float64 reference: ~1e-3; a wrong loss would be off by far more.
    for r in measured[1:]:
        assert r["err_grad_weight"] < 1e-2 and r["err_grad_x"] < 1e-2, r
    assert "torch_kl/torch" in (tmp_path / "results.md").read_text()
    assert matplotlib.image.imread(tmp_path / "bench.png").shape[0] > 100


def test_bench_vocab_gives_each_head_every_vocabulary_and_rows_their_tflops(tmp_path) -> None:
    from benchmarks import bench

    argv = ["--quick", "--mode", "hidden", "--heads", "32x256", "--vocab", "250,256", "--n", "64"]
    assert bench.main([*argv, "--impls", "floor", "torch_kl/torch", "--out-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["head"], r["impl"]) for r in rows] == [
        ("32x250", "floor"), ("32x250", "torch_kl/torch"), ("quick-32", "floor"), ("quick-32", "torch_kl/torch"),
    ]  # fmt: skip
    for r, v in zip(rows, (250, 250, 256, 256), strict=True):
        flops = 6 * 64 * 32 * v + 2 * 64 * 64 * v  # the three GEMMs, and the teacher head's (twice as wide)
        assert r["tflops"] == pytest.approx(flops / (r["ms"] * 1e9)), r


@pytest.mark.parametrize("vocab", ["0", "50k"])
def test_bench_refuses_a_vocabulary_that_is_not_a_positive_integer(vocab: str) -> None:
    from benchmarks import bench
    from benchmarks.impls import build

    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--vocab", vocab], build())
    assert e.value.code == 2


def test_bench_timing_budgets_come_from_the_flags() -> None:
    from benchmarks import bench
    from benchmarks.impls import build
    from benchmarks.measure import Timing

    impls = build()
    assert bench.parse_args([], impls).timing == bench.DEFAULTS["timing"]
    assert bench.parse_args(["--quick"], impls).timing == bench.QUICK_DEFAULTS["timing"]
    given = bench.parse_args(["--reps", "3", "--rep-ms", "5", "--warmup-ms", "7"], impls)
    assert given.timing == Timing(3, 5.0, 7.0)


def test_interleave_quick_writes_table_and_plot(tmp_path, capsys) -> None:
    from benchmarks import interleave

    argv = ["--quick", "--mode", "ce", "--impls", "torch_kl/torch", "eager", "--out-dir", str(tmp_path)]
    assert interleave.main(argv) == 0
    rounds = [line for line in capsys.readouterr().out.splitlines() if line.startswith("round ")]
    assert len(rounds) == 2 and all("torch_kl/torch" in line and "eager" in line for line in rounds)
    table = (tmp_path / "interleave.md").read_text()
    assert "| torch_kl/torch |" in table and "| eager |" in table
    assert matplotlib.image.imread(tmp_path / "interleave.png").shape[0] > 100
    assert interleave.main(["--quick", "--impls", "jax_kl/xla", "--out-dir", str(tmp_path)]) == 2  # not torch


@pytest.mark.parametrize("mode", ["ce", "topk"])
def test_unchecked_variant_skips_only_the_value_check(monkeypatch, mode: str) -> None:
    """``torch_kl/triton-unchecked`` is ``torch_kl/triton`` without the eager value check: the
    check makes no ``wait`` there, and the gradients are the same."""
    import torch

    import torch_kl.validate
    from benchmarks.impls import build
    from benchmarks.modes import MODES, make_inputs, make_weight

    waits = []
    real = torch_kl.validate.check_values
    monkeypatch.setattr(torch_kl.validate, "check_values", lambda *a: waits.append(real(*a)) or waits[-1])
    inputs = make_inputs(MODES[mode], make_weight(32, 256, torch.device("cpu")), 64)
    impls = build()
    checked = impls["torch_kl/triton"].make(inputs).step()
    unchecked = impls["torch_kl/triton-unchecked"].make(inputs).step()
    assert waits[0] is not None and waits[1] is None
    assert all(torch.equal(a, b) for a, b in zip(checked, unchecked, strict=True))


def test_results_md_quotes_its_data_and_the_plot_is_drawn_from_it(tmp_path, capsys) -> None:
    """RESULTS.md's per-mode tables are what ``python -m benchmarks.results`` makes of results.csv."""
    from benchmarks import results

    assert results.main(["--plot", str(tmp_path / "results.png")]) == 0
    tables = capsys.readouterr().out
    assert tables.count("#### ") == len(results.groups(results.load(results.HERE / "results.csv")))
    assert tables in (results.HERE / "RESULTS.md").read_text(encoding="utf-8")
    assert matplotlib.image.imread(tmp_path / "results.png").shape[0] > 100


def test_a_bench_run_added_to_the_data_replaces_its_rows_and_keeps_the_floors_still_quoted(tmp_path) -> None:
    from benchmarks import results

    def row(impl: str, commit: str, ms: str) -> dict[str, str]:
        values = ("kl", "llama3-8b", "8192", impl, ms, "1.00", "", "", "", "", "", commit, "2026-12-02", "1000/500")
        return dict(zip(results.FIELDS, values, strict=True))

    data = tmp_path / "results.csv"
    results.save([row("floor", "old", "38"), row("torch_kl/triton", "old", "41"), row("liger", "old", "44")], data)
    measured = dict(status="ok", peak_gib=None, beyond_grads_gib=None, err_grad_weight=None, err_grad_x=None, note="")
    timing = {"rep_ms": 400.0, "warmup_ms": 100.0}
    run = {
        "meta": {"config": {"mode": "kl", "impls": ["floor", "torch_kl/triton"], "timing": timing}},
        "rows": [
            dict(measured, head="llama3-8b", n=8192, impl="floor", ms=37.5, x_floor=1.0, tflops=687.0),
            dict(measured, head="llama3-8b", n=8192, impl="torch_kl/triton", ms=39.9, x_floor=1.064, tflops=646.2),
            dict(measured, head="llama3-8b", n=8192, impl="compile", status="error: out of memory", ms=None),
        ],
    }
    (tmp_path / "run.json").write_text(json.dumps(run))
    argv = ["--data", str(data), "--plot", str(tmp_path / "p.png"), "--add", str(tmp_path / "run.json")]
    assert results.main([*argv, "--commit", "new", "--date", "2026-12-03"]) == 0
    got = [(r["impl"], r["commit"], r["ms"], r["x_floor"], r["timing_ms"]) for r in results.load(data)]
    assert got == [
        ("floor", "old", "38", "1.00", "1000/500"),  # liger's run's floor, still quoted
        ("liger", "old", "44", "1.00", "1000/500"),
        ("floor", "new", "37.5", "1.00", "400/100"),
        ("torch_kl/triton", "new", "39.9", "1.06", "400/100"),
    ]


def test_bench_module_runs_from_the_repository_root() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "--mode" in result.stdout and "llama3-8b" in result.stdout


def test_scaling_quick_writes_table_json_and_plot(tmp_path) -> None:
    """The several-devices benchmark on CPU: two gloo ranks for torch, two host devices for JAX."""
    from benchmarks import scaling

    assert scaling.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    rows = {(r["framework"], r["layout"].strip().split(",")[0]): r for r in result["rows"]}
    for framework in ("torch", "jax"):
        one, vocab = rows[(framework, "one device")], rows[(framework, "vocabulary sharded over 2")]
        assert all(r["ms"] > 0 for (fw, _), r in rows.items() if fw == framework)
        assert one["x_one"] == 1.0 and rows[(framework, "rows sharded")]["goal"] == 1.05
        assert vocab["grad_w_gib"] == pytest.approx(one["grad_w_gib"] / 2)  # half the head's gradient per device
    assert "all-reduce of grad_x" in (tmp_path / "results.md").read_text()
    assert matplotlib.image.imread(tmp_path / "scaling.png").shape[0] > 50
