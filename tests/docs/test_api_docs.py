"""Every public name carries its documentation at runtime (``help()`` in a REPL, IDE tooltips):
the Rust extension's classes and functions, and the Python package's public API."""

from __future__ import annotations

import inspect

import pytest

import blockdraft
import blockdraft._core as core


def _public(module: object) -> list[tuple[str, object]]:
    names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
    return [(n, getattr(module, n)) for n in names if callable(getattr(module, n))]


@pytest.mark.parametrize(("name", "obj"), _public(core), ids=lambda x: x if isinstance(x, str) else "")
def test_core_names_have_docs(name: str, obj: object) -> None:
    assert (obj.__doc__ or "").strip(), f"blockdraft._core.{name} has no __doc__"


@pytest.mark.parametrize(("name", "obj"), _public(blockdraft), ids=lambda x: x if isinstance(x, str) else "")
def test_package_names_have_docs(name: str, obj: object) -> None:
    assert inspect.getdoc(obj), f"blockdraft.{name} has no docstring"


def test_proposer_public_methods_have_docs() -> None:
    missing = [
        n for n, f in inspect.getmembers(blockdraft.DFlashProposer, inspect.isfunction)
        if not n.startswith("_") and not inspect.getdoc(f)
    ]
    assert not missing, f"DFlashProposer methods without docstrings: {missing}"
