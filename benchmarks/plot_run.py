"""Draw the charts to watch first from a run's TensorBoard event file, as one PNG.

    python benchmarks/plot_run.py runs/RUN --out curves.png      (needs matplotlib)
    python benchmarks/plot_run.py runs/RUN --charts reward,held-out --out learning.png

The first group of charts on the Custom Scalars dashboard simple_rl writes (reward, held-out
accuracy, loss, KL, entropy, the mismatched-token total, step time), read from the same
layout, so the picture and the dashboard never disagree. A chart with no data in the run (the
held-out accuracy without an eval, say) is left out.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def charts() -> list[tuple[str, list[str]]]:
    """(title, tags) of every chart in the first group of simple_rl's Custom Scalars dashboard,
    in its order (a Qwen3-MoE run's routing chart included: without data it is left out)."""
    import simple_rl as rl

    layout = rl.tensorboard_layout(moe=True)["simple_rl"]
    return [(title, tags) for title, (_, tags) in layout.items()]


def read_scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def plot(scalars: dict, out: str, title: str, only: list[str] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(name, tags) for name, tags in charts() if any(t in scalars for t in tags)
              and (not only or name.startswith(tuple(only)))]
    assert panels, "no simple_rl scalars in these event files"
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(10 * cols / 3 + 1, 2.6 * rows), dpi=90,
                             squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (name, tags) in zip(axes.flat, panels):
        for tag in tags:
            if tag in scalars:
                steps, values = zip(*scalars[tag])
                ax.plot(steps, values, marker="o", markersize=3)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "run_dir", help="a run directory (LOG_DIR/RUN_NAME) or any folder of event files"
    )
    p.add_argument("--out", default="curves.png")
    p.add_argument("--title", default="")
    p.add_argument("--charts", default="", help="comma-separated chart titles (their first "
                   "words) to draw; default: every chart of the first group")
    a = p.parse_args()
    only = [c.strip() for c in a.charts.split(",") if c.strip()]
    plot(read_scalars(a.run_dir), a.out, a.title or a.run_dir, only)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
