"""`flotilla deploy`: a registered model as an HTTP endpoint on Ray Serve, from the spec's `serve` section.

    python pipelines/deploy.py --config configs/digits.yaml --query
    ray job submit --working-dir . -- python pipelines/deploy.py --config configs/digits.yaml

`python pipelines/deploy.py --help` shows every option, more examples and the exit codes.
"""

import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parents[1] / "pipelines" / "_checkout.py"), run_name="__main__",
              init_globals={"COMMAND": "deploy"})
