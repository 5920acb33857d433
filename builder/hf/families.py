"""The family registry: every Hugging Face ``model_type`` we read and write, and the checks a
converted spec passes (``validate``). A family is a table in one of the modules ``MODULES``
lists (:mod:`yamlformer.builder.hf.decoders`, :mod:`yamlformer.builder.hf.qwen`,
:mod:`yamlformer.builder.hf.deepseek`...); adding one is adding it to that module's ``FAMILIES``
list (a new module is also added to ``MODULES``)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from yamlformer.builder.hf import decoders, deepseek, encoders, gemma3, gpt_oss, llama4, mpt, neox, olmo, phi3, qwen
from yamlformer.builder.hf.common import Family, HFError, Unsupported
from yamlformer.builder.spec.schema import SpecRuleError, spec_model

#: every family module, in the order export tries them
MODULES = (decoders, qwen, olmo, gemma3, gpt_oss, llama4, mpt, neox, phi3, deepseek, encoders)
FAMILIES: dict[str, Family] = {f.model_type: f for module in MODULES for f in module.FAMILIES}

#: what a transformers model_type looks like (``gpt2``, ``gpt_neox``, ``xlm-roberta``)
_FAMILY_NAME = re.compile(r"[a-z][a-z0-9_-]{0,39}")

#: config.json keys that are not architecture and travel unchanged through import and export
TOKEN_KEYS = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "forced_eos_token_id",
)


def supported_families() -> str:
    return "\n".join(f"  {name:8} {family.description}" for name, family in FAMILIES.items())


def family_of(config: Mapping, path: str | Path = "config.json") -> Family:
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        # a family's name is shown when it is shaped like one (transformers' model types are
        # lower-case identifiers); other text of the file is not printed
        shown = (
            repr(model_type)
            if isinstance(model_type, str) and _FAMILY_NAME.fullmatch(model_type)
            else ("(absent)" if model_type is None else "(not a family name)")
        )
        raise Unsupported(f"{path}: model_type {shown} is not supported; supported families:\n{supported_families()}")
    return FAMILIES[model_type]


def validate(spec_dict: Mapping, config: Mapping | None = None, source: str | Path = "the converted spec"):
    """The validated ``ModelSpec`` of a spec dict, or a one-line :class:`HFError`: the first
    problem, named by the ``config`` key that gave the value when one did."""

    try:
        return spec_model().model_validate(dict(spec_dict))
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0]
        field = ".".join(map(str, first["loc"]))
        keys = _keys_with_value(config or {}, first.get("input"))
        where = f"{' or '.join(keys)} (the spec's {field})" if keys else field
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        raise HFError(f"{source}: {where}: {first['msg']}{more}") from None
    except SpecRuleError as exc:
        raise HFError(f"{source}: {' '.join(str(exc).split())}") from None


def _keys_with_value(config: Mapping, value: Any) -> list[str]:
    """The config keys holding ``value`` (same type; booleans apart): who set a bad field."""
    if value is None or isinstance(value, (dict, list)):
        return []
    return [k for k, v in config.items() if type(v) is type(value) and v == value]
