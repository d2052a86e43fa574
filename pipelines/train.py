"""`flotilla train`: preprocess → train (Ray Train + DeepSpeed) → evaluate → bundle → register.

    python pipelines/train.py --config configs/digits.yaml --set train.lr=3e-4
    ray job submit --working-dir . -- python pipelines/train.py --config configs/digits.yaml

`python pipelines/train.py --help` shows every option, more examples and the exit codes.
"""

import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parents[1] / "pipelines" / "_checkout.py"), run_name="__main__",
              init_globals={"COMMAND": "train"})
