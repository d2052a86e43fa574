"""The training-curve PNG logged with every run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

QUALITY = (("accuracy", "val_accuracy", "train_accuracy"), ("rmse", "val_rmse", "train_rmse"),
           ("perplexity", "val_perplexity", "train_perplexity"))


def plot_training_curves(history: list[dict[str, Any]], path: str | Path, title: str) -> Path:
    """Loss and the task's quality metric per epoch, train against validation."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on cluster nodes
    import matplotlib.pyplot as plt

    epochs = [m["epoch"] for m in history]
    fig, (loss_ax, quality_ax) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    loss_ax.plot(epochs, [m["train_loss"] for m in history], marker="o", label="train")
    loss_ax.plot(epochs, [m["val_loss"] for m in history], marker="o", label="validation")
    loss_ax.set(title="loss", xlabel="epoch", ylabel="loss")
    loss_ax.legend()
    for name, val_key, train_key in QUALITY:
        if history and val_key in history[0]:
            if train_key in history[0]:
                quality_ax.plot(epochs, [m[train_key] for m in history], marker="o", label="train")
            quality_ax.plot(epochs, [m[val_key] for m in history], marker="o", label="validation")
            quality_ax.set(title=name, xlabel="epoch", ylabel=name)
            quality_ax.legend()
            break
    for ax in (loss_ax, quality_ax):
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(title)
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
