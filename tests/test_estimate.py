"""Whole-model estimates: the zoo's published counts, FLOPs against FlopCounterMode, activation
bytes against what autograd saves, the KV cache against what ``generate`` allocates, the
describe/compare/diff commands and MFU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from yamlformer.blocks import generation
from yamlformer.blocks.configs.ffn import GLUConfig
from yamlformer.blocks.configs.pairs import visible_pairs
from yamlformer.builder.analysis import mfu
from yamlformer.builder.analysis.estimates import estimate
from yamlformer.builder.analysis.layout import Layout
from yamlformer.builder.assemble import build_model
from yamlformer.builder.cli import main
from yamlformer.builder.cli.compare import compare
from yamlformer.builder.spec.loader import load_spec
from yamlformer.builder.spec.schema import spec_model

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted((ROOT / "specs").rglob("*.yaml"))
TINY = [p for p in SPECS if "tiny" in p.relative_to(ROOT / "specs").parts]

PUBLISHED = {
    "gpt2-small.yaml": 124_439_808,
    "gpt3-175b.yaml": 174_604_259_328,
    "bert-base.yaml": 109_514_298,
    "t5-small.yaml": 60_506_624,
    "llama2-7b.yaml": 6_738_415_616,
    "llama2-70b.yaml": 68_976_648_192,
    "mixtral-8x7b.yaml": 46_702_792_704,
    "transformer-base.yaml": 63_082_496,
}


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT / "specs"))


def _no_dropout(value):
    if isinstance(value, dict):
        return {k: 0.0 if k == "dropout" and isinstance(v, float) else _no_dropout(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_dropout(v) for v in value]
    return value


def _forward(model, spec, batch: int, seq: int, src: int | None):
    ids = torch.randint(0, spec.vocab_size, (batch, seq))
    if spec.architecture == "encoder-decoder":
        return model(torch.randint(0, spec.vocab_size, (batch, src or seq)), decoder_input_ids=ids), ids
    return model(ids), ids


def test_zoo_is_found():
    assert len(SPECS) >= 8 and TINY, "specs/ (recursive) should hold the zoo and its tiny variants"


@pytest.mark.parametrize("path", SPECS, ids=_id)
def test_compare_matches_on_meta(path):
    result = compare(load_spec(path))
    bad = [row for row in result["components"] if not row["match"]]
    assert result["match"], f"{_id(path)}: estimated vs built differ: {bad}"


@pytest.mark.parametrize("name, total", sorted(PUBLISHED.items()))
def test_published_counts(name, total):
    assert estimate(load_spec(ROOT / "specs" / name)).params.total == total


def test_mixtral_active_and_kaplan():
    est = estimate(load_spec(ROOT / "specs" / "mixtral-8x7b.yaml"))
    assert est.params.active == 12_879_925_248
    gpt2 = estimate(load_spec(ROOT / "specs" / "gpt2-small.yaml")).params
    assert gpt2.embedding == 50257 * 768 + 1024 * 768  # token + learned positions (head tied)
    assert gpt2.non_embedding == gpt2.total - gpt2.embedding == 85_056_000


@pytest.mark.parametrize("path", TINY, ids=_id)
def test_flops_equal_flop_counter(path):
    spec = load_spec(path)
    torch.manual_seed(0)
    model = build_model(spec, attention_backend="eager").eval()
    enc_dec = spec.architecture == "encoder-decoder"
    for seq, src in ((7, 13), (16, 5)):
        src = src if enc_dec else None
        est = estimate(spec, seq_len=seq, src_len=src)
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            _forward(model, spec, 1, seq, src)
        assert counter.get_total_flops() == est.flops.forward_per_sequence
        assert est.flops.forward_per_token == round(est.flops.forward_per_sequence / seq)
        assert est.flops.train_per_token == round(3 * est.flops.forward_per_sequence / seq)
        assert estimate(spec, seq_len=seq, src_len=src, activation_checkpointing=True).flops.train_per_token == round(
            4 * est.flops.forward_per_sequence / seq
        )


@pytest.mark.parametrize("path", TINY, ids=_id)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_activations_match_saved_tensors(path, dtype):
    """The eager-attention activation estimate against the bytes autograd keeps (plus the
    logits the caller holds), dropout off: CPU dropout keeps a float mask where CUDA keeps a
    one-byte one, and the estimate follows CUDA."""
    spec = spec_model().model_validate(_no_dropout(load_spec(path).model_dump(exclude={"extends"})))
    torch.manual_seed(0)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    model = build_model(spec, attention_backend="eager", dtype=torch_dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved.setdefault(storage.data_ptr(), storage.nbytes())
        return tensor

    src = 9 if spec.architecture == "encoder-decoder" else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits, ids = _forward(model, spec, 2, 12, src)
        F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
    measured = sum(saved.values()) + logits.numel() * logits.element_size()
    est = estimate(spec, seq_len=12, src_len=src, batch=2, dtype=dtype, fused_attention=False)
    assert est.memory.activations == pytest.approx(measured, rel=0.03)


def test_memory_conventions():
    spec = load_spec(ROOT / "specs" / "llama2-7b.yaml")
    n = 6_738_415_616
    bf16 = estimate(spec, seq_len=1024, batch=2).memory
    # AdamW (the default): two fp32 states per element and an fp32 step for each of the 291 tensors
    adamw = 8 * n + 4 * 291
    assert (bf16.weights, bf16.master_weights, bf16.gradients, bf16.optimizer) == (2 * n, 4 * n, 2 * n, adamw)
    fp32 = estimate(spec, seq_len=1024, batch=2, dtype="fp32").memory
    assert (fp32.weights, fp32.master_weights, fp32.gradients, fp32.optimizer) == (4 * n, 0, 4 * n, adamw)
    # Muon: one fp32 momentum per element of the 32 x 7 hidden matrices, AdamW's state on the rest
    hidden = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    muon = estimate(spec, seq_len=1024, batch=2, optimizer="muon").memory
    assert muon.optimizer == 4 * hidden + 8 * (n - hidden) + 4 * (291 - 32 * 7)
    assert estimate(spec, seq_len=1024, batch=2, optimizer="sgd").memory.optimizer == 4 * n  # its momentum
    fsdp = estimate(spec, seq_len=1024, batch=2, layout=Layout(devices=8)).memory
    # FSDP2 (yamlformer.builder.analysis.layout): fp32 shards that are the master weights (every Llama dim divides
    # by 8), fp32 sharded gradients, AdamW's two states and a step for each of the 291 tensors
    assert (fsdp.weights, fsdp.master_weights, fsdp.gradients) == (4 * n // 8, 0, 4 * n // 8)
    assert fsdp.optimizer == 8 * n // 8 + 4 * 291
    assert fsdp.activations == bf16.activations and fsdp.sharding_buffers > 0
    ddp = estimate(spec, seq_len=1024, batch=2, layout=Layout(devices=8, strategy="ddp")).memory
    assert ddp.training_total == bf16.training_total
    ckpt = estimate(spec, seq_len=1024, batch=2, activation_checkpointing=True).memory
    assert ckpt.activations < bf16.activations / 5
    eager = estimate(spec, seq_len=1024, batch=2, fused_attention=False).memory
    assert eager.activations > bf16.activations  # the (seq, seq) probabilities
    # KV cache: 2 (k, v) x 32 layers x 4096 wide x 1024 tokens x 2 sequences x 2 bytes
    assert bf16.kv_cache == 2 * 32 * 4096 * 1024 * 2 * 2


def test_kv_cache_caps_at_sliding_window():
    spec = load_spec(ROOT / "specs" / "mistral-7b.yaml")
    window = spec.decoder.attention.sliding_window
    assert window is not None
    at_window = estimate(spec, seq_len=window).memory.kv_cache
    assert estimate(spec, seq_len=2 * window).memory.kv_cache == at_window


@pytest.mark.parametrize("path", [p for p in TINY if "bert" not in p.name], ids=_id)
def test_kv_cache_equals_generate(path, monkeypatch):
    spec = load_spec(path)
    torch.manual_seed(0)
    model = build_model(spec).eval()
    caches = []
    original = generation.KVCache.for_stack.__func__

    def spy(cls, *args, **kwargs):
        cache = original(cls, *args, **kwargs)
        caches.append(cache)
        return cache

    monkeypatch.setattr(generation.KVCache, "for_stack", classmethod(spy))
    batch, prompt, new, src = 2, 5, 12, 7  # the tiny gemma2 window (16) caps the context (17)
    if spec.architecture == "encoder-decoder":
        model.generate(
            torch.randint(0, spec.vocab_size, (batch, src)),
            max_new_tokens=new,
            decoder_input_ids=torch.zeros(batch, prompt, dtype=torch.long),
        )
    else:
        model.generate(torch.randint(0, spec.vocab_size, (batch, prompt)), max_new_tokens=new)
        src = None
    assert len(caches) == 1
    est = estimate(spec, seq_len=prompt + new, src_len=src, batch=batch, dtype="fp32")
    assert est.memory.kv_cache == caches[0].nbytes()


def test_kernel_flops_count_visible_pairs():
    spec = load_spec(ROOT / "specs" / "tiny" / "llama.yaml")
    seq = 32
    est = estimate(spec, seq_len=seq)
    d = spec.d_model
    attention = spec.decoder.attention
    q = attention.n_heads * attention.resolved_head_dim(d)
    saved = spec.decoder.n_layers * 4 * q * (seq * seq - seq * (seq + 1) // 2)  # the masked half
    assert est.flops.forward_per_sequence - seq * est.flops.kernel_forward_per_token == saved


def test_visible_pairs_closed_form():
    def brute(seq_q, seq_k, causal, window):
        total = 0
        for i in range(seq_q):
            pos = i + seq_k - seq_q
            hi = pos + 1 if causal else seq_k
            lo = max(0, pos - window + 1) if window is not None else 0
            total += max(0, min(hi, seq_k) - lo)
        return total

    for seq_q in range(1, 9):
        for seq_k in range(1, 9):
            for causal in (True, False):
                for window in (None, 1, 2, 3, 6, 20):
                    assert visible_pairs(seq_q, seq_k, causal, window) == brute(seq_q, seq_k, causal, window)


def test_describe_json(capsys):
    assert (
        main(
            [
                "describe",
                str(ROOT / "specs" / "t5-small.yaml"),
                "--json",
                "--seq-len",
                "64",
                "--src-len",
                "128",
                "--batch",
                "4",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["name"] == "t5-small"
    assert out["params"]["total"] == 60_506_624
    assert {"total", "embedding", "by_component"} <= set(out["params"])
    components = set(out["params"]["by_component"])
    assert {"encoder.attention", "decoder.cross_attention", "head", "embedding"} <= components
    assert {"seq_len", "forward_per_token", "train_per_token"} <= set(out["flops"])
    assert out["flops"]["seq_len"] == 64 and out["flops"]["src_len"] == 128
    assert out["memory"]["kv_cache"] > 0 and out["conventions"]


def test_describe_table_and_plot(capsys, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps to the terminal's width
    plot = tmp_path / "where.png"
    assert (
        main(
            [
                "describe",
                str(ROOT / "specs" / "tiny" / "mixtral.yaml"),
                "--plot",
                str(plot),
                "--set",
                "decoder.n_layers=3",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "decoder.ffn" in text and "moe 4xglu top2" in text and "conventions" in text
    assert plot.stat().st_size > 10_000


def test_compare_exit_codes(capsys, monkeypatch):
    spec = str(ROOT / "specs" / "tiny" / "llama.yaml")
    assert main(["compare", spec]) == 0
    monkeypatch.setattr(GLUConfig, "params", lambda self, d_model: 1)
    capsys.readouterr()  # the table of the matching run
    assert main(["compare", spec, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["match"] is False and out["estimated"] != out["actual"]
    assert [row["component"] for row in out["components"] if not row["match"]] == ["decoder.ffn"]


def test_diff(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    base = ROOT / "specs" / "tiny" / "llama.yaml"
    other = tmp_path / "gqa.yaml"
    other.write_text(f"extends: {base}\ndecoder:\n  attention:\n    n_kv_heads: 1\n")
    assert main(["diff", str(base), str(other), "--json", "--seq-len", "32"]) == 0
    out = json.loads(capsys.readouterr().out)
    fields = {row["path"]: (row["a"], row["b"]) for row in out["fields"]}
    assert fields == {"decoder.attention.n_kv_heads": (2, 1)}
    effects = {row["quantity"]: row for row in out["effects"]}
    a, b = load_spec(base), load_spec(other)
    assert effects["params.total"]["change"] == estimate(b).params.total - estimate(a).params.total < 0
    assert effects["memory.kv_cache"]["percent"] == pytest.approx(-50.0)
    assert main(["diff", str(base), str(other)]) == 0
    assert "n_kv_heads" in capsys.readouterr().out


def test_diff_measures_both_specs_at_one_sequence_length_and_says_which(capsys, monkeypatch):
    """llama2-7b -> mistral-7b read FLOPs +104% and activations +752%, each spec at its own
    max_seq_len (4,096 against 32,768) without a word; at one length the change is +6.55%."""
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["diff", "llama2-7b", "mistral-7b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["a"]["seq_len"] == out["b"]["seq_len"] == out["seq_len"] == 4096
    assert out["seq_len_from"] == "the shorter max_seq_len"
    effects = {row["quantity"]: row for row in out["effects"]}
    assert effects["flops.forward_per_token"]["percent"] == pytest.approx(6.55, abs=0.01)
    assert main(["diff", "llama2-7b", "mistral-7b"]) == 0
    assert "effect, both at seq_len 4,096 (the shorter max_seq_len, llama2-7b's" in capsys.readouterr().out
    assert main(["diff", "mistral-7b", "llama2-7b", "--json", "--seq-len", "1024"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["seq_len"] == out["a"]["seq_len"] == out["b"]["seq_len"] == 1024 and out["seq_len_from"] == "--seq-len"


def test_describe_gpt3_is_torch_free_and_fast():
    code = (
        "import sys, time; from yamlformer.builder.cli import main; "
        "main(['describe', 'specs/gpt3-175b.yaml']); "
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', time.process_time())"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "174,604,259,328" in done.stdout
    assert done.stdout.split()[-2] == "NO-TORCH"
    # the child's CPU time, interpreter start and imports included (0.25 s measured): other
    # processes on a loaded machine do not count against it
    assert float(done.stdout.split()[-1]) < 3.0


def test_bad_settings_are_clear():
    spec = load_spec(ROOT / "specs" / "tiny" / "llama.yaml")
    with pytest.raises(ValueError, match="dtype must be one of"):
        estimate(spec, dtype="int8")
    with pytest.raises(ValueError, match="src_len applies to encoder-decoder"):
        estimate(spec, src_len=4)


def test_mfu(monkeypatch):
    monkeypatch.delenv(mfu.ENV_VAR, raising=False)
    assert mfu.peak_flops("NVIDIA H200", "bf16") == 989.5e12
    assert mfu.peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.5e12
    assert mfu.peak_flops("NVIDIA H100 PCIe", "bf16") == 756.5e12
    assert mfu.peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == 156e12
    assert mfu.peak_flops("NVIDIA GeForce RTX 3090", "bf16") is None
    assert mfu.peak_flops("NVIDIA H200", "bf16", override=1e15) == 1e15
    monkeypatch.setenv(mfu.ENV_VAR, "5e14")
    assert mfu.peak_flops("NVIDIA H200", "bf16") == 5e14
    monkeypatch.setenv(mfu.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="BUILDER_PEAK_FLOPS"):
        mfu.peak_flops("NVIDIA H200", "bf16")
    assert mfu.achieved_flops(1000.0, 6e9) == 6e12
    assert mfu.mfu(1000.0, 6e9, 12e12) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        mfu.mfu(1.0, 1.0, 0)


def test_the_package_exports_the_estimate_function():
    """`from builder import estimate` is the function of the contract, even after the module loads."""
    import yamlformer.builder.analysis.estimates  # noqa: F401  (a loaded submodule must not shadow the export)
    from yamlformer.builder import estimate as exported

    assert callable(exported) and exported is estimate
