"""Tools as agent RL meets them (issue 40): simple_rl.ToolError is one class however the script
runs, tools of one turn run in parallel with their results in episode order, a hung or slow
tool ends at --tool-timeout, and a tool's text stays text."""

import subprocess
import sys
from pathlib import Path

from helpers import cpu_argv

ROOT = Path(__file__).resolve().parents[1]

# An env whose every step is a wrong tool call: --check must see simple_rl's own ToolError.
RAISES = '''
from simple_rl import ToolError


class Strict:
    def reset(self, problem):
        return problem.question

    def step(self, completion):
        raise ToolError("no tool call in " + repr(completion))
'''


def test_an_env_raising_simple_rl_tool_error_passes_check_on_the_real_command_line(
        ckpt, tmp_path):
    env = tmp_path / "strict.py"
    env.write_text(RAISES)
    argv = cpu_argv(ckpt(), tmp_path / "runs", env=f"{env}:Strict") + ["--check"]
    out = subprocess.run([sys.executable, str(ROOT / "simple_rl.py"), *argv], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert "check: config: valid" in out.stdout
