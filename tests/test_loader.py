"""The loader: safe located YAML, extends, --set overrides, plugins, and robustness to any edit."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict

from yamlformer.builder.spec.loader import SpecError, load_config, load_spec, parse_set_args, read_merged, validate_file

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
TINY = """\
architecture: decoder-only
vocab_size: 256
d_model: 64
max_seq_len: 64
decoder:
  n_layers: 2
  attention: {n_heads: 4, n_kv_heads: 2}
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# -- safety ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tag",
    ["!!python/object/apply:os.system", "!!python/object/new:os.system", "!!python/name:os.system"],
)
def test_python_tags_are_refused_without_running_anything(tmp_path, tag):
    marker = tmp_path / "pwned"
    spec = write(tmp_path, "evil.yaml", TINY + f'name: {tag} ["touch {marker}"]\n')
    problems = validate_file(spec)
    assert not marker.exists()
    assert [(p.line, p.path) for p in problems] == [(8, "name")]
    assert "not allowed" in problems[0].message


def test_python_tag_on_a_mapping_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    spec = write(
        tmp_path, "evil.yaml", TINY + f"embedding: !!python/object/apply:os.system\n  args: ['touch {marker}']\n"
    )
    problems = validate_file(spec)
    assert not marker.exists()
    assert [(p.line, p.path) for p in problems] == [(8, "embedding")]


def test_alias_bomb_and_recursive_alias_are_problems(tmp_path):
    lines = ["name: bomb", "a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, 9)]
    bomb = write(tmp_path, "bomb.yaml", "\n".join(lines) + "\n")
    assert "YAML nodes" in validate_file(bomb)[0].message
    loop = write(tmp_path, "loop.yaml", "name: loop\na: &x\n  - *x\n")
    assert "recursive" in validate_file(loop)[0].message


# -- located data ------------------------------------------------------------------------------


def test_anchors_aliases_and_merge_keys(tmp_path):
    spec = write(
        tmp_path,
        "anchors.yaml",
        """\
        architecture: encoder-decoder
        vocab_size: 256
        d_model: 64
        max_seq_len: 64
        encoder: &stack
          n_layers: 2
          attention: &attn {n_heads: 4, qkv_bias: true}
          norm: {eps: 1e-6}
        decoder:
          <<: *stack
          n_layers: 3
          attention:
            <<: *attn
            n_kv_heads: 2
        """,
    )
    loaded = load_spec(spec)
    assert loaded.name == "anchors"  # the file's stem
    assert loaded.decoder.n_layers == 3 and loaded.encoder.n_layers == 2
    assert loaded.decoder.attention.qkv_bias and loaded.decoder.attention.n_kv_heads == 2
    assert loaded.encoder.norm.eps == 1e-6  # YAML 1.2 float, not the string '1e-6'
    doc = read_merged(spec)
    assert doc.values[("decoder", "attention", "n_heads")].line == 7  # set by the anchor
    assert doc.values[("decoder", "n_layers")].line == 11


def test_duplicate_keys_are_reported_with_both_lines(tmp_path):
    spec = write(tmp_path, "dup.yaml", TINY + "decoder:\n  n_layers: 1\n")
    problems = validate_file(spec)
    # the last one wins (as in PyYAML), so its missing attention is reported too
    assert [(p.line, p.path) for p in problems] == [(8, "decoder"), (8, "decoder.attention")]
    assert "first set on line 5" in problems[0].message


def test_spec_error_lists_every_problem(tmp_path):
    spec = write(tmp_path, "bad.yaml", TINY.replace("vocab_size: 256", "vocab_size: x").replace("64\n", "-1\n", 1))
    with pytest.raises(SpecError) as caught:
        load_spec(str(spec))
    problems = caught.value.problems
    assert [p.path for p in problems] == ["vocab_size", "d_model"]
    assert str(caught.value) == "\n".join(map(str, problems))
    assert str(problems[0]) == f"{spec}:2:13: vocab_size: expected an integer, got 'x'"


def test_missing_file_is_a_problem(tmp_path):
    problems = validate_file(tmp_path / "nope.yaml")
    assert len(problems) == 1 and problems[0].message == "no such file"


def test_not_utf8_and_control_characters_are_located(tmp_path):
    spec = tmp_path / "binary.yaml"
    spec.write_bytes(b"name: ok\nd_model: \xff\xfe\n")
    assert [(p.line, p.message) for p in validate_file(spec)] == [(2, "not UTF-8 text")]
    spec.write_text("name: ok\nd_model: 6\x07\n")
    problem = validate_file(spec)[0]
    assert problem.line == 2 and "character" in problem.message


# -- extends -----------------------------------------------------------------------------------


def test_extends_merges_mappings_and_replaces_scalars_lists_and_other_block_types(tmp_path):
    write(
        tmp_path,
        "base/parent.yaml",
        TINY + "  ffn: {type: glu, hidden_dim: 96}\n  overrides:\n"
        "    - {layers: [0], attention: {sliding_window: 8}}\n",
    )
    child = write(
        tmp_path,
        "child.yaml",
        """\
        extends: base/parent.yaml
        d_model: 32
        decoder:
          attention: {n_kv_heads: 4}
          ffn: {type: moe, n_experts: 2, expert: {type: mlp}}
          overrides:
            - {layers: [1], attention: {sliding_window: 4}}
        """,
    )
    spec = load_spec(child)
    assert spec.name == "child" and spec.d_model == 32
    assert (spec.decoder.attention.n_heads, spec.decoder.attention.n_kv_heads) == (4, 4)
    assert spec.decoder.ffn.type == "moe"  # a different block type replaces, not merges
    assert [layer.attention.sliding_window for layer in spec.decoder.layers()] == [None, 4]
    doc = read_merged(child)
    assert doc.values[("decoder", "attention", "n_heads")].file.endswith("parent.yaml")
    assert doc.values[("decoder", "attention", "n_kv_heads")].file == str(child)


def test_extends_must_be_a_path(tmp_path):
    spec = write(tmp_path, "x.yaml", "extends: [a.yaml]\n")
    assert [(p.line, p.path) for p in validate_file(spec)] == [(1, "extends")]


# -- overrides ---------------------------------------------------------------------------------


def test_overrides_apply_after_extends_and_create_sections():
    spec = load_spec(
        SPECS / "tiny" / "gemma2.yaml",
        overrides={"decoder.n_layers": 4, "decoder.overrides.0.layers": "1::2", "embedding.dropout": 0.1},
    )
    assert spec.decoder.n_layers == 4 and spec.embedding.dropout == 0.1
    assert [layer.attention.sliding_window for layer in spec.decoder.layers()] == [None, 16, None, 16]
    spec = load_spec(
        SPECS / "tiny" / "llama.yaml", overrides={"position.scaling.type": "linear", "position.scaling.factor": 2}
    )
    assert spec.position.scaling.factor == 2.0
    spec = load_spec(SPECS / "llama2-7b.yaml", overrides={"embedding.norm.type": "rmsnorm"})
    assert spec.embedding.norm.type == "rmsnorm"


def test_set_args_are_parsed_as_yaml_and_located():
    overrides = parse_set_args(
        [
            "decoder.n_layers=2",
            "decoder.overrides.0.layers=1::2",
            "head.softcap=null",
            "decoder.overrides.0.attention={sliding_window: 8}",
        ]
    )
    assert overrides == {
        "decoder.n_layers": 2,
        "decoder.overrides.0.layers": "1::2",
        "head.softcap": None,
        "decoder.overrides.0.attention": {"sliding_window": 8},
    }
    with pytest.raises(SpecError) as caught:
        parse_set_args(["decoder.n_layers", "=3", "a..b=1", "x=[1, 2", "y=!!python/object/apply:os.system [ls]"])
    assert [p.file for p in caught.value.problems] == [
        "<--set decoder.n_layers>",
        "<--set =3>",
        "<--set a..b=1>",
        "<--set x=[1, 2>",
        "<--set y=!!python/object/apply:os.system [ls]>",
    ]
    assert all(p.line is None for p in caught.value.problems)


@pytest.mark.parametrize(
    ("key", "value", "path", "words"),
    [
        ("decoder.n_layers", "two", "decoder.n_layers", "expected an integer, got 'two'"),
        ("decoder.atention.n_heads", 2, "decoder.atention", "did you mean 'attention'?"),
        ("d_model.width", 3, "d_model.width", "d_model is a value (768), not a section"),
        ("decoder.overrides.0.layers", "1::2", "decoder.overrides.0.layers", "decoder.overrides is not set"),
    ],
)
def test_bad_set_is_located_at_the_override(key, value, path, words):
    problems = validate_file(SPECS / "gpt2-small.yaml", {key: value})
    assert len(problems) == 1, problems
    assert problems[0].file == f"<--set {key}={value}>" and problems[0].line is None
    assert problems[0].path == path and words in problems[0].message
    assert str(problems[0]).startswith(f"<--set {key}={value}>: {path}: ")


def test_set_index_out_of_range():
    problems = validate_file(SPECS / "gemma2-2b.yaml", {"decoder.overrides.3.layers": "0"})
    assert "is a list of 1" in problems[0].message


def test_set_mapping_merges_as_extends_does():
    spec = load_spec(SPECS / "tiny" / "llama.yaml", overrides={"decoder.attention": {"n_kv_heads": 1}})
    assert spec.decoder.attention.n_kv_heads == 1 and spec.decoder.attention.n_heads == 4  # kept
    moe = {"type": "moe", "n_experts": 2, "expert": {"type": "glu", "hidden_dim": 16}}
    spec = load_spec(SPECS / "tiny" / "llama.yaml", overrides={"decoder.ffn": moe})
    assert spec.decoder.ffn.type == "moe"  # another block type replaces the glu and its fields


# -- the one merge: problems in inherited fields are reported where they were written --------


def test_a_problem_in_a_field_layers_inherit_is_reported_once_at_its_line(tmp_path):
    spec = write(
        tmp_path,
        "s.yaml",
        """\
        architecture: encoder-decoder
        vocab_size: 256
        d_model: 64
        max_seq_len: 64
        encoder: {n_layers: 2, attention: {n_heads: 4}}
        decoder:
          n_layers: 2
          attention: {n_heads: 4, n_kv_heads: 3}
          cross_attention: {n_kv_heads: 2}
          overrides:
            - {layers: [0], attention: {sliding_window: 8}, ffn: {hidden_dim: 8}}
            - {layers: [1], cross_attention: {out_bias: true}}
        """,
    )
    problems = validate_file(spec)
    assert [(p.line, p.path) for p in problems] == [(8, "decoder.attention.n_kv_heads")], problems
    assert "try n_kv_heads: 2" in problems[0].message
    typo = write(tmp_path, "t.yaml", spec.read_text().replace("n_kv_heads: 3", "qkv_bais: true"))
    problems = validate_file(typo)
    assert [(p.line, p.path) for p in problems] == [(8, "decoder.attention.qkv_bais")], problems
    assert "did you mean 'qkv_bias'" in problems[0].message
    missing = write(
        tmp_path,
        "m.yaml",
        TINY.replace("{n_heads: 4, n_kv_heads: 2}", "{n_kv_heads: 2}")
        + "  overrides:\n    - {layers: [1], attention: {sliding_window: 8}}\n",
    )
    assert [(p.line, p.path) for p in validate_file(missing)] == [(7, "decoder.attention.n_heads")]


def test_merged_documents_carry_where_every_field_was_written(tmp_path):
    from yamlformer.builder.spec.merge import merge
    from yamlformer.builder.spec.source import Document, read_document

    doc = read_document(
        write(tmp_path, "a.yaml", TINY + "  overrides:\n    - {layers: [1], attention: {n_heads: 8}}\n")
    )
    stack = doc.data["decoder"]
    out = merge(
        stack["attention"],
        stack["overrides"][0]["attention"],
        out=doc,
        at=("decoder", "overrides", 0, "attention"),
        base_from=(doc, ("decoder", "attention")),
    )
    assert out == {"n_heads": 8, "n_kv_heads": 2}
    at = ("decoder", "overrides", 0, "attention")
    assert doc.written_at(at + ("n_kv_heads",)) == ("decoder", "attention", "n_kv_heads")  # inherited
    assert doc.written_at(at + ("n_heads",)) == at + ("n_heads",)  # its own
    assert doc.written_at(at + ("head_dim",), missing=True) == ("decoder", "attention", "head_dim")
    assert doc.values[at + ("n_kv_heads",)].line == 7
    # without a document nothing is located; a block of another type replaces
    assert merge({"type": "glu", "hidden_dim": 4}, {"type": "moe"}) == {"type": "moe"}
    assert merge({"hidden_dim": 4}, {"type": "glu"}, types={"ffn": "mlp"}, at=("ffn",)) == {"type": "glu"}
    assert merge({"a": {"b": 1, "c": [1]}}, {"a": {"c": [2]}}) == {"a": {"b": 1, "c": [2]}}
    assert Document(None, {}, {}).written_at(("x",)) == ("x",)


def test_the_spec_type_is_a_static_class_plugins_still_validate_through():
    from yamlformer.blocks.configs.base import AttentionBlock
    from yamlformer.builder.spec.schema import ModelSpec, StackSpec

    spec = load_spec(SPECS / "tiny" / "llama.yaml")
    assert isinstance(spec, ModelSpec) and isinstance(spec.decoder, StackSpec)
    assert isinstance(spec.decoder.attention, AttentionBlock)
    again = ModelSpec.model_validate(spec.model_dump())
    assert isinstance(again, ModelSpec) and again == spec
    assert ModelSpec.model_json_schema()["title"] == "ModelSpec"
    assert StackSpec.model_fields["attention"].annotation is AttentionBlock  # what code may ask


# -- load_config -------------------------------------------------------------------------------


class _Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid")
    spec: str
    lr: float
    steps: int = 10


def test_load_config_gives_the_same_located_errors(tmp_path):
    write(tmp_path, "base.yaml", "spec: specs/tiny/llama.yaml\nlr: 3.0e-4\n")
    good = write(tmp_path, "good.yaml", "extends: base.yaml\nsteps: 5\n")
    recipe = load_config(good, _Recipe, overrides={"lr": 1e-3})
    assert (recipe.lr, recipe.steps, recipe.spec) == (1e-3, 5, "specs/tiny/llama.yaml")
    bad = write(tmp_path, "bad.yaml", "extends: base.yaml\nstep: 5\nlr: fast\n")
    with pytest.raises(SpecError) as caught:
        load_config(bad, _Recipe)
    assert [(p.line, p.path, p.message) for p in caught.value.problems] == [
        (2, "step", "unknown key 'step'; did you mean 'steps'?"),
        (3, "lr", "expected a number, got 'fast'"),
    ]


# -- plugins -----------------------------------------------------------------------------------


def test_plugin_blocks_join_the_schema_only_when_asked(tmp_path):
    """Run in a subprocess: a registered block would stay in this process's registry."""
    write(
        tmp_path,
        "myblocks.py",
        """\
        from typing import Literal
        from yamlformer.blocks.configs.base import NormBlock
        from yamlformer.blocks.registry import register

        @register("norm", "myblocks:ScaleNorm")
        class ScaleNormConfig(NormBlock):
            type: Literal["scalenorm"] = "scalenorm"
            def params(self, d_model):
                return 1
            def param_shapes(self, d_model):
                return {"scale": ()}
            def saved_bytes(self, d_model, tokens, act_bytes):
                return tokens * d_model * 4
        """,
    )
    spec = write(tmp_path, "s.yaml", TINY + "  norm: {type: scalenorm}\n")
    env_path = str(tmp_path)
    run = lambda *extra: subprocess.run(
        [sys.executable, "-m", "yamlformer.builder.cli", "validate", str(spec), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin", "PYTHONSAFEPATH": "1"},
    )
    without = run()
    assert without.returncode == 1 and "unknown type 'scalenorm'" in without.stdout
    with_plugin = run("--plugin", "myblocks")
    assert with_plugin.returncode == 0, with_plugin.stdout + with_plugin.stderr
    missing = run("--plugin", "no_such_plugin")
    assert missing.returncode == 1 and "plugin 'no_such_plugin' not found" in missing.stdout
    assert "Traceback" not in without.stderr + with_plugin.stderr + missing.stderr


# -- property-based: any edit gives a valid spec or located problems, never an exception -----

_BASES = [p for p in sorted(SPECS.glob("*.yaml")) if "extends:" not in p.read_text()]
_JUNK = st.one_of(
    st.integers(-5, 10**6),
    st.floats(allow_nan=True),
    st.booleans(),
    st.none(),
    st.text(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(min_size=1, max_size=5), st.integers(), max_size=2),
    st.sampled_from(["rope", "moe", "glu", "0::2", "1e-5", "sandwich", "encoder-decoder"]),
)


def _paths(node, prefix=()):
    yield prefix
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield from _paths(child, prefix + (key,))


def _assert_located(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mutant.yaml"
        path.write_text(text)
        problems = validate_file(path)
    for problem in problems:
        assert problem.file == str(path) and problem.line is not None and problem.line > 0, problem
        assert problem.message


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.sampled_from(_BASES), data=st.data())
def test_mutated_specs_give_located_problems(base, data):
    spec = yaml.safe_load(base.read_text())
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in _paths(spec) if p]
        path = data.draw(st.sampled_from(paths))
        parent = spec
        for part in path[:-1]:
            parent = parent[part]
        action = data.draw(st.sampled_from(["delete", "rename", "retype", "junk"]))
        key = path[-1]
        if action == "delete" and isinstance(parent, dict):
            del parent[key]
        elif action == "rename" and isinstance(parent, dict):
            parent[str(key) + data.draw(st.sampled_from(["s", "_", "x", ""]))[:1] or "_"] = parent.pop(key)
        elif action == "junk" and isinstance(parent, dict):
            parent[data.draw(st.text(min_size=1, max_size=6))] = data.draw(_JUNK)
        else:
            parent[key] = data.draw(_JUNK)
    _assert_located(yaml.safe_dump(spec, sort_keys=False))


@settings(max_examples=100, deadline=None)
@given(base=st.sampled_from(_BASES), data=st.data())
def test_mangled_text_gives_located_problems(base, data):
    text = base.read_text()
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(text)))
        cut = data.draw(st.integers(0, 5))
        insert = data.draw(st.text(alphabet=":-[]{}&*!|>'\"#\t\n %@`,?abc01", max_size=4))
        text = text[:at] + insert + text[at + cut :]
    _assert_located(text)


def test_a_key_indented_one_level_too_shallow_says_where_it_belongs(tmp_path):
    spec = tmp_path / "shallow.yaml"
    spec.write_text(
        textwrap.dedent("""\
        name: shallow
        architecture: decoder-only
        vocab_size: 100
        d_model: 64
        max_seq_len: 128
        decoder:
          n_layers: 2
          sliding_window: 64
          attention: {n_heads: 4}
          ffn: {type: mlp, hidden_dim: 128, activation: swish}
        """)
    )
    problems = {p.path: p for p in validate_file(spec)}
    shallow = problems["decoder.sliding_window"]
    assert (
        shallow.line == 8
        and shallow.message.startswith("unknown key 'sliding_window'; it belongs under 'attention'")
        and "decoder.attention.sliding_window" in shallow.message
    )
    assert problems["decoder.ffn.activation"].message.endswith("; 'swish' is called 'silu' here")


def test_a_tab_in_the_indentation_is_named_at_its_line(tmp_path):
    spec = tmp_path / "tabs.yaml"
    spec.write_text("name: tabs\ndecoder:\n  n_layers: 2\n  ffn:\n\t  hidden_dim: 3\n")
    (problem,) = validate_file(spec)
    assert (problem.line, problem.col, problem.message) == (
        5,
        1,
        "a tab in the indentation: YAML indents with spaces only",
    )
