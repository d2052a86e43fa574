"""`flotilla predict`: score a whole table with a registered model on Ray Data, predictions as Parquet.

    python pipelines/predict.py --model digits@champion --input rows.parquet --output scored/
    ray job submit --working-dir . -- python pipelines/predict.py --model digits@champion --input s3://b/rows/ --output s3://b/scored/

`python pipelines/predict.py --help` shows every option, more examples and the exit codes.
"""

import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parents[1] / "pipelines" / "_checkout.py"), run_name="__main__",
              init_globals={"COMMAND": "predict"})
