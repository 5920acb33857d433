"""A calibration table: one GPU's measured kernel rates, as a YAML file (torch-free).

One file per GPU, named by the hardware table's key (``h200.yaml``; a device the table does not
know, by its own name, ``cpu.yaml``), holding the run that measured it and what it measured:

* ``gemm``: by dtype (``bf16``, ``fp8``), rows of one linear's three GEMMs (forward ``x W^T``, the
  input gradient, the weight gradient) over ``tokens`` rows from ``k`` to ``n`` features, at
  ``tflops`` (their FLOPs over their time together);
* ``attention``: by backend (``flash``, ``cudnn``: SDPA's; ``triton``: this project's kernel), rows
  of one call over ``queries`` and ``keys`` (``causal`` or not) at ``forward_tflops`` and
  ``backward_tflops`` (the backward counted as twice the forward's FLOPs over the visible pairs);
* ``hbm_gbs``: the bandwidth a streaming kernel reached, GB/s;
* ``datasheet``: only for a device the hardware table (``yamlformer.builder.analysis.hardware``) does
  not know: its figures, so the planner can plan on it.

:func:`load_table` refuses a malformed file with every problem located
(``file:line:col: field: message``, ``yamlformer.builder.spec.loader.load_config``);
:func:`write_table` writes one.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from yamlformer.blocks.configs.base import rule_error
from yamlformer.builder.analysis.hardware import GPUS
from yamlformer.builder.spec.loader import load_config

#: the GEMM dtypes a table rates, and the attention backends
GEMM_DTYPES = ("bf16", "fp8")
BACKENDS = ("flash", "cudnn", "triton")
#: the largest figure any field takes (a guard against a mistyped exponent, not a physical limit)
MAX_RATE = 1e6  # TFLOP/s or GB/s
MAX_SIZE = 1 << 30


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class MeasuredRun(_Strict):
    """The run that measured the table."""

    date: str = Field(..., pattern=r"^\d{4}-\d{2}-\d{2}$", description="When it was measured (YYYY-MM-DD).")
    torch: str = Field(..., min_length=1, description="torch.__version__ of the measuring run.")
    device: str = Field(..., min_length=1, description="The device's own name (torch.cuda.get_device_name()).")
    command: str = Field(..., min_length=1, description="The command that measured it.")
    note: str | None = Field(None, description="Anything else a reader needs (a transcription's source).")


class GemmRow(_Strict):
    """One linear's forward, input-gradient and weight-gradient GEMMs timed together."""

    tokens: int = Field(..., ge=1, le=MAX_SIZE, description="Rows (tokens) through the linear.")
    k: int = Field(..., ge=1, le=MAX_SIZE, description="Input features.")
    n: int = Field(..., ge=1, le=MAX_SIZE, description="Output features.")
    tflops: float = Field(..., gt=0, le=MAX_RATE, description="6 tokens k n over the three GEMMs' time, TFLOP/s.")


class AttentionRow(_Strict):
    """One attention call, forward and backward timed apart."""

    queries: int = Field(..., ge=1, le=MAX_SIZE, description="Query positions.")
    keys: int = Field(..., ge=1, le=MAX_SIZE, description="Key positions.")
    causal: bool = Field(..., description="A causal mask (the visible pairs counted).")
    forward_tflops: float = Field(..., gt=0, le=MAX_RATE, description="4 x visible pairs x heads x head_dim / time.")
    backward_tflops: float = Field(..., gt=0, le=MAX_RATE, description="Twice the forward's FLOPs / its time.")


class Datasheet(_Strict):
    """A device the hardware table does not know: the figures the planner plans with."""

    name: str = Field(..., min_length=1, description="How plans name the device.")
    peak_tflops: dict[str, float] = Field(..., description="Dense peak TFLOP/s by dtype (bf16 required).")
    memory_gb: float = Field(..., gt=0, le=MAX_RATE, description="Memory of one device, GB.")
    hbm_gbs: float = Field(..., gt=0, le=MAX_RATE, description="Its memory bandwidth, GB/s.")
    intra_node_gbs: float = Field(..., gt=0, le=MAX_RATE, description="Per device, per direction, inside a node.")
    inter_node_gbs: float = Field(..., gt=0, le=MAX_RATE, description="Per device, per direction, between nodes.")

    @model_validator(mode="after")
    def _peaks(self):
        for dtype, value in self.peak_tflops.items():
            if dtype not in ("bf16", "fp16", "fp8", "fp32"):
                raise rule_error(("peak_tflops", dtype), f"unknown dtype {dtype!r}: one of bf16, fp16, fp8, fp32")
            if not 0 < value <= MAX_RATE:
                raise rule_error(("peak_tflops", dtype), f"{value!r}: must be a rate in (0, {MAX_RATE:g}] TFLOP/s")
        if "bf16" not in self.peak_tflops:
            raise rule_error(("peak_tflops",), "needs a bf16 peak")
        return self


class CalibrationTable(_Strict):
    """One GPU's calibration file (the module doc)."""

    file_kind: ClassVar[str] = "a calibration table"

    gpu: str = Field(..., min_length=1, description="The hardware table's key (h200), or the device's own name.")
    measured: MeasuredRun
    hbm_gbs: float = Field(..., gt=0, le=MAX_RATE, description="Measured streaming bandwidth, GB/s.")
    gemm: dict[Literal["bf16", "fp8"], list[GemmRow]] = Field(..., description="Linears' GEMM rates by dtype.")
    attention: dict[Literal["flash", "cudnn", "triton"], list[AttentionRow]] = Field(
        ..., description="Attention rates by backend."
    )
    datasheet: Datasheet | None = Field(None, description="For a device the hardware table does not know.")

    @model_validator(mode="after")
    def _complete(self):

        if not self.gemm.get("bf16"):
            raise rule_error(("gemm",), "needs bf16 rows (the rate of every linear not in float8)")
        for kind, rows in (("gemm", self.gemm), ("attention", self.attention)):
            for key, listed in rows.items():
                if not listed:
                    raise rule_error((kind, key), "an empty list: leave the key out or give rows")
        if not self.attention:
            raise rule_error(("attention",), f"needs rows of at least one backend ({', '.join(BACKENDS)})")
        if self.datasheet is None and self.gpu not in GPUS:
            raise rule_error(
                ("gpu",),
                f"{self.gpu!r} is not in the hardware table ({', '.join(GPUS)}): give its datasheet figures "
                "(datasheet:) or the table's key",
            )
        return self


def load_table(path: str | Path) -> CalibrationTable:
    """The validated table at ``path``; ``yamlformer.builder.spec.loader.SpecError`` lists every
    problem located (``file:line:col: field: message``)."""

    return load_config(Path(path), CalibrationTable)


def write_table(table: CalibrationTable, path: str | Path, header: str = "") -> Path:
    """Write ``table`` as YAML at ``path`` (its folder made), ``header`` as comment lines first."""

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = table.model_dump(exclude_none=True)
    lines = [f"# {line}".rstrip() for line in header.splitlines()] if header else []
    text = "\n".join(lines) + ("\n" if lines else "") + yaml.safe_dump(data, sort_keys=False, width=100)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # a reader never sees half a file
    load_table(path)  # what was written reads back
    return path
