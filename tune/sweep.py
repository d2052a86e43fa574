"""`flotilla sweep`: a hyperparameter sweep with Ray Tune; every trial is an ordinary training run.

    python tune/sweep.py --config configs/digits_sweep.yaml --set tune.num_samples=16
    ray job submit --working-dir . -- python tune/sweep.py --config configs/digits_sweep.yaml

`python tune/sweep.py --help` shows every option, more examples and the exit codes.
"""

import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parents[1] / "pipelines" / "_checkout.py"), run_name="__main__",
              init_globals={"COMMAND": "sweep"})
