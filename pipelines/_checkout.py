"""Runs the `flotilla` subcommand `COMMAND` (set by the script that runs this file) from the checkout.

`python pipelines/train.py ARGS` is `flotilla train ARGS`: the scripts stay (for `ray job submit
--working-dir . -- python pipelines/train.py ...`, where a node has the checkout but maybe no
install) and this is the one place that puts the checkout's `platform/` on the import path.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from flotilla.cli import main  # noqa: E402

sys.exit(main([COMMAND, *sys.argv[1:]]))  # noqa: F821 (given by the script)
