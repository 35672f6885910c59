"""Registers the guided-decoding backends; their heavy imports happen only when chosen."""

from __future__ import annotations

import kiln


@kiln.hookimpl
def register_guided_backends(register) -> None:
    register("xgrammar", "kiln_guided.xgrammar_backend:XGrammarBackend")
    register("lm-format-enforcer", "kiln_guided.lmfe_backend:LMFormatEnforcerBackend")
