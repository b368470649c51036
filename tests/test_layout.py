"""The layout a reader of simple_rl.py relies on (CONTRIBUTING.md): the RL story at most 2,400
lines before its banner, no function longer than 60 lines, no line over 100 characters."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE = [ROOT / "simple_rl.py", ROOT / "batch_invariant_backward.py"]
BANNER = "# The RL story ends here."


def test_the_story_fits_its_budget():
    lines = (ROOT / "simple_rl.py").read_text().splitlines()
    before = [i for i, line in enumerate(lines) if line.startswith(BANNER)]
    assert len(before) == 1, "one banner ends the story"
    assert 2000 < before[0] <= 2400, before[0]  # lines before the banner's first line


@pytest.mark.parametrize("path", CODE, ids=lambda p: p.name)
def test_no_function_passes_60_lines(path):
    tree = ast.parse(path.read_text())
    long = {f"{n.name}:{n.lineno}": n.end_lineno - n.lineno + 1 for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > 60}
    assert long == {}


@pytest.mark.parametrize("path", [*CODE, *sorted((ROOT / "tests").glob("*.py")),
                                  *sorted((ROOT / "benchmarks").glob("*.py")),
                                  *sorted((ROOT / "examples").glob("*.py"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_line_passes_100_characters(path):
    wide = [i + 1 for i, line in enumerate(path.read_text().splitlines()) if len(line) > 100]
    assert wide == []
