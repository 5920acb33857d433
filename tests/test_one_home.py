"""One home for each fact: the loss's ignored target id, the bytes of each compute dtype and the
attention backends are each defined once (every other module imports them); the start-of-run
line says how many of the built parameters train; the Triton interpreter's environment variable
is set only while our kernels need it (importing the kernels leaves the environment alone:
tests/test_kernels.py)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "blocks", "builder", "recipes")


def _definitions() -> dict[str, list[str]]:
    """Where each fact is assigned at a module's top: ``IGNORE``, a mapping of the compute dtypes
    to their bytes, a tuple naming the attention backends."""
    found: dict[str, list[str]] = {"ignored target id": [], "bytes per dtype": [], "attention backends": []}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                    continue
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                value = node.value
                if "IGNORE" in names:
                    found["ignored target id"].append(where)
                dtypes = {getattr(k, "value", None) for k in getattr(value, "keys", [])}
                if dtypes == {"fp32", "bf16", "fp16"} and all(
                    isinstance(getattr(v, "value", None), int) for v in value.values
                ):
                    found["bytes per dtype"].append(where)
                if isinstance(value, ast.Tuple) and {"eager", "sdpa", "triton"} <= {
                    getattr(e, "value", None) for e in value.elts
                }:
                    found["attention backends"].append(where)
    return found


def test_each_fact_is_defined_once():
    assert {fact: len(places) for fact, places in _definitions().items()} == dict.fromkeys(_definitions(), 1), (
        _definitions()
    )


def test_the_start_of_run_line_says_how_many_parameters_train():
    import torch

    from yamlformer.builder import build_model, estimate, load_spec
    from yamlformer.builder.analysis.report import summary_line

    spec = load_spec(ROOT / "specs" / "tiny" / "llama.yaml", overrides={"decoder.n_layers": 2})
    est = estimate(spec, seq_len=16)
    torch.manual_seed(0)
    model = build_model(spec)
    assert "trained" not in summary_line(spec, est, actual=model)
    frozen = list(model.decoder.layers[0].parameters())
    for p in frozen:
        p.requires_grad_(False)
    trained = est.params.total - sum(p.numel() for p in frozen)
    assert f"(= the built model), {trained:,} of them trained;" in summary_line(spec, est, actual=model)


@pytest.mark.slow  # a fresh process's torch and triton (the plain case is tests/test_kernels.py's)
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the interpreter serves machines without CUDA")
def test_the_interpreter_is_scoped_when_triton_was_imported_first():
    """Triton imported before the kernels (torch.utils.flop_counter does): its helpers re-wrapped
    for the interpreter, TRITON_INTERPRET set only while our kernels are decorated and run, and the
    process's environment as it was before, between and after, a forward and a backward."""
    code = (
        "import os, sys, torch\n"
        "import torch.utils.flop_counter, triton\n"
        "import yamlformer.kernels as K\n"
        "assert 'TRITON_INTERPRET' not in os.environ, 'set on import'\n"
        "q = torch.randn(1, 2, 24, 16, requires_grad=True)\n"
        "out = K.attention(q, q, q, K.Mask(causal=True), backend='triton')\n"
        "assert 'TRITON_INTERPRET' not in os.environ, 'left set after a forward'\n"
        "ref = K.attention(q, q, q, K.Mask(causal=True), backend='eager')\n"
        "assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()\n"
        "out.sum().backward()\n"
        "assert 'TRITON_INTERPRET' not in os.environ, 'left set after a backward'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT.parent, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
