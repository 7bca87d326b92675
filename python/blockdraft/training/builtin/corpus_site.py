"""The corpus packages: pure-Python, permissively licensed distributions from the package index
whose source joins the standard library in the built-in pair's corpus.

    python -m blockdraft.training.builtin.corpus_site DEST            # pip-install them into DEST
    python -m blockdraft.training.builtin.corpus_site DEST --pack F   # and pack their source into F.tar.xz
    python -m blockdraft.training.builtin.corpus_site DEST --packages corpus_packages.txt \
        --packages corpus_packages_wide.txt                  # the wide corpus: both lists

The pinned list is ``corpus_packages.txt`` beside this module (the shipped pair's corpus);
``corpus_packages_wide.txt`` beside it adds more distributions for a corpus about 2.2 times as
large. A ``--packages`` name that is not a file is looked up beside this module. Each is
installed without its dependencies (``pip install --no-deps --only-binary=:all: --target
DEST``), so DEST holds exactly these distributions with their ``RECORD`` and metadata: what
:class:`~blockdraft.training.builtin.licences.PermissiveFilter` reads to keep or drop every file. The
build takes DEST with ``make_builtin_pair --corpus-site DEST``; ``--pack`` writes the ``.py``
files the corpus can use (and every ``*.dist-info``) to one archive, for a build machine with no
network.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import tarfile
from pathlib import Path

from blockdraft.training.data import may_fit

log = logging.getLogger(__name__)

PACKAGES_FILE = Path(__file__).with_name("corpus_packages.txt")


def pinned_packages(path: Path = PACKAGES_FILE) -> list[str]:
    """The ``name==version`` lines of the package list (comments and blanks dropped).

    Raises:
        ValueError: a line that is not ``name==version``.
    """
    out: list[str] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise ValueError(f"{path}:{number}: expected name==version, not {line!r}")
        out.append(f"{name.strip()}=={version.strip()}")
    return out


def package_list(name: Path) -> Path:
    """``name`` if it is a file, else the list of that name beside this module.

    Raises:
        FileNotFoundError: neither exists.
    """
    for path in (name, PACKAGES_FILE.with_name(name.name)):
        if path.is_file():
            return path
    raise FileNotFoundError(f"no package list {name} (nor {PACKAGES_FILE.with_name(name.name)})")


def install(dest: Path, packages: list[str] | None = None) -> None:
    """pip-install the pinned packages (wheels only, no dependencies) into ``dest``.

    Raises:
        RuntimeError: pip failed (its output is in the message).
    """
    specs = pinned_packages() if packages is None else packages
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
           "--only-binary=:all:", "--upgrade", "--target", str(dest), *specs]
    log.info("installing %d corpus packages into %s", len(specs), dest)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"pip install into {dest} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def pack(dest: Path, archive: Path) -> int:
    """Write ``dest``'s usable ``.py`` files and its ``*.dist-info`` folders to ``archive``
    (xz-compressed tar, paths relative to ``dest``); returns the number of files packed.

    A ``.py`` file is usable when its size could pass the corpus's length filter
    (:func:`~blockdraft.training.data.may_fit`).
    """
    files = []
    for path in sorted(dest.rglob("*")):
        if not path.is_file():
            continue
        rel = path.relative_to(dest)
        in_metadata = any(part.endswith(".dist-info") for part in rel.parts)
        if in_metadata or (path.suffix == ".py" and may_fit(path.stat().st_size)):
            files.append(rel)
    with tarfile.open(archive, "w:xz") as tar:
        for rel in files:
            tar.add(dest / rel, arcname=str(rel))
    return len(files)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dest", type=Path, help="directory to install the corpus packages into")
    ap.add_argument("--pack", type=Path, default=None, help="also write their usable source to this .tar.xz")
    ap.add_argument("--packages", type=Path, action="append", default=None, metavar="FILE",
                    help="a pinned package list (repeatable; default: corpus_packages.txt)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        lists = [package_list(f) for f in args.packages or [PACKAGES_FILE]]
        install(args.dest, [spec for path in lists for spec in pinned_packages(path)])
    except (RuntimeError, ValueError, FileNotFoundError) as exc:
        log.error("%s", exc)
        return 1
    if args.pack is not None:
        count = pack(args.dest, args.pack)
        log.info("packed %d files into %s (%.1f MB)", count, args.pack, args.pack.stat().st_size / 1e6)
    return 0


if __name__ == "__main__":
    sys.exit(main())
