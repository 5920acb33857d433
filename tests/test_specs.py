"""Every shipped spec validates (recursive glob), matches its JSON Schema, and the malformed
corpus under tests/malformed/ gives exactly the located problems each file's header expects."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from yamlformer.builder.spec.json_schema import spec_json_schema
from yamlformer.builder.spec.loader import load_spec, read_merged, validate_file
from yamlformer.builder.spec.source import read_document

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted((ROOT / "specs").glob("**/*.yaml"))
MALFORMED = ROOT / "tests" / "malformed"
CORPUS = sorted(p for p in MALFORMED.glob("**/*.yaml") if "# expect:" in p.read_text())

#: the published parameter counts each full spec must reproduce (tiny ones state their own)
EXPECTED_PARAMS = {
    "transformer-base": 63_082_496,
    "gpt2-small": 124_439_808,
    "gpt3-175b": 174_604_259_328,
    "bert-base": 109_514_298,
    "t5-small": 60_506_624,
    "llama2-7b": 6_738_415_616,
    "llama2-70b": 68_976_648_192,
    "mixtral-8x7b": 46_702_792_704,
    "llama3-8b": 8_030_261_248,
    "mistral-7b": 7_241_732_096,
    "gemma2-2b": 2_614_341_888,
    "qwen2-0.5b": 494_032_768,
    "mpt-7b": 6_649_286_656,
    "pythia-160m": 162_322_944,
    # transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM built on meta (tests/test_deepseek.py);
    # V3's with its multi-token-prediction module (transformers' MtpModel less the shared embedding and head)
    "deepseek-v2-lite": 15_706_484_224,
    "deepseek-v3": 682_636_472_320,
    # transformers built on meta from the published configs (tests/test_hf_families_zoo.py)
    "qwen3-0.6b": 596_049_920,
    "qwen3-30b-a3b": 30_532_122_624,
    "olmo2-7b": 7_298_617_344,
    "phi3-mini": 3_821_079_552,
    # transformers built on meta from the published configs (tests/test_hf_families_recent.py)
    "gemma3-1b": 999_885_952,
    "gpt-oss-20b": 20_914_757_184,
    "gpt-oss-120b": 116_829_156_672,
    "llama4-scout": 107_769_861_120,
}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_specs_are_found():
    assert len(SPECS) >= 21
    assert {p.stem for p in SPECS} >= set(EXPECTED_PARAMS)
    assert len(list((ROOT / "specs" / "tiny").glob("*.yaml"))) >= 8


@pytest.mark.parametrize("path", SPECS, ids=_rel)
def test_shipped_spec_validates(path):
    assert validate_file(path) == []
    spec = load_spec(path)
    assert spec.name and spec.name != "model"


@pytest.mark.parametrize("path", SPECS, ids=_rel)
def test_header_states_the_parameter_count(path):
    """Each file's header names its source and its count; the estimator must agree."""
    estimate = pytest.importorskip("yamlformer.builder.analysis.estimates").estimate
    header = path.read_text().split("\nname:")[0]
    stated = re.search(r"Parameters: ([\d,]+)", header)
    assert stated, f"{_rel(path)} has no 'Parameters: N' in its header comment"
    spec = load_spec(path)
    total = estimate(spec, seq_len=16).params.total
    assert total == int(stated.group(1).replace(",", ""))
    if spec.name in EXPECTED_PARAMS:
        assert total == EXPECTED_PARAMS[spec.name]


@pytest.fixture(scope="module")
def schema_validator():
    schema = spec_json_schema()
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("path", SPECS, ids=_rel)
def test_json_schema_accepts_shipped_specs(schema_validator, path):
    """The file as an editor sees it (partial when it extends), and the merged result."""
    raw = read_document(path).data
    assert [e.message for e in schema_validator.iter_errors(raw)] == []
    merged = read_merged(path).data
    merged.pop("extends", None)
    assert [e.message for e in schema_validator.iter_errors(merged)] == []


def test_json_schema_rejects_what_the_loader_rejects(schema_validator):
    spec = read_document(ROOT / "specs" / "llama2-7b.yaml").data
    spec["decoder"]["attention"]["n_kv_head"] = 8
    assert list(schema_validator.iter_errors(spec))
    spec = read_document(ROOT / "specs" / "llama2-7b.yaml").data
    spec["position"] = {"theta": 10000.0}  # a position block needs its type
    assert list(schema_validator.iter_errors(spec))
    spec = read_document(ROOT / "specs" / "llama2-7b.yaml").data
    del spec["architecture"]  # required, unless the file extends another
    assert list(schema_validator.iter_errors(spec))
    assert not list(schema_validator.iter_errors({**spec, "extends": "llama2-7b.yaml"}))


def test_json_schema_keeps_descriptions(schema_validator):
    attention = schema_validator.schema["definitions"]["AttentionConfig"]["properties"]
    assert "GQA" in attention["n_kv_heads"]["description"]


def _expectations(path: Path) -> list[tuple[str, int, str, str]]:
    """``# expect: [FILE:]LINE PATH | MESSAGE`` lines; PATH ``-`` means no field."""
    found = []
    for match in re.finditer(r"^# expect: (?:(\S+):)?(\d+) (\S+)(?: \| (.*))?$", path.read_text(), re.M):
        file, line, field, message = match.groups()
        target = (path.parent / file) if file else path
        found.append((str(target.relative_to(MALFORMED)), int(line), "" if field == "-" else field, message or ""))
    return found


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 25


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: str(p.relative_to(MALFORMED)))
def test_malformed_spec_reports_located_problems(path, monkeypatch):
    monkeypatch.chdir(MALFORMED)
    expected = _expectations(path)
    problems = validate_file(str(path.relative_to(MALFORMED)))
    got = sorted((p.file, p.line, p.path) for p in problems)
    assert got == sorted((file, line, field) for file, line, field, _ in expected), "\n".join(map(str, problems))
    for file, line, field, message in expected:
        texts = [p.message for p in problems if (p.file, p.line, p.path) == (file, line, field)]
        assert any(message in text for text in texts), f"{message!r} not in {texts}"
    for problem in problems:
        assert problem.col is not None and problem.col >= 1


def test_validate_command_exit_codes_and_output():
    good = [_rel(p) for p in SPECS[:3]]
    bad = _rel(MALFORMED / "several_problems.yaml")
    run = subprocess.run(
        [sys.executable, "-m", "yamlformer.builder.cli", "validate", *good], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == "3 files ok"
    run = subprocess.run(
        [sys.executable, "-m", "yamlformer.builder.cli", "validate", *good, bad],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1 and not run.stderr
    lines = run.stdout.strip().splitlines()
    assert lines[0].startswith(f"{bad}:7:13: vocab_size: expected an integer")
    assert lines[-1] == "3 of 4 files ok; 4 problems in 1"


def test_validate_never_imports_torch():
    code = (
        "import sys; from yamlformer.builder.cli import main; rc = main(['validate', 'specs/tiny/llama.yaml']);"
        "print(rc, 'torch' in sys.modules, 'lightning' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.stdout.split()[-3:] == ["0", "False", "False"], run.stdout + run.stderr


def test_schema_command_prints_json():
    run = subprocess.run(
        [sys.executable, "-m", "yamlformer.builder.cli", "schema"], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0
    schema = json.loads(run.stdout)
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert "ModelSpec" in schema["definitions"]


def test_llama2_70b_counts_as_transformers_builds_it():
    """The 70B spec against transformers' Llama on the meta device, from the published config and
    from the config export-hf writes for the spec."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from yamlformer.builder.hf import choose_family

    spec = load_spec(ROOT / "specs" / "llama2-70b.yaml")
    published = {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    family, exported = choose_family(spec)
    assert family.model_type == "llama"
    assert {key: exported[key] for key in published} == published
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**published))
    assert sum(p.numel() for p in model.parameters()) == 68_976_648_192
