"""The console a user sees: one parity line and one step line per step, the table every
--parity-every steps, quiet libraries, and warnings only when they can be acted on."""

import logging
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

import simple_rl as rl
from conftest import ROOT
from helpers import ExactEngine, TorchEngine, cpu_argv, main_cpu, metrics_rows


STEP_LINE = re.compile(
    r"^step (\d+)/5 \| reward \d\.\d{3}( \| held-out \d\.\d{3})? \| loss [+-]\d\.\d{4} \| "
    r"(?:kl \d\.\d{4} \| )?ent \d+\.\d{3} \| "
    r"len \d+\.\d \| mismatched 0/\d+ \| rollout \d+\.\ds train \d+\.\ds push \d\.\d\ds \| "
    r"\d+\.\d s/step \| ETA [0-9hms]+$")  # ETA as format_duration writes it


def test_one_parity_line_and_one_step_line_per_step_and_the_table_every_n(ckpt, tmp_path, capsys):
    argv = cpu_argv(ckpt(), tmp_path / "runs", steps=5, parity_every=2, kl_coef=0.0,
                    micro_batch_tokens=4096, save_every=0)
    assert main_cpu(argv, ExactEngine) == 0
    out = capsys.readouterr().out.splitlines()
    steps = [line for line in out if line.startswith("step ")]
    assert [int(STEP_LINE.match(s).group(1)) for s in steps] == [1, 2, 3, 4, 5], steps
    assert not [s for s in steps if " kl " in s]  # --kl-coef 0: no reference model, no KL
    assert sum(line.startswith("parity: identical=yes | 0/") for line in out) == 5
    tables = [i for i, line in enumerate(out) if line.split()[:2] == ["sample", "pos/len"]]
    assert len(tables) == 3  # steps 0, 2 and 4 (--parity-every 2)
    assert steps[-1].endswith("ETA 0s") and out[-1].startswith("saved ")
    # the held-out eval: before the first step, in its line, and after the last, in its own
    assert [bool(STEP_LINE.match(s).group(2)) for s in steps] == [True] + [False] * 4
    assert re.fullmatch(r"held-out accuracy after 5 steps: \d\.\d{3} \(4 problems, greedy\)",
                        out[-2]), out[-2]
    assert not [line for line in out if "warning" in line.lower()]


def test_step_line_shows_gpu_memory_when_measured():
    m = dict(reward_mean=0.5, loss=-0.01, kl_div=0.0, entropy=1.0, completion_len_mean=10.0,
             **{"determinism/mismatched_tokens": 0, "determinism/tokens": 80,
                "time/rollout_s": 1.0, "time/train_s": 2.0, "time/push_s": 0.03})
    plain = rl.format_step(0, 2, m, 3.0, 3.0)
    assert "GiB" not in plain and "push 0.03s | 3.0 s/step" in plain
    assert " kl " not in rl.format_step(0, 2, {k: v for k, v in m.items() if k != "kl_div"},
                                        3.0, 3.0)  # --kl-coef 0: no reference model, no KL
    m["memory/in_use_gib"] = 66.6
    assert "push 0.03s | 67 GiB | 3.0 s/step | ETA 3s" in rl.format_step(0, 2, m, 3.0, 3.0)


def test_libraries_are_quiet_unless_verbose(monkeypatch):
    for name in ("VLLM_LOGGING_LEVEL", "TRANSFORMERS_VERBOSITY", "FLASHINFER_LOGGING_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    rl.quiet_console(verbose=True)
    assert "VLLM_LOGGING_LEVEL" not in os.environ
    rl.quiet_console(verbose=False)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "error"
    assert os.environ["FLASHINFER_LOGGING_LEVEL"] == "warning"
    assert logging.getLogger("torch._opaque_base").level == logging.ERROR


@pytest.mark.parametrize("verbose", [False, True])
def test_progress_bars_are_off_unless_verbose(verbose):
    """vLLM 0.34 draws a bar while it captures graphs; tqdm reads TQDM_DISABLE once, when it is
    imported, so simple_rl must set it before anything imports tqdm."""
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    code = "import simple_rl, tqdm; print(tqdm.tqdm(range(2)).disable)"
    out = subprocess.run([sys.executable, "-c", code, *(["--verbose"] if verbose else [])],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == [str(not verbose)], out.stderr[-2000:]


def test_expected_vllm_warnings_are_dropped_and_others_kept():
    def record(msg, args=None):
        return logging.LogRecord("vllm.engine", logging.WARNING, "x.py", 1, msg, args, None)

    assert not rl.ExpectedWarnings.filter(record("The global random seed is set to %d. ...", (0,)))
    # vLLM's JIT monitor, as it logs our backward kernels' first compile (message from args)
    assert not rl.ExpectedWarnings.filter(record(
        "%s %s during inference: %s%s. This causes a latency spike; consider extending warmup "
        "to cover this shape/config.", ("Triton kernel", "JIT compilation", "dq_kernel", "")))
    assert rl.ExpectedWarnings.filter(record("Not enough memory for the KV cache"))


def test_durations_read_like_a_clock():
    assert [rl.format_duration(s) for s in (0, 9.6, 61, 3599, 3600 * 2 + 65)] == \
        ["0s", "10s", "1m01s", "59m59s", "2h01m"]


class OneOff(TorchEngine):
    """The stand-in engine with one token's logprob off per step: a known mismatch."""

    def first_turn(self, prompts, indices, step):
        outs = super().first_turn(prompts, indices, step)
        outs[0][0].logprobs[0] += 0.5
        return outs


def test_reference_kernels_say_once_that_tokens_may_differ(ckpt, tmp_path, capsys):
    """Differences are expected with reference kernels: one note at the start, no
    `identical=no` line and no table each step; the step line still counts them."""
    argv = cpu_argv(ckpt(), tmp_path / "runs", steps=3, save_every=0, eval_size=0)
    assert main_cpu(argv, OneOff) == 0
    out = capsys.readouterr().out.splitlines()
    assert sum("only --kernels vllm on a GPU is bitwise" in line for line in out) == 1
    assert not [line for line in out if line.startswith("parity:")]
    assert not [line for line in out if line.split()[:2] == ["sample", "pos/len"]]
    steps = [line for line in out if line.startswith("step ")]
    assert len(steps) == 3 and all(re.search(r"mismatched [1-9]\d*/", s) for s in steps)


def test_the_mismatch_total_runs_across_a_resume(ckpt, tmp_path):
    """determinism/mismatched_tokens_total (the dashboard's chart): once off 0, never back,
    and a resume continues it from the steps before its checkpoint."""
    import itertools

    runs = tmp_path / "runs"
    assert main_cpu(cpu_argv(ckpt(), runs, steps=3, save_every=2, eval_size=0,
                             run_name="r"), OneOff) == 0
    step2 = runs / "r" / "checkpoints" / "step_000002"
    assert main_cpu(["--resume", str(step2), "--steps", "4"], OneOff) == 0
    rows = metrics_rows(runs / "r")
    per_step = [r["determinism/mismatched_tokens"] for r in rows]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and min(per_step) >= 1
    assert [r["determinism/mismatched_tokens_total"] for r in rows] == list(
        itertools.accumulate(per_step))


def test_vllms_own_logging_config_gets_the_filter(monkeypatch):
    """vLLM 0.34 builds its console handler from DEFAULT_LOGGING_CONFIG when its engine starts:
    quiet_vllm puts the filter there, once, and a handler built from it drops what is expected
    and passes the rest (a stand-in vllm.logger, with vLLM's shape of config)."""
    import copy
    import io
    import logging.config
    config = {"version": 1, "disable_existing_loggers": False,
              "handlers": {"vllm": {"class": "logging.StreamHandler", "stream": io.StringIO()}},
              "loggers": {"vllm": {"handlers": ["vllm"], "level": "WARNING",
                                   "propagate": False}}}
    fake = SimpleNamespace(DEFAULT_LOGGING_CONFIG=config)
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(logger=fake))
    monkeypatch.setitem(sys.modules, "vllm.logger", fake)
    rl.quiet_vllm(verbose=True)
    assert "filters" not in config["handlers"]["vllm"]
    rl.quiet_vllm(verbose=False)
    rl.quiet_vllm(verbose=False)
    assert config["handlers"]["vllm"]["filters"] == ["simple_rl"]
    stream = io.StringIO()
    built = copy.deepcopy(config)
    built["handlers"]["vllm"]["stream"] = stream
    logging.config.dictConfig(built)
    log = logging.getLogger("vllm.renderers.base")
    log.warning("Chat template warmup failed")
    log.warning("Not enough memory for the KV cache")
    assert stream.getvalue() == "Not enough memory for the KV cache\n"


def test_vllms_process_groups_end_before_ours(monkeypatch):
    """At exit vLLM 0.34's engine destroys its groups and raises if ours were destroyed first:
    end_process_groups tears down vLLM's state first (a stand-in records the order), then the
    default group (a real gloo group of one)."""
    calls = []
    stand_in = SimpleNamespace(
        destroy_model_parallel=lambda: calls.append(("model_parallel", rl.dist.is_initialized())),
        destroy_distributed_environment=lambda: calls.append(("world", rl.dist.is_initialized())))
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", stand_in)
    rl.dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    rl.end_process_groups()
    assert calls == [("model_parallel", True), ("world", True)]  # while ours was still alive
    assert not rl.dist.is_initialized()
    rl.end_process_groups()  # nothing left: a no-op
    assert len(calls) == 4 and not rl.dist.is_initialized()


# a step's metrics as report_step reads them, and a trainer of 10 steps on the given kernels
STEP_METRICS = {"reward_mean": 0.5, "loss": 0.1, "entropy": 1.0, "completion_len_mean": 4.0,
                "determinism/mismatched_tokens": 0, "determinism/tokens": 6,
                "time/rollout_s": 1.0, "time/train_s": 1.0, "time/push_s": 0.1}


def ten_steps_on(kernels: str, parity_every: int) -> SimpleNamespace:
    return SimpleNamespace(cfg=rl.Config(steps=10, parity_every=parity_every),
                           model=SimpleNamespace(ops=SimpleNamespace(name=kernels)))


def test_the_step_lines_eta_counts_the_steps_left_after_this_one(capsys):
    """step k of n (0-based) leaves n - k - 1 steps: at 60 s a step, step 8/10 shows ETA 2m00s
    and the last step ETA 0s."""
    trainer, m = ten_steps_on("reference", 1000), STEP_METRICS
    parity = rl.Parity(n_tokens=6, n_mismatch=0, max_abs_diff=0.0, table="")
    for step, eta in ((7, "ETA 2m00s"), (9, "ETA 0s")):
        capsys.readouterr()
        rl.report_step(trainer, step, False, m, parity, None, 60.0)
        line = capsys.readouterr().out.strip().splitlines()[-1]
        assert line.startswith(f"step {step + 1}/10 ") and line.endswith(f"60.0 s/step | {eta}")


def test_a_step_whose_tokens_differ_prints_its_table_between_parity_every_steps(capsys):
    """On the bitwise kernels the table of differing tokens is printed every --parity-every
    steps, at the first step this process runs (a resumed run's too), and at any step whose
    tokens differ: a mismatch at step 3 of a run checked every 4 shows where it differs then,
    not only in the counts (the table is the one place that says which sample and token went
    wrong first)."""
    trainer, m = ten_steps_on("vllm", 4), STEP_METRICS
    for step, first, differ, shown in ((1, True, 0, True), (2, False, 0, False),
                                       (3, False, 2, True), (4, False, 0, True)):
        parity = rl.Parity(n_tokens=6, n_mismatch=differ, max_abs_diff=0.5 * differ,
                           table="<the table>")
        capsys.readouterr()
        rl.report_step(trainer, step, first, {**m, "determinism/mismatched_tokens": differ},
                       parity, None, 1.0)
        out = capsys.readouterr().out
        assert ("<the table>" in out) == shown, (step, out)
        assert f"| {differ}/6 tokens differ |" in out


def test_a_steps_metrics_row_holds_its_scalars_but_the_weight_deltas(tmp_path):
    """report_step's row of metrics.jsonl: the step, then every scalar of the step but the
    weight_delta/ ones, which only TensorBoard gets (two a layer, and two a tensor with
    --log-param-deltas: they would swamp each row of the file)."""
    trainer, m = ten_steps_on("reference", 1000), STEP_METRICS
    parity = rl.Parity(n_tokens=6, n_mismatch=0, max_abs_diff=0.0, table="")
    deltas = {"weight_delta/layers.0/magnitude": 0.25, "weight_delta/norm/relative_change": 0.5}
    with (tmp_path / "metrics.jsonl").open("a") as log:
        rl.report_step(trainer, 3, False, {**m, **deltas}, parity, log, 1.0)
    assert metrics_rows(tmp_path) == [{"step": 3, **m}]
