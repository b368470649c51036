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


def test_the_readme_quotes_its_learning_run():
    """The top README's learning run (vLLM 0.34; its console log is what came back from the
    machine): the reward it quotes and its held-out table are the log's."""
    log = (RESULTS / "h200_vllm034_learning" / "arith.log").read_text()
    rewards = [float(r) for r in re.findall(r"^step \d+/120 \| reward ([\d.]+)", log, re.M)]
    assert len(rewards) == 120
    said = f"the sampled reward from {rewards[0]:.2f} at step 1 to {sum(rewards[-10:]) / 10:.2f} " \
           "averaged over the last 10 steps"
    assert said == "the sampled reward from 0.23 at step 1 to 0.54 averaged over the last 10 steps"
    readme = (ROOT / "README.md").read_text()
    assert said in " ".join(readme.split())
    held = {int(n) - 1: float(a) for n, a in
            re.findall(r"^step (\d+)/120 \| reward [\d.]+ \| held-out ([\d.]+)", log, re.M)}
    held[120] = float(re.search(r"^held-out accuracy after 120 steps: ([\d.]+)", log, re.M)[1])
    row = " | ".join(f"{100 * held[n]:.1f}%" for n in (0, 25, 50, 75, 100, 120))
    assert f"| one H200 | {row} |" in readme


def test_contributing_maps_every_test_file():
    """CONTRIBUTING.md's table names every test file of tests/, and only files that exist: a new
    test file gets its row, and a renamed one is renamed there."""
    named = set(re.findall(r"`(test_\w+\.py)`", (ROOT / "CONTRIBUTING.md").read_text()))
    have = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    assert sorted(named - have) == [] and sorted(have - named) == []
