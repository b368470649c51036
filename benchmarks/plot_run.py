"""Draw the charts to watch first from a run's TensorBoard event files, as one PNG.

    python benchmarks/plot_run.py runs/RUN --out curves.png
    python benchmarks/plot_run.py runs/RUN --charts reward,held-out --out learning.png

The first group of charts on the Custom Scalars dashboard simple_rl writes (reward, held-out
accuracy in percent with its 95% interval, loss, KL, entropy, the mismatched-token total, step
time), read from the same layout and matched to the logged tags as TensorBoard matches them, so
the picture and the dashboard never disagree. One series per chart, unsmoothed, at 800 pixels
wide (the README's width). A chart with no data in the run (the held-out accuracy without an
eval, say), or the KL of a run with --kl-coef 0 (0 at every step), is left out, and one
line says which and why. Event files of older runs (held-out accuracy as the fraction
`eval/accuracy`, no run total of mismatched tokens) are read under today's tags.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WIDTH_IN, DPI = 8.0, 100  # 800 pixels: the README's width
YLABEL = {  # the y axis of each chart, by the tag it draws (default: the tag itself)
    "reward_mean": "mean reward",
    "eval/accuracy_pct": "accuracy (%)",
    "kl_div": "KL (nats per token)",
    "entropy": "nats per token",
    "determinism/mismatched_tokens_total": "tokens",
    "determinism/routing_mismatch": "tokens",
    "time/step_s": "seconds",
}


def charts() -> list[tuple[str, str, list[str]]]:
    """(title, kind, tags) of every chart in the first group of simple_rl's Custom Scalars
    dashboard, in its order (a Qwen3-MoE run's routing chart included: without data it is
    left out). kind "Multiline": one tag regex; "Margin": the value, lower and upper tags."""
    import simple_rl as rl

    layout = rl.tensorboard_layout(routes=True)["simple_rl"]
    return [(title, kind, tags) for title, (kind, tags) in layout.items()]


def series(kind: str, tags: list[str], logged) -> list[str]:
    """The logged tags a chart draws, as TensorBoard picks them: a Multiline tag is a regex
    matched at the start of each tag; a Margin chart's three tags are exact names (all, or the
    value alone when an older run logged no interval, or none)."""
    if kind == "Margin":
        if all(t in logged for t in tags):
            return list(tags)
        return tags[:1] if tags[0] in logged else []
    return sorted(t for t in logged if any(re.match(pattern, t) for pattern in tags))


def with_todays_tags(scalars: dict, eval_size: int = 0) -> dict:
    """Older event files under today's tags: the held-out accuracy was logged as a fraction
    (`eval/accuracy`), without its 95% interval (drawn from `eval_size`, the problems each
    eval scored, when given: 1.96 sqrt(p (1 - p) / n), the interval simple_rl logs for 0/1
    rewards), the mismatched tokens per step only (their run total is their running sum), and
    no step time (the sum of its three phases, as simple_rl logs it)."""
    scalars = dict(scalars)
    old = scalars.get("eval/accuracy")
    if old and "eval/accuracy_pct" not in scalars:
        scalars["eval/accuracy_pct"] = [(step, 100 * v) for step, v in old]
    pct = scalars.get("eval/accuracy_pct")
    if pct and eval_size and "eval/accuracy_low_pct" not in scalars:
        half = [196 * math.sqrt(v / 100 * (1 - v / 100) / eval_size) for _, v in pct]
        scalars["eval/accuracy_low_pct"] = [(s, v - h) for (s, v), h in zip(pct, half)]
        scalars["eval/accuracy_high_pct"] = [(s, v + h) for (s, v), h in zip(pct, half)]
    phases = [dict(scalars.get(f"time/{phase}_s", [])) for phase in ("rollout", "train", "push")]
    if "time/step_s" not in scalars and all(phases):
        scalars["time/step_s"] = [(s, sum(p[s] for p in phases)) for s in sorted(phases[0])
                                  if all(s in p for p in phases)]
    per_step = scalars.get("determinism/mismatched_tokens")
    if per_step and "determinism/mismatched_tokens_total" not in scalars:
        totals = itertools.accumulate(v for _, v in per_step)
        scalars["determinism/mismatched_tokens_total"] = list(zip((s for s, _ in per_step),
                                                                  totals))
    return scalars


def read_scalars(run_dir: str, eval_size: int = 0) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from the event files of one run directory (all of them:
    a resumed run appends a file; TensorBoard's reader drops the steps a resume purged);
    eval_size: an older run's held-out problems, for its accuracy's interval."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not any(Path(run_dir).glob("events.out.tfevents.*")):
        sys.exit(f"plot_run: no TensorBoard event files in {run_dir}; give a run directory "
                 "(runs/<run>), not the folder of runs.")
    # a resume's purge is expected: no "TensorFlow restart" warning for it
    logging.getLogger("tensorboard").setLevel(logging.ERROR)
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return with_todays_tags({t: [(e.step, e.value) for e in acc.Scalars(t)]
                             for t in acc.Tags()["scalars"]}, eval_size)


def chosen_charts(only: list[str]) -> list[tuple[str, str, list[str]]]:
    """The charts whose title starts with a word of `only` (every chart if empty); a word that
    starts no title is named in one sentence."""
    every = charts()
    for word in only:
        if not any(name.startswith(word) for name, _, _ in every):
            firsts = ", ".join(name.split()[0] for name, _, _ in every)
            sys.exit(f"plot_run: no chart is called {word!r}; --charts takes the first words "
                     f"of: {firsts}.")
    return [c for c in every if not only or c[0].startswith(tuple(only))]


def left_out(name: str, tags: list[str], scalars: dict) -> str | None:
    """Why a chart is not drawn, or None: no data, or the KL of a run without a reference
    model (--kl-coef 0 logs 0 at every step; a reward of 0 does say something)."""
    if not tags:
        return "not in these event files"
    if name.startswith("KL") and all(v == 0 for _, v in scalars[tags[0]]):
        return "every value is 0 (--kl-coef 0)"
    return None


def plot(scalars: dict, out: str, title: str = "", only: list[str] | None = None):
    """One panel per chart with data (those whose title starts with a word of `only`, if
    given), three to a row, 800 pixels wide, saved to `out`; returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels, skipped = [], []
    for name, kind, tags in chosen_charts(only or []):
        drawn = series(kind, tags, scalars)
        why = left_out(name, drawn, scalars)
        if why is None:
            panels.append((name, kind, drawn))
        elif drawn or only or "routed" not in name:  # a dense model has no routing chart
            skipped.append(f"{name.split(' (')[0]}: {why}")
    if skipped:
        print(f"plot_run: left out {'; '.join(skipped)}", file=sys.stderr)
    if not panels:
        sys.exit("plot_run: none of the charts asked for has data in these event files.")
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(WIDTH_IN, 2.6 * rows + 0.4 * bool(title)),
                             dpi=DPI, squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (name, kind, tags) in zip(axes.flat, panels):
        steps, values = zip(*scalars[tags[0]])
        ax.plot(steps, values, marker="o", markersize=3 if len(steps) < 50 else 0)
        if len(tags) == 3:  # a Margin chart's 95% interval around the value
            low, high = ([v for _, v in scalars[t]] for t in tags[1:])
            ax.fill_between(steps, low, high, alpha=0.25, linewidth=0)
        # a third of 800 pixels holds about 36 characters of a title
        ax.set_title(textwrap.fill(name, 36, break_on_hyphens=False), fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel(YLABEL.get(tags[0], tags[0]), fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    folder = Path(out).parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        sys.exit(f"plot_run: cannot make the folder {folder} for --out: {e.strerror or e}.")
    try:
        fig.savefig(out)
    except OSError as e:
        sys.exit(f"plot_run: cannot write {out}: {e.strerror or e}.")
    plt.close(fig)  # out of pyplot's list of open figures; the object stays usable
    return fig


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("run_dir", help="a run directory (LOG_DIR/RUN_NAME)")
    p.add_argument("--out", default="curves.png", help="the PNG to write (its folder is made "
                   "if missing)")
    p.add_argument("--title", default="", help="a title above the charts")
    p.add_argument("--charts", default="", help="comma-separated chart titles (their first "
                   "words) to draw; empty: every chart of the first group with data")
    p.add_argument("--eval-size", type=int, default=0, help="the run's --eval-size, for a run "
                   "logged before the held-out accuracy's interval was (0: no band then)")
    a = p.parse_args()
    only = [c.strip() for c in a.charts.split(",") if c.strip()]
    plot(read_scalars(a.run_dir, a.eval_size), a.out, a.title, only)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
