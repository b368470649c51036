"""GPU (pytest -m gpu): a Qwen3.5 on vLLM's kernels, end to end. vLLM generates with the
settings of "Qwen3.5 on vLLM" (simple_rl.py, after the story), the trainer replays its schedule
on the same kernels (batch_invariant_backward.vllm_forwards), and every generated token's
logprob must be vLLM's bit for bit, before and after a weight push; three prompts generated
alone must draw what they drew inside the batch.

Then simple_rl.py itself on that model at T = 0.7: two runs and a resumed one end at one sha256,
0 mismatched tokens at every step; and episodes of 1-4 turns with tool messages between them.
Last, Qwen3.5-4B's exact shape, whole: the parity checks at 256 and 2048 new tokens, and
simple_rl.py twice to one sha256 (and resumed, where the disk holds its checkpoint).

The model: Qwen3.5-0.8B's shapes (head_dim 256, 16 linear heads of 128, partial rotary), cut
to 4 layers (three Gated DeltaNet, one gated attention), random bf16 weights. It runs through
tests/gpu_driver.py (the Qwen3 parity experiment: it builds VLLMEngine and the model itself
and compares every token's logprob, weights and batch-freedom), one engine per process.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_gpu import ROOT, SCRIPTED_ENV, _need_gpu_stack, driver, episode_run, simple_rl

pytestmark = pytest.mark.gpu

SHAPE = ("--preset", "qwen3.5-0.8b", "--layers", "4")
# 16 prompts of 1 to 220 tokens (prefills across fla's 64-token chunks) x 8 samples of up to
# 256 tokens, two steps (a push between them)
RUN = ("--prompts", "16", "--group", "8", "--steps", "2", "--max-new-tokens", "256",
       "--max-prompt", "220", "--temperature", "1.0")
# T = 1 in both engine modes; T = 0.7 (the sampler's fp32 tempered logits) with prompts of up to
# 1000 tokens (16 of fla's 64-token chunks)
RUNS = {"cuda-graphs": (), "eager": ("--no-cuda-graphs",),
        "t07-long-prompts": ("--temperature", "0.7", "--max-prompt", "1000")}


def make_qwen35(out: Path, *flags, shape=SHAPE) -> Path:
    if not (out / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "tests" / "make_checkpoint.py"), str(out),
                        *shape, "--device", "cuda", *flags], check=True, timeout=900)
    return out


@pytest.fixture(scope="module")
def qwen35_runs(tmp_path_factory):
    _need_gpu_stack()
    tmp = tmp_path_factory.mktemp("qwen35_parity")
    # 1,000 eos ids of 248,320 (tests/make_checkpoint.py): about 64% of the samples stop before
    # 256 tokens, at random lengths (a CUDA graph's decode batch then has padding rows)
    ckpt = make_qwen35(tmp / "qwen3.5-0.8b-4-layers", "--stop-ids", "1000")
    done = {}

    def get(name: str) -> dict:  # each run once, when a test first asks for it (-k picks)
        if name not in done:  # later flags win: RUNS' over RUN's
            done[name] = driver(tmp, "parity", "--ckpt", ckpt, *RUN, *RUNS[name])
        return done[name]

    return get


def check_every_step(r: dict, longest_prompt: int, samples: int) -> None:
    """A parity run's steps: every generated token's logprob vLLM's, the weights equal at the
    start and after each push."""
    assert r["weights_equal_at_start"]
    for s in r["steps"]:
        assert s["prompt_lens"] == [1, longest_prompt]
        assert s["samples"] == samples
        assert s["tokens"] > samples
        assert s["mismatched"] == 0 and s["max_abs_diff"] == 0, s
        assert s["weights_equal_after_push"], s


def check_identical(lines: list[str], steps: int | None = None) -> None:
    """A simple_rl run's parity lines (`steps` of them, where given) all say identical."""
    parity = [line for line in lines if line.startswith("parity:")]
    assert steps in (None, len(parity)) and all("identical=yes" in p for p in parity), lines


@pytest.mark.parametrize("run", sorted(RUNS))
def test_every_generated_token_of_a_qwen35_bitwise_equal(qwen35_runs, run):
    r = qwen35_runs(run)
    check_every_step(r, 1000 if run.startswith("t07") else 220, 16 * 8)
    assert all(0 < s["stopped_at_eos"] < s["samples"] for s in r["steps"]), r["steps"]


@pytest.mark.parametrize("run", sorted(RUNS))
def test_a_qwen35_rollout_is_batch_free(qwen35_runs, run):
    """Three prompts alone draw the samples and logprobs they drew among sixteen (their
    prefills and decodes shared steps with other requests' there: mixed steps)."""
    assert qwen35_runs(run)["batch_free"]


def test_simple_rl_on_a_qwen35_is_exact_deterministic_and_resumable(tmp_path):
    """simple_rl.py on the Qwen3.5 above, 4 steps at T = 0.7 (its settings: no prefix cache,
    prompts prefilled whole): every step's parity line says identical (the stopped and resumed
    runs' too), two runs of one seed end at one sha256 with the same lines, and a run stopped at
    step 2 and resumed ends there too."""
    _need_gpu_stack()
    make_qwen35(tmp_path / "ckpt")
    t = ("--temperature", "0.7")
    a, b, part = (simple_rl(tmp_path, name, 0, steps, *t)
                  for name, steps in (("a", 4), ("b", 4), ("part", 2)))
    saved = tmp_path / "runs" / "part" / "checkpoints" / "step_000002"
    resumed = simple_rl(tmp_path, "part", 0, 4, *t, "--resume", str(saved))
    check_identical(a[0], 4)
    assert a[0] == b[0] and a[1] == b[1] and a[2] == b[2]
    assert part[1] != a[1] and resumed[1] == a[1]
    check_identical(part[0], 2)
    check_identical(resumed[0], 2)
    print({"sha256": a[1], "lines": a[0]})
    print("\n".join(line for line in a[3].splitlines() if line.startswith("step")))  # timings


def test_every_token_of_every_turn_of_a_qwen35_bitwise_equal(tmp_path):
    """simple_rl.py on the Qwen3.5 above (with a chat template), 3 steps of 16 prompts x 8
    episodes of 1-4 turns, a tool message before each later turn: vLLM prefills each turn's
    whole request (no prefix cache) and the trainer replays every turn as a sample of its own;
    0 mismatched tokens at every step, every turn's tokens counted."""
    _need_gpu_stack()
    make_qwen35(tmp_path / "ckpt", "--chat")
    (tmp_path / "env.py").write_text(SCRIPTED_ENV)
    rows, _ = episode_run(tmp_path, "turns")
    steps = [r for r in rows if "loss" in r]
    print([{k: v for k, v in r.items() if k.startswith(("determinism/", "episode/"))}
           for r in steps])
    assert len(steps) == 3
    for r in steps:
        assert r["determinism/mismatched_tokens"] == 0 and r["determinism/max_abs_diff"] == 0, r
        assert r["episode/turns_mean"] > 1 and r["episode/tool_tokens_mean"] > 0, r


def test_lora_on_a_qwen35_every_token_bitwise_equal_and_deterministic(tmp_path):
    """simple_rl.py on the Qwen3.5 above with LoRA r16 on every default target (attention, MLP,
    and the linear attention's in_proj_qkv, in_proj_z and out_proj, vLLM's LoRA kernels on its
    4-slice in_proj_qkvz), 3 steps: every step's parity line identical, two runs one sha256."""
    _need_gpu_stack()
    make_qwen35(tmp_path / "ckpt")
    lora = ("--lora-rank", "16", "--lr", "1e-3")
    a, b = (simple_rl(tmp_path, name, 0, 3, *lora) for name in ("a", "b"))
    check_identical(a[0], 3)
    assert a[0] == b[0] and a[1] == b[1]
    print({"sha256": a[1], "lines": a[0]})


# Qwen3.5-4B whole (32 layers: 24 Gated DeltaNet, 8 gated attention), full fine-tuning, prompts
# of 1 to 1000 tokens, two steps (a push between): (new tokens, samples a prompt, flags). 256 at
# T = 1 with CUDA graphs; 2048 at T = 0.7 eager, fewer samples (131,072 generated tokens a step).
# Micro-batches as simple_rl picks them (4096 tokens: about 122 GiB estimated of an H200's 140).
FOUR_B = {"256-graphs": (256, 8, ()),
          "2048-t07-eager": (2048, 4, ("--temperature", "0.7", "--no-cuda-graphs"))}


@pytest.fixture(scope="module")
def qwen35_4b(tmp_path_factory):
    _need_gpu_stack()
    return make_qwen35(tmp_path_factory.mktemp("q35_4b") / "ckpt", shape=("--preset", "qwen3.5-4b"))


@pytest.mark.parametrize("run", list(FOUR_B))  # the shorter first
def test_every_token_of_qwen35_4b_bitwise_equal(qwen35_4b, tmp_path, run):
    """Qwen3.5-4B's exact shape (random weights): every generated token's logprob vLLM's, the
    weights equal after the push, three prompts alone sampling what they sampled among 16."""
    new, group, flags = FOUR_B[run]
    r = driver(tmp_path, "parity", "--ckpt", qwen35_4b, "--prompts", 16, "--group", group,
               "--max-new-tokens", new, "--steps", 2, "--max-prompt", 1000,
               "--micro-batch-tokens", 0, *flags)
    print({k: v for k, v in r.items() if k != "steps"}, *r["steps"], sep="\n")  # memory too
    check_every_step(r, 1000, 16 * group)
    assert r["batch_free"]
    assert all(s["max_completion"] == new for s in r["steps"])  # random weights: eos is rare


def test_simple_rl_on_qwen35_4b_is_exact_and_deterministic(qwen35_4b, tmp_path):
    """simple_rl.py on Qwen3.5-4B's exact shape with full fine-tuning, 2 steps at T = 0.7 at its
    defaults otherwise, twice: every step's parity line identical, one sha256, the same
    metrics, a gradient at every step. Then a run stopped at step 1 and resumed ends there
    too, where the disk holds the checkpoint (fp32 masters, Adam's two moments and the bf16
    export: 7x the bf16 weights, ~59 GB) beside the checkpoint read and the resume's export."""
    (tmp_path / "ckpt").symlink_to(qwen35_4b)
    t = ("--temperature", "0.7", "--save-every", "0")
    a, b = (simple_rl(tmp_path, name, 0, 2, *t) for name in ("a", "b"))
    check_identical(a[0], 2)
    assert a[0] == b[0] and a[1] == b[1] and a[2] == b[2]
    steps = [r for r in a[2] if "loss" in r]
    assert len(steps) == 2 and all(r["grad_norm"] > 0 for r in steps), steps  # it trains
    print({"sha256": a[1], "lines": a[0]})
    print("\n".join(line for line in a[3].splitlines() if line.startswith("step")))
    for name in ("a", "b"):  # the exports: room for the resume's checkpoint
        shutil.rmtree(tmp_path / "runs" / name / "final")
    weights = sum(f.stat().st_size for f in Path(qwen35_4b).glob("*.safetensors"))
    free = shutil.disk_usage(tmp_path).free
    if free < 8 * weights:  # the checkpoint (7x) and the resume's export (1x)
        pytest.skip(f"two runs at one sha256 {a[1][:8]}; no resume: {free / 2**30:.0f} GiB "
                    f"free, a checkpoint and an export take {8 * weights / 2**30:.0f}")
    part = simple_rl(tmp_path, "part", 0, 1, *t, "--save-every", "1")
    shutil.rmtree(tmp_path / "runs" / "part" / "final")  # the resume writes its own
    saved = tmp_path / "runs" / "part" / "checkpoints" / "step_000001"
    resumed = simple_rl(tmp_path, "part", 0, 2, *t, "--resume", str(saved))
    assert part[1] != a[1] and resumed[1] == a[1], (part[1], resumed[1], a[1])
    assert resumed[2] == a[2]  # the metrics of both steps
    check_identical(resumed[0])
