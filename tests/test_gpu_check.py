"""benchmarks/gpu_check.py, the one GPU script: each section's plumbing runs on the CPU, a section
that hangs or dies costs only its own row, and every table prints as its section ends."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "benchmarks"))  # the benchmark scripts, imported as modules

#: what each section's rows must carry
KEYS = {
    "recipes": {"recipe", "status", "first_step_s", "tokens_per_s"},
    "fsdp": {"tokens_per_s", "memory_estimate", "max_memory_allocated", "mfu"},
    "compile": {"compile", "status", "tokens_per_s", "first_step_s"},
    "yardstick": {"recipe_tokens_per_s", "yardstick_tokens_per_s", "ratio", "recipe_syncs_per_step"},
    "perf-kernels": {"table"},
    "memory": {"adapters", "estimate_bytes", "measured_bytes", "ratio", "within_10pct"},
}


def _check(summary: dict, names: list[str]) -> None:
    assert list(summary["sections"]) == names
    for name in names:
        section = summary["sections"][name]
        assert section["ok"], (name, section)
        assert section["rows"], name
        assert KEYS.get(name, set()) <= set(section["rows"][0]), (name, section["rows"][0])


def test_the_cheap_sections_run_on_the_cpu_and_print_their_tables(tmp_path, capsys):
    import gpu_check

    out = tmp_path / "check.json"
    assert gpu_check.main(["--cpu", "--only", "fsdp,yardstick,memory", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    _check(summary, ["fsdp", "yardstick", "memory"])
    printed = capsys.readouterr().out
    assert "## fsdp: ok" in printed and "| recipe_tokens_per_s |" in printed


@pytest.mark.slow  # about two minutes: every section, each in its processes
def test_every_section_runs_on_the_cpu(tmp_path):
    import gpu_check

    out, tables = tmp_path / "check.json", tmp_path / "tables"
    code = gpu_check.main(["--cpu", "--json", str(out), "--out", str(tables)])
    summary = json.loads(out.read_text())
    _check(summary, list(gpu_check.ORDER))
    assert code == 0
    # --out keeps what this device measured, as the two scripts write it: the calibration table
    # and the attention tuning table (the shipped one with this sweep's generation merged in)
    import yaml

    calibration = yaml.safe_load((tables / "cpu.yaml").read_text())
    assert calibration["gpu"] == "cpu" and calibration["gemm"]["bf16"] and calibration["attention"], calibration.keys()
    tuning = yaml.safe_load((tables / "attention_tuning.yaml").read_text())
    assert "interpreter" in tuning and "sm_90" in tuning, tuning.keys()


def test_a_section_over_its_limit_fails_alone_and_the_rest_go_on(tmp_path, monkeypatch, capsys):
    import gpu_check

    monkeypatch.setattr(gpu_check, "GRACE", 0.0)
    monkeypatch.setattr(gpu_check, "CPU_LIMIT", 2.0)  # too short for a section to import torch and train
    out = tmp_path / "check.json"
    assert gpu_check.main(["--cpu", "--only", "fsdp,compile", "--json", str(out)]) == 1
    sections = json.loads(out.read_text())["sections"]
    assert [s["ok"] for s in sections.values()] == [False, False]
    assert all("timed out after 2 s" in s["error"] for s in sections.values())
    printed = capsys.readouterr().out
    assert printed.count("FAILED (timed out") == 2


def test_unknown_sections_and_a_bad_scale_are_one_line(capsys):
    import gpu_check

    for argv, fragment in (
        (["--only", "fsdp,nope"], "unknown section 'nope'"),
        (["--scale", "0"], "--scale must be above 0"),
    ):
        with pytest.raises(SystemExit) as exit:
            gpu_check.main(["--cpu", *argv])
        assert exit.value.code == 2
        assert fragment in capsys.readouterr().err


def test_tables_show_numbers_readably():
    import gpu_check
    from gpu_sections import flat_rows

    assert [gpu_check.cell(v) for v in (None, True, 12345, 1234.5, 0.012345, "a|b")] == [
        "n/a",
        "yes",
        "12,345",
        "1,234",
        "0.0123",
        "a/b",
    ]
    rows = flat_rows({"gemms": [{"tflops": 1.0}], "attention": [{"tflops": 2.0}], "device": "cpu"})
    assert rows == [{"table": "gemms", "tflops": 1.0}, {"table": "attention", "tflops": 2.0}]
