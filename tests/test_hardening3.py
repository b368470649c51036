"""Hardening, third pass: a checkpoint runs no code and chooses no file it cannot vouch for, a
reward cannot end a run as a success, every write fails in one sentence, a resume cannot mix
two runs, a signal after the last step saves it, and jsonl answers stay as written. One test
(or more) per row of the issue, numbered as there."""

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import simple_rl as rl
from helpers import TorchEngine, cpu_argv, exits, refuse

# ---------------------------------------------------------------- 2. a reward cannot end a run


REWARDS = {
    "exit": "import sys\n    sys.exit(0)",
    "huge int": "return 10**400",
    "string": "return 'correct'",
    "overflows fp32": "return 1e308",
    "overflows the group": "return 3e38",
}


@pytest.mark.parametrize("kind", list(REWARDS))
def test_2_a_reward_that_exits_or_overflows_is_a_reward_failure(ckpt, tmp_path, capsys, kind):
    file = tmp_path / "r.py"
    file.write_text("calls = [0]\ndef f(completion, answer):\n    calls[0] += 1\n"
                    f"    if calls[0] == 1:  # the check at start\n        return 0.0\n"
                    f"    {REWARDS[kind]}\n")
    argv = cpu_argv(ckpt(), tmp_path / "runs", steps=2, run_name="r", reward=f"{file}:f",
                    eval_size=0, max_new_tokens=3)
    err = exits(capsys, argv, 7, TorchEngine)
    assert f"step 0: the reward ({file}:f) " in err and "on sample " in err
    want = {"exit": "raised SystemExit: 0", "huge int": "returned 1000000000",
            "string": "returned 'correct', not a finite number in fp32",
            "overflows fp32": "returned 1e+308, not a finite number in fp32",
            "overflows the group": "returned 3e+38, so large that its group's advantages"}[kind]
    assert want in err
    assert not (tmp_path / "runs" / "r" / "checkpoints").exists()


def test_2_a_reward_that_exits_at_the_first_call_is_refused_at_start(ckpt, tmp_path, capsys):
    file = tmp_path / "r.py"
    file.write_text("import sys\ndef f(completion, answer):\n    sys.exit(0)\n")
    err = refuse(cpu_argv(ckpt(), tmp_path / "runs", reward=f"{file}:f"), capsys)
    assert "on an empty completion it raised SystemExit: 0." in err


# ---------------------------------------------------------------- 3. every write, one sentence


class FailingFile:
    """metrics.jsonl, failing at its n-th write or at close with a real OSError."""

    def __init__(self, file, code: int, at: str):
        self.file, self.code, self.at, self.name = file, code, at, file.name

    def fail(self):
        raise OSError(self.code, os.strerror(self.code), self.name)

    def write(self, text):
        if self.at == "write" and '"step": 1' in text:
            self.fail()
        return self.file.write(text)

    def flush(self):
        self.file.flush()

    def close(self):
        self.file.close()
        if self.at == "close":
            self.fail()


WRITES = [("metrics write", errno.ENOSPC), ("metrics close", errno.EIO),
          ("tensorboard step", errno.EROFS), ("tensorboard eval", errno.EACCES),
          ("tensorboard flush", errno.ENOSPC), ("tensorboard close", errno.EIO)]
WORDS = {errno.ENOSPC: "no space left on the device holding", errno.EIO: "could not write",
         errno.EROFS: "is on a read-only file system", errno.EACCES: "no permission to write"}


@pytest.mark.parametrize("where,code", WRITES)
def test_3_a_write_failing_mid_run_exits_6(ckpt, tmp_path, monkeypatch, capsys, where, code):
    from torch.utils.tensorboard import SummaryWriter

    run_dir = tmp_path / "runs" / "w"

    def fail(*a, **k):
        raise OSError(code, os.strerror(code), str(run_dir / "events.out.tfevents"))

    if where.startswith("metrics"):
        real_open = Path.open

        def open_failing(self, *a, **k):
            f = real_open(self, *a, **k)
            return FailingFile(f, code, where.split()[1]) if self.name == "metrics.jsonl" else f

        monkeypatch.setattr(Path, "open", open_failing)
    else:
        real = {n: getattr(SummaryWriter, n) for n in ("add_scalar", "flush", "close")}

        def add_scalar(self, tag, *a, **k):
            if (where == "tensorboard step" and tag == "loss") or \
                    (where == "tensorboard eval" and tag == "eval/accuracy" and a[1] > 0):
                fail()
            return real["add_scalar"](self, tag, *a, **k)

        monkeypatch.setattr(SummaryWriter, "add_scalar", add_scalar)
        if where in ("tensorboard flush", "tensorboard close"):
            name = where.split()[1]
            monkeypatch.setattr(SummaryWriter, name, lambda self: (real[name](self), fail()))
    err = exits(capsys, cpu_argv(ckpt(), tmp_path / "runs", steps=2, run_name="w"), 6,
                TorchEngine)
    assert WORDS[code] in err and str(run_dir) in err


def mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir()
    if sys.platform != "linux" or os.geteuid() != 0:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True)
    return done.returncode == 0


class FillDiskAtStep1(TorchEngine):
    """Another program fills the disk while step 1's rollout runs."""

    disk: Path = None

    def rollout(self, prompts, indices, step):
        if step == 1:
            with open(FillDiskAtStep1.disk / "filler", "wb", buffering=0) as f:
                with pytest.raises(OSError):
                    while True:
                        f.write(b"x" * 2**16)
        return super().rollout(prompts, indices, step)


def test_3_a_real_disk_filled_mid_run_exits_6(ckpt, tmp_path, capsys):
    disk = tmp_path / "disk"
    if not mount_tmpfs(disk, "96m"):
        pytest.skip("mounting a tmpfs needs root on Linux")
    try:
        FillDiskAtStep1.disk = disk
        err = exits(capsys, cpu_argv(ckpt(), disk / "runs", steps=3, run_name="t",
                                     save_every=1), 6, FillDiskAtStep1)
        assert f"no space left on the device holding {disk / 'runs' / 't'}" in err
        assert rl.is_complete(disk / "runs" / "t" / "checkpoints" / "step_000001")
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# ---------------------------------------------------------------- 5. a signal after the last step


class Signalled(Exception):
    """What the test's own handler raises when no handler of simple_rl's is installed."""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("during", ["last eval", "export"])
def test_5_a_signal_during_the_last_eval_or_export_saves_the_last_step(
        ckpt, tmp_path, monkeypatch, capsys, sig, during):
    def unhandled(*a):  # simple_rl's own handler must be the one called
        raise Signalled

    previous = {s: signal.signal(s, unhandled) for s in (signal.SIGTERM, signal.SIGINT)}

    class SignalAtLastEval(TorchEngine):
        evals = 0

        def generate(self, prompts, n, seeds, max_tokens, temperature):
            if temperature == 0:  # a held-out eval's (single-turn) episodes
                self.evals += 1
                if self.evals == 2:  # the second eval: after the last step
                    os.kill(os.getpid(), sig)
            return super().generate(prompts, n, seeds, max_tokens, temperature)

    real_save = rl.save_hf_checkpoint

    def signal_in_export(out, *a, **k):
        real_save(out, *a, **k)
        if out.name.startswith(".tmp_final"):
            os.kill(os.getpid(), sig)

    if during == "export":
        monkeypatch.setattr(rl, "save_hf_checkpoint", signal_in_export)
    run_dir = tmp_path / "runs" / "s"
    try:
        err = exits(capsys, cpu_argv(ckpt(), tmp_path / "runs", steps=1, run_name="s"),
                    143 if sig == signal.SIGTERM else 130,
                    SignalAtLastEval if during == "last eval" else TorchEngine)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    ckpt_dir = run_dir / "checkpoints" / "step_000001"
    assert f"checkpoint {ckpt_dir}; continue with --resume {ckpt_dir}" in err
    assert rl.is_complete(ckpt_dir)
    if during == "last eval":
        assert "before the final export" in err and not (run_dir / "final").exists()
    else:
        assert "after the final export" in err and rl.is_earlier_export(run_dir / "final")
    assert not list(run_dir.glob(".tmp_*"))


# ---------------------------------------------------------------- 6. answers as written


def test_6_jsonl_answers_are_kept_as_written(tmp_path):
    answers = [3, 2.5, 4, 12345678901234567891, "x", 4.0, -0.10, 1e5, "7"]
    lines = [f'{{"question": "q{i}", "answer": {json.dumps(a) if isinstance(a, str) else a}}}'
             for i, a in enumerate(answers)]
    lines[5] = '{"question": "q5", "answer": 4.0}'
    lines[6] = '{"question": "q6", "answer": -0.10}'
    data = tmp_path / "mixed.jsonl"
    data.write_text("\n".join(lines) + "\n")
    got = [p.answer for p in rl.jsonl_problems(str(data))]
    assert got == ["3", "2.5", "4", "12345678901234567891", "x", "4.0", "-0.10", "100000.0", "7"]
    assert rl.reward("Answer: 12345678901234567891", got[3]) == 1.0
    assert rl.reward("Answer: 12345678901234567890", got[3]) == 0.0


def test_6_gsm8k_and_parquet_answers_are_kept_as_written(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "gsm8k.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "so #### 12345678901234567891"}) +
                    "\n")
    assert [p.answer for p in rl.gsm8k_problems(str(data))] == ["12345678901234567891"]
    table = pa.table({"question": ["a", "b"],
                      "answer": pa.array([3, 12345678901234567], pa.int64())})
    pq.write_table(table, tmp_path / "ints.parquet")
    got = [p.answer for p in rl.jsonl_problems(str(tmp_path / "ints.parquet"))]
    assert got == ["3", "12345678901234567"]
