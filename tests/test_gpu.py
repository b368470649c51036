"""GPU suite (pytest -m gpu): bitwise parity with vLLM, weight pushes, the debugger, run-to-run
determinism; on two GPUs (torchrun): the split rollout, Qwen3-8B, and N=2 determinism.

Each experiment runs in its own process (tests/gpu_driver.py or simple_rl.py itself), since a
vLLM engine holds process-wide state. Numbers land in the JSON each writes.
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


def _need_gpu_stack(gpus: int = 1):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    pytest.importorskip("vllm")
    pytest.importorskip("torchtitan")


def _env(**extra):
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, VLLM_BATCH_INVARIANT="1",
                VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=path, **extra)


def _launch(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}"]


def driver(tmp, mode, *flags, nproc=1, timeout=900) -> dict:
    out = tmp / f"{mode}_{nproc}_{abs(hash(flags))}.json"
    cmd = [*_launch(nproc), str(ROOT / "tests" / "gpu_driver.py"), mode, *map(str, flags),
           "--out", str(out)]
    subprocess.run(cmd, check=True, env=_env(), timeout=timeout)
    return json.loads(out.read_text())


def make_checkpoint(out: Path, preset: str) -> Path:
    if not (out / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "tests" / "make_checkpoint.py"), str(out),
                        "--preset", preset, "--device", "cuda"], check=True, timeout=900)
    return out


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory):
    _need_gpu_stack()
    cache = {}

    def get(*flags):
        if flags not in cache:
            cache[flags] = driver(tmp_path_factory.mktemp("parity"), "parity", *flags)
            print(json.dumps({"flags": flags, "steps": cache[flags]["steps"]}))
        return cache[flags]

    return get


# (tied head, T=1.0, eager engine) also serves the debugger; the others replay decode steps as
# CUDA graphs; every run but one sleeps the engine while the trainer runs
RUNS = {"tied-eager": ("--tied", "--temperature", "1.0", "--no-cuda-graphs", "--debug"),
        "untied-graphs": ("--no-tied", "--temperature", "0.7", "--cuda-graphs"),
        "tied-graphs-awake": ("--tied", "--temperature", "1.0", "--cuda-graphs",
                              "--no-engine-sleep")}


def check_parity_run(r, steps, samples, tokens_per_step):
    assert r["weights_equal_at_start"]
    # the engine was built to schedule step t + 1 while step t runs, and its linear layers
    # run on cuBLASLt on Hopper: the bits below hold with both, across pushes and sleep/wake
    assert r["async_scheduling"] is True
    assert r["batch_free"]  # per-request seeds: a sample does not depend on its batch
    assert r["linear_on_cublaslt"] is (torch.cuda.get_device_capability()[0] == 9)
    assert len(r["steps"]) == steps
    for s in r["steps"]:
        assert s["samples"] == samples and s["tokens"] > tokens_per_step
        assert s["mismatched"] == 0 and s["max_abs_diff"] == 0.0, s
        assert s["weights_equal_after_push"], s
        for rank in s["per_rank"]:  # every rank, every step
            assert rank["mismatched"] == 0 and rank["weights_equal_after_push"], rank
    assert any(s["loss"] != 0 for s in r["steps"])  # the weights really moved between pushes


@pytest.mark.parametrize("run", sorted(RUNS))
def test_every_token_bitwise_equal_across_weight_pushes(parity_runs, run):
    """16 prompts (1..220 tokens) x 8 samples, up to 256 new tokens, 4 GRPO steps + pushes."""
    r = parity_runs(*RUNS[run], "--steps", "4")
    check_parity_run(r, 4, 128, 10_000)
    for s in r["steps"]:
        assert s["prompt_lens"] == [1, 220] and s["max_completion"] == 256
    assert sum(s["stopped_at_eos"] for s in r["steps"]) > 0
    assert sum(s["hit_max_tokens"] for s in r["steps"]) > 0


def test_debugger_finds_nothing_then_names_an_injected_ulp(parity_runs):
    r = parity_runs(*RUNS["tied-eager"], "--steps", "4")
    for plen in (5, 120, 300):
        assert r[f"debug_{plen}"] == {"first": None, "n_bad": 0}
    assert r["debug_injected"]["first"] == "layers.1.feed_forward.act_fn"


def simple_rl(tmp, name, seed, steps, *extra, nproc=1):
    """simple_rl.py itself on the tiny checkpoint: its step/parity lines, sha256, metrics."""
    cmd = [*_launch(nproc), str(ROOT / "simple_rl.py"), "--model", str(tmp / "ckpt"),
           "--steps", str(steps), "--seed", str(seed), "--lr", "1e-4", "--entropy-coef", "0.01",
           "--max-new-tokens", "64", "--log-dir", str(tmp / "runs"), "--run-name", name,
           "--save-every", "2", *extra]
    logs = [tmp / f"{name}-{steps}.{end}" for end in ("out", "err")]  # kept if it never ends
    with open(logs[0], "w") as stdout, open(logs[1], "w") as stderr:
        done = subprocess.run(cmd, env=_env(), stdout=stdout, stderr=stderr, timeout=900)
    done.stdout, done.stderr = (log.read_text() for log in logs)
    out = finished(done).stdout + STDERR + done.stderr
    lines = [re.sub(r"\| rollout .*", "", line) for line in out.splitlines()
             if line.startswith(("step", "parity:"))]
    digest = re.search(r"weights sha256 ([0-9a-f]{64})", out).group(1)
    from helpers import metrics_rows  # here: tests/test_moe_gpu.py runs as a script too

    rows = metrics_rows(tmp / "runs" / name)
    return lines, digest, [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))}
                           for r in rows], out


def determinism_runs(tmp, nproc):
    make = [sys.executable, str(ROOT / "tests" / "make_checkpoint.py"), str(tmp / "ckpt")]
    subprocess.run(make, check=True)
    r = {k: simple_rl(tmp, k, seed, steps, nproc=nproc)
         for k, seed, steps in (("a", 0, 4), ("b", 0, 4), ("c", 1, 4), ("part", 0, 2))}
    saved = tmp / "runs" / "part" / "checkpoints" / "step_000002"
    r["resumed"] = simple_rl(tmp, "part", 0, 4, "--resume", str(saved), nproc=nproc)
    print(json.dumps({k: {"sha256": v[1], "lines": v[0]} for k, v in r.items()}, indent=1))
    return r


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    _need_gpu_stack()
    return determinism_runs(tmp_path_factory.mktemp("runs"), 1)


def check_determinism(r):
    (a_lines, a, a_rows, _), (b_lines, b, b_rows, _), c = r["a"], r["b"], r["c"][1]
    assert len(a_lines) == 8 and all("identical=yes" in s for s in a_lines
                                     if s.startswith("parity"))
    assert a_lines == b_lines and a_rows == b_rows and a == b
    assert c != a  # another seed, other weights
    (_, part, _, _), (r_lines, resumed, r_rows, _) = r["part"], r["resumed"]
    assert part != a
    assert resumed == a and r_rows == a_rows
    assert all("identical=yes" in s for s in r_lines if s.startswith("parity"))


def test_two_runs_same_seed_same_metrics_and_weights_and_resume(runs):
    check_determinism(runs)


STDERR = "\n--- stderr ---\n"  # simple_rl's stdout, then this, then its stderr


def test_console_is_quiet(runs):
    stdout, stderr = runs["a"][3].split(STDERR)
    out = stdout.splitlines()
    assert not [line for line in out if " INFO " in line or "Warning" in line
                or "deprecated" in line], out[:20]
    # stderr: no traceback at exit, no progress bar, no deprecation notice, and not torch's C++
    # warning that the cuBLAS flag vLLM sets is experimental
    noise = ("Traceback", "Capturing CUDA graphs", "deprecated", " INFO ", "WARNING", "Warning")
    assert not [line for line in stderr.splitlines() if any(n in line for n in noise)], stderr
    assert out[0].startswith("reading the weights of ")  # each checked finite, before vLLM
    assert out[1].startswith("starting vLLM on 1 GPU(s)"), out[:3]


# ---------------------------------------------------------------- two GPUs


@pytest.fixture(scope="module")
def two_gpu_runs(tmp_path_factory):
    _need_gpu_stack(2)
    return determinism_runs(tmp_path_factory.mktemp("runs2"), 2)


def test_two_gpus_same_seed_same_weights_and_resume(two_gpu_runs):
    check_determinism(two_gpu_runs)
    assert "2 rank(s)" in two_gpu_runs["a"][3]


def test_two_gpu_rollouts_equal_one_gpu_rollouts_at_qwen3_1p7b(tmp_path_factory):
    """Step 0, random Qwen3-1.7B weights: every sample's tokens and logprobs, N=1 vs N=2."""
    _need_gpu_stack(2)
    tmp = tmp_path_factory.mktemp("r17")
    ckpt = make_checkpoint(tmp / "ckpt", "qwen3-1.7b")
    flags = ("--ckpt", ckpt, "--prompts", "16", "--group", "8", "--max-new-tokens", "128")
    one = driver(tmp, "rollouts", *flags, nproc=1)
    two = driver(tmp, "rollouts", *flags, nproc=2)
    assert two["world"] == 2 and one["tokens"] == two["tokens"] > 10_000
    assert two["samples"] == one["samples"]  # bitwise: the same ids, the same fp32 logprobs
    print(json.dumps({"tokens": one["tokens"], "engine_start_s": [one["engine_start_s"],
                                                                  two["engine_start_s"]]}))


def two_hosts(tmp, mode, *flags) -> dict:
    """The driver as two one-GPU "hosts" (tests/helpers.launch_two_hosts), each seeing only its
    own GPU, which is its LOCAL_RANK 0."""
    from helpers import launch_two_hosts

    out = tmp / f"{mode}_two_hosts.json"
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "0,1").split(",")
    launch_two_hosts(ROOT / "tests" / "gpu_driver.py", [mode, *flags, "--out", out], _env(),
                     lambda i: {"CUDA_VISIBLE_DEVICES": gpus[i]})
    return json.loads(out.read_text())


def test_two_hosts_same_samples_as_two_gpus_of_one_host_and_bitwise_equal(tmp_path_factory):
    """Two one-GPU "hosts" give N = 2 on one host's samples, bit for bit, and 0 mismatched
    tokens over 3 steps of weight pushes."""
    _need_gpu_stack(2)
    tmp = tmp_path_factory.mktemp("hosts")
    flags = ("--prompts", "16", "--group", "8", "--max-new-tokens", "128")
    one_host = driver(tmp, "rollouts", *flags, nproc=2)
    hosts = two_hosts(tmp, "rollouts", *flags)
    assert hosts["world"] == 2 and hosts["tokens"] == one_host["tokens"] > 5_000
    assert hosts["samples"] == one_host["samples"]
    r = two_hosts(tmp, "parity", "--steps", "3", *flags)
    check_parity_run(r, 3, 128, 5_000)


def test_qwen3_8b_on_two_gpus_every_token_bitwise_equal(tmp_path_factory):
    """Qwen3-8B's exact shape, random weights, 2 GPUs: 5 steps of 16 prompts x 8 samples and
    256 new tokens, weights changing, the micro-batch simple_rl picks (4096): 0 mismatched
    tokens on every rank at every step."""
    _need_gpu_stack(2)
    tmp = tmp_path_factory.mktemp("q8b")
    ckpt = make_checkpoint(tmp / "ckpt", "qwen3-8b")
    r = driver(tmp, "parity", "--ckpt", ckpt, "--steps", "5", "--prompts", "16", "--group", "8",
               "--max-new-tokens", "256", "--lr", "1e-5", "--micro-batch-tokens", "0",
               nproc=2, timeout=1200)
    check_parity_run(r, 5, 128, 10_000)
    assert r["micro_batch_tokens"] == 4096
    print(json.dumps([{k: v for k, v in s.items()} for s in r["steps"]]))


# ---------------------------------------------------------------- memory at the defaults


def test_qwen3_4b_at_the_defaults_fits_an_h200_and_an_h100_is_told_what_would(tmp_path_factory):
    """Qwen3-4B's shape, random weights, simple_rl.py with its default batch (16 x 8, 256 new
    tokens, the largest micro-batch its estimate fits: 8192 on an H200) on one GPU: 2 steps,
    every token equal, memory within the GPU. Or, on a GPU below the README's measured peak
    (115 GiB: an H100), refused before vLLM starts, in one sentence stating a need above the
    GPU's size and a torchrun that would fit; never refused on a GPU above that peak."""
    _need_gpu_stack()
    tmp = tmp_path_factory.mktemp("q4b")
    ckpt = make_checkpoint(tmp / "ckpt", "qwen3-4b")
    cmd = [sys.executable, str(ROOT / "simple_rl.py"), "--model", str(ckpt), "--steps", "2",
           "--save-every", "0", "--log-dir", str(tmp / "runs"), "--run-name", "q4b"]
    run = subprocess.run(cmd, env=_env(), timeout=900, capture_output=True, text=True)
    print(run.stdout[-4000:], run.stderr[-4000:])
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    if run.returncode == 2:  # refused
        need = int(re.search(r"needs about (\d+) GiB per GPU", run.stderr).group(1))
        assert total < need and total < 115 and "starting vLLM" not in run.stdout, need
        assert f"this GPU has {total:.0f} GiB" in run.stderr
        assert re.search(r"`torchrun --nproc-per-node \d+ simple_rl.py \.\.\.`", run.stderr)
        return
    assert run.returncode == 0, run.stderr[-2000:]
    from helpers import metrics_rows

    rows = metrics_rows(tmp / "runs" / "q4b")
    assert len(rows) == 2
    for r in rows:
        assert r["determinism/mismatched_tokens"] == 0 and r["determinism/tokens"] > 16_000, r
        assert 0 < r["memory/in_use_gib"] <= total, r
    print(json.dumps([{k: v for k, v in r.items() if k.startswith(("memory", "time"))}
                      for r in rows]))


# ---------------------------------------------------------------- it learns

# The README's learning run, less its length: the flags after --model.
LEARNING_RUN = ["--num-prompts", "64", "--group-size", "8", "--max-new-tokens", "80",
                "--max-model-len", "128", "--lr", "1e-4", "--temperature", "1.0",
                "--eval-size", "512", "--no-engine-sleep"]


@pytest.mark.parametrize("arch, gain", [("qwen3", 0.10), ("qwen3.5", 0.20)])
def test_grpo_raises_the_held_out_accuracy_of_a_warm_start(tmp_path_factory, arch, gain):
    """examples/warm_start.py's model of the architecture (or, for Qwen3, the one
    SIMPLE_RL_WARM_START names), then simple_rl.py from it on one GPU: greedy accuracy on
    held-out problems rises by at least `gain` in 60 steps (Qwen3.5: 20 points, as its issue
    asks), and no generated token's logprob differs at any step."""
    _need_gpu_stack()
    tmp = tmp_path_factory.mktemp("learn")
    given = os.environ.get("SIMPLE_RL_WARM_START") if arch == "qwen3" else None
    warm = given or str(tmp / "warm")
    if not given:
        subprocess.run([sys.executable, str(ROOT / "examples" / "warm_start.py"), "--arch", arch,
                        "--out", warm], check=True, timeout=900)
    cmd = [sys.executable, str(ROOT / "simple_rl.py"), "--model", warm, *LEARNING_RUN,
           "--steps", "60", "--eval-every", "20", "--save-every", "0",
           "--log-dir", str(tmp / "runs"), "--run-name", "learn"]
    subprocess.run(cmd, check=True, env=_env(), timeout=900)
    from helpers import metrics_rows

    rows = metrics_rows(tmp / "runs" / "learn")
    acc = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    steps = [r for r in rows if "loss" in r]
    print(json.dumps({"held_out_accuracy": acc,
                      "reward_mean": [round(r["reward_mean"], 3) for r in steps]}))
    assert sorted(acc) == [0, 20, 40, 60]
    assert acc[60] >= acc[0] + gain, acc
    assert len(steps) == 60
    assert all(r["determinism/mismatched_tokens"] == 0 and r["determinism/tokens"] > 5000
               for r in steps)


# ---------------------------------------------------------------- episodes of several turns

# The env answers after every turn until turn K (3 or 4, by the length of the episode's first
# turn), whatever the model wrote: every episode has 3+ turns, and a prompt's episodes end at
# different turns.
SCRIPTED_ENV = '''
class Scripted:
    def reset(self, problem):
        self.turns = 0
        return problem.question

    def step(self, completion):
        self.turns += 1
        if self.turns == 1:  # 3 or 4 turns, by what this episode sampled first
            self.last = 3 + len(completion) % 2
        if self.turns < self.last:
            return f"result {self.turns}: {len(completion)}", None
        return None, float(len(completion) % 2)
'''


def episode_run(tmp, name, *extra):
    """simple_rl.py on a tiny random Qwen3 with a chat template and the scripted env: metrics
    rows and the weights sha256."""
    out = episode_console(tmp, name, *extra)
    from helpers import metrics_rows

    return metrics_rows(tmp / "runs" / name), re.search(r"weights sha256 ([0-9a-f]{64})",
                                                       out).group(1)


def episode_console(tmp, name, *extra) -> str:
    if not (tmp / "ckpt" / "config.json").is_file():
        from helpers import make_checkpoint as tiny

        tiny(tmp / "ckpt", dtype=torch.bfloat16, chat=True)
        (tmp / "env.py").write_text(SCRIPTED_ENV)
    cmd = [sys.executable, str(ROOT / "simple_rl.py"), "--model", str(tmp / "ckpt"),
           "--env", f"{tmp / 'env.py'}:Scripted", "--max-turns", "4", "--steps", "3",
           "--num-prompts", "16", "--group-size", "8", "--max-new-tokens", "48",
           "--max-model-len", "512", "--lr", "1e-4", "--entropy-coef", "0.01",
           "--eval-size", "16", "--save-every", "0", "--log-dir", str(tmp / "runs"),
           "--run-name", name, *extra]
    return finished(subprocess.run(cmd, env=_env(), capture_output=True, text=True,
                                   timeout=900)).stdout


def finished(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """The run, if it succeeded; else the test fails with the end of what it printed (its
    traceback), which capture_output would otherwise keep from the log."""
    if done.returncode:
        pytest.fail(f"{' '.join(map(str, done.args[:3]))} ... exited {done.returncode}:\n"
                    f"{done.stdout[-1500:]}{STDERR}{done.stderr[-4000:]}", pytrace=False)
    return done


@pytest.mark.parametrize("temperature", ["1.0", "0.7"])
def test_every_token_of_every_turn_bitwise_equal_with_prefix_caching(tmp_path_factory,
                                                                     temperature):
    """3 steps of 16 prompts x 8 episodes of 3-4 turns (each turn after the episode so far
    and a tool message, prefilled from vLLM's prefix cache), pushes between: 0 mismatched
    tokens at every step; the same run without prefix caching trains to the same weights."""
    _need_gpu_stack()
    tmp = tmp_path_factory.mktemp(f"episodes{temperature}")
    rows, digest = episode_run(tmp, "cached", "--temperature", temperature)
    steps = [r for r in rows if "loss" in r]
    print(json.dumps([{k: v for k, v in r.items() if k.startswith(("determinism/", "episode/",
                                                                   "time/rollout"))}
                      for r in steps]))
    assert len(steps) == 3
    for r in steps:
        assert r["determinism/mismatched_tokens"] == 0 and r["determinism/max_abs_diff"] == 0
        assert 3 <= r["episode/turns_mean"] <= 4 and r["episode/turns_mean"] not in (3, 4)
        assert r["determinism/tokens"] > 128 * 3 * 20  # every generated token of every turn
        assert r["episode/tool_tokens_mean"] > 0
    if temperature == "1.0":
        _, uncached = episode_run(tmp, "uncached", "--temperature", temperature,
                                  "--no-prefix-caching")
        assert uncached == digest


def test_debugger_follows_every_turn_through_the_prefix_cache(tmp_path_factory):
    """--debug-parity with the scripted env: step 0's first episode, 3-4 turns, each later turn
    prefilled from vLLM's prefix cache; every traced op of every row vLLM computed in every
    turn equals the trainer's at the same position, bit for bit."""
    _need_gpu_stack()
    out = episode_console(tmp_path_factory.mktemp("episodes_debug"), "debug", "--debug-parity")
    print(out)
    turns = re.search(r"^(\d) turn\(s\); .* per turn: (.*)$", out, re.M)
    cached = [int(c) for c in re.findall(r"\((\d+)\)", turns.group(2))]
    assert int(turns.group(1)) >= 3 and cached[0] == 0 and min(cached[1:]) > 0, turns.group(0)
    assert re.search(r"^layers\.1\.feed_forward\.w2 +0 +[1-9]", out, re.M)
    assert "no divergence" in out and "generated-token logprobs that differ: 0" in out


CALC_RUN = ["--env", "calc", "--max-turns", "3", *LEARNING_RUN, "--steps", "60",
            "--eval-every", "20", "--save-every", "0"]


def test_grpo_learns_to_call_the_calculator(tmp_path_factory):
    """examples/warm_start.py --tool (or SIMPLE_RL_TOOL_WARM_START), then simple_rl.py --env
    calc for 60 steps on one GPU: greedy held-out accuracy, tools included, rises by at least
    20 points, the tool-call rate rises, no generated token of any turn differs at any step;
    the same run without prefix caching ends with the same weights."""
    _need_gpu_stack()
    tmp = tmp_path_factory.mktemp("calc")
    warm = os.environ.get("SIMPLE_RL_TOOL_WARM_START") or str(tmp / "warm")
    if not os.environ.get("SIMPLE_RL_TOOL_WARM_START"):
        subprocess.run([sys.executable, str(ROOT / "examples" / "warm_start.py"), "--tool",
                        "--out", warm], check=True, timeout=900)
    from helpers import metrics_rows

    digests, rows = {}, {}
    for name, extra in (("cached", []), ("uncached", ["--no-prefix-caching"])):
        cmd = [sys.executable, str(ROOT / "simple_rl.py"), "--model", warm, *CALC_RUN, *extra,
               "--log-dir", str(tmp / "runs"), "--run-name", name]
        out = subprocess.run(cmd, check=True, env=_env(), capture_output=True, text=True,
                             timeout=900).stdout
        digests[name] = re.search(r"weights sha256 ([0-9a-f]{64})", out).group(1)
        rows[name] = metrics_rows(tmp / "runs" / name)
    acc = {r["step"]: r["eval/accuracy"] for r in rows["cached"] if "eval/accuracy" in r}
    calls = {r["step"]: r["eval/tool_call_frac"] for r in rows["cached"] if "eval/accuracy" in r}
    steps = [r for r in rows["cached"] if "loss" in r]
    print(json.dumps({"held_out_accuracy": acc, "held_out_tool_calls": calls,
                      "sha256": digests,
                      "tool_call_frac": [round(r["episode/tool_call_frac"], 3) for r in steps],
                      "turns": [round(r["episode/turns_mean"], 2) for r in steps],
                      "tokens": [r["determinism/tokens"] for r in steps],
                      "mismatched": [r["determinism/mismatched_tokens"] for r in steps],
                      "rollout_s": [round(r["time/rollout_s"], 2) for r in steps]}))
    assert sorted(acc) == [0, 20, 40, 60]
    assert acc[60] >= acc[0] + 0.20, acc
    assert calls[60] > calls[0], calls
    assert steps[-1]["episode/tool_call_frac"] > steps[0]["episode/tool_call_frac"]
    assert len(steps) == 60
    assert all(r["determinism/mismatched_tokens"] == 0 and r["determinism/tokens"] > 4000
               for r in steps), [r["determinism/mismatched_tokens"] for r in steps]
    assert digests["uncached"] == digests["cached"]
