"""Draw the charts to watch first from a run's TensorBoard event file, as one PNG.

    python benchmarks/plot_run.py runs/RUN --out curves.png      (needs matplotlib)

Reward, loss, KL, entropy, mismatched tokens against tokens checked, and where the step's time
goes (rollout, train, push): the same charts as the Custom Scalars dashboard simple_rl writes.
"""

from __future__ import annotations

import argparse

CHARTS = [
    ("reward", ["reward_mean"]),
    ("loss", ["loss", "pg_loss"]),
    ("KL", ["kl_div"]),
    ("entropy", ["entropy"]),
    ("tokens: mismatched / checked", ["determinism/mismatched_tokens", "determinism/tokens"]),
    ("step time (s)", ["time/rollout_s", "time/train_s", "time/push_s"]),
]


def read_scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def plot(scalars: dict, out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(10, 5.2), dpi=90)
    for ax, (name, tags) in zip(axes.flat, CHARTS):
        for tag in tags:
            if tag in scalars:
                steps, values = zip(*scalars[tag])
                ax.plot(steps, values, marker="o", markersize=3, label=tag.split("/")[-1])
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        if len(tags) > 1:
            ax.legend(fontsize=7)
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
    a = p.parse_args()
    plot(read_scalars(a.run_dir), a.out, a.title or a.run_dir)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
