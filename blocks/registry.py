"""The block registry: every block kind maps YAML ``type`` strings to config classes.

This module is torch-free on purpose. A config class (pydantic) describes one block, counts its
own parameters and FLOPs, and names the ``nn.Module`` that builds it by import path, so
validating and sizing a spec never imports torch. A config subclasses its kind's contract
(``yamlformer.blocks.configs.base.KIND_BASES``: what generic code may ask of it, declared here as
that module loads) and implements every abstract method; :func:`register` refuses one that does
not. Blocks register with :func:`register`: the built-in ones as ``yamlformer.blocks.configs``
loads (the spec's schema imports it, and so does anything that asks the registry through
builder), user packages' through the ``yamlformer.blocks`` entry-point group or ``--plugin``
(see ``yamlformer.builder.spec.plugins``), and they become part of the schema automatically.
This module imports nothing of the project: the configs import it, never the other way round.
"""

from __future__ import annotations

import importlib
from typing import Any

#: block kinds; "architecture" is the spec's ``architecture:`` (which stacks of layers a model has),
#: "adapter" its ``adapters:`` (what fine-tuning adds to linear layers, ``yamlformer.blocks.linear``)
KINDS = ("attention", "position", "ffn", "norm", "head", "architecture", "adapter")
#: the type a block mapping takes when its ``type`` key is left out, by block kind
DEFAULT_TYPES = {"attention": "multi_head", "ffn": "mlp", "norm": "layernorm"}

_REGISTRY: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS}
_CONTRACTS: dict[str, type] = {}  # kind -> the base class its configs subclass (declare_contracts)
_VERSION = [0]  # bumped on every registration so cached schemas know to rebuild


class RegistryError(ValueError):
    """A block registration that cannot be accepted (unknown kind, duplicate name)."""


def register(kind: str, module: str):
    """Class decorator: register a config class under ``kind`` and its ``type`` literal.

    ``module`` is ``"package.module:ClassName"``, the ``nn.Module`` built from the config.
    """
    if kind not in KINDS:
        raise RegistryError(f"unknown block kind {kind!r}; kinds are {', '.join(KINDS)}")

    def decorate(cls):
        _check_contract(kind, cls)
        name = type_name(cls)
        existing = _REGISTRY[kind].get(name)
        if existing is not None and existing is not cls:
            raise RegistryError(
                f"{kind} block {name!r} is already registered by "
                f"{existing.__module__}.{existing.__qualname__}; pick another type name"
            )
        cls.kind = kind
        cls.module_path = module
        _REGISTRY[kind][name] = cls
        _VERSION[0] += 1
        return cls

    return decorate


def declare_contracts(bases: dict[str, type]) -> None:
    """The contract of each kind (``yamlformer.blocks.configs.base.KIND_BASES``, which declares
    them as it loads: this module imports no config)."""
    _CONTRACTS.update(bases)


def _check_contract(kind: str, cls) -> None:
    base = _CONTRACTS[kind]  # declared: every config class subclasses one, so its module is loaded
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise RegistryError(
            f"{getattr(cls, '__qualname__', cls)} must subclass yamlformer.blocks.configs.base.{base.__name__} "
            f"to be registered as a {kind} block"
        )
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise RegistryError(
            f"{cls.__qualname__} leaves {', '.join(missing)} of {base.__name__} unimplemented; see blocks/README.md"
        )


def type_name(cls) -> str:
    """The YAML ``type`` string a config class answers to (its ``type`` field's default)."""
    field = getattr(cls, "model_fields", {}).get("type")
    if field is None or not isinstance(field.default, str):
        raise RegistryError(f"{cls.__qualname__} needs a field `type: Literal['name'] = 'name'`")
    return field.default


def configs(kind: str) -> dict[str, Any]:
    """The registered config classes of one kind, by type name."""
    _loaded()
    return dict(_REGISTRY[kind])


def config_class(kind: str, name: str):
    _loaded()
    try:
        return _REGISTRY[kind][name]
    except KeyError:
        raise RegistryError(
            f"no {kind} block named {name!r}; registered: {', '.join(sorted(_REGISTRY[kind]))}"
        ) from None


def module_class(config) -> type:
    """Import and return the ``nn.Module`` class that builds ``config`` (imports torch)."""
    path = type(config).module_path
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def version() -> int:
    return _VERSION[0]


def _loaded() -> None:
    """Refuse a lookup before any config is loaded (the built-in ones are
    ``yamlformer.blocks.configs``, which declares the contracts as it loads)."""
    if not _CONTRACTS:
        raise RegistryError(
            "no block configs are loaded: import yamlformer.blocks.configs (the spec schema, "
            "yamlformer.builder.spec.schema, does) before asking the registry"
        )
