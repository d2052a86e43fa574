"""A multi-layer perceptron over the concatenated `features` column."""

from __future__ import annotations

import torch
from torch import nn

_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU}


class MLP(nn.Module):
    def __init__(self, num_features: int, hidden: list[int], num_outputs: int, dropout: float, activation: str):
        super().__init__()
        layers: list[nn.Module] = []
        width = num_features
        for h in hidden:
            layers += [nn.Linear(width, h), _ACTIVATIONS[activation](), nn.Dropout(dropout)]
            width = h
        layers.append(nn.Linear(width, num_outputs))
        self.net = nn.Sequential(*layers)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features)


def build_mlp(spec: dict, schema: dict) -> MLP:
    outputs = schema["num_classes"] if schema["task"] == "classification" else 1
    return MLP(schema["num_features"], list(spec["hidden"]), outputs, spec["dropout"], spec["activation"])
