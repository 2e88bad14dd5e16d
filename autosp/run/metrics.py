"""Metrics of a run: one JSON line per step in DIR/metrics.jsonl (its loss, speed, and each rank's
measured peak of allocated device memory beside the plan's prediction), and a loss curve in DIR/loss.png."""
from __future__ import annotations

import json
import os


def read(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def truncate(path: str, last_step: int) -> None:
    """Drop the lines of steps after `last_step` (a resumed run writes them again)."""
    rows = [r for r in read(path) if r.get("step", 0) <= last_step]
    if os.path.isfile(path):
        with open(path + ".tmp", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        os.replace(path + ".tmp", path)


class Writer:
    """Appends a line per step and flushes it: a crash loses at most the step in flight."""

    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "a")

    def write(self, row: dict) -> None:
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def plot_loss(metrics_path: str, png_path: str, title: str) -> str | None:
    """The loss curve as a PNG; None (and nothing written) when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = read(metrics_path)
    steps, loss = [r["step"] for r in rows], [r["loss"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, loss, lw=0.8, alpha=0.45, label="per step")
    if len(loss) >= 20:
        k = 10
        avg = [sum(loss[i - k:i]) / k for i in range(k, len(loss) + 1)]
        ax.plot(steps[k - 1:], avg, lw=1.6, label=f"mean of {k} steps")
        ax.legend(fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path
