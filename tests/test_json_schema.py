"""The spec and recipe JSON Schemas are draft-07 (what yaml-language-server validates fully), accept
every shipped file, carry the whole block schema inside per-layer and recipe overrides (so an
editor completes there and flags a typo), and tell a recipe's tasks apart."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from yamlformer.builder.spec.json_schema import NEWER_KEYWORDS, spec_json_schema
from yamlformer.builder.spec.source import read_document
from yamlformer.recipes.tasks.json_schema import recipe_json_schema

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


@pytest.fixture(scope="module")
def spec_schema():
    schema = spec_json_schema()
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.fixture(scope="module")
def recipe_schema():
    schema = recipe_json_schema()
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _keywords(node, found: set[str], refs_with_siblings: list) -> None:
    """Every keyword used anywhere in a schema (property names are names, not keywords)."""
    if isinstance(node, list):
        for item in node:
            _keywords(item, found, refs_with_siblings)
        return
    if not isinstance(node, dict):
        return
    if "$ref" in node and len(node) > 1:
        refs_with_siblings.append(node)
    for key, value in node.items():
        found.add(key)
        if key in ("properties", "patternProperties", "definitions"):
            for sub in value.values():
                _keywords(sub, found, refs_with_siblings)
        else:
            _keywords(value, found, refs_with_siblings)


@pytest.mark.parametrize("make", [spec_json_schema, recipe_json_schema], ids=["spec", "recipe"])
def test_schemas_are_draft_07(make):
    schema = make()
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    found, siblings = set(), []
    _keywords(schema, found, siblings)
    assert not found & NEWER_KEYWORDS
    assert siblings == []  # draft-07 ignores what stands beside a $ref
    text = json.dumps(schema)
    assert "#/$defs/" not in text and text.count('"$ref": "#/definitions/') > 10
    for ref in set(__import__("re").findall(r'"\$ref": "#/definitions/([^"]+)"', text)):
        assert ref in schema["definitions"], ref


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_schema_accepts_shipped_recipes(recipe_schema, path):
    assert [e.message for e in recipe_schema.iter_errors(read_document(path).data)] == []


def test_a_typo_inside_layer_overrides_is_flagged(spec_schema):
    spec = read_document(ROOT / "specs" / "gemma2-2b.yaml").data
    assert not list(spec_schema.iter_errors(spec))
    good = copy.deepcopy(spec)
    good["decoder"]["overrides"].append(
        {"layers": [1], "attention": {"softcap": 30.0}, "ffn": {"hidden_dim": 64}, "norm": {"eps": 1.0e-5}}
    )
    assert [e.message for e in spec_schema.iter_errors(good)] == []
    for field, typo in (("attention", {"sliding_windw": 4096}), ("ffn", {"hiden_dim": 64}), ("norm", {"epsilon": 1.0})):
        bad = copy.deepcopy(spec)
        bad["decoder"]["overrides"][0][field] = typo
        assert list(spec_schema.iter_errors(bad)), (field, typo)
    bad = copy.deepcopy(spec)
    bad["decoder"]["overrides"][0]["ffn"] = {
        "type": "moe",
        "n_experts": 4,
        "top_k": 2,
        "expert": {"type": "glu"},
        "hidden_dim": 8,
    }  # a moe has no hidden_dim of its own
    assert list(spec_schema.iter_errors(bad))
    bad["decoder"]["overrides"][0]["ffn"].pop("hidden_dim")
    assert [e.message for e in spec_schema.iter_errors(bad)] == []
    # the partial schema of a spec that extends another checks its overrides the same way
    child = {"extends": "gemma2-2b", "decoder": {"overrides": [{"layers": "0::2", "attention": {"sliding_windw": 8}}]}}
    assert list(spec_schema.iter_errors(child))
    child["decoder"]["overrides"][0]["attention"] = {"sliding_window": 8}
    assert [e.message for e in spec_schema.iter_errors(child)] == []


def test_recipe_model_section_carries_the_spec_schema(recipe_schema):
    recipe = read_document(ROOT / "recipes" / "lm-stdlib.yaml").data
    assert "vocab_size" not in recipe["model"]["spec"]  # an inline spec leaves it to the tokenizer

    def errors(change):
        data = copy.deepcopy(recipe)
        change(data)
        return [e.message for e in recipe_schema.iter_errors(data)]

    assert (
        errors(
            lambda r: r["model"].update(
                overrides={"decoder": {"n_layers": 2, "attention": {"n_kv_heads": 1}}, "decoder.ffn.hidden_dim": 64}
            )
        )
        == []
    )
    assert errors(lambda r: r["model"].update(overrides={"decoder": {"n_layer": 2}}))
    assert errors(lambda r: r["model"].update(overrides={"d_modle": 2}))
    assert errors(lambda r: r["model"]["spec"]["decoder"]["attention"].update(n_kv_head=2))
    assert errors(lambda r: r["model"].update(spec="tiny/llama")) == []
    assert errors(lambda r: r["trainer"].update(max_step=3))
    assert errors(lambda r: r["optimizer"].update(betas=[0.9, 0.95, 0.99]))
    # the optimizer by its type: muon's fields under muon, none of another's; no type is AdamW's
    assert errors(lambda r: r.update(optimizer={"type": "muon", "lr": 0.02, "adamw_lr": 3e-3})) == []
    assert errors(lambda r: r.update(optimizer={"type": "muon", "lrr": 0.02}))
    assert errors(lambda r: r.update(optimizer={"adamw_lr": 3e-3}))
    assert errors(lambda r: r.update(optimizer={"type": "lion"}))
    assert errors(lambda r: r.update(schedule={"type": "wsd", "decay_fraction": 0.2, "decay_shape": "1-sqrt"})) == []
    assert errors(lambda r: r.update(eval={"num_beams": 4}))  # a translation section in an LM recipe


def test_recipe_tasks_pick_their_schema(recipe_schema):
    translation = read_document(ROOT / "recipes" / "translate-multi30k.yaml").data
    translation["eval"]["num_beam"] = 3
    assert [e.message for e in recipe_schema.iter_errors(translation)] == [
        "Additional properties are not allowed ('num_beam' was unexpected)"
    ]
    classify = read_document(ROOT / "recipes" / "classify.yaml").data
    classify["classification"]["pooling"] = "max"
    assert list(recipe_schema.iter_errors(classify))
    child = {"extends": "bert-mlm", "trainer": {"max_steps": 5}}  # partial: the parent has the rest
    assert [e.message for e in recipe_schema.iter_errors(child)] == []
    child["trainer"]["max_step"] = 5
    assert list(recipe_schema.iter_errors(child))


def test_schema_command_prints_the_recipe_schema():
    run = subprocess.run(
        [sys.executable, "-m", "yamlformer.builder.cli", "schema", "--recipe", "--indent", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    schema = json.loads(run.stdout)
    assert schema["title"] == "Transformer builder training recipe" and "InlineModelSpec" in schema["definitions"]


def test_the_spec_schema_takes_a_parametrization(spec_schema):
    spec = read_document(ROOT / "specs" / "tiny" / "llama.yaml").data
    spec.pop("extends", None)
    ok = {**spec, "parametrization": {"type": "mup", "base_d_model": 16, "output_multiplier": 2.0}}
    bad = {**spec, "parametrization": {"type": "mup", "base_dmodel": 16}}
    assert not [e for e in spec_schema.iter_errors(ok) if "parametrization" in str(list(e.absolute_path))]
    assert [e for e in spec_schema.iter_errors(bad) if "parametrization" in str(list(e.absolute_path))]
