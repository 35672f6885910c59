"""Swapping a model's submodules in place (the CPU platform's weight layouts)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def child_slots(model: torch.nn.Module, types: tuple[type, ...]) -> list[tuple[torch.nn.Module, str]]:
    """(parent, attribute name) of every submodule whose type is exactly one of ``types``.

    Holding slots rather than the modules lets a caller that replaces them one by one free
    each original as soon as it is swapped (a model never needs its weights twice)."""
    return [
        (parent, name) for parent in model.modules() for name, child in parent.named_children() if type(child) in types
    ]


def replace_linears(model: torch.nn.Module, wrappers: dict[torch.dtype, Callable]) -> int:
    """Swap each plain ``nn.Linear`` whose weight dtype has a wrapper for ``wrapper(linear)``;
    returns how many were swapped."""
    swapped = 0
    for parent, name in child_slots(model, (torch.nn.Linear,)):
        linear = getattr(parent, name)
        if linear.weight.dtype in wrappers:
            setattr(parent, name, wrappers[linear.weight.dtype](linear))
            swapped += 1
    return swapped
