"""What the READMEs say about committed results: every file or run folder they name is in the
repository, and the learning run's numbers are the ones its committed metrics hold."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
# a file with one of these endings, or a run folder (`runs/NAME/`); `<tmp>/`-style machine
# paths and patterns (`gpu_test_{flip,sign}.log`, `bench_*`) are not names of one file
FILE = re.compile(r"^(?:\.\./)?[\w.-]+(?:/[\w.-]+)*\.(?:log|json|jsonl|png|md|py|txt|csv)$")
RUN = re.compile(r"^(?:[\w.-]+/)*runs/[\w.-]+/?$")
READMES = [ROOT / "README.md", RESULTS / "README.md", *sorted(RESULTS.glob("*/README.md"))]


def named_paths(readme: Path) -> list[str]:
    """The paths a README names: in backticks, or as a link's or a picture's target. The top
    README also names what a run writes (`metrics.jsonl`), so there only paths from the root."""
    text = readme.read_text()
    names = re.findall(r"`([^`\n]+)`", text) + re.findall(r"\]\(([^)\s]+)\)", text)
    names = [n for n in names if FILE.match(n) or RUN.match(n)]
    if readme == ROOT / "README.md":
        names = [n for n in names if n.startswith("results/")]
    return names


def found(name: str, folder: Path) -> bool:
    """In the README's folder (or, for a bare file name, anywhere below it: a section may be
    about a subfolder), at the root, in results/, or a script in benchmarks/ or examples/."""
    places = [folder, ROOT, RESULTS, ROOT / "benchmarks", ROOT / "examples"]
    if any((place / name).exists() for place in places):
        return True
    return "/" not in name and any(folder.glob(f"**/{name}"))


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_readme_names_is_committed(readme):
    names = named_paths(readme)
    assert names, "no path found: the pattern no longer reads this README"
    missing = [n for n in names if not found(n, readme.parent)]
    assert missing == []


def test_a_run_folder_a_readme_names_holds_its_metrics():
    """A named run folder has what draws its pictures and tables, not only a name."""
    runs = {(readme.parent / n).resolve() for readme in READMES for n in named_paths(readme)
            if RUN.match(n)}
    assert RESULTS / "learning_h200" / "runs" / "a" in runs
    for run in runs:
        assert (run / "metrics.jsonl").stat().st_size > 0, run


def learning_rows() -> list[dict]:
    """The README's learning run: one metrics row per training step, 0 to 119."""
    path = RESULTS / "learning_h200" / "runs" / "a" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == list(range(120))
    return steps


def test_the_episodes_learning_log_is_the_committed_learning_run():
    """results/h200_episodes' learning run (its folder not kept) printed, step for step, the
    reward, loss, held-out accuracy and token count of learning_h200/runs/a."""
    rows = learning_rows()
    log = (RESULTS / "h200_episodes" / "learning_run.log").read_text()
    lines = re.findall(r"^step (\d+)/120 \| reward ([\d.]+) \|(?: held-out ([\d.]+) \|)? "
                       r"loss (\S+) \| .* mismatched 0/(\d+) \|", log, re.M)
    assert [int(n) for n, *_ in lines] == list(range(1, 121))
    for (_, reward, held_out, loss, tokens), row in zip(lines, rows):
        assert (reward, loss) == (f"{row['reward_mean']:.3f}", f"{row['loss']:+.4f}")
        assert int(tokens) == row["determinism/tokens"]
        assert held_out == "" or float(held_out) == round(row["eval/accuracy"], 3)


def test_the_readme_says_which_reward_it_quotes():
    rows = learning_rows()
    first, last = rows[0]["reward_mean"], rows[-1]["reward_mean"]
    last10 = sum(r["reward_mean"] for r in rows[-10:]) / 10
    said = f"sampled reward from {first:.2f} at step 1 to {last:.3f} at step 120 " \
           f"({last10:.2f} averaged over the last 10\nsteps)"
    assert said == "sampled reward from 0.30 at step 1 to 0.715 at step 120 (0.62 averaged " \
        "over the last 10\nsteps)"
    assert said in (ROOT / "README.md").read_text()
