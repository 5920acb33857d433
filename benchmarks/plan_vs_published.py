"""The planner's performance model (``yamlformer.builder.analysis.perf``) against published measured runs.

Each row pins a layout a team published, predicts its tokens/s per GPU and memory per GPU with
the model's one calibration (printed), and sets them next to the measured figures. Then the
orderings: where a team measured two layouts, schedules or settings of one model, is the faster
one predicted faster, and by a similar margin?

Source (figures quoted exactly): the torchtitan team's December 2024 H100 benchmark,
``benchmarks/llama3_h100_202412_torchtitan.md`` in pytorch/torchtitan (commit 31a17bf as read):
Grand Teton hosts of 8 H100 SXM with 96 GB HBM2e at 2.4 TB/s, 400 Gb/s RDMA per GPU, 500 W (a
peak "between SXM and NVL", its footnote 2: the midpoint is taken); the
sequence length 8192 of tables 1, 3, 4 and 5 is torchtitan's ``train_configs/llama3_{8b,70b,405b}.toml``
``seq_len``; pipeline micro-batches are the default of the benchmark's torchtitan (commit 9dec370,
``torchtitan/parallelisms/pipelining_utils.py``: ``pipeline_parallel_microbatches`` unset gives
``n_microbatches = pipeline_parallel_degree``), so 8 of 4 sequences under either schedule,
interleaved 1F1B with 2 stages per rank; 405B's ``train_configs/llama3_405b.toml`` there turns on
async TP and float8 FSDP all-gathers. Float8 rows run the projections at the fp8 peak. A second source:
the Trainy team's June 2025 H200 run (``benchmarks/llama3_8b_h200_2025-06_torchtitan.md``).

Calibration, one for every row, fitted to none: the H200's measured kernel rates
(``builder/analysis/calibration/h200.yaml``, 2026-12-04, torch 2.11). On the H200 rows they apply as
measured; on the H100 rows by the H100's datasheet ratio to the H200: each GEMM and attention rate
times the ratio of the two dense peaks in its dtype (the Grand Teton H100's 912.5 bf16 TFLOP/s over
the H200's 989.5), the HBM bandwidth times the ratio of the two datasheet bandwidths (2.4 over 4.8
TB/s); links are each GPU's own. The attention kernel is SDPA's flash backend on both (torchtitan's
SDPA on Hopper in 2024 and 2025: ``sdp_utils`` then preferred flash; torchtitan's own
``ScaledDotProductAttention`` put cuDNN first only on B200). Each row prints its terms: seconds per
step of GEMMs, attention kernels, memory-bound work (with the optimizer step), exposed communication
and the pipeline bubble. A last row is the project's own single-H200 run from the same record
(``benchmarks/gpu_check.py``'s 0.38B spec, FSDP2 on one GPU, this project's Triton attention, which
``auto`` chose on CUDA at c88aa3b).

Run: ``python benchmarks/plan_vs_published.py`` (prints Markdown). Torch-free, about a second.
"""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

from yamlformer.builder.analysis.calibration import reference  # noqa: E402
from yamlformer.builder.analysis.hardware import gpu  # noqa: E402
from yamlformer.builder.analysis.layout import Layout  # noqa: E402
from yamlformer.builder.analysis.perf import Model, Run, predict  # noqa: E402
from yamlformer.builder.spec.loader import load_spec  # noqa: E402

SOURCE = (
    "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (tables 1-6, H100) and "
    "benchmarks/llama3_8b_h200_2025-06_torchtitan.md (table H200)"
)
GIB = 2**30
#: the benchmark's hardware as the file states it (96 GB HBM2e at 2.4 TB/s, 400 Gb/s per GPU, 500 W);
#: its footnote 2: "the actual peak TFLOPs number is between SXM and NVL, and we don't know its exact
#: value" -- taken as the midpoint of the H100 SXM's 989.5 and the H100 NVL's 835.5 dense bf16 TFLOP/s
GRAND_TETON_PEAK = (989.5e12 + 835.5e12) / 2
GRAND_TETON = gpu("h100", memory=96 * 10**9, hbm_bandwidth=2.4e12, inter_node=400e9 / 8, peak=GRAND_TETON_PEAK)


@dataclass(frozen=True)
class Row:
    table: str
    label: str
    spec: str
    gpus: int
    tp: int
    pp: int
    cp: int
    seq: int
    global_batch: int
    micro_batch: int
    recompute: str
    tps: int  # published TPS/GPU
    memory_gib: float  # published peak memory
    schedule: str = "1f1b"
    compile: bool = False
    float8: bool = False
    async_tp: bool = False
    source: str = "torchtitan-202412"
    float8_all_gather: bool = False
    compile_loss: bool = False
    attention: str = "flash"

    @property
    def bf16(self) -> bool:
        return not self.float8


ROWS = [
    Row("1", "FSDP", "llama3-8b", 8, 1, 1, 1, 8192, 16, 2, "selective", 5762, 82.4),
    Row("1", "FSDP + torch.compile", "llama3-8b", 8, 1, 1, 1, 8192, 16, 2, "selective", 6667, 77.0, compile=True),
    Row(
        "1",
        "FSDP + compile + Float8",
        "llama3-8b",
        8,
        1,
        1,
        1,
        8192,
        16,
        2,
        "selective",
        8532,
        76.8,
        compile=True,
        float8=True,
    ),
    Row("3", "FSDP", "llama3-8b", 128, 1, 1, 1, 8192, 256, 2, "selective", 5605, 67.0),
    Row("3", "FSDP + torch.compile", "llama3-8b", 128, 1, 1, 1, 8192, 256, 2, "selective", 6514, 62.0, compile=True),
    Row(
        "3",
        "FSDP + compile + Float8",
        "llama3-8b",
        128,
        1,
        1,
        1,
        8192,
        256,
        2,
        "selective",
        8380,
        61.8,
        compile=True,
        float8=True,
    ),
]
_F8 = {"compile": True, "float8": True}
#: train_configs/llama3_405b.toml at the benchmark's commit (9dec370): async TP, and float8 FSDP all-gathers
#: with precomputed scales
_F8_405B = {**_F8, "async_tp": True, "float8_all_gather": True}
ROWS += [
    Row("2", f"FSDP {8 // cp}, CP {cp}", "llama3-8b", 8, 1, 1, cp, seq, 8 // cp, 1, "full", tps, mem, **_F8)
    for cp, seq, tps, mem in (
        (1, 32768, 3890, 83.9),
        (2, 65536, 2540, 84.2),
        (4, 131072, 1071, 84.0),
        (8, 262144, 548, 84.5),
    )
]
ROWS += [
    Row("4", "2D", "llama3-70b", 256, 8, 1, 1, 8192, 512, 16, "full", 829, 71.9, **_F8),
    Row("4", "2D + AsyncTP", "llama3-70b", 256, 8, 1, 1, 8192, 512, 16, "full", 876, 67.6, async_tp=True, **_F8),
    Row("5", "1F1B", "llama3-405b", 512, 8, 8, 1, 8192, 256, 4, "full", 100, 82.5, **_F8_405B),
    Row(
        "5",
        "Interleaved 1F1B",
        "llama3-405b",
        512,
        8,
        8,
        1,
        8192,
        256,
        4,
        "full",
        128,
        72.7,
        schedule="interleaved-1f1b",
        **_F8_405B,
    ),
]
ROWS += [
    Row(
        "6",
        f"FSDP {8 // cp}, CP {cp}",
        "llama3-405b",
        512,
        8,
        8,
        cp,
        seq,
        64 // cp,
        1,
        "full",
        tps,
        mem,
        **_F8_405B,
    )
    for cp, seq, tps, mem in ((1, 32768, 76, 75.3), (2, 65536, 47, 75.9), (4, 131072, 31, 77.1), (8, 262144, 16, 84.9))
]
#: the Trainy team's June 2025 H200 run (pytorch/torchtitan benchmarks/llama3_8b_h200_2025-06_torchtitan.md):
#: Llama 3.1 8B on 4 and 8 hosts of 8 H200, FSDP over all (llama3_8b.toml: data_parallel_shard_degree -1,
#: seq_len 8192, selective per-op recomputation), local batch 2, compile, float8 with float8 FSDP all-gathers;
#: its torchtitan (e7c0cae, torchtitan/components/loss.py) compiles the loss under --training.compile, which
#: the December one did not (9dec370 train.py: "compiling loss function causes CUDA errors, turning off for now")
_H200 = {
    "compile": True,
    "compile_loss": True,
    "float8": True,
    "float8_all_gather": True,
    "source": "torchtitan-h200-202506",
}
ROWS += [
    Row("H200", f"{n} nodes", "llama3-8b", 8 * n, 1, 1, 1, 8192, 16 * n, 2, "selective", tps, mem, **_H200)
    for n, tps, mem in ((4, 10938, 47.96), (8, 10753, 46.97))
]
#: the project's own run (shared/gpu-runs/2026-12-04-h200.md): benchmarks/gpu_check.py's spec at 8 layers
#: (0.38B; the character vocabulary of its corpus, 102), seq 2048, batch 8, FSDP2 on one H200, bf16-mixed,
#: eager, no checkpointing, attention by this project's Triton kernel (``auto`` on CUDA at c88aa3b);
#: 122,115 tokens/s, torch.cuda.max_memory_allocated 18.8 GiB
OWN = Row(
    "own", "gpu_check 8 x 2048", "gpu-check", 1, 1, 1, 1, 2048, 8, 8, "none", 122115, 18.8,
    source="project-h200-202612", attention="triton",
)  # fmt: skip
OWN_VOCAB = 102
#: the H200's measured table: as measured on the H200 rows, by the datasheet ratio on the H100 ones
CALIBRATION = reference()
HARDWARE = {
    "torchtitan-202412": GRAND_TETON,
    "torchtitan-h200-202506": gpu("h200"),
    "project-h200-202612": gpu("h200"),
}
#: pairs a table measured of one model: (table, faster label, slower label)
ORDERINGS = [
    ("1", "FSDP + torch.compile", "FSDP"),
    ("3", "FSDP + torch.compile", "FSDP"),
    ("1", "FSDP + compile + Float8", "FSDP + torch.compile"),
    ("4", "2D + AsyncTP", "2D"),
    ("5", "Interleaved 1F1B", "1F1B"),
    ("2", "FSDP 8, CP 1", "FSDP 4, CP 2"),
    ("2", "FSDP 4, CP 2", "FSDP 2, CP 4"),
    ("2", "FSDP 2, CP 4", "FSDP 1, CP 8"),
    ("6", "FSDP 8, CP 1", "FSDP 4, CP 2"),
    ("6", "FSDP 4, CP 2", "FSDP 2, CP 4"),
    ("6", "FSDP 2, CP 4", "FSDP 1, CP 8"),
    ("H200", "4 nodes", "8 nodes"),
]


def row_spec(row: Row):
    """The spec a row ran: a zoo file, or gpu_check's own."""
    if row.spec == "gpu-check":
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        from gpu_check import spec as gpu_check_spec

        return load_spec({**gpu_check_spec(8), "vocab_size": OWN_VOCAB})
    return load_spec(Path(ROOT) / "specs" / f"{row.spec}.yaml")


def predict_row(row: Row, models: dict):
    spec = row_spec(row)
    if row.seq > spec.max_seq_len:  # torchtitan ran 262,144 tokens past the config's 131,072 positions
        spec = spec.model_copy(update={"max_seq_len": row.seq})
    layout = Layout(
        devices=row.gpus,
        nodes=max(1, row.gpus // 8),
        tensor_parallel=row.tp,
        pipeline_parallel=row.pp,
        context_parallel=row.cp,
    )
    run = Run(
        seq_len=row.seq,
        global_batch=row.global_batch,
        micro_batch=row.micro_batch,
        recompute=row.recompute,
        schedule=row.schedule,
        stages_per_rank=2 if row.schedule == "interleaved-1f1b" else 1,
        compile=row.compile,
        async_tp=row.async_tp,
        float8=row.float8,
        float8_all_gather=row.float8_all_gather,
        compile_loss=row.compile_loss,
        kv_repeat=row.source == "torchtitan-202412",  # its Llama's repeat_kv before SDPA (models/llama/model.py)
        attention=row.attention,
    )
    key = (row.spec, row.seq)
    if key not in models:
        models[key] = Model(spec, row.seq)
    return predict(spec, layout, run, HARDWARE[row.source], CALIBRATION, model=models[key])


#: the terms each row prints, from the prediction's breakdown (seconds per step)
TERMS = {
    "GEMM": ("gemm",),
    "attention": ("attention",),
    "memory-bound": ("memory_bound", "optimizer"),
    "exposed comm": ("exposed_fsdp", "exposed_tp", "exposed_cp", "exposed_ep", "exposed_pp"),
    "bubble": ("bubble",),
}
#: the goal: tokens/s per GPU within this of the published figure
WITHIN = 0.15


def row_result(row: Row, models: dict) -> dict:
    p = predict_row(row, models)
    return {
        "row": row,
        "tps": p.tokens_per_s_per_gpu,
        "tps_error": p.tokens_per_s_per_gpu / row.tps - 1,
        "memory_gib": p.memory_per_gpu_bytes / GIB,
        "memory_error": p.memory_per_gpu_bytes / GIB / row.memory_gib - 1,
        "mfu": p.mfu,
        "step_s": p.step_s,
        "breakdown": p.breakdown,
        "memory_bound": p.memory_bound,
        "terms": {name: sum(p.breakdown[k] for k in keys) for name, keys in TERMS.items()},
    }


def results() -> tuple[list[dict], list[dict]]:
    """Every published row's prediction, and the orderings."""
    models: dict = {}
    rows = [row_result(row, models) for row in ROWS]
    by = {(r["row"].table, r["row"].label): r for r in rows}
    orders = []
    for table, fast, slow in ORDERINGS:
        f, s = by[(table, fast)], by[(table, slow)]
        orders.append(
            {
                "table": table,
                "faster": fast,
                "slower": slow,
                "published": f["row"].tps / s["row"].tps,
                "predicted": f["tps"] / s["tps"],
            }
        )
    return rows, orders


def own_result() -> dict:
    """The project's own single-H200 run (:data:`OWN`)."""
    return row_result(OWN, {})


def markdown(rows: list[dict], orders: list[dict], own: dict | None = None) -> str:
    out = [
        f"Sources: {SOURCE}, figures quoted exactly. Hardware as each file states it: the H100 SXM peak with "
        "96 GB at 2.4 TB/s and 400 Gb/s per GPU (tables 1-6); the H200 SXM row of the hardware table, "
        "400 Gb/s per GPU (table H200). Kernel rates, one table for every row: " + CALIBRATION.describe() + "; "
        "on the H100 rows times the datasheet ratios (peak 912.5 / 989.5 TFLOP/s, HBM 2.4 / 4.8 TB/s).",
        "",
        "| table | run | model | GPUs | TP | PP | CP | seq | recompute | "
        + " | ".join(f"{t} s" for t in TERMS)
        + " | step s | published TPS/GPU | predicted | error | published GiB | predicted GiB | error |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | "
        + " | ".join("---:" for _ in TERMS)
        + " | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows + ([own] if own else []):
        row = r["row"]
        terms = " | ".join(f"{r['terms'][t]:.3g}" for t in TERMS)
        out.append(
            f"| {row.table} | {row.label}{'' if row.bf16 else ' (fp8)'} | {row.spec} | {row.gpus} | {row.tp} "
            f"| {row.pp} | {row.cp} | {row.seq} | {row.recompute} | {terms} | {r['step_s']:.3g} "
            f"| {row.tps:,} | {r['tps']:,.0f} | {r['tps_error']:+.0%} "
            f"| {row.memory_gib} | {r['memory_gib']:.1f} | {r['memory_error']:+.0%} |"
        )
    out += ["", "| table | faster | slower | published ratio | predicted ratio |", "| --- | --- | --- | ---: | ---: |"]
    for o in orders:
        out.append(f"| {o['table']} | {o['faster']} | {o['slower']} | {o['published']:.2f} | {o['predicted']:.2f} |")
    parts = sorted({part for r in rows for part in r["memory_bound"]})
    out += [
        "",
        "The memory-bound seconds per step by part (the blocks' counts, yamlformer.blocks.configs.traffic; "
        "float8 casts; FSDP2's copies), and the optimizer step:",
        "",
        "| table | run | " + " | ".join(parts) + " | optimizer |",
        "| --- | --- | " + " | ".join("---:" for _ in parts) + " | ---: |",
    ]
    for r in rows + ([own] if own else []):
        cells = " | ".join(f"{r['memory_bound'].get(part, 0.0):.3g}" for part in parts)
        out.append(f"| {r['row'].table} | {r['row'].label} | {cells} | {r['breakdown']['optimizer']:.3g} |")
    within = [r for r in rows if abs(r["tps_error"]) <= WITHIN]
    out += [
        "",
        f"Rows within {WITHIN:.0%} of the published TPS/GPU: {len(within)} of {len(rows)}; memory within 15%: "
        f"{sum(abs(r['memory_error']) <= 0.15 for r in rows)} of {len(rows)}; orderings right: "
        f"{sum(o['predicted'] > 1 for o in orders)} of {len(orders)}"
        + "".join(
            f"; {o['faster']} over {o['slower']} (table {o['table']}, {o['published'] - 1:.1%} apart as measured) "
            f"is predicted {'a tie' if abs(o['predicted'] - 1) < 0.01 else 'the other way'}"
            for o in orders
            if o["predicted"] <= 1
        )
        + "."
        + (
            f" The project's own H200 run: {own['tps_error']:+.1%} tokens/s, {own['memory_error']:+.1%} memory."
            if own
            else ""
        ),
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    rows, orders = results()
    print(markdown(rows, orders, own_result()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
