"""Two processes on gloo (CPU), as torchrun starts them: the split rollout, the FSDP2 gradient,
and checkpoints that resume at the same or another world size."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import cpu_argv, launch_two_hosts, metrics_rows

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "dist_driver.py"


def driver_env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def launch(nproc: int, *args, check=True, timeout=600) -> subprocess.CompletedProcess:
    """The driver under torchrun with `nproc` processes, or plainly for one."""
    runner = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
              "--standalone"] if nproc > 1 else [sys.executable]
    out = subprocess.run([*runner, str(DRIVER), *map(str, args)], env=driver_env(),
                         capture_output=True, text=True, timeout=timeout)
    assert not check or out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def sha_of(out: subprocess.CompletedProcess) -> str:
    return re.search(r"weights sha256 ([0-9a-f]{64})", out.stdout).group(1)


def metrics(run_dir: Path) -> list[dict]:
    return metrics_rows(run_dir, timings=False)


@pytest.mark.parametrize("lora_rank", [0, 8])
def test_two_ranks_sample_what_one_does_and_compute_its_gradient(ckpt, tmp_path, lora_rank):
    """FSDP2 over 2 ranks: every trained weight's gradient (under LoRA the adapters', FSDP2
    sharding them alone while every rank holds the frozen base) is one process's."""
    results = {}
    for n in (1, 2):
        out = tmp_path / f"n{n}.pt"
        launch(n, "rollout-grads", "--model", ckpt(), "--log-dir", tmp_path / f"runs{n}",
               "--out", out, "--lora-rank", lora_rank)
        results[n] = torch.load(out, weights_only=True)
    one, two = results[1], results[2]
    assert two["world"] == 2 and one["world"] == 1
    one_s, two_s = json.loads(one["samples"]), json.loads(two["samples"])
    assert len(one_s) == 3  # prompts 0 and 2 on rank 0, prompt 1 on rank 1
    assert [c for c, _ in two_s] == [c for c, _ in one_s]  # the same tokens, sample for sample
    # the same logprobs up to the CPU stand-in's batch-dependent rounding (vLLM's are bitwise:
    # the GPU suite checks that)
    flat = [torch.tensor(sum(lp, [])) for lp in ([x for _, lps in s for x in lps]
                                                for s in (one_s, two_s))]
    torch.testing.assert_close(flat[1], flat[0], atol=1e-5, rtol=0)
    for name, a in one["grads"].items():
        b = two["grads"][name]
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-4, msg=name)  # fp32 sum order only
        if ".lora.a." in name:  # B starts at 0, so dA = (gy B)^T x does too
            assert a.abs().sum() == 0, name
        else:
            assert a.abs().sum() > 0, name
    assert len(one["grads"]) == (2 * 14 if lora_rank else 2 * 8 + 2)  # every trained one


def test_fsdp_keeps_a_qwen35s_a_log_in_fp32(q35, tmp_path):
    """FSDP2 gathers a bf16 run's masters as bf16 casts; Gated DeltaNet's A_log is used in fp32
    (as vLLM keeps it), so its layer is gathered in fp32: every forward on 2 ranks sees it so,
    and the gradients are one process's."""
    results = {}
    for n in (1, 2):
        out = tmp_path / f"n{n}.pt"
        launch(n, "rollout-grads", "--model", q35(dtype=torch.bfloat16), "--log-dir",
               tmp_path / f"runs{n}", "--out", out, "--dtype", "bfloat16")
        results[n] = torch.load(out, weights_only=True)
    seen = results[2]["a_log_dtypes"]
    assert seen and set(seen) == {"torch.float32"} == set(results[1]["a_log_dtypes"])
    for name, a in results[1]["grads"].items():
        torch.testing.assert_close(results[2]["grads"][name], a, atol=1e-2, rtol=5e-2,
                                   msg=name)  # bf16 activations: sums in another order


TWO_RANKS = dict(num_prompts=3, micro_batch_tokens=128)


@pytest.fixture(scope="module")
def two_rank_run(ckpt, tmp_path_factory):
    """A 2-step run on 2 ranks (checkpoint at step 2): (its output, its metrics as they were
    when it ended, its run directory). Launched once for the two tests that need it."""
    runs = tmp_path_factory.mktemp("two_ranks") / "runs"
    out = launch(2, "main", *cpu_argv(ckpt(), runs, **TWO_RANKS), "--steps", "2",
                 "--run-name", "part")
    return out, metrics(runs / "part"), runs / "part"


def test_two_rank_checkpoints_resume_at_two_exactly_and_at_one(ckpt, tmp_path, two_rank_run):
    part = two_rank_run[2]
    base = cpu_argv(ckpt(), tmp_path / "runs", **TWO_RANKS)
    whole = launch(2, "main", *base, "--steps", "4", "--run-name", "whole")
    assert "2 rank(s)" in whole.stdout and whole.stdout.count("| weights sha256") == 1
    saved = part / "checkpoints" / "step_000002"
    assert sorted(p.name for p in (saved / "trainer").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]  # a shard per rank
    assert json.loads((saved / "state.json").read_text())["world_size"] == 2
    resumed = launch(2, "main", "--resume", saved, "--steps", "4")
    assert sha_of(resumed) == sha_of(whole)
    assert metrics(part) == metrics(tmp_path / "runs" / "whole")
    # another world size: DCP reshards the masters and AdamW state; the run goes on
    again = launch(1, "main", "--resume", saved, "--steps", "3", "--output-dir",
                   tmp_path / "one")
    assert "1 rank(s)" in again.stdout and (tmp_path / "one" / "model.safetensors").is_file()
    rows = metrics(part)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # 3: the final held-out eval's own row
    assert "loss" not in rows[3] and "eval/accuracy" in rows[3]
    assert rows[2]["loss"] == pytest.approx(metrics(tmp_path / "runs" / "whole")[2]["loss"],
                                            rel=1e-4)


def test_a_reward_failing_on_one_rank_stops_every_rank(ckpt, tmp_path):
    """Rank 1's reward raises in the first eval: both ranks stop at once (no rank waits in a
    collective until the timeout), and rank 0 says which held-out problem it was."""
    fn = tmp_path / "rank1.py"
    fn.write_text("import os\n\nCALLS = [0]\n\n\ndef score(completion, answer):\n"
                  "    CALLS[0] += 1\n    if os.environ['RANK'] == '1' and CALLS[0] > 1:\n"
                  "        raise RuntimeError('only on rank 1')\n    return 0.0\n")
    out = launch(2, "main", *cpu_argv(ckpt(), tmp_path / "runs", steps=2, save_every=0,
                                      run_name="r1", reward=f"{fn}:score"), check=False,
                 timeout=180)  # far below the collectives' 10-minute timeout: no rank waited
    assert out.returncode != 0
    assert "step 1/2: the reward" in out.stderr and "raised RuntimeError: only on rank 1 on " \
        "held-out problem 1," in out.stderr, out.stderr[-3000:]


def test_two_hosts_train_as_two_processes_of_one_host(ckpt, tmp_path, two_rank_run):
    """The multi-host launch (two launchers, c10d rendezvous, a shared --log-dir) gives the run
    that `--nproc-per-node 2` gives on one host: the same metrics and final weights."""
    one_host, one_host_rows, _ = two_rank_run
    base = cpu_argv(ckpt(), tmp_path / "runs", **TWO_RANKS)
    outs = launch_two_hosts(DRIVER, ["main", *base, "--steps", "2", "--run-name", "two_hosts"],
                            driver_env(), timeout=600)
    main = [o for o in outs if "| weights sha256" in o]
    assert len(main) == 1 and "2 rank(s)" in main[0]  # one rank 0, whichever host it landed on
    assert re.search(r"weights sha256 ([0-9a-f]{64})", main[0]).group(1) == sha_of(one_host)
    assert metrics(tmp_path / "runs" / "two_hosts") == one_host_rows


def check_under_torchrun(argv: list, env: dict) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node 2 simple_rl.py ... --check` as a user types it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
           str(ROOT / "simple_rl.py"), *map(str, argv), "--check"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_check_under_torchrun_needs_no_gpu_and_names_a_bad_reward(ckpt, tmp_path):
    """Both ranks run every CPU check on gloo; without CUDA a good run's --check passes and a
    bad --reward is named in one sentence, exit 2 on each rank (torchrun itself then says 1)."""
    env = dict(driver_env(), CUDA_VISIBLE_DEVICES="")
    argv = ["--model", ckpt(), "--log-dir", tmp_path / "runs", "--run-name", "r"]
    good = check_under_torchrun(argv, env)
    assert good.returncode == 0, good.stderr[-3000:]
    lines = good.stdout.splitlines()
    assert len(lines) == 8 and all(line.startswith("check: ") for line in lines), good.stdout
    assert "check: reward simple_rl.reward: takes (completion, answer), gives 0 on an empty " \
        "completion" in lines
    assert "no CUDA GPU found" not in good.stdout + good.stderr
    assert not (tmp_path / "runs").exists()
    fn = tmp_path / "bad.py"
    fn.write_text("def score(completion):\n    return 0.0\n")
    bad = check_under_torchrun([*argv, "--reward", f"{fn}:score"], env)
    sentence = (f"simple_rl: error: --reward: score(completion) in {fn} must take "
                "(completion, answer).")
    # each rank fails on its own, and rank 0 says it (torchrun's summary gives the causes)
    said = [line for line in bad.stderr.splitlines() if line.startswith("simple_rl")]
    if said:
        assert said == [sentence], bad.stderr[-3000:]
    else:  # rank 1 ended first, and torchrun's SIGTERM cut rank 0 short
        assert f"traceback : {sentence}" in bad.stderr, bad.stderr[-3000:]
    passed = [line.split(":")[1].split()[0] for line in bad.stdout.splitlines()]
    checks = ["config", "run", "model", "tokenizer", "data"]  # then the reward failed
    assert passed == (checks if said else checks[:len(passed)]) and bad.returncode != 0
    assert "exitcode  : 2" in bad.stderr and "no CUDA GPU found" not in bad.stderr
