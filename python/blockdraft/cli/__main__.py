"""``python -m blockdraft.cli ARGS``."""

import sys

from blockdraft.cli.app import main

sys.exit(main())
