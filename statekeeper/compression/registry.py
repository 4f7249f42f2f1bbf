"""Every compression method by the names it answers to. A method class registers itself (`@register`): the
spec names it builds from (`by_name`: "krul-kv@0.4", "expected-merge@0.25"), the session policies it builds
from (`from_config`), and the stored form it restores (`restore_state`). Adding a method is its own file and
its registration; these lookups do not change."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from statekeeper.compression.form import StoredForm

Layers = list[tuple[torch.Tensor, torch.Tensor]]
Restore = Callable[[dict[str, torch.Tensor], StoredForm, int], tuple[Layers, list | None]]


@dataclass(frozen=True, slots=True)
class MethodSpec:
    """One method's part of a name: `<head>[-<option>...][@<own>]`, with what the caller passed besides."""

    text: str
    head: str
    options: tuple[str, ...]
    own: str  # the number after '@' ('' when absent)
    ratio: float = 0.2
    gamma: float = 0.6
    rankings: dict | None = None
    profile: object = None  # a HeadProfile (compression/head_profile.py), for calibrated budgets

    @classmethod
    def parse(cls, text: str, **context) -> MethodSpec:
        base, _, own = text.partition("@")
        head, *options = base.split("-")
        return cls(text, head, tuple(options), own, **context)


_BY_SPEC: dict[str, type] = {}
_BY_POLICY: dict[str, type] = {}
_RESTORES: dict[str, Restore] = {}


def register(cls):
    """Registers a method class by its `spec_names`, `policies` and (if it defines one) its stored form's
    `restore`. Two methods may not claim one name."""
    for table, names in ((_BY_SPEC, cls.spec_names), (_BY_POLICY, cls.policies)):
        for name in names:
            if name in table and table[name] is not cls:
                raise ValueError(f"{name!r} is already {table[name].__name__}'s")
            table[name] = cls
    if "restore" in vars(cls):
        _RESTORES[cls.form] = cls.restore
    return cls


def method_class(spec: MethodSpec) -> type:
    try:
        return _BY_SPEC[spec.head]
    except KeyError:
        raise ValueError(f"unknown compression {spec.text!r}") from None


def policy_class(policy: str) -> type:
    try:
        return _BY_POLICY[policy]
    except KeyError:
        raise ValueError(f"unknown compression policy {policy!r}") from None


def restorer(form: StoredForm) -> Restore:
    try:
        return _RESTORES[form.kind]
    except KeyError:
        raise ValueError(f"no method restores a {form.kind!r} form here") from None


def registered() -> dict[str, type]:
    """Spec name -> method class, for the test matrix over every method."""
    return dict(_BY_SPEC)
