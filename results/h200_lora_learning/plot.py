"""Draw this folder's learning curves from simple_rl's console logs (nothing else is read).

Reads, beside this file, the console logs lora_arith.log, lora_arith_lr3e-3.log, lora_calc.log,
lookup.log, lookup_lr3e-4.log, lookup90.log and lookup95.log, and the full fine-tuning run of
the same arithmetic warm start, ../h200_episodes/learning_run.log. From each it takes the step
lines (`step N/S | reward R | held-out H | ...`: the held-out accuracy on step N's line was
measured before step N, i.e. after N - 1 updates) and the last line's
`held-out accuracy after S steps: H`. Writes learning.png (arithmetic and calculator) and
lookup.png (the lookup task), beside this file or into OUT_DIR. The uncached runs are not
drawn: their step lines equal the cached runs' (see README.md).

    python results/h200_lora_learning/plot.py [OUT_DIR]
"""
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
STEP = re.compile(r"^step (\d+)/\d+ \| reward ([\d.]+)(?: \| held-out ([\d.]+))?", re.M)
FINAL = re.compile(r"^held-out accuracy after (\d+) steps: ([\d.]+)", re.M)


def read(path: Path) -> tuple[list[int], list[float], list[int], list[float]]:
    """(steps, rewards, eval steps, held-out accuracies) of one console log."""
    text = path.read_text()
    steps, rewards, at, acc = [], [], [], []
    for n, reward, held in STEP.findall(text):
        steps.append(int(n))
        rewards.append(float(reward))
        if held:
            at.append(int(n) - 1)  # measured before step n: after n - 1 updates
            acc.append(100 * float(held))
    for n, held in FINAL.findall(text):
        at.append(int(n))
        acc.append(100 * float(held))
    return steps, rewards, at, acc


def draw(runs: list[tuple[str, Path, str, str]], title: str, out: Path) -> None:
    """Held-out accuracy (left) and the batch's mean reward each step (right) of every run."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, path, color, style in runs:
        steps, rewards, at, acc = read(path)
        left.plot(at, acc, style, color=color, marker="o", ms=4, label=label)
        right.plot(steps, rewards, style, color=color, lw=1, label=label)
    left.set(xlabel="GRPO step", ylabel="held-out greedy accuracy (%)", ylim=(0, 102),
             title=f"{title}: held-out accuracy (512 problems)")
    right.set(xlabel="GRPO step", ylabel="mean reward of the step's samples", ylim=(0, 1.02),
              title=f"{title}: reward per step")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print("wrote", out)


def main(out_dir: Path) -> None:
    draw([("LoRA r16, lr 1e-3", HERE / "lora_arith.log", "tab:blue", "-"),
          ("LoRA r16, lr 3e-3", HERE / "lora_arith_lr3e-3.log", "tab:red", "-"),
          ("full FT, lr 1e-4 (h200_episodes)",
           HERE.parent / "h200_episodes" / "learning_run.log", "black", "--"),
          ("LoRA r16, lr 1e-3, calculator (--env calc)", HERE / "lora_calc.log", "tab:green",
           "-")],
         "arithmetic", out_dir / "learning.png")
    draw([("direct 0.7, lr 1e-4", HERE / "lookup.log", "tab:blue", "-"),
          ("direct 0.7, lr 3e-4", HERE / "lookup_lr3e-4.log", "tab:red", "-"),
          ("direct 0.9, lr 1e-4", HERE / "lookup90.log", "tab:orange", "-"),
          ("direct 0.95, lr 1e-4", HERE / "lookup95.log", "tab:purple", "-")],
         "lookup task, full FT", out_dir / "lookup.png")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
