"""The torch optimizer each registered optimizer type builds, registered by the module that
builds it (``@implements("muon")``): the optimizer's config (``yamlformer.builder.optim``, torch-free)
names no module of this layer, and :func:`yamlformer.recipes.optim.build_optimizer` asks
:func:`implementation` alone. A plugin's optimizer registers its builder the same way, in a module
its ``yamlformer.optimizers`` entry point (or ``--plugin``) imports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from yamlformer.blocks.registrable import Registry, RegistryError, type_name
from yamlformer.recipes.errors import RecipeError

#: ``builder(config, groups)`` -> the torch optimizer for groups of ``{"params": [...], **settings}``
Builder = Callable[[Any, list[dict]], Any]

#: each optimizer type's builder, by the type name its config answers to
IMPLEMENTATIONS: Registry[Builder] = Registry("optimizer implementation")


def implements(name: str) -> Callable[[Builder], Builder]:
    """Decorator: ``builder`` builds the torch optimizer of the optimizer type ``name``."""
    return IMPLEMENTATIONS.register(name)


def implementation(optimizer) -> Builder:
    """The builder registered for ``optimizer``'s type (a config of ``yamlformer.builder.optim``)."""
    name = type_name(type(optimizer))
    try:
        return IMPLEMENTATIONS.get(name)
    except RegistryError as exc:
        raise RecipeError(
            f"{exc}: the optimizer {name!r} has no torch side; register one with "
            f"@yamlformer.recipes.optim.implements({name!r}) in a module its plugin imports"
        ) from None
