"""One registry for every registered kind (torch-free; imports nothing of the project).

A :class:`Registry` maps the names a YAML file or a run may give to what is registered under
them: the config classes of one block kind (``yamlformer.blocks.registry``), the optimizer configs
(``yamlformer.builder.optim``), the torch builder of each optimizer (``yamlformer.recipes.optim``).
It refuses a second registration under a taken name and a lookup of a name it does not hold,
with one message each, checks a registered class against the kind's contract (a subclass of
its base with every abstract method implemented and a ``type`` literal), and counts its changes,
so a cached schema knows to rebuild. OLMo-core's ``Registrable`` (``dataclass_extensions``) is the
model: ``OptimConfig.register("adamw")`` on a base class whose subclasses are looked up by name.
Here the registry is a value beside its base rather than the base itself, since a block kind's
base is declared after its registry (``yamlformer.blocks.configs`` imports the registry, never the
other way round) and a registry need not hold classes (an optimizer's torch builder is a function).
A layer registers what it owns into a registry of a layer below it (the recipes register the torch
side of the builder's optimizers), so no lower layer names an upper module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class RegistryError(ValueError):
    """A registration that cannot be accepted (a taken name, a broken contract), or an unknown name."""


def type_name(cls) -> str:
    """The YAML ``type`` string a config class answers to (its ``type`` field's default)."""
    field = getattr(cls, "model_fields", {}).get("type")
    if field is None or not isinstance(field.default, str):
        raise RegistryError(f"{cls.__qualname__} needs a field `type: Literal['name'] = 'name'`")
    return field.default


def _where(entry: Any) -> str:
    return f"{getattr(entry, '__module__', '?')}.{getattr(entry, '__qualname__', repr(entry))}"


class Registry(Generic[T]):
    """The entries of one registered kind, by name.

    ``what`` names the kind in messages (``"norm block"``, ``"optimizer"``); ``error`` is the
    exception its refusals raise (a :class:`RegistryError`); ``contract``, when set, is the base
    class every entry subclasses (:meth:`register_class` checks it), and ``docs`` where a user reads
    how to implement it."""

    def __init__(
        self, what: str, *, error: type[RegistryError] = RegistryError, contract: type | None = None, docs: str = ""
    ):
        self.what = what
        self.error = error
        self.contract = contract
        self.docs = docs
        self._entries: dict[str, T] = {}
        self.changes = 0  # bumped on every registration

    def add(self, name: str, entry: T) -> T:
        """Register ``entry`` under ``name`` (the same entry again is a no-op)."""
        existing = self._entries.get(name)
        if existing is not None and existing is not entry:
            raise self.error(
                f"{self.what} {name!r} is already registered by {_where(existing)}; pick another type name"
            )
        self._entries[name] = entry
        self.changes += 1
        return entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register what it decorates under ``name``."""
        return lambda entry: self.add(name, entry)

    def register_class(self, cls: T) -> T:
        """Register a config class under its ``type`` literal, after checking it against the
        contract: a subclass of it, with every abstract method implemented."""
        base = self.contract
        if base is not None and not (isinstance(cls, type) and issubclass(cls, base)):
            raise self.error(
                f"{getattr(cls, '__qualname__', cls)} must subclass {base.__module__}.{base.__name__} "
                f"to be registered as {_article(self.what)} {self.what}"
            )
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        if missing:
            raise self.error(
                f"{cls.__qualname__} leaves {', '.join(missing)} of {base.__name__ if base else 'its base'} "
                f"unimplemented{'; see ' + self.docs if self.docs else ''}"
            )
        try:
            name = type_name(cls)
        except RegistryError as exc:
            raise self.error(str(exc)) from None
        return self.add(name, cls)

    def get(self, name: str) -> T:
        """The entry registered under ``name``; refuses an unknown one, naming those registered."""
        try:
            return self._entries[name]
        except KeyError:
            registered = ", ".join(sorted(self._entries)) or "none"
            raise self.error(f"no {self.what} named {name!r}; registered: {registered}") from None

    def entries(self) -> dict[str, T]:
        """Every entry by name, in registration order (a copy)."""
        return dict(self._entries)

    def copy(self) -> Registry[T]:
        """A registry holding the same entries (a test's own, to register into and drop)."""
        twin = Registry(self.what, error=self.error, contract=self.contract, docs=self.docs)
        twin._entries, twin.changes = dict(self._entries), self.changes
        return twin

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def _article(what: str) -> str:
    return "an" if what[:1] in "aeiou" else "a"
