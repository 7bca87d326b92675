"""``python -m blockdraft.bench``: the ``blockdraft bench`` command on its own."""

from __future__ import annotations

import argparse
import logging
import sys

from blockdraft.bench.command import add_arguments, main_from_args


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(prog="python -m blockdraft.bench")
    add_arguments(parser)
    return main_from_args(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
