"""The training corpus's licence filter: SPDX expressions, each way core metadata declares a
licence, and the filter over a made-up interpreter (a standard library and a site-packages of
dist-info directories) through ``collect_python_sources``."""

from __future__ import annotations

from pathlib import Path

import pytest

from blockdraft.training.builtin.licences import PermissiveFilter, file_licences, spdx_permissive
from blockdraft.training.data import collect_python_sources

BODY = "def f(x):\n    return x + 1\n\n" * 12  # longer than collect_python_sources' minimum


@pytest.mark.parametrize(("expression", "permissive"), [
    ("MIT", True),
    ("BSD-3-Clause AND 0BSD AND MIT AND Zlib AND CC0-1.0", True),
    ("Apache-2.0 OR BSD-2-Clause", True),
    ("(Apache-2.0 OR GPL-2.0-only)", True),
    ("MIT OR GPL-3.0-or-later", True),
    ("GPL-3.0-only", False),
    ("MIT AND GPL-2.0-only", False),
    ("MPL-2.0 AND MIT", False),
    ("Apache-2.0 WITH LLVM-exception", False),
    ("LicenseRef-NVIDIA-Proprietary", False),
    ("", False),
])
def test_spdx_expressions(expression: str, permissive: bool) -> None:
    assert spdx_permissive(expression) is permissive


def _dist(site: Path, name: str, headers: list[str], files: dict[str, str]) -> None:
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("\n".join(["Metadata-Version: 2.4", f"Name: {name}", "Version: 1.0",
                                              *headers]) + "\n\n")
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in files) + f"{info.name}/METADATA,,\n")


@pytest.fixture
def interpreter(tmp_path: Path) -> tuple[Path, Path]:
    stdlib = tmp_path / "lib" / "python3"
    (stdlib / "json").mkdir(parents=True)
    (stdlib / "json" / "decoder.py").write_text(BODY + "# stdlib\n")
    site = stdlib / "site-packages"  # inside the stdlib root, as on a system interpreter
    _dist(site, "spdx_mit", ["License-Expression: MIT"], {"spdx_mit/a.py": BODY + "# a\n"})
    _dist(site, "classic", ["Classifier: License :: OSI Approved :: BSD License"],
          {"classic/b.py": BODY + "# b\n"})
    _dist(site, "dual", ["Classifier: License :: OSI Approved :: GNU General Public License v3 (GPLv3)",
                         "Classifier: License :: OSI Approved :: MIT License"], {"dual/c.py": BODY + "# c\n"})
    _dist(site, "free_text", ["License: Apache 2.0 License"], {"free_text/d.py": BODY + "# d\n"})
    _dist(site, "gpl", ["License-Expression: GPL-3.0-only"], {"gpl/e.py": BODY + "# e\n"})
    _dist(site, "gpl_classifier", ["Classifier: License :: OSI Approved :: GNU General Public License v2 (GPLv2)"],
          {"gpl_classifier/f.py": BODY + "# f\n"})
    _dist(site, "mystery", ["License: see the LICENSE file"], {"mystery/g.py": BODY + "# g\n"})
    _dist(site, "silent", [], {"silent/h.py": BODY + "# h\n"})
    (site / "orphan.py").write_text(BODY + "# no distribution owns this file\n")
    return stdlib, site


def test_each_declaration_is_read(interpreter: tuple[Path, Path]) -> None:
    _, site = interpreter
    got = {lic.distribution: (lic.licence, lic.permissive) for lic in file_licences([site]).values()}
    assert got == {
        "spdx_mit": ("MIT", True),
        "classic": ("BSD", True),
        "dual": ("MIT", True),
        "free_text": ("Apache-2.0", True),
        "gpl": ("GPL-3.0-only", False),
        "gpl_classifier": ("OSI Approved :: GNU General Public License v2 (GPLv2)", False),
        "mystery": ("see the LICENSE file", False),
        "silent": ("unknown", False),
    }


def test_the_filter_keeps_the_stdlib_and_permissive_distributions_only(interpreter: tuple[Path, Path]) -> None:
    stdlib, site = interpreter
    keep = PermissiveFilter(stdlib, [site])
    files = collect_python_sources([stdlib, site], max_chars=10**9, keep=keep)
    kept = sorted(Path(f.path).relative_to(stdlib).as_posix() for f in files)
    assert kept == ["json/decoder.py", "site-packages/classic/b.py", "site-packages/dual/c.py",
                    "site-packages/free_text/d.py", "site-packages/spdx_mit/a.py"]
    assert {name: lic.licence for name, lic in keep.used.items()} == {
        "Python standard library": "PSF-2.0", "classic": "BSD", "dual": "MIT", "free_text": "Apache-2.0",
        "spdx_mit": "MIT",
    }


def test_without_a_filter_everything_is_collected(interpreter: tuple[Path, Path]) -> None:
    stdlib, site = interpreter
    files = collect_python_sources([stdlib, site], max_chars=10**9)
    assert len(files) == 10  # the stdlib file, eight distributions' files and the orphan
