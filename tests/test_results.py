"""The code under results/: each plot.py redraws its folder's pictures from the committed
console logs (into a temporary folder: the committed PNGs stay as they are), and the curves it
draws hold the held-out accuracies, turns and rewards its folder's README states."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
PICTURES = {"h200_lookup_graded": ["lookup.png"],
            "h200_vllm034_learning": ["learning.png", "lookup.png"],
            "h200_lora_learning": ["learning.png", "lookup.png"]}


def plot_module(folder: str):
    """results/FOLDER/plot.py, imported (its main not run)."""
    spec = importlib.util.spec_from_file_location(f"plot_{folder}", RESULTS / folder / "plot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cells(readme: Path, start: str) -> list[str]:
    """The cells of the table row of readme that begins with `start`, bold marks removed."""
    line = next(line.strip() for line in readme.read_text().splitlines()
                if line.strip().startswith(start))
    return [cell.strip().replace("**", "") for cell in line.strip("|").split("|")]


def test_every_script_under_results_is_a_plot_this_file_runs():
    assert sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*.py")) == \
        sorted(f"{folder}/plot.py" for folder in PICTURES)


@pytest.mark.parametrize("folder", PICTURES)
def test_a_plot_redraws_its_pictures_into_the_folder_given(folder, tmp_path):
    from matplotlib.image import imread

    def stamp(name: str) -> tuple[int, bytes]:
        path = RESULTS / folder / name
        return path.stat().st_mtime_ns, path.read_bytes()

    committed = {name: stamp(name) for name in PICTURES[folder]}
    out = subprocess.run([sys.executable, str(RESULTS / folder / "plot.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"wrote {tmp_path / name}" for name in PICTURES[folder]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(PICTURES[folder])
    for name, before in committed.items():
        assert stamp(name) == before  # not written over
        assert imread(tmp_path / name).shape == imread(RESULTS / folder / name).shape


def test_the_lookup_graded_curves_are_its_readmes_table():
    """Held-out accuracy after 0, 10, ..., 60 steps and turns an episode at steps 1 and 60."""
    plot = plot_module("h200_lookup_graded")
    for name in ("A.log", "B.log", "C.log", "D.log"):
        row = cells(RESULTS / "h200_lookup_graded" / "README.md", f"| `{name}`")
        held, turns = plot.curves(name)
        assert [round(held[n], 1) for n in range(0, 61, 10)] == [float(c) for c in row[4:11]]
        assert f"{turns[1]:.1f} -> {turns[60]:.1f}" == row[11]
    held, _ = plot.curves("B.log")
    assert (round(held[0], 1), round(held[60], 1)) == (1.6, 95.9)  # the defaults: +94.3 points


def test_the_vllm034_curves_are_its_readmes_table():
    """Held-out accuracy after the steps of the table's columns; a blank cell: no eval there."""
    plot = plot_module("h200_vllm034_learning")
    steps = (0, 10, 20, 25, 40, 50, 60, 120)
    for log in ("arith", "lora_arith", "calc", "lora_calc", "lookup"):
        row = cells(RESULTS / "h200_vllm034_learning" / "README.md", f"| `{log}.log`")
        held = plot.curves(f"{log}.log")["held"]
        assert [round(held[n], 1) if n in held else None for n in steps] == \
            [float(c) if c else None for c in row[2:10]], log
    lookup = plot.curves("lookup.log")
    assert (round(lookup["held"][0], 1), round(lookup["held"][60], 1)) == (1.6, 65.0)
    assert (lookup["turns"][1], lookup["turns"][60]) == (2.4, 4.1)  # "turns an episode 2.4 -> 4.1"


def test_the_lora_learning_curves_are_its_readmes():
    """The held-out table of the LoRA runs (a cell "(25) 65.6": after 25 steps), the quoted
    rewards, and the lookup runs' accuracy at steps 0, 10 and 60."""
    plot = plot_module("h200_lora_learning")
    here = RESULTS / "h200_lora_learning"
    logs = {"LoRA r16, lr 1e-3 |": here / "lora_arith.log",
            "LoRA r16, lr 3e-3 |": here / "lora_arith_lr3e-3.log",
            "LoRA r16, lr 1e-3, calculator |": here / "lora_calc.log",
            "full FT, lr 1e-4 (`../h200_episodes/`": RESULTS / "h200_episodes" / "learning_run.log"}
    for start, log in logs.items():
        _, _, at, acc = plot.read(log)
        held = dict(zip(at, acc))
        row = cells(here / "README.md", f"| {start}")
        for column, cell in zip(range(0, 61, 10), row[1:8]):
            if cell:
                step, value = re.fullmatch(r"(?:\((\d+)\) )?([\d.]+)", cell).groups()
                assert round(held[int(step or column)], 1) == float(value), (log, cell)
    _, rewards, _, _ = plot.read(here / "lora_arith.log")
    assert (rewards[0], round(sum(rewards[-10:]) / 10, 3)) == (0.301, 0.594)
    for name, want in (("lookup.log", (1.4, 98.8, 99.2)), ("lookup_lr3e-4.log", (1.4, 96.7, 98.8)),
                       ("lookup95.log", (1.4, 99.4, 99.8)), ("lookup90.log", (1.4, 98.2, 99.6))):
        _, _, at, acc = plot.read(here / name)
        held = dict(zip(at, acc))
        assert tuple(round(held[n], 1) for n in (0, 10, 60)) == want, name

