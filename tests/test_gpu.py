"""GPU suite (pytest -m gpu): bitwise parity with vLLM, weight pushes, the debugger, run-to-run determinism.

Each experiment runs in its own process (tests/gpu_driver.py or simple_rl.py itself),
since a vLLM engine holds process-wide state. Numbers land in the JSON each writes.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.gpu


def _need_gpu_stack():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm")
    pytest.importorskip("torchtitan")


def _env():
    env = dict(os.environ, VLLM_BATCH_INVARIANT="1", VLLM_USE_V2_MODEL_RUNNER="0", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return env


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory):
    _need_gpu_stack()
    cache = {}

    def get(*flags):
        if flags not in cache:
            out = tmp_path_factory.mktemp("parity") / "r.json"
            cmd = [sys.executable, str(ROOT / "tests" / "gpu_driver.py"), "parity", *flags, "--out", str(out)]
            subprocess.run(cmd, check=True, env=_env(), timeout=900)
            cache[flags] = json.loads(out.read_text())
            print(json.dumps({"flags": flags, "steps": cache[flags]["steps"]}))
        return cache[flags]

    return get


# (tied head, T=1.0, eager engine) also serves the debugger test; the others replay decode steps as CUDA graphs
RUNS = {"tied-eager": ("--tied", "--temperature", "1.0", "--no-cuda-graphs", "--debug"),
        "untied-graphs": ("--no-tied", "--temperature", "0.7", "--cuda-graphs"),
        "tied-graphs": ("--tied", "--temperature", "1.0", "--cuda-graphs")}


@pytest.mark.parametrize("run", sorted(RUNS))
def test_every_token_bitwise_equal_across_weight_pushes(parity_runs, run):
    """16 prompts (1..220 tokens) x 8 samples, up to 256 new tokens, 4 GRPO steps each followed by a push."""
    r = parity_runs(*RUNS[run], "--steps", "4")
    assert r["weights_equal_at_start"]
    assert len(r["steps"]) == 4
    for s in r["steps"]:
        assert s["samples"] == 128 and s["prompt_lens"] == [1, 220] and s["max_completion"] == 256
        assert s["tokens"] > 10_000
        assert s["mismatched"] == 0 and s["max_abs_diff"] == 0.0, s
        assert s["weights_equal_after_push"], s
    assert sum(s["stopped_at_eos"] for s in r["steps"]) > 0 and sum(s["hit_max_tokens"] for s in r["steps"]) > 0
    assert any(s["loss"] != 0 for s in r["steps"])  # the weights really moved between pushes


def test_debugger_finds_nothing_then_names_an_injected_ulp(parity_runs):
    r = parity_runs(*RUNS["tied-eager"], "--steps", "4")
    for plen in (5, 120, 300):
        assert r[f"debug_{plen}"] == {"first": None, "n_bad": 0}
    assert r["debug_injected"]["first"] == "layers.1.act_fn"


def _run(tmp, name, seed, steps, *extra):
    """simple_rl.py itself on the tiny checkpoint; returns its step/parity lines, sha256 and metrics.jsonl rows."""
    cmd = [sys.executable, str(ROOT / "simple_rl.py"), "--model", str(tmp / "ckpt"), "--steps", str(steps), "--seed", str(seed),
           "--lr", "1e-4", "--entropy-coef", "0.01", "--max-new-tokens", "64", "--log-dir", str(tmp / "runs"),
           "--run-name", name, "--save-every", "2", *extra]
    out = subprocess.run(cmd, check=True, env=_env(), capture_output=True, text=True, timeout=600).stdout
    lines = [re.sub(r"\| rollout .*", "", line) for line in out.splitlines() if line.startswith(("step", "parity:"))]
    digest = re.search(r"weights sha256 ([0-9a-f]{64})", out).group(1)
    rows = [json.loads(r) for r in (tmp / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return lines, digest, [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    _need_gpu_stack()
    tmp = tmp_path_factory.mktemp("runs")
    subprocess.run([sys.executable, str(ROOT / "tests" / "make_checkpoint.py"), str(tmp / "ckpt"), "--preset", "tiny"], check=True)
    r = {"a": _run(tmp, "a", 0, 4), "b": _run(tmp, "b", 0, 4), "c": _run(tmp, "c", 1, 4), "part": _run(tmp, "d", 0, 2)}
    r["resumed"] = _run(tmp, "d", 0, 4, "--resume", str(tmp / "runs" / "d" / "checkpoints" / "step_000002"))
    print(json.dumps({k: {"sha256": v[1], "lines": v[0]} for k, v in r.items()}, indent=1))
    return r


def test_two_runs_same_seed_same_metrics_and_weights(runs):
    (a_lines, a, a_rows), (b_lines, b, b_rows), (_, c, _) = runs["a"], runs["b"], runs["c"]
    assert len(a_lines) == 8 and all("identical=yes" in s for s in a_lines if s.startswith("parity"))
    assert a_lines == b_lines and a_rows == b_rows and a == b
    assert c != a  # another seed, other weights


def test_resume_on_gpu_matches_the_uninterrupted_run(runs):
    (_, a, a_rows), (_, part, _), (r_lines, resumed, r_rows) = runs["a"], runs["part"], runs["resumed"]
    assert part != a
    assert resumed == a and r_rows == a_rows
    assert all("identical=yes" in s for s in r_lines if s.startswith("parity"))
