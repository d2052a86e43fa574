"""`flotilla promote`: move a registered model's alias, or roll `champion` back.

    python pipelines/promote.py --model digits --version 3
    python pipelines/promote.py --config configs/digits.yaml --rollback

`python pipelines/promote.py --help` shows every option, more examples and the exit codes.
"""

import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parents[1] / "pipelines" / "_checkout.py"), run_name="__main__",
              init_globals={"COMMAND": "promote"})
