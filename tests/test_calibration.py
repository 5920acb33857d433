"""The performance model's calibration tables (yamlformer.builder.analysis.calibration): the rates a
table gives by shape and backend against hand-computed values, which table a GPU gets (its own,
else the H200's fractions of its datasheet, said so), the loader's located refusals, and
`builder plan --calibrate`'s machinery run on the CPU, whose table the planner then reads."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from yamlformer.builder.analysis.calibration import SHIPPED, interpolate, lookup
from yamlformer.builder.analysis.calibration.table import load_table
from yamlformer.builder.cli import main
from yamlformer.builder.spec.source import SpecError

GEMM = 6 * 16384 * 4096 * 4096  # one linear's three GEMMs at the 8B layer's (16384 tokens, 4096 -> 4096)


def test_the_shipped_h200_table_gives_the_record_s_rates_at_its_shapes(tmp_path):
    key, row, cal = lookup("h200", tmp_path)
    assert key == "h200" and cal.measured and "2026-12-04" in cal.source and "2.11.0+cu130" in cal.source
    assert cal.linear_seconds("bf16", 16384, 4096, 4096, row) == pytest.approx(GEMM / 699.0e12)
    assert cal.linear_seconds("fp8", 16384, 4096, 4096, row) == pytest.approx(GEMM / 1275.7e12)
    assert cal.attention_rates("flash", 8192, 8192, True, row) == pytest.approx((261.2e12, 235.8e12))
    assert cal.attention_rates("cudnn", 4096, 4096, True, row) == pytest.approx((531.0e12, 370.8e12))
    # a ring step's half block (non-causal) is rated by the non-causal rows, not the causal ones
    assert cal.attention_rates("flash", 32768, 16384, False, row) == pytest.approx((348.6e12, 247.9e12))
    assert cal.hbm(row) == pytest.approx(3900e9)


def test_between_measured_shapes_the_nearest_rows_weigh_by_inverse_square_distance():
    points = (((0.0, 0.0, 0.0), (0.5,)), ((2.0, 0.0, 0.0), (0.7,)))
    assert interpolate(points, (0.0, 0.0, 0.0)) == (0.5,)  # on a row: the row's
    assert interpolate(points, (1.0, 0.0, 0.0)) == pytest.approx((0.6,))  # halfway: the mean
    # a quarter of the way: weights 1 / 0.25 and 1 / 2.25
    assert interpolate(points, (0.5, 0.0, 0.0)) == pytest.approx(((0.5 / 0.25 + 0.7 / 2.25) / (1 / 0.25 + 1 / 2.25),))


def test_small_gemms_roll_off_to_the_bandwidth_bound(tmp_path):
    _, row, cal = lookup("h200", tmp_path)
    tokens, k, n = 16384, 4096, 16  # 16 outputs: the operands' bytes, not the FLOPs, set the time
    moved = (2 * 2 + 2) * (tokens * k + k * n + tokens * n)  # bf16 operands read twice, results once
    assert cal.linear_seconds("bf16", tokens, k, n, row) == pytest.approx(moved / 3900e9)
    assert moved / 3900e9 > 6 * tokens * k * n / (0.7 * row.peak["bf16"])
    fp8 = (2 * 1 + 2) * (tokens * k + k * n + tokens * n)  # float8 operands, bf16 results
    assert cal.linear_seconds("fp8", tokens, k, n, row) == pytest.approx(fp8 / 3900e9)


def test_an_unmeasured_gpu_gets_the_h200_s_fractions_of_its_own_datasheet(tmp_path, capsys):
    _, h100, cal = lookup("h100", tmp_path)
    assert not cal.measured and cal.source.startswith("not measured on H100 SXM")
    assert "h200.yaml" in cal.source and "--calibrate" in cal.source
    # the same fraction of each figure: the peaks are the H200's, the HBM 3.35 of 4.8 TB/s
    assert cal.linear_seconds("bf16", 16384, 4096, 4096, h100) == pytest.approx(GEMM / 699.0e12)
    assert cal.hbm(h100) == pytest.approx(3900e9 * 3350 / 4800)
    _, a100, cal = lookup("a100", tmp_path)
    assert cal.linear_seconds("bf16", 16384, 4096, 4096, a100) == pytest.approx(GEMM / (699.0e12 * 312 / 989.5))
    argv = ["plan", "llama3-8b", "--gpus", "8", "--global-batch", "16", "--seq-len", "8192"]
    assert main([*argv, "--calibration-dir", str(tmp_path)]) == 0
    assert "kernel rates not measured on H100 SXM" in capsys.readouterr().out.replace("\n", " ")
    assert main([*argv, "--gpu", "h200", "--calibration-dir", str(tmp_path), "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)["calibration"]
    assert measured["measured"] and "h200.yaml" in measured["source"]


def test_a_users_table_wins_over_the_shipped_one_and_must_name_its_gpu(tmp_path):
    data = yaml.safe_load((SHIPPED / "h200.yaml").read_text())
    data["hbm_gbs"] = 2000
    (tmp_path / "h200.yaml").write_text(yaml.safe_dump(data))
    _, row, cal = lookup("h200", tmp_path)
    assert cal.hbm(row) == pytest.approx(2000e9) and str(tmp_path) in cal.source
    (tmp_path / "h100.yaml").write_text(yaml.safe_dump(data))  # an H200's table under the H100's name
    with pytest.raises(ValueError, match="gpu: 'h200', but the file is 'h100'"):
        lookup("h100", tmp_path)


def test_a_malformed_table_is_refused_with_every_problem_located(tmp_path, capsys):
    bad = tmp_path / "h200.yaml"
    bad.write_text(
        "gpu: h200\n"
        "measured:\n"
        "  date: 2026-12-04\n"
        "  torch: 2.11\n"
        "  device: NVIDIA H200\n"
        "  command: python benchmarks/perf_kernels.py --write\n"
        "hbm_gbs: fast\n"
        "gemm:\n"
        "  bf16:\n"
        "    - {tokens: 16384, k: 4096, n: 4096, tflop: 699.0}\n"
        "attention:\n"
        "  flash: []\n"
    )
    with pytest.raises(SpecError) as caught:
        load_table(bad)
    lines = str(caught.value).splitlines()
    assert lines[0] == f"{bad}:4:10: measured.torch: expected a string, got 2.11"
    assert lines[1] == f"{bad}:7:10: hbm_gbs: expected a number, got 'fast'"
    assert any(line.startswith(f"{bad}:10:41: gemm.bf16.0.tflop: unknown key 'tflop'") for line in lines)
    argv = ["plan", "llama3-8b", "--gpus", "8", "--gpu", "h200", "--global-batch", "16", "--seq-len", "8192"]
    assert main([*argv, "--calibration-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --gpu h200: its calibration table is malformed") and f"{bad}:7:10" in err
    # a rule over the fields: a device the hardware table does not know needs its datasheet
    bad.write_text((SHIPPED / "h200.yaml").read_text().replace("gpu: h200", "gpu: rtx-9090"))
    with pytest.raises(SpecError, match=r"h200.yaml:\d+:6: gpu: 'rtx-9090' is not in the hardware table"):
        load_table(bad)


def test_calibrate_on_the_cpu_writes_a_table_the_planner_then_reads(tmp_path, capsys):
    """`builder plan --calibrate --cpu`: the whole measurement at 1/64 on the CPU (the GPU branch's
    machinery), written as cpu.yaml with the CPU's own datasheet; `--gpu cpu` then plans with it."""
    assert main(["plan", "--calibrate", "--cpu", "--calibration-dir", str(tmp_path)]) == 0
    assert f"wrote {tmp_path / 'cpu.yaml'} (--gpu cpu)" in capsys.readouterr().out
    table = load_table(tmp_path / "cpu.yaml")
    assert table.gpu == "cpu" and table.datasheet is not None and table.measured.torch
    assert set(table.gemm) == {"bf16", "fp8"} and set(table.attention) == {"flash"}
    rates = [r.tflops for rows in table.gemm.values() for r in rows] + [table.hbm_gbs]
    assert all(rate > 0 and math.isfinite(rate) for rate in rates)
    argv = ["plan", "gpt2-small", "--gpus", "1", "--gpu", "cpu", "--global-batch", "4", "--seq-len", "256"]
    assert main([*argv, "--calibration-dir", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["calibration"]["measured"] and str(tmp_path / "cpu.yaml") in out["calibration"]["source"]
    assert out["cluster"]["gpu"] == "cpu" and out["step_s"] > 0
    # elsewhere, no table: the CPU is unknown, and --cpu alone is refused
    assert main([*argv, "--calibration-dir", str(tmp_path / "none")]) == 1
    assert "--gpu 'cpu': unknown" in capsys.readouterr().err
    assert main(["plan", "--cpu"]) == 1 and "--cpu goes with --calibrate" in capsys.readouterr().err
