"""GPU (pytest -m gpu): a Qwen3.5 on vLLM's kernels, end to end. vLLM generates with the
settings of "Qwen3.5 on vLLM" (simple_rl.py, after the story), the trainer replays its schedule
on the same kernels (batch_invariant_backward.vllm_forwards), and every generated token's
logprob must be vLLM's bit for bit, before and after a weight push; three prompts generated
alone must draw what they drew inside the batch.

The model: Qwen3.5-0.8B's shapes (head_dim 256, 16 linear heads of 128, partial rotary), cut
to 4 layers (three Gated DeltaNet, one gated attention), random bf16 weights. It runs through
tests/gpu_driver.py (the Qwen3 parity experiment: it builds VLLMEngine and the model itself,
so simple_rl's refusal of a Qwen3.5 run is not in its way), one engine per process.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from test_gpu import ROOT, _need_gpu_stack, driver

pytestmark = pytest.mark.gpu

SHAPE = ("--preset", "qwen3.5-0.8b", "--layers", "4")
# 16 prompts of 1 to 220 tokens (prefills across fla's 64-token chunks) x 8 samples of up to
# 256 tokens, two steps (a push between them)
RUN = ("--prompts", "16", "--group", "8", "--steps", "2", "--max-new-tokens", "256",
       "--max-prompt", "220", "--temperature", "1.0")
RUNS = {"cuda-graphs": (), "eager": ("--no-cuda-graphs",)}


def make_qwen35(out: Path) -> Path:
    if not (out / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "tests" / "make_checkpoint.py"), str(out),
                        *SHAPE, "--device", "cuda"], check=True, timeout=900)
    return out


@pytest.fixture(scope="module")
def qwen35_runs(tmp_path_factory):
    _need_gpu_stack()
    tmp = tmp_path_factory.mktemp("qwen35_parity")
    ckpt = make_qwen35(tmp / "qwen3.5-0.8b-4-layers")
    return {name: driver(tmp, "parity", "--ckpt", ckpt, *RUN, *flags)
            for name, flags in RUNS.items()}


@pytest.mark.parametrize("run", sorted(RUNS))
def test_every_generated_token_of_a_qwen35_bitwise_equal(qwen35_runs, run):
    r = qwen35_runs[run]
    assert r["weights_equal_at_start"]
    for s in r["steps"]:
        assert s["samples"] == 16 * 8
        assert s["tokens"] > 16 * 8
        assert s["mismatched"] == 0 and s["max_abs_diff"] == 0, s
        assert s["weights_equal_after_push"], s


@pytest.mark.parametrize("run", sorted(RUNS))
def test_a_qwen35_rollout_is_batch_free(qwen35_runs, run):
    """Three prompts alone draw the samples and logprobs they drew among sixteen (their
    prefills and decodes shared steps with other requests' there: mixed steps)."""
    assert qwen35_runs[run]["batch_free"]
