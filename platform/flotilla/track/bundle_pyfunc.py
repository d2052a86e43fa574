"""The MLflow pyfunc model of an inference bundle, logged as code ("models from code").

MLflow stores this file with the model and runs it on load; the weights come from the bundle
(safetensors + JSON) logged as the model's artifact `bundle`, so loading unpickles nothing.

    model = mlflow.pyfunc.load_model("models:/digits@champion")
    model.predict(pandas.DataFrame(rows))        # classification: columns `prediction`, `probabilities`
    model.predict(pandas.DataFrame({"prompt": ["def "]}), params={"max_tokens": 32})   # gpt: `text`

A `custom` model's factory is code; it runs only when the model config allows it: the run logs
the factory it trained with (`model_config`), and `mlflow.pyfunc.load_model(uri,
model_config={"allow_factories": [...]})` replaces that list. Loading a pyfunc model runs this file
as the registry holds it, so it trusts the registry; Flotilla's own loaders do not (`flotilla.track.load_registered_bundle`).
"""

from __future__ import annotations

from typing import Any

import mlflow
import pandas as pd
from mlflow.pyfunc import PythonModel


class BundleModel(PythonModel):
    def load_context(self, context) -> None:
        # Function-local: MLflow imports this file to log the model; Flotilla loads when the model does.
        from flotilla.bundle import load_bundle

        allowed = (context.model_config or {}).get("allow_factories", ())
        self.bundle = load_bundle(context.artifacts["bundle"], factories=allowed,
                                  allow_with="mlflow.pyfunc.load_model(..., model_config={{'allow_factories': ['{factory}']}})")

    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        return self.bundle.predict_frame(model_input, params)


mlflow.models.set_model(BundleModel())
