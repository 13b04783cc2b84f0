"""Name -> function registries: the trainer's estimators, bonus variants, loss modes and KL
kinds, and the generation backends a worker builds by name (:mod:`workers.engines.registry`).

Callers resolve a configured name once through a registry instead of branching on it. A
registry refuses to register a name twice, so two modules cannot silently replace each other's
entry, and an unknown name fails with the list of known ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Registry"]

F = TypeVar("F", bound=Callable[..., object])


class Registry(Generic[F]):
    """A named collection of functions that share one signature.

    ``kind`` is what the entries are (``"EGPO variant"``, ``"loss_agg_mode"``); it appears in
    error messages so that a bad configuration value is easy to trace.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, *names: str) -> Callable[[F], F]:
        """Decorator registering the function under each of ``names`` (aliases allowed).

        Raises ValueError when no name is given, a name is not a non-empty string, or a name is
        already registered.
        """
        if not names:
            raise ValueError(f"register() for {self.kind} needs at least one name")
        for name in names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
        if len(set(names)) != len(names):
            raise ValueError(f"{self.kind} names repeat within one registration: {names!r}")

        def decorator(fn: F) -> F:
            for name in names:
                if name in self._entries:
                    raise ValueError(f"{self.kind} {name!r} is already registered")
            for name in names:
                self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """The function registered as ``name``; ValueError naming the known names otherwise."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            known = ", ".join(sorted(self._entries))
            raise ValueError(f"unknown {self.kind} {name!r}; known: {known}") from None

    def names(self) -> tuple[str, ...]:
        """All registered names, sorted."""
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)
