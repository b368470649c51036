"""Draw this folder's lookup curves from simple_rl's console logs (nothing else is read).

Reads, beside this file, A.log, B.log, C.log and D.log. From each it takes the step lines
(`step N/S | reward R | held-out H | ... | turns T tools K | ...`: the held-out accuracy on step
N's line was measured before step N, i.e. after N - 1 updates) and the last line's
`held-out accuracy after S steps: H`. Writes lookup.png: held-out accuracy (left) and turns
per episode (right), beside this file or into OUT_DIR. The uncached runs are not drawn: their
step lines equal the cached runs'.

    python results/h200_lookup_graded/plot.py [OUT_DIR]
"""
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
LINE = re.compile(r"^step (\d+)/\d+ \|(.*)$|^held-out accuracy after (\d+) steps: ([\d.]+)", re.M)
RUNS = [("A: 4 links, deeper 0.3, lr 1e-4", "A.log", "tab:blue"),
        ("B: 4 links, deeper 0.1, lr 1e-4 (the defaults)", "B.log", "black"),
        ("C: 3 links, deeper 0.3, lr 1e-4", "C.log", "tab:green"),
        ("D: 4 links, deeper 0.3, lr 5e-5", "D.log", "tab:orange")]


def curves(name: str) -> tuple[dict[int, float], dict[int, float]]:
    """(held-out accuracy (%) by updates done, turns per episode by step) of one console log."""
    turns, held = {}, {}
    for step, rest, final, acc in LINE.findall((HERE / name).read_text()):
        if final:
            held[int(final)] = 100 * float(acc)
            continue
        fields = dict(f.split(" ", 1) for f in rest.strip().split(" | ") if " " in f)
        turns[int(step)] = float(fields["turns"].split()[0])
        if "held-out" in fields:  # measured before this step: after step - 1 updates
            held[int(step) - 1] = 100 * float(fields["held-out"])
    return held, turns


def main(out_dir: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, name, color in RUNS:
        held, turns = curves(name)
        left.plot(list(held), list(held.values()), color=color, marker="o", ms=4, label=label)
        right.plot(list(turns), list(turns.values()), color=color, lw=1, label=label)
    left.set(xlabel="GRPO step", ylabel="held-out greedy accuracy (%)", ylim=(0, 102),
             title="lookup task: held-out accuracy (512 questions)")
    right.set(xlabel="GRPO step", ylabel="model turns per episode (the step's samples)",
              title="lookup task: turns per episode (a search ends a turn)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out_dir / "lookup.png", dpi=110)
    print("wrote", out_dir / "lookup.png")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
