"""The JSON Schema (draft-07) of a recipe file, every task's, with the spec's inside ``model``.
Torch-free; ``builder schema --recipe`` prints it.

A recipe's ``task`` picks its schema (``lm`` when left out). ``model.spec`` is a file, a zoo
name, or an inline spec (the spec schema less ``vocab_size``, which the tokenizer sets);
``model.overrides`` takes the spec's fields, every one optional and checked as in a spec, or
dotted keys (``decoder.n_layers: 2``). A recipe with ``extends:`` is checked against partial
schemas, as a spec is.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic.json_schema import models_json_schema

from yamlformer.builder.optim.registry import optimizer_schemas
from yamlformer.builder.spec.json_schema import draft7, partial, spec_definitions
from yamlformer.recipes.tasks import NAMES, recipe_class

#: a dotted key of ``model.overrides`` (``decoder.attention.n_kv_heads``): not checked by the schema
DOTTED_KEY = r"^[^.]+(\.[^.]+)+$"


def recipe_json_schema() -> dict[str, Any]:
    """The recipe schema: every task's, the spec's definitions included."""
    classes = {task: recipe_class(task) for task in NAMES}
    _, top = models_json_schema([(cls, "validation") for cls in classes.values()], ref_template="#/$defs/{model}")
    recipe_defs = top["$defs"]
    defs = spec_definitions()
    taken = set(recipe_defs) & set(defs)
    if taken:
        raise ValueError(f"recipe and spec schemas both define {sorted(taken)}")

    inline = copy.deepcopy(defs["ModelSpec"])
    inline["properties"].pop("extends", None)
    inline["required"] = [name for name in inline.get("required", []) if name != "vocab_size"]
    inline["description"] = "An inline spec (it cannot extend); vocab_size is set by the tokenizer."
    overrides = copy.deepcopy(defs["ModelSpecPartial"])
    overrides["properties"].pop("extends", None)
    overrides["patternProperties"] = {DOTTED_KEY: {}}
    overrides["description"] = (
        "Spec fields laid over the spec as extends: merges them (every field optional), "
        "or dotted keys (decoder.n_layers: 2)."
    )
    added = {"InlineModelSpec": inline, "ModelOverrides": overrides}

    section = recipe_defs["ModelSection"]["properties"]
    section["spec"] = {
        "anyOf": [
            {"type": "string", "description": "A spec file (relative to the recipe) or a zoo name (`builder list`)."},
            {"$ref": "#/$defs/InlineModelSpec"},
        ],
        "description": section["spec"].get("description", ""),
    }
    section["overrides"] = {
        "$ref": "#/$defs/ModelOverrides",
        "description": section["overrides"].get("description", ""),
    }
    optimizers, optimizer = optimizer_schemas()  # every registered kind, by its type
    taken = set(optimizers) & (set(defs) | set(recipe_defs))
    if taken:
        raise ValueError(f"optimizer and recipe schemas both define {sorted(taken)}")
    recipe_defs.update(optimizers, Optimizer=optimizer)
    for cls in classes.values():
        recipe_defs[cls.__name__]["properties"]["optimizer"] = {"$ref": "#/$defs/Optimizer"}
    precision = recipe_defs["TrainerSection"]["properties"]["precision"]
    precision["enum"] = [*precision["enum"], 32]  # `precision: 32` is read as "32"
    precision.pop("type", None)
    for cls in classes.values():
        recipe_defs[cls.__name__]["properties"]["extends"] = {
            "type": "string",
            "description": "A recipe this one overrides (a path relative to this file, or a zoo name).",
        }

    combined = {**defs, **recipe_defs, **added}
    for name in [*recipe_defs, *added]:
        combined[f"{name}Partial"] = partial(combined[name])

    def by_task(suffix: str) -> dict:
        node: dict = {"$ref": f"#/$defs/{classes['lm'].__name__}{suffix}"}
        for task, cls in reversed([(t, c) for t, c in classes.items() if t != "lm"]):
            node = {
                "if": {"properties": {"task": {"const": task}}, "required": ["task"]},
                "then": {"$ref": f"#/$defs/{cls.__name__}{suffix}"},
                "else": node,
            }
        return node

    return draft7(
        {
            "title": "Transformer builder training recipe",
            "description": "A training recipe; its task (lm when left out) picks its schema.",
            "type": "object",
            "if": {"required": ["extends"]},
            "then": by_task("Partial"),
            "else": by_task(""),
            "$defs": combined,
        }
    )
