"""The optimizer registry and the contract every optimizer config follows (torch-free).

A config subclasses :class:`OptimizerConfig`, has ``type: Literal["name"] = "name"`` and
registers with :func:`register` (into :data:`OPTIMIZERS`, a ``yamlformer.blocks.registrable.Registry``
as every registered kind is); the built-in ones as ``yamlformer.builder.optim`` loads; a package
adds its own through the ``yamlformer.optimizers`` entry-point group (``yamlformer.builder.spec.plugins``
loads it with the blocks'), or ``--plugin``. A recipe's ``optimizer:`` is validated as the registered
config its ``type`` names (``adamw`` when left out: :func:`optimizer_field`), so a plugin's joins at
once. The torch optimizer each type builds is registered by the recipes
(``yamlformer.recipes.optim.implements``): this layer names none.
"""

from __future__ import annotations

import dataclasses
import difflib
from abc import abstractmethod
from collections.abc import Iterable
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, SerializeAsAny, ValidationError, WithJsonSchema

from yamlformer.blocks.configs.base import first_error, rule_error
from yamlformer.blocks.configs.tensors import TensorScaling
from yamlformer.blocks.registrable import Registry, RegistryError

#: packages add optimizers here: ``[project.entry-points."yamlformer.optimizers"]``
GROUP = "yamlformer.optimizers"
#: what a recipe trains with when its ``optimizer:`` names no type (every recipe before types)
DEFAULT = "adamw"

Loc = tuple[str | int, ...]


class OptimizerError(RegistryError):
    """An optimizer registration that cannot be accepted, or an unknown type name."""


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """What an optimizer keeps for one parameter tensor: bytes per element (AdamW's two fp32
    moments: 8) and per tensor (AdamW's fp32 step: 4)."""

    per_element: int
    per_tensor: int = 0


@dataclasses.dataclass(frozen=True)
class Trainable:
    """A parameter an optimizer trains, as its group rules see it: its name, shape, what the
    spec's parametrization makes of it (role and width ratios), and whether it is an embedding
    table (which AdamW and SGD leave undecayed unless ``decay_embeddings``) and whether the spec
    creates it (an adapter's is not declared by any block)."""

    name: str
    shape: tuple[int, ...]
    scaling: TensorScaling
    table: bool = False
    in_spec: bool = True  # a tensor the spec creates (not an adapter's or another addition's)

    @property
    def role(self) -> str | None:
        return self.scaling.role


@dataclasses.dataclass
class Group:
    """One torch parameter group: its settings (``lr``, ``weight_decay`` and the optimizer's own
    keys) and the indices of its members among the trainables given."""

    settings: dict[str, Any]
    members: list[int] = dataclasses.field(default_factory=list)


def grouped(
    keys: Iterable[tuple[int, dict[str, Any]]], always: Iterable[tuple[int, dict[str, Any]]] = ()
) -> list[Group]:
    """Groups from each trainable's ``(order, settings)``: one group per distinct settings, ordered
    by ``order`` then first appearance; ``always``: groups that exist even when empty (a
    checkpoint's optimizer state is by group and position)."""
    found: dict[tuple, tuple[int, int, Group]] = {}

    def group_of(order: int, settings: dict[str, Any]) -> Group:
        key = (order, *sorted(settings.items()))  # groups of another order stay apart even when alike
        if key not in found:
            found[key] = (order, len(found), Group(dict(settings)))
        return found[key][2]

    for order, settings in always:
        group_of(order, settings)
    for index, (order, settings) in enumerate(keys):
        group_of(order, settings).members.append(index)
    return [group for _, _, group in sorted(found.values(), key=lambda item: item[:2])]


class OptimizerConfig(BaseModel):
    """An optimizer: its recipe fields and what generic code asks of it."""

    model_config = ConfigDict(extra="forbid", validate_default=True, strict=True, allow_inf_nan=False)

    @abstractmethod
    def groups(self, params: list[Trainable]) -> list[Group]:
        """Which group each trainable goes in, and each group's settings (its learning rate with
        the parametrization's multiplier, its weight decay, the optimizer's own keys)."""

    @abstractmethod
    def state(self, role: str | None, ndim: int) -> StateBytes:
        """What it keeps for a tensor of ``role`` (``yamlformer.blocks.configs.tensors``; None: undeclared)
        and ``ndim`` dims, in fp32 bytes."""

    @property
    @abstractmethod
    def peak_lr(self) -> float:
        """The learning rate the schedule's ``min_lr`` is a share of (the main group's)."""

    def problems(self, params: list[Trainable]) -> list[tuple[Loc, str]]:
        """Why it cannot train these parameters: ``(field path within the section, message)``."""
        return []

    def describe(self) -> str:
        """One line for reports: its type and learning rate."""
        return f"{getattr(self, 'type', type(self).__name__)} lr {self.peak_lr:g}"


#: every optimizer config by type name (filled by :func:`register`)
OPTIMIZERS: Registry[type[OptimizerConfig]] = Registry("optimizer", error=OptimizerError, contract=OptimizerConfig)


def register(cls: type[OptimizerConfig]) -> type[OptimizerConfig]:
    """Class decorator: register an optimizer config under its ``type``."""
    return OPTIMIZERS.register_class(cls)


def optimizer_configs() -> dict[str, type[OptimizerConfig]]:
    """Every registered optimizer config by type name."""
    return OPTIMIZERS.entries()


def config_class(name: str) -> type[OptimizerConfig]:
    return OPTIMIZERS.get(name)


def optimizer_named(optimizer: OptimizerConfig | str | None = None) -> OptimizerConfig:
    """An optimizer config: ``optimizer`` itself, or a type name's with its defaults (None: AdamW)."""
    if isinstance(optimizer, OptimizerConfig):
        return optimizer
    return config_class(optimizer or DEFAULT)()


def optimizer_state_bytes(tensors: Iterable[tuple[int, str | None, int, int]], optimizer=None) -> int:
    """The bytes ``optimizer`` (a config or a type name; None: AdamW) keeps for ``tensors``: each
    ``(elements held, role, ndim, how many tensors)``, a group of alike tensors or one. The one
    count the memory estimate, the per-rank shards and the planner read."""
    optimizer = optimizer_named(optimizer)
    total = 0
    for elements, role, ndim, count in tensors:
        state = optimizer.state(role, ndim)
        total += elements * state.per_element + count * state.per_tensor
    return total


def optimizer_field(description: str):
    """The type of a recipe's ``optimizer:`` field: a mapping validated as the registered optimizer
    its ``type`` names (:data:`DEFAULT` when left out), among those registered when it is
    validated (a plugin's too); dumped with its own fields. A problem inside it is one located
    error at the field it names."""

    def validate(value: Any) -> Any:
        if isinstance(value, OptimizerConfig) or not isinstance(value, dict):
            return value
        name = value.get("type", DEFAULT)
        if not isinstance(name, str):
            raise rule_error(("type",), "optimizer type must be a string naming a registered optimizer")
        try:
            cls = config_class(name)
        except OptimizerError as exc:
            raise rule_error(("type",), str(exc)) from None
        try:
            return cls.model_validate({**value, "type": name})
        except ValidationError as exc:
            raise _with_suggestion(exc, cls) from None

    schema = {"type": "object", "description": description}
    return Annotated[SerializeAsAny[OptimizerConfig], BeforeValidator(validate), WithJsonSchema(schema)]


def _with_suggestion(exc: ValidationError, cls: type[OptimizerConfig]):
    """The first error, located; an unknown key with the closest of the config's fields."""
    error = first_error(exc)
    first = exc.errors()[0]
    if first["type"] == "extra_forbidden":
        close = difflib.get_close_matches(str(first["loc"][-1]), list(cls.model_fields), n=2)
        if close:
            hint = " or ".join(repr(c) for c in close)
            loc = tuple(first["loc"])
            return rule_error(loc, f"unknown key {loc[-1]!r}; did you mean {hint}?")
    return error


def optimizer_schemas() -> tuple[dict[str, Any], dict[str, Any]]:
    """``(definitions, the schema of an optimizer: section)``: each registered config's schema, and
    one of them by ``type``, which only the default may leave out."""
    # local: pydantic's JSON Schema machinery loads only when a schema is printed (builder validate starts without it)
    from pydantic.json_schema import models_json_schema

    classes = optimizer_configs()
    _, top = models_json_schema([(cls, "validation") for cls in classes.values()], ref_template="#/$defs/{model}")
    defs = top["$defs"]
    for name, cls in classes.items():
        if name != DEFAULT:
            schema = defs[cls.__name__]
            schema["required"] = sorted({*schema.get("required", []), "type"})
    union = {
        "oneOf": [{"$ref": f"#/$defs/{cls.__name__}"} for cls in classes.values()],
        "description": f"The optimizer, by its `type` ({DEFAULT} when left out).",
    }
    return defs, union
