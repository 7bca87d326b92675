"""The ``blockdraft`` argument parser and entry point."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from collections.abc import Sequence

from blockdraft._core import __version__
from blockdraft.bench import add_arguments, main_from_args
from blockdraft.cli.common import ArgumentParser, report_failure
from blockdraft.cli.demo import add_demo_command
from blockdraft.cli.generate import add_generate_command
from blockdraft.cli.serve import add_serve_command
from blockdraft.cli.train import add_training_commands

DESCRIPTION = "DFlash speculative decoding: generate, train and evaluate drafters, benchmark the proposer."

DEBUG_HELP = "show tracebacks and debug logs"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="blockdraft", description=DESCRIPTION)
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    parser.add_argument("--version", action="version", version=f"blockdraft {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    add_demo_command(sub)
    add_generate_command(sub)
    bench = sub.add_parser("bench", help="benchmark the proposer on random weights (see docs/BENCHMARKS.md)")
    add_arguments(bench)
    bench.set_defaults(func=main_from_args)
    add_training_commands(sub)
    add_serve_command(sub)
    # `--debug` also after the subcommand; SUPPRESS keeps a `--debug` given before it.
    for command in sub.choices.values():
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; every failure is one ``blockdraft: error:`` line and exit code 2
    (``--debug`` prints the traceback first)."""
    args = build_parser().parse_args(argv)
    debug = bool(args.debug)
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, format="%(message)s")
    try:
        rc: int = args.func(args)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print("blockdraft: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI turns every failure into one line
        return report_failure(exc, debug=debug)
    return rc
