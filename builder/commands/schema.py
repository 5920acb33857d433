"""``builder schema``: the JSON Schema of a spec, for editors' YAML language servers.

Save it with ``builder schema > spec.schema.json`` and put
``# yaml-language-server: $schema=spec.schema.json`` (a path relative to the YAML file, or a URL)
on the first line of a spec. The schema follows the registry, plugins included (``--plugin``).

Pydantic's schema is adjusted where it would reject a valid spec:
- a block mapping may leave out ``type`` only for the kind's default block (``ffn`` is ``mlp``,
  ``norm`` ``layernorm``, ``attention`` ``multi_head``); every other member requires ``type``,
  so exactly one member of each ``oneOf`` matches;
- a spec with ``extends:`` is checked against a partial schema (nothing required, since its
  parent provides the rest).
"""

from __future__ import annotations

import argparse
import copy
import json
from typing import Any

from builder.commands.arguments import count
from builder.commands.common import add_spec_options

DRAFT = "https://json-schema.org/draft/2020-12/schema"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--indent", type=count(minimum=0, maximum=16), default=2,
                        help="JSON indentation, 0 to 16 (default 2)")
    add_spec_options(parser)


def run(args: argparse.Namespace) -> int:
    from builder.commands.common import load_plugins_from_args
    from builder.plugins import PluginError

    try:
        load_plugins_from_args(args)
    except PluginError as exc:
        print(f"error: {exc}")
        return 1
    print(json.dumps(spec_json_schema(), indent=args.indent))
    return 0


def spec_json_schema() -> dict[str, Any]:
    """The JSON Schema of a spec file, as YAML language servers and ``jsonschema`` read it."""
    from blocks import registry
    from builder.schema import DEFAULT_TYPES, spec_model

    full = spec_model().model_json_schema()
    defs = full.pop("$defs")
    defaults = {
        cls.__name__: name == DEFAULT_TYPES.get(kind)
        for kind in registry.KINDS
        for name, cls in registry.configs(kind).items()
    }
    _require_types(full, defaults)
    _require_types(defs, defaults)
    full_def = dict(full)
    partial = {f"{name}Partial": _partial(schema) for name, schema in {**defs, "ModelSpec": full_def}.items()}
    return {
        "$schema": DRAFT,
        "title": "Transformer builder spec",
        "description": full_def.get("description", ""),
        "type": "object",
        "if": {"required": ["extends"]},
        "then": {"$ref": "#/$defs/ModelSpecPartial"},
        "else": {"$ref": "#/$defs/ModelSpec"},
        "$defs": {**defs, "ModelSpec": full_def, **partial},
    }


def _require_types(node: Any, defaults: dict[str, bool]) -> None:
    """In each ``oneOf`` of blocks, require ``type`` except on the kind's default member."""
    if isinstance(node, list):
        for item in node:
            _require_types(item, defaults)
        return
    if not isinstance(node, dict):
        return
    members = node.get("oneOf")
    if isinstance(members, list) and all(isinstance(m, dict) and "$ref" in m for m in members):
        explicit = "discriminator" in node  # a plain `Field(discriminator="type")`: always required
        wrapped = []
        for member in members:
            name = member["$ref"].rsplit("/", 1)[-1]
            optional = not explicit and defaults.get(name, False)
            wrapped.append(member if optional else {"allOf": [member], "required": ["type"]})
        node["oneOf"] = wrapped
        node.pop("discriminator", None)
    for value in node.values():
        _require_types(value, defaults)


def _partial(schema: Any) -> Any:
    """The same schema with nothing required and refs to partial definitions (for ``extends:``)."""
    if isinstance(schema, list):
        return [_partial(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "required":
            continue
        if key == "$ref" and isinstance(value, str) and value.startswith("#/$defs/"):
            out[key] = value + "Partial"
        elif key == "oneOf":  # with fields left out, more than one block may match
            out["anyOf"] = _partial(value)
        else:
            out[key] = _partial(copy.deepcopy(value))
    return out
