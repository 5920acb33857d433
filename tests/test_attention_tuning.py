"""Launch configs without waiting: the shipped table's shape, bucketed keys, the disk cache between
processes (timings mocked: no GPU here), the measured preference ``auto`` reads, and the sweep's
plumbing (``benchmarks/attention.py --sweep --cpu``)."""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from yamlformer.kernels import Mask, tuning

attn = importlib.import_module("yamlformer.kernels.attention")  # the module (the package exports its function)
REPO = Path(__file__).resolve().parents[1]
FAKE_GPU = ("sm_90", "Fake H200", 132, 227 * 1024)
CANDIDATES = [{"BLOCK_M": 128, "BLOCK_N": n, "num_warps": 8, "num_stages": 3} for n in (32, 64, 128)]


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A table of three fwd candidates (one chosen for one key), an empty user cache under
    tmp_path, an sm_90 GPU as device_facts reports it, and no remembered choices."""
    table = tmp_path / "table.yaml"
    table.write_text(
        yaml.safe_dump({"sm_90": {"fwd": {"candidates": CANDIDATES, "chosen": {"shipped key": CANDIDATES[2]}}}})
    )
    monkeypatch.setenv(tuning.TABLE_ENV, str(table))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # platformdirs' user cache on Linux
    monkeypatch.setattr(tuning, "device_facts", lambda device: FAKE_GPU)
    monkeypatch.setattr(tuning, "_chosen", {})
    monkeypatch.setattr(tuning, "_stats", dict.fromkeys(tuning._stats, 0))
    tuning._load_table.cache_clear()
    yield tmp_path
    tuning._load_table.cache_clear()


def _timings(ms_by_block_n: dict, calls: list):
    """``(run, bench)``: a launch that records the config it got, and a stand-in for do_bench that
    launches once and answers that config's milliseconds (by its BLOCK_N; None: it fails)."""

    def run(config):
        calls.append(config["BLOCK_N"])

    def bench(launch):
        launch()
        if ms_by_block_n[calls[-1]] is None:
            raise RuntimeError("out of resources")  # a candidate this GPU cannot run
        return ms_by_block_n[calls[-1]]

    return run, bench


def test_a_tuned_choice_is_written_to_disk_and_read_back_without_timing(fake_gpu, monkeypatch):
    calls = []
    run, bench = _timings({32: 2.0, 64: 1.0, 128: None}, calls)
    monkeypatch.setattr(tuning, "_bench", bench)
    device = torch.device("cuda", 0)
    chosen = tuning.choose("fwd", "new key", device, run)
    assert chosen == CANDIDATES[1]  # the failing one skipped
    assert sorted(calls) == [32, 32, 64, 64, 128, 128]  # each compiled (in threads), then timed once
    assert tuning.stats()["tuned"] == 1 and tuning.stats()["tuning_seconds"] > 0
    written = json.loads(tuning.cache_path().read_text())
    assert tuning.cache_path().is_relative_to(fake_gpu)
    assert written[tuning.fingerprint()]["Fake H200"]["fwd"]["new key"] == CANDIDATES[1]
    # a new process: nothing remembered in memory, timing would fail; the file answers
    monkeypatch.setattr(tuning, "_chosen", {})
    monkeypatch.setattr(tuning, "_bench", lambda run: pytest.fail("timed again"))
    assert tuning.choose("fwd", "new key", device, run) == CANDIDATES[1]
    assert tuning.stats()["from_disk"] == 1
    # the table's own choice costs nothing, and a choice cached by other kernels' source is not trusted
    assert tuning.choose("fwd", "shipped key", device, run) == CANDIDATES[2]
    assert tuning.stats()["from_table"] == 1
    stale = {"triton 0, torch 0, kernels 0": written[tuning.fingerprint()]}
    tuning.cache_path().write_text(json.dumps(stale))
    monkeypatch.setattr(tuning, "_chosen", {})
    calls.clear()
    run, bench = _timings({32: 0.5, 64: 1.0, 128: 3.0}, calls)
    monkeypatch.setattr(tuning, "_bench", bench)
    assert tuning.choose("fwd", "new key", device, run) == CANDIDATES[0]
    assert len(calls) == 6


def test_tuning_off_takes_the_first_eligible_candidate_and_a_corrupt_cache_is_empty(fake_gpu, monkeypatch):
    monkeypatch.setenv(tuning.TUNING_ENV, "off")
    monkeypatch.setattr(tuning, "_bench", lambda run: pytest.fail("timed with tuning off"))
    tuning.cache_path().parent.mkdir(parents=True)
    tuning.cache_path().write_text("{not json")
    eligible = lambda config: config["BLOCK_N"] != 32
    assert tuning.choose("fwd", "another key", torch.device("cuda", 0), lambda c: None, eligible) == CANDIDATES[1]
    with pytest.raises(RuntimeError, match="no launch config of the 'dq' attention kernel fits"):
        tuning.choose("dq", "a key", torch.device("cuda", 0), lambda c: None)


def test_a_training_run_and_a_decode_loop_tune_a_handful_of_times():
    buckets = {tuning.length_bucket(n) for n in range(1, 40_000)}
    assert buckets == {128 << i for i in range(8)}  # 128 .. 16384
    training = {tuning.shape_key(torch.bfloat16, 128, 128, True, False, False, n, n) for n in range(100, 4097, 7)}
    assert len(training) == 6  # variable-length batches up to 4096 tokens
    cache = {tuning.shape_key(torch.bfloat16, 128, 128, True, True, False, n) for n in range(1, 16385)}
    assert len(cache) == 8  # a decode loop's growing cache
    assert tuning.length_bucket(129) == 256 and tuning.length_bucket(128) == 128


def test_the_split_count_fills_the_multiprocessors():
    splits, length = tuning.decode_splits(16384, programs=64, multiprocessors=132, waves=2, block_n=64)
    assert splits * 64 >= 2 * 132 and length % 64 == 0 and splits * length >= 16384 > (splits - 1) * length
    assert tuning.decode_splits(100, programs=64, multiprocessors=132, waves=2, block_n=64) == (1, 128)
    assert tuning.decode_splits(10**7, programs=1, multiprocessors=132, waves=4, block_n=64)[0] <= 256


def test_a_measured_preference_changes_what_auto_takes(fake_gpu, monkeypatch):
    q, v = torch.empty(1, 4, 64, 64), torch.empty(1, 2, 64, 64)
    no_masks, softcap = Mask(causal=True), Mask(causal=True, softcap=30.0)
    monkeypatch.setattr(tuning, "generation", lambda device: "sm_90")
    assert attn.auto_backend("cuda", q, v, no_masks, 0.0) == "sdpa"  # nothing measured: SDPA needs no mask
    prefer = {"train:causal:d64": "triton", "train:causal+softcap:d64": "sdpa", "train:causal+window:d64": "sdpa"}
    table = yaml.safe_load((fake_gpu / "table.yaml").read_text())
    table["sm_90"]["prefer"] = prefer
    (fake_gpu / "table.yaml").write_text(yaml.safe_dump(table))
    tuning._load_table.cache_clear()
    assert attn.auto_backend("cuda", q, v, no_masks, 0.0) == "triton"
    window = Mask(causal=True, sliding_window=5)
    assert attn.auto_backend("cuda", q, v, window, 0.0) == "sdpa"  # measured: SDPA's masked kernel won
    assert attn.auto_backend("cuda", q, v, softcap, 0.0) == "triton"  # SDPA cannot soft-cap, whatever is written
    assert attn.auto_backend("cuda", q, v, Mask(), 0.0) == "sdpa"  # another case (not causal): unmeasured
    monkeypatch.setattr(tuning, "generation", lambda device: "sm_80")
    assert attn.auto_backend("cuda", q, v, no_masks, 0.0) == "sdpa"  # another generation: unmeasured


def test_auto_reads_the_table_without_breaking_a_compiled_graph(fake_gpu, monkeypatch):
    """``auto`` runs inside compiled models: the table lookup is a constant to Dynamo."""
    monkeypatch.setattr(tuning, "generation", lambda device: "sm_90")
    table = yaml.safe_load((fake_gpu / "table.yaml").read_text())
    table["sm_90"]["prefer"] = {"train:causal:d64": "triton"}
    (fake_gpu / "table.yaml").write_text(yaml.safe_dump(table))
    tuning._load_table.cache_clear()
    q, v = torch.randn(1, 4, 64, 64), torch.randn(1, 2, 64, 64)

    def step(q, v):
        chosen = attn.auto_backend("cuda", q, v, Mask(causal=True), 0.0)
        return q * 2 if chosen == "triton" else q * 3

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="eager", fullgraph=True)  # a graph break would raise
    torch.testing.assert_close(compiled(q, v), q * 2)
    torch._dynamo.reset()


def test_the_shipped_table_is_well_formed():
    shipped = yaml.safe_load(tuning.TABLE_PATH.read_text())
    assert set(shipped) == set(tuning.GENERATIONS)
    for gen, entry in shipped.items():
        assert set(entry) == {*tuning.KERNELS, "prefer"}
        assert all(v in ("sdpa", "triton") for v in entry["prefer"].values())
        for kernel in tuning.KERNELS:
            configs = entry[kernel]["candidates"] + list(entry[kernel]["chosen"].values())
            assert configs, (gen, kernel)
            for config in configs:
                needed = {"BLOCK_N", "num_warps", "num_stages"} | ({"BLOCK_M"} if kernel != "decode" else set())
                assert needed <= set(config) <= needed | {"BLOCK_M", "TMA", "WARP_SPEC", "waves"}, config
                assert gen == "sm_90" or not config.get("TMA"), "tensor descriptors need sm_90"


def test_a_sweeps_choices_merge_into_the_table(tmp_path):
    chosen = {
        "fwd": {"bfloat16 d128/128 causal 4096/4096": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}}
    }
    broken = yaml.safe_load(tuning.TABLE_PATH.read_text())["sm_90"]["dq"]["candidates"][0]
    table = tuning.updated_table(
        yaml.safe_load(tuning.TABLE_PATH.read_text()),
        "sm_90",
        chosen,
        {"train:causal:d128": "triton"},
        {"dq": [broken]},
    )
    path = tuning.write_table(table, tmp_path / "table.yaml")
    text = path.read_text()
    assert text.startswith("# Launch configs") and "&id" not in text  # the header kept, no YAML aliases
    again = yaml.safe_load(text)
    assert again["sm_90"]["fwd"]["chosen"] == chosen["fwd"] and again["sm_90"]["prefer"] == {
        "train:causal:d128": "triton"
    }
    assert broken not in again["sm_90"]["dq"]["candidates"]  # failed on that GPU, won nowhere: dropped
    assert again["sm_80"] == yaml.safe_load(tuning.TABLE_PATH.read_text())["sm_80"]  # other generations untouched


def test_a_case_over_its_time_limit_stops_with_its_rows_only():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from attention_sweep import CaseTimeout, time_limit

    started = time.perf_counter()
    with pytest.raises(CaseTimeout), time_limit(0.2):
        while True:
            time.sleep(0.01)
    assert time.perf_counter() - started < 2.0


def test_the_sweep_runs_its_plumbing_on_the_cpu(tmp_path, capsys):
    """``--sweep --cpu``: every config of every kernel checked against eager and timed, ours against
    SDPA and FlexAttention, the JSON written and the table merged (into a copy, never the shipped one)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import attention as bench

    out, table = tmp_path / "sweep.json", tmp_path / "table.yaml"
    assert bench.main(["--sweep", "--cpu", "--budget", "300", "--json", str(out), "--write-table", str(table)]) == 0
    printed = capsys.readouterr().out
    assert "| documents | config | fwd |" in printed and "| decode-static | compare | ours |" in printed
    result = json.loads(out.read_text())
    assert json.loads(printed.splitlines()[-1]) == result  # the last line, as gpu_check reads it
    rows = result["rows"]
    configs = [r for r in rows if r["section"] == "config"]
    assert {r["what"] for r in configs} == set(tuning.KERNELS) and all(r["ok"] for r in configs)
    assert any(r.get("config", {}).get("TMA") for r in configs)  # both load paths ran
    compared = {(r["case"], r["what"]): r for r in rows if r["section"] == "compare"}
    assert compared["documents", "ours"]["ok"] and compared["documents", "flex"]["ok"]
    assert compared["decode-static", "ours"]["ok"] and compared["decode-static", "sdpa"]["ok"]
    merged = yaml.safe_load(table.read_text())
    assert (
        merged["sm_90"] == yaml.safe_load(tuning.TABLE_PATH.read_text())["sm_90"]
    )  # a new file starts from the shipped
    written = merged["interpreter"]
    assert set(written["fwd"]["chosen"]) == {"float32 d16/16 causal+ranged 128/128"}
    assert set(written["prefer"]) == {"train:causal+documents:d16", "decode:causal+token_index:d16"}
    assert bench.main(["--write-table", str(tmp_path / "again.yaml"), "--from-json", str(out)]) == 0
    assert yaml.safe_load((tmp_path / "again.yaml").read_text())["interpreter"] == written


def test_the_sweep_refuses_to_write_interpreter_timings_into_the_shipped_table(capsys):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import attention as bench

    with pytest.raises(SystemExit) as info:
        bench.main(["--sweep", "--cpu", "--write-table"])
    assert info.value.code == 2 and "needs a PATH" in capsys.readouterr().err
