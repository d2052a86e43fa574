"""The sweep plot: the metric against each swept hyperparameter, one point per trial."""

from __future__ import annotations

from pathlib import Path

STATUS_STYLE = {"completed": ("o", "tab:blue"), "early-stopped": ("x", "tab:orange"), "errored": ("s", "tab:red")}


def plot_sweep(outcome, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = sorted({p for row in outcome.trials for p in row.values}) or ["(none)"]
    fig, axes = plt.subplots(1, len(paths), figsize=(4.5 * len(paths), 4), constrained_layout=True, squeeze=False)
    for ax, param in zip(axes[0], paths):
        values = [row.values.get(param) for row in outcome.trials]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values if v is not None)
        labels = sorted({str(v) for v in values}) if not numeric else None
        for status, (marker, color) in STATUS_STYLE.items():
            points = [(row.values.get(param), row.metric) for row in outcome.trials
                      if row.status == status and row.metric is not None]
            if not points:
                continue
            xs = [x if numeric else labels.index(str(x)) for x, _ in points]
            ax.scatter(xs, [y for _, y in points], marker=marker, color=color, label=status)
        if numeric and values and min(v for v in values if v is not None) > 0:
            finite = [v for v in values if v is not None]
            if max(finite) / min(finite) >= 50:
                ax.set_xscale("log")
        if labels:
            ax.set_xticks(range(len(labels)), labels, rotation=20)
        ax.set(xlabel=param, ylabel=outcome.metric, title=f"{outcome.metric} vs {param}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{outcome.name}: {len(outcome.trials)} trials (last reported {outcome.metric})")
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
