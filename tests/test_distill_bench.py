"""``python -m benchmarks.distill_hf --quick``: one distillation step of tiny Hugging Face models per loss, on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from benchmarks import distill_hf

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
QUICK_TOKENS = (64, 128)  # the --quick default
BF16_RTOL = 1e-2  # the two losses read the same bf16 hidden states; only where float32 begins differs


class QuickRun(NamedTuple):
    printed: str
    data: dict[str, Any]  # distill_hf.json
    markdown: str  # distill_hf.md


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> QuickRun:
    """What one ``--quick`` run prints and writes."""
    out = tmp_path_factory.mktemp("distill")
    env = {**os.environ, "TRITON_INTERPRET": "1", "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.distill_hf", "--quick", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((out / "distill_hf.json").read_text(encoding="utf-8"))
    return QuickRun(proc.stdout, data, (out / "distill_hf.md").read_text(encoding="utf-8"))


def _rows(data: dict[str, Any], impl: str) -> dict[int, dict[str, Any]]:
    return {row["tokens"]: row for row in data["rows"] if row["impl"] == impl}


def test_quick_run_measures_ours_and_unfused_at_every_token_count(quick_run: QuickRun) -> None:
    data = quick_run.data
    for impl in ("ours", "unfused"):
        rows = _rows(data, impl)
        assert sorted(rows) == list(QUICK_TOKENS), impl
        for row in rows.values():
            assert row["status"] == "ok", row
            assert row["ms"] > 0 and row["loss"] > 0, row
            assert row["batch"] * row["seq"] == row["tokens"], row
            assert row["peak_gib"] is None, row  # no allocator peak on the CPU
    assert data["meta"]["device"] == "cpu"
    assert data["meta"]["config"]["vocab"] == distill_hf.QUICK["vocab"]


def test_ours_gives_the_unfused_loss_at_the_first_step(quick_run: QuickRun) -> None:
    out, data = quick_run.printed, quick_run.data
    ours, unfused = _rows(data, "ours"), _rows(data, "unfused")
    for tokens in QUICK_TOKENS:
        assert ours[tokens]["loss"] == pytest.approx(unfused[tokens]["loss"], rel=BF16_RTOL), tokens
        assert f"{ours[tokens]['loss']:.6g}" in out  # the loss per implementation is printed


def test_liger_rows_are_marked_skipped_on_the_cpu(quick_run: QuickRun) -> None:
    data = quick_run.data
    for impl in ("liger", "liger-chunked"):
        rows = _rows(data, impl)
        assert sorted(rows) == list(QUICK_TOKENS), impl
        assert all(row["status"].startswith("skipped: ") and "ms" not in row for row in rows.values()), rows


def test_printed_table_has_a_line_per_row_and_times_relative_to_ours(quick_run: QuickRun) -> None:
    out, data = quick_run.printed, quick_run.data
    table = [line for line in out.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert header[:6] == ["impl", "tokens", "batch × seq", "step ms", "× ours", "peak GiB"]
    body = [[cell.strip() for cell in line.strip("|").split("|")] for line in table[2:]]
    assert len(body) == len(data["rows"])
    ours = {row["tokens"]: row["ms"] for row in data["rows"] if row["impl"] == "ours"}
    for cells, row in zip(body, data["rows"], strict=True):
        assert cells[:2] == [row["impl"], str(row["tokens"])]
        if row["status"] == "ok":
            assert float(cells[4]) == pytest.approx(row["ms"] / ours[row["tokens"]], abs=0.006)
        else:
            assert cells[3] == cells[4] == "" and cells[-1] == row["status"]
    assert quick_run.markdown.splitlines() == table


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--impls", "ours,nope"], "--impls: unknown nope"),
        (["--tokens", "0"], "--tokens"),
        (["--seq-len", "0"], "--seq-len: expected a positive integer"),
        (["--tokens", "12288", "--seq-len", "8192"], "multiples of it"),
    ],
)
def test_bad_arguments_are_refused_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        distill_hf.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
