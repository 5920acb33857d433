"""JSON Schemas of specs (and the pieces recipes build theirs from), in draft-07.

Editors read them through yaml-language-server (``# yaml-language-server: $schema=...`` on a
file's first line), which validates draft-07 fully and newer drafts only in part; pydantic
emits draft 2020-12, so :func:`draft7` converts: ``$defs`` -> ``definitions`` (and every
``$ref``), ``prefixItems`` -> ``items`` as a list, ``dependentRequired`` -> ``dependencies``,
and a ``$ref`` with sibling keywords (ignored beside ``$ref`` before 2019-09) wrapped in
``allOf``. The spec schema follows the registry, plugins included.

Pydantic's schema is adjusted where it would reject a valid spec or accept a wrong one:
- a block mapping may leave out ``type`` only for the kind's default block (``ffn`` is ``mlp``,
  ``norm`` ``layernorm``, ``attention`` ``multi_head``); every other member requires ``type``,
  so exactly one member of each ``oneOf`` matches;
- a spec with ``extends:`` is checked against a partial schema (nothing required, since its
  parent provides the rest): each definition ``X`` has an ``XPartial``;
- a per-layer ``overrides`` entry's blocks are merged over the stack's, so each takes the
  partial schema of every block of its kind (every field optional, unknown keys refused):
  editors complete inside them and flag a typo.
"""

from __future__ import annotations

import copy
from typing import Any

DRAFT = "http://json-schema.org/draft-07/schema#"
#: keywords of drafts after 07 that :func:`draft7` must have converted (none may remain)
NEWER_KEYWORDS = frozenset(
    {
        "$defs",
        "prefixItems",
        "dependentRequired",
        "dependentSchemas",
        "unevaluatedProperties",
        "unevaluatedItems",
        "$anchor",
        "$dynamicRef",
        "$dynamicAnchor",
        "minContains",
        "maxContains",
        "$recursiveRef",
    }
)


def spec_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft-07) of a spec file, as YAML language servers and ``jsonschema`` read it."""
    defs = spec_definitions()
    return draft7(
        {
            "title": "Transformer builder spec",
            "description": defs["ModelSpec"].get("description", ""),
            "type": "object",
            "if": {"required": ["extends"]},
            "then": {"$ref": "#/$defs/ModelSpecPartial"},
            "else": {"$ref": "#/$defs/ModelSpec"},
            "$defs": defs,
        }
    )


def spec_definitions() -> dict[str, Any]:
    """Every definition of the spec schema (2020-12 refs, ``#/$defs/...``): ``ModelSpec``, its
    sections and blocks, and each one's ``...Partial`` (nothing required)."""
    # local: builder --help loads this module; the registry loads when a JSON Schema is made
    from yamlformer.blocks import registry

    # local: builder validate loads this module; the spec schema loads when a JSON Schema is made
    from yamlformer.builder.spec.schema import DEFAULT_TYPES, spec_model

    full = spec_model().model_json_schema()
    defs = full.pop("$defs")
    defaults = {
        cls.__name__: name == DEFAULT_TYPES.get(kind)
        for kind in registry.KINDS
        for name, cls in registry.configs(kind).items()
    }
    _require_types(full, defaults)
    _require_types(defs, defaults)
    defs = {**defs, "ModelSpec": dict(full)}
    defs.update({f"{name}Partial": partial(schema) for name, schema in list(defs.items())})
    for name in ("LayerOverride", "LayerOverridePartial"):
        _override_blocks(defs[name])
    return defs


def _override_blocks(override: dict) -> None:
    """Each block field of a per-layer override: any block of its kind, every field optional."""
    # local: builder --help loads this module; the registry loads when a JSON Schema is made
    from yamlformer.blocks import registry

    # local: builder validate loads this module; the spec schema loads when a JSON Schema is made
    from yamlformer.builder.spec.schema import LAYER_FIELDS

    for field in LAYER_FIELDS:
        kind = "attention" if field == "cross_attention" else field
        here = override["properties"][field]
        members = [{"$ref": f"#/$defs/{cls.__name__}Partial"} for cls in registry.configs(kind).values()]
        override["properties"][field] = {
            "anyOf": [*members, {"type": "null"}],
            **{k: here[k] for k in ("title", "description", "default") if k in here},
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


def partial(schema: Any) -> Any:
    """The same schema with nothing required and refs to partial definitions (for ``extends:``)."""
    if isinstance(schema, list):
        return [partial(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "required":
            continue
        if key == "$ref" and isinstance(value, str) and value.startswith("#/$defs/"):
            out[key] = value if value.endswith("Partial") else value + "Partial"
        elif key == "oneOf":  # with fields left out, more than one block may match
            out["anyOf"] = partial(value)
        else:
            out[key] = partial(copy.deepcopy(value))
    return out


def draft7(schema: dict[str, Any]) -> dict[str, Any]:
    """A draft 2020-12 schema (as pydantic emits it) in draft-07, with ``$schema`` set."""
    out = _draft7(schema)
    if "definitions" in out:  # the definitions last, after what a reader looks at first
        out["definitions"] = out.pop("definitions")
    return {"$schema": DRAFT, **{k: v for k, v in out.items() if k != "$schema"}}


def _draft7(node: Any) -> Any:
    if isinstance(node, list):
        return [_draft7(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties", "$defs", "definitions"):  # names, not keywords
            out["definitions" if key == "$defs" else key] = {name: _draft7(sub) for name, sub in value.items()}
        elif key == "$ref" and isinstance(value, str):
            out[key] = value.replace("#/$defs/", "#/definitions/")
        elif key == "prefixItems":
            out["items"] = _draft7(value)
            if "items" in node:
                out["additionalItems"] = _draft7(node["items"])
        elif key == "items" and "prefixItems" in node:
            continue
        elif key in ("dependentRequired", "dependentSchemas"):
            out.setdefault("dependencies", {}).update(_draft7(value))
        elif key == "discriminator":  # OpenAPI's, not JSON Schema's
            continue
        else:
            out[key] = _draft7(value)
    newer = NEWER_KEYWORDS & out.keys()
    if newer:
        raise ValueError(f"JSON Schema keywords draft-07 has no form of: {sorted(newer)}")
    if "$ref" in out and len(out) > 1:  # draft-07 ignores a $ref's siblings
        ref = out.pop("$ref")
        out["allOf"] = [{"$ref": ref}, *out.get("allOf", [])]
    return out
