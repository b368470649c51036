"""Draw this folder's learning curves from its console logs, and beside them the Qwen3.5 run's
of ../h200_after_refactor/ (nothing else is read).

From each log it takes the step lines (`step N/S | reward R | held-out H | ...`; a held-out
accuracy printed on step N's line was measured before step N, after N - 1 updates) and the
last line's `held-out accuracy after S steps: H`. Writes learning.png (arithmetic and the
calculator, full fine-tuning beside LoRA; arithmetic on a Qwen3.5) and lookup.png (the lookup
task: accuracy and turns), beside this file or into OUT_DIR.

    python results/h200_vllm034_learning/plot.py [OUT_DIR]
"""
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
STEP = re.compile(r"^step (\d+)/\d+ \| reward ([\d.]+)(?: \| held-out ([\d.]+))?(.*)$", re.M)
FINAL = re.compile(r"^held-out accuracy after (\d+) steps: ([\d.]+)", re.M)
TURNS = re.compile(r"\| turns ([\d.]+)")


def curves(name: str) -> dict[str, dict[int, float]]:
    """held-out accuracy (%) by updates done, reward and turns by step, of one console log."""
    text = (HERE / name).read_text()
    out = {"held": {}, "reward": {}, "turns": {}}
    for step, reward, held, rest in STEP.findall(text):
        out["reward"][int(step)] = float(reward)
        if held:
            out["held"][int(step) - 1] = 100 * float(held)
        if turns := TURNS.search(rest):
            out["turns"][int(step)] = float(turns.group(1))
    for steps, held in FINAL.findall(text):
        out["held"][int(steps)] = 100 * float(held)
    return out


def draw(runs, right_key: str, right_label: str, out: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, name, color, style in runs:
        c = curves(name)
        left.plot(list(c["held"]), list(c["held"].values()), style, color=color, marker="o",
                  ms=4, label=label)
        right.plot(list(c[right_key]), list(c[right_key].values()), style, color=color, lw=1,
                   label=label)
    left.set(xlabel="GRPO step", ylabel="held-out greedy accuracy (%)", ylim=(0, 102))
    right.set(xlabel="GRPO step", ylabel=right_label)
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("vLLM 0.34, torch 2.14, one H200: 0 mismatched tokens at every step")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print("wrote", out)


def main(out_dir: Path) -> None:
    draw([("arithmetic, full fine-tuning, lr 1e-4", "arith.log", "black", "-"),
          ("arithmetic, LoRA r16, lr 1e-3", "lora_arith.log", "black", "--"),
          ("arithmetic, a Qwen3.5 (Gated DeltaNet), full fine-tuning, lr 1e-4",
           "../h200_after_refactor/learning_qwen35.log", "tab:red", "-"),
          ("calculator, full fine-tuning, lr 1e-4", "calc.log", "tab:blue", "-"),
          ("calculator, LoRA r16, lr 1e-3", "lora_calc.log", "tab:blue", "--")],
         "reward", "mean reward of the step's samples", out_dir / "learning.png")
    draw([("lookup, full fine-tuning, lr 1e-4", "lookup.log", "tab:green", "-")],
         "turns", "turns per episode", out_dir / "lookup.png")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
