"""The ``blockdraft`` command line (``generate``, ``serve``, ``train-drafter``, ``eval-drafter``,
``demo``, ``bench``).

:mod:`blockdraft.cli.common` holds what the subcommands share; :mod:`blockdraft.cli.app` builds
the parser. This package module stays free of imports so that a subcommand module imported on
its own (e.g. :mod:`blockdraft.cli.train`) can use the shared helpers without importing the parser.
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """The console entry point: ``blockdraft ARGS`` (see :func:`blockdraft.cli.app.main`)."""
    from blockdraft.cli.app import main as run

    return run(argv)
