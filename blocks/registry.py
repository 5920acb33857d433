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

from yamlformer.blocks.registrable import Registry, RegistryError, type_name

#: block kinds; "architecture" is the spec's ``architecture:`` (which stacks of layers a model has),
#: "adapter" its ``adapters:`` (what fine-tuning adds to linear layers, ``yamlformer.blocks.linear``)
KINDS = ("attention", "position", "ffn", "norm", "head", "architecture", "adapter")
#: the type a block mapping takes when its ``type`` key is left out, by block kind
DEFAULT_TYPES = {"attention": "multi_head", "ffn": "mlp", "norm": "layernorm"}

#: each kind's configs by type name; a kind's contract (the base its configs subclass) is declared
#: by ``yamlformer.blocks.configs`` as it loads (:func:`declare_contracts`)
REGISTRIES: dict[str, Registry[Any]] = {kind: Registry(f"{kind} block", docs="blocks/README.md") for kind in KINDS}

__all__ = [
    "DEFAULT_TYPES",
    "KINDS",
    "REGISTRIES",
    "RegistryError",
    "config_class",
    "configs",
    "declare_contracts",
    "module_class",
    "register",
    "type_name",
    "version",
]


def register(kind: str, module: str):
    """Class decorator: register a config class under ``kind`` and its ``type`` literal.

    ``module`` is ``"package.module:ClassName"``, the ``nn.Module`` built from the config.
    """
    if kind not in KINDS:
        raise RegistryError(f"unknown block kind {kind!r}; kinds are {', '.join(KINDS)}")

    def decorate(cls):
        if REGISTRIES[kind].contract is None:  # declared by the module defining the kind's base
            raise RegistryError(f"no {kind} contract is declared yet: import yamlformer.blocks.configs first")
        REGISTRIES[kind].register_class(cls)
        cls.kind = kind
        cls.module_path = module
        return cls

    return decorate


def declare_contracts(bases: dict[str, type]) -> None:
    """The contract of each kind (``yamlformer.blocks.configs.base.KIND_BASES``, which declares
    them as it loads: this module imports no config)."""
    for kind, base in bases.items():
        REGISTRIES[kind].contract = base


def configs(kind: str) -> dict[str, Any]:
    """The registered config classes of one kind, by type name."""
    _loaded()
    return REGISTRIES[kind].entries()


def config_class(kind: str, name: str):
    _loaded()
    return REGISTRIES[kind].get(name)


def module_class(config) -> type:
    """Import and return the ``nn.Module`` class that builds ``config`` (imports torch)."""
    path = type(config).module_path
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def version() -> int:
    """Changes to any kind's registry so far (a cached schema rebuilds when it moves)."""
    return sum(registry.changes for registry in REGISTRIES.values())


def _loaded() -> None:
    """Refuse a lookup before any config is loaded (the built-in ones are
    ``yamlformer.blocks.configs``, which declares the contracts as it loads)."""
    if all(registry.contract is None for registry in REGISTRIES.values()):
        raise RegistryError(
            "no block configs are loaded: import yamlformer.blocks.configs (the spec schema, "
            "yamlformer.builder.spec.schema, does) before asking the registry"
        )
