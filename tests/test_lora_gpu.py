"""GPU suite for LoRA (pytest -m gpu): the trainer adds its adapters with vLLM's own LoRA
kernels (lora_shrink, lora_expand) on the engine's own tensors, so every generated token's
logprob equals vLLM's with the adapter active: at T = 1 and 0.7, eager and CUDA graphs, with the
KL reference (the adapters off), across resumes and episodes of several turns with the prefix
cache on. Qwen3-14B's and Qwen3.5-9B's exact shapes at the defaults on one GPU; Qwen3-32B's and
Qwen3.5-27B's layers, cut, for the memory estimate.

    python tests/test_lora_gpu.py 14b OUT.json     # the 14B run alone, as a script
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from test_gpu import _env, _need_gpu_stack, episode_run, simple_rl  # noqa: E402

pytestmark = pytest.mark.gpu

LORA = ("--lora-rank", "16", "--lr", "2e-3")


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    _need_gpu_stack()
    tmp = tmp_path_factory.mktemp("lora")
    subprocess.run([sys.executable, str(ROOT / "tests" / "make_checkpoint.py"), str(tmp / "ckpt")],
                   check=True)
    kl = (*LORA, "--kl-coef", "0.05")
    r = {"a": simple_rl(tmp, "a", 0, 4, *kl), "b": simple_rl(tmp, "b", 0, 4, *kl),
         "t07": simple_rl(tmp, "t07", 0, 3, *LORA, "--temperature", "0.7", "--no-cuda-graphs"),
         "part": simple_rl(tmp, "part", 0, 2, *kl)}
    saved = tmp / "runs" / "part" / "checkpoints" / "step_000002"
    r["resumed"] = simple_rl(tmp, "part", 0, 4, "--resume", str(saved))
    r["tmp"] = tmp
    print(json.dumps({k: {"sha256": v[1], "lines": v[0]} for k, v in r.items() if k != "tmp"},
                     indent=1))
    return r


def test_lora_every_token_bitwise_equal_deterministic_and_resumable(lora_runs):
    r = lora_runs
    (a_lines, a, a_rows, a_out), (b_lines, b, b_rows, _) = r["a"], r["b"]
    for name in ("a", "b", "t07", "resumed"):
        lines, _, rows, _ = r[name]
        assert all("identical=yes" in s for s in lines if s.startswith("parity")), lines
        assert all(row["determinism/mismatched_tokens"] == 0 for row in rows if "loss" in row)
        assert all(row["determinism/tokens"] > 2000 for row in rows if "loss" in row)
    assert a_lines == b_lines and a_rows == b_rows and a == b  # run to run
    assert r["resumed"][1] == a and r["resumed"][2] == a_rows  # a resume, bit for bit
    steps = [row for row in a_rows if "loss" in row]
    # the adapter starts at B = 0 (the base: KL 0), then moves the policy off it
    assert steps[0]["kl_div"] == 0 and all(s["kl_div"] > 0 for s in steps[1:]), steps
    final = r["tmp"] / "runs" / "a" / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] == 16 and (final / "adapter_model.safetensors")
    assert "params, LoRA rank 16 on" in a_out


# The GPU suite's determinism run (tests/test_gpu.py, run "a") ends at these weights on vLLM 0.34
# (results/h200_vllm034/): full fine-tuning is the same path with LoRA in it.
FULL_FT_SHA256 = "694c224a67a8798ebd04afd52c2529639939a3b8148f5661794b04047170f4c8"


def test_full_fine_tuning_still_ends_at_its_sha256(lora_runs):
    _, digest, _, _ = simple_rl(lora_runs["tmp"], "full", 0, 4)
    assert digest == FULL_FT_SHA256


def test_lora_every_token_of_every_turn_bitwise_equal_with_prefix_caching(tmp_path_factory):
    """The scripted env's episodes of 3-4 turns (tests/test_gpu.py), LoRA at T = 0.7: 0
    mismatched tokens at every step; without the prefix cache, the same weights."""
    _need_gpu_stack()
    tmp = tmp_path_factory.mktemp("lora_episodes")
    rows, digest = episode_run(tmp, "cached", "--temperature", "0.7", *LORA)
    steps = [row for row in rows if "loss" in row]
    assert len(steps) == 3
    for row in steps:
        assert row["determinism/mismatched_tokens"] == 0 and row["determinism/tokens"] > 5000
        assert row["episode/turns_mean"] >= 3 and row["episode/tool_tokens_mean"] > 0
    _, uncached = episode_run(tmp, "uncached", "--temperature", "0.7", "--no-prefix-caching",
                              *LORA)
    assert uncached == digest


def test_lora_weight_gradients_sum_every_token_in_chunks():
    """token_sum_mm (the adapters' dA, dB): the tokens in chunks on their own tiles, the chunks
    summed in order; within fp32's rounding of an fp64 sum, at chunk counts from 1 to 64 and a
    T no chunk divides, and the same bits on every call."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import batch_invariant_backward as bib

    g = torch.Generator(device="cuda").manual_seed(0)
    for T, M, N in ((32768, 48, 2048), (5001, 16, 6144), (300, 2048, 16), (8192, 6144, 64)):
        left = torch.randn(T, M, device="cuda", generator=g).to(torch.bfloat16)
        right = torch.randn(T, N, device="cuda", generator=g).to(torch.bfloat16)
        out = bib.token_sum_mm(left, right)
        exact = left.double().t() @ right.double()  # (M, N)
        assert out.dtype == torch.float32 and out.shape == (M, N)
        assert (out.double() - exact).abs().max() <= 1e-6 * T ** 0.5 * exact.abs().max() + 1e-3
        assert torch.equal(out, bib.token_sum_mm(left, right))


def big_lora_run(tmp: Path, preset: str, layers: int | None, *flags) -> dict:
    """simple_rl.py --lora-rank 16 on a random checkpoint of a published shape (its layers cut
    to `layers`), at the defaults but for `flags`: metrics and the banner's estimate."""
    ckpt = tmp / "ckpt"
    make = [sys.executable, str(ROOT / "tests" / "make_checkpoint.py"), str(ckpt), "--preset",
            preset, "--device", "cuda", *(["--layers", str(layers)] if layers else [])]
    subprocess.run(make, check=True, timeout=900)
    # the entropy bonus moves the adapter off B = 0 though a random model earns no reward
    cmd = [sys.executable, str(ROOT / "simple_rl.py"), "--model", str(ckpt), "--lora-rank", "16",
           "--lr", "1e-4", "--entropy-coef", "0.01", "--save-every", "0", "--log-dir",
           str(tmp / "runs"), "--run-name", "r", *flags]
    out = subprocess.run(cmd, check=True, env=_env(), capture_output=True, text=True,
                         timeout=1500).stdout
    print(out[-4000:])
    from helpers import metrics_rows

    rows = metrics_rows(tmp / "runs" / "r")
    banner = next(line for line in out.splitlines() if line.startswith("simple_rl |"))
    estimate = float(banner.split(" GiB per GPU (estimate)")[0].rsplit("~", 1)[1].split(" ")[0])
    steps = [r for r in rows if "loss" in r]
    return dict(steps=steps, estimate_gib=estimate, banner=banner,
                peak_gib=max(r["memory/in_use_gib"] for r in steps),
                mismatched=sum(r["determinism/mismatched_tokens"] for r in steps),
                tokens=sum(r["determinism/tokens"] for r in steps),
                step_s=[r["time/step_s"] for r in steps], push_s=[r["time/push_s"] for r in steps],
                wake_s=[r["time/engine_wake_s"] for r in steps],
                memory=[{k: v for k, v in r.items() if k.startswith("memory/")} for r in steps])


def test_qwen3_14b_lora_at_the_defaults_on_one_gpu(tmp_path_factory):
    """Qwen3-14B's exact shape (random weights), LoRA rank 16 at the defaults (16 x 8, 256 new
    tokens), one GPU: 5 steps, every token equal, the adapter's push (written in place) within
    50 ms and the engine's wake (the trainer's allocator emptied, the KV cache mapped again)
    within 0.5 s, memory within the GPU and the estimate within 15% of the largest step's."""
    _need_gpu_stack()
    r = big_lora_run(tmp_path_factory.mktemp("q14b"), "qwen3-14b", None, "--steps", "5")
    print(json.dumps({k: v for k, v in r.items() if k != "steps"}))
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    assert len(r["steps"]) == 5 and r["mismatched"] == 0 and r["tokens"] > 5 * 16_000
    assert r["peak_gib"] <= total and max(r["wake_s"]) < 0.5
    assert max(p - w for p, w in zip(r["push_s"], r["wake_s"])) < 0.05
    assert abs(r["estimate_gib"] / r["peak_gib"] - 1) <= 0.15, r


@pytest.mark.parametrize("preset,layers,flags", [
    ("qwen3.5-9b", None, ()),
    # 8 of its 64 layers (the disk holds no 27B), at the micro-batch all 64 pick on an H200
    ("qwen3.5-27b", 8, ("--micro-batch-tokens", "4096")),
])
def test_qwen35_lora_at_published_shapes_within_the_estimate(tmp_path_factory, preset, layers,
                                                            flags):
    """Qwen3.5-9B's exact shape and 27B's layers (random weights), LoRA rank 16 on every default
    target (the Gated DeltaNet's in- and out-projections too) at the defaults, one GPU, 3 steps:
    every token equal, and the banner's estimate within 15% of the largest step's memory. On
    one H100 with LoRA's fixed margin at 3 GiB: 9B 68.7 GiB in use against ~76.3 estimated
    (1.11x), 27B's cut layers 23.4 against ~26.3 (1.12x) (results/h100_q35_routes/; 27B was
    1.17x with 4 GiB: results/h100_q35_early_stops/)."""
    _need_gpu_stack()
    r = big_lora_run(tmp_path_factory.mktemp(preset), preset, layers, "--steps", "3",
                     "--eval-size", "0", *flags)
    print(json.dumps({k: v for k, v in r.items() if k != "steps"}))
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    assert len(r["steps"]) == 3 and r["mismatched"] == 0 and r["tokens"] > 3 * 16_000
    assert r["peak_gib"] <= total
    assert abs(r["estimate_gib"] / r["peak_gib"] - 1) <= 0.15, r


if __name__ == "__main__":  # python tests/test_lora_gpu.py {14b,32b-cut} OUT.json [LAYERS]
    import tempfile

    which, out = sys.argv[1], Path(sys.argv[2])
    tmp = Path(tempfile.mkdtemp())
    if which == "14b":
        r = big_lora_run(tmp, "qwen3-14b", None, "--steps", "5")
    else:  # Qwen3-32B's layers, cut to fit the disk, at the micro-batch 64 layers would pick
        r = big_lora_run(tmp, "qwen3-32b", int(sys.argv[3]), "--steps", "3",
                         "--micro-batch-tokens", "2048", "--eval-size", "16")
    out.write_text(json.dumps(r, indent=1))
    print(json.dumps({k: v for k, v in r.items() if k != "steps"}, indent=1))
