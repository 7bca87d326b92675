"""Which installed Python source may go into a training corpus: each file's distribution and the
licence it declares, and whether that licence is permissive.

A file under a site-packages root belongs to the distribution whose ``RECORD`` lists it
(``importlib.metadata``). Its licence is read from the distribution's metadata, most specific
first: the SPDX ``License-Expression`` (core metadata 2.4), then the ``License :: ...`` trove
classifiers, then the free-text ``License`` field when it is a known name. A file no
distribution owns, or whose licence is unknown or not on the permissive list, is left out: the
filter errs towards leaving source out. The standard library is under the PSF licence.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from blockdraft.training.data import SourceFile, collect_python_sources, python_source_roots

PERMISSIVE_SPDX = frozenset({
    "0BSD", "Apache-2.0", "BSD-2-Clause", "BSD-3-Clause", "CC0-1.0", "HPND", "ISC", "MIT", "MIT-0",
    "PSF-2.0", "Python-2.0", "Unlicense", "Zlib",
})
"""SPDX identifiers taken as permissive (no copyleft, no field-of-use terms)."""

_PERMISSIVE_CLASSIFIERS = {
    "License :: OSI Approved :: MIT License": "MIT",
    "License :: OSI Approved :: MIT No Attribution License (MIT-0)": "MIT-0",
    "License :: OSI Approved :: BSD License": "BSD",
    "License :: OSI Approved :: Apache Software License": "Apache-2.0",
    "License :: OSI Approved :: Python Software Foundation License": "PSF-2.0",
    "License :: OSI Approved :: ISC License (ISCL)": "ISC",
    "License :: OSI Approved :: The Unlicense (Unlicense)": "Unlicense",
    "License :: OSI Approved :: zlib/libpng License": "Zlib",
    "License :: CC0 1.0 Universal (CC0 1.0) Public Domain Dedication": "CC0-1.0",
}

_FREE_TEXT = {
    "mit": "MIT", "mit license": "MIT", "the mit license": "MIT", "mit-0": "MIT-0",
    "bsd": "BSD", "bsd license": "BSD", "new bsd license": "BSD-3-Clause", "bsd-2-clause": "BSD-2-Clause",
    "bsd-3-clause": "BSD-3-Clause", "3-clause bsd": "BSD-3-Clause", "2-clause bsd": "BSD-2-Clause",
    "apache 2.0": "Apache-2.0", "apache 2.0 license": "Apache-2.0", "apache-2.0": "Apache-2.0",
    "apache license 2.0": "Apache-2.0",
    "apache license, version 2.0": "Apache-2.0", "apache software license": "Apache-2.0",
    "psf": "PSF-2.0", "psf-2.0": "PSF-2.0", "python software foundation license": "PSF-2.0",
    "isc": "ISC", "isc license": "ISC", "unlicense": "Unlicense", "zlib": "Zlib", "0bsd": "0BSD",
}

STDLIB_LICENCE = "PSF-2.0"


@dataclass(frozen=True)
class Licence:
    """What one distribution declares: its name and version, the licence as read (an SPDX
    expression, a classifier's short name, the free text, or ``"unknown"``), and whether it
    counts as permissive."""

    distribution: str
    version: str
    licence: str
    permissive: bool


def spdx_permissive(expression: str) -> bool:
    """Whether an SPDX licence expression allows permissive use: some ``OR`` alternative whose
    every ``AND`` term is on :data:`PERMISSIVE_SPDX` (``WITH`` exceptions make a term fail)."""
    text = expression.replace("(", " ").replace(")", " ")
    for alternative in re.split(r"\s+OR\s+", text.strip()):
        terms = [t.strip() for t in re.split(r"\s+AND\s+", alternative) if t.strip()]
        if terms and all(t.removesuffix("+") in PERMISSIVE_SPDX for t in terms):
            return True
    return False


def _field(meta: metadata.PackageMetadata, name: str) -> str | None:
    values = meta.get_all(name)
    return str(values[0]) if values else None


def declared_licence(meta: metadata.PackageMetadata) -> tuple[str, bool]:
    """(the licence as read, permissive?) from one distribution's core metadata."""
    expression = _field(meta, "License-Expression")
    if expression:
        return expression.strip(), spdx_permissive(expression)
    classifiers = [c for c in (meta.get_all("Classifier") or []) if c.startswith("License ::")]
    if classifiers:
        names = [_PERMISSIVE_CLASSIFIERS.get(c) for c in classifiers]
        # Several licence classifiers: the distribution is dual- or multi-licensed; one
        # permissive choice is enough.
        chosen = next((n for n in names if n is not None), None)
        if chosen is not None:
            return chosen, True
        return "; ".join(c.removeprefix("License :: ") for c in classifiers), False
    free = (_field(meta, "License") or "").strip()
    if free:
        known = _FREE_TEXT.get(free.lower())
        if known is not None:
            return known, True
        first = free.splitlines()[0][:80]
        return first, False
    return "unknown", False


def file_licences(roots: Sequence[Path]) -> dict[Path, Licence]:
    """Every file the distributions installed under ``roots`` list in their ``RECORD``,
    resolved, mapped to its distribution's :class:`Licence`."""
    out: dict[Path, Licence] = {}
    for dist in metadata.distributions(path=[str(r) for r in roots]):
        text, ok = declared_licence(dist.metadata)
        lic = Licence(_field(dist.metadata, "Name") or "?", str(dist.version), text, ok)
        base = Path(str(dist.locate_file("")))
        for f in dist.files or []:
            out[(base / f).resolve()] = lic
    return out


class PermissiveFilter:
    """A ``keep(path)`` filter for :func:`~blockdraft.training.data.collect_python_sources`:
    files under ``stdlib`` are kept (PSF licence), files of a permissive distribution under
    ``site_roots`` are kept, anything else is left out. ``used`` collects the licence of every
    distribution a kept file came from (for the model card)."""

    def __init__(self, stdlib: Path | None, site_roots: Sequence[Path]) -> None:
        self.stdlib = stdlib.resolve() if stdlib is not None else None
        self.licences = file_licences(site_roots)
        self.used: dict[str, Licence] = {}

    def __call__(self, path: Path) -> bool:
        resolved = path.resolve()
        lic = self.licences.get(resolved)
        if lic is None:
            in_packages = any(part in ("site-packages", "dist-packages") for part in resolved.parts)
            if self.stdlib is not None and not in_packages and resolved.is_relative_to(self.stdlib):
                self.used.setdefault("Python standard library",
                                     Licence("Python standard library", "", STDLIB_LICENCE, True))
                return True
            return False
        if lic.permissive:
            self.used.setdefault(lic.distribution, lic)
        return lic.permissive


def permissive_python_sources(
    *, max_chars: int, site_roots: Sequence[Path] | None = None, **kwargs: int
) -> tuple[list[SourceFile], list[Licence]]:
    """:func:`~blockdraft.training.data.collect_python_sources` over the standard library and
    ``site_roots`` (default: the interpreter's own site-packages), keeping only the standard
    library and permissively licensed distributions; also returns the licence of every
    distribution the kept files came from, sorted by name."""
    roots = python_source_roots()
    if site_roots is not None:
        roots = roots[:1] + [Path(r) for r in site_roots]
    keep = PermissiveFilter(roots[0] if roots else None, roots[1:])
    files = collect_python_sources(roots, max_chars=max_chars, keep=keep, **kwargs)
    return files, sorted(keep.used.values(), key=lambda lic: lic.distribution.lower())


__all__ = ["Licence", "PERMISSIVE_SPDX", "PermissiveFilter", "STDLIB_LICENCE", "declared_licence",
           "file_licences", "permissive_python_sources", "spdx_permissive"]
