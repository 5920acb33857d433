"""Specs and recipes are strict: a value of the wrong type is a located error, never coerced.

YAML is read with the 1.2 core schema (only true/false are booleans, `1:8` is a string, `010` is
ten), and every field takes its own type only: integers take integers, booleans true/false,
floats finite numbers (integers included).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from yamlformer.builder.spec.loader import SpecError, load_spec, parse_set_args
from yamlformer.builder.spec.source import parse_value
from yamlformer.recipes.tasks import load_recipe

ROOT = Path(__file__).resolve().parents[1]
TINY = """\
architecture: decoder-only
vocab_size: 256
d_model: 64
max_seq_len: 64
decoder:
  n_layers: 2
  attention: {n_heads: 4, n_kv_heads: 2}
  norm: {type: rmsnorm, eps: 1.0e-5}
"""


def problems_of(tmp_path: Path, text: str) -> list:
    path = tmp_path / "spec.yaml"
    path.write_text(textwrap.dedent(text))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return info.value.problems


@pytest.mark.parametrize(
    "old, new, field, line",
    [
        ("n_layers: 2", "n_layers: yes", "decoder.n_layers", 6),
        ("n_layers: 2", "n_layers: true", "decoder.n_layers", 6),
        ("n_layers: 2", "n_layers: 1e9", "decoder.n_layers", 6),
        ("n_layers: 2", "n_layers: 2.0", "decoder.n_layers", 6),
        ("d_model: 64", 'd_model: "64"', "d_model", 3),
        ("eps: 1.0e-5", "eps: .inf", "decoder.norm.eps", 8),
        ("eps: 1.0e-5", "eps: .nan", "decoder.norm.eps", 8),
        ("eps: 1.0e-5", 'eps: "1e-5"', "decoder.norm.eps", 8),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_where_it_is_written(tmp_path, old, new, field, line):
    problems = problems_of(tmp_path, TINY.replace(old, new))
    assert [(p.path, p.line) for p in problems] == [(field, line)]


@pytest.mark.parametrize("value", ["yes", '"yes"', "1", "on"])
def test_a_boolean_field_takes_true_or_false_only(tmp_path, value):
    problems = problems_of(tmp_path, TINY + f"tie_embeddings: {value}\n")
    assert [(p.path, p.line) for p in problems] == [("tie_embeddings", 9)]
    assert "true or false" in problems[0].message


def test_a_float_field_takes_an_integer(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(TINY.replace("eps: 1.0e-5", "eps: 1"))
    assert load_spec(path).decoder.norm.eps == 1.0


def test_a_python_tag_on_a_key_is_refused_not_dropped(tmp_path):
    problems = problems_of(tmp_path, TINY + "!!python/name:os.system tie_embeddings: true\n")
    assert [p.line for p in problems] == [9]
    assert "not allowed on a key" in problems[0].message


@pytest.mark.parametrize(
    "text, value",
    [
        ("yes", "yes"),
        ("on", "on"),
        ("1:8", "1:8"),
        ("010", 10),
        ("0x10", 16),
        ("0o10", 8),
        ("1.0e6", 1e6),
        ("1e-5", 1e-5),
        ("2001-12-14", "2001-12-14"),
        ("True", True),
        ("~", None),
    ],
)
def test_yaml_is_read_with_the_1_2_core_schema(text, value):
    assert parse_value(text) == value and type(parse_value(text)) is type(value)


def test_a_layer_slice_written_without_quotes_is_a_slice(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(TINY.replace("n_layers: 2", "n_layers: 8") + "  overrides:\n    - {layers: 1:8, dropout: 0.1}\n")
    spec = load_spec(path)
    assert [spec.decoder.layer(i).dropout for i in range(8)] == [0.0] + [0.1] * 7


@pytest.mark.parametrize(
    "item, field",
    [
        ("decoder.n_layers=true", "decoder.n_layers"),
        ("d_model='512'", "d_model"),
        ("tie_embeddings=yes", "tie_embeddings"),
        ("decoder.norm.eps=.inf", "decoder.norm.eps"),
    ],
)
def test_set_values_are_strict_too(tmp_path, item, field):
    path = tmp_path / "spec.yaml"
    path.write_text(TINY)
    with pytest.raises(SpecError) as info:
        load_spec(path, parse_set_args([item]))
    assert [p.path for p in info.value.problems] == [field]
    assert info.value.problems[0].file.startswith("<--set")


def test_set_extends_is_refused_not_ignored(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(TINY)
    with pytest.raises(SpecError) as info:
        load_spec(path, parse_set_args(["extends=other.yaml"]))
    assert [p.path for p in info.value.problems] == ["extends"]
    assert "write `extends:` in the file" in info.value.problems[0].message


@pytest.mark.parametrize(
    "key, value, field",
    [
        ("trainer.max_steps", "yes", "trainer.max_steps"),
        ("data.batch_size", "'8'", "data.batch_size"),
        ("optimizer.lr", ".inf", "optimizer.lr"),
        ("optimizer.betas", "[0.9, 1.5]", "optimizer.betas.1"),
        ("trainer.compile", "1", "trainer.compile"),
    ],
)
def test_recipes_are_strict(key, value, field):
    with pytest.raises(SpecError) as info:
        load_recipe(ROOT / "recipes" / "lm-stdlib.yaml", {key: parse_value(value)})
    assert [p.path for p in info.value.problems] == [field]


def test_recipe_betas_are_read_from_a_yaml_list():
    assert load_recipe(
        ROOT / "recipes" / "lm-stdlib.yaml", {"optimizer.betas": [0.9, 0.99]}
    ).recipe.optimizer.betas == (
        0.9,
        0.99,
    )


@pytest.mark.parametrize(
    "path", sorted([*ROOT.glob("specs/**/*.yaml"), *ROOT.glob("recipes/*.yaml")]), ids=lambda p: p.name
)
def test_every_shipped_file_reads_the_same_under_yaml_1_1_and_1_2(path):
    """Numbers are written so PyYAML (1.1) and editors (1.2) agree: 1000000.0, not 1.0e6."""
    import yaml

    from yamlformer.builder.spec.source import read_document

    assert read_document(path).data == yaml.safe_load(path.read_text())
