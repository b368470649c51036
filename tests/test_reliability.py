"""Checkpoints, bit-exact resume, the NaN guard, Ctrl-C/SIGTERM and disk errors (CPU, stand-in
engine, the real `main`)."""

import errno
import json
import os
import shutil
import signal
import sys
import time

import pytest
import torch

import simple_rl as rl
from helpers import TorchEngine, cpu_argv, main_cpu, metrics_rows, run_cpu


def metrics(run_dir):
    return metrics_rows(run_dir, timings=False)


def ckpt_dir(tmp_path, run, step):
    return tmp_path / "runs" / run / "checkpoints" / f"step_{step:06d}"


@pytest.fixture(scope="module")
def whole(ckpt, tmp_path_factory):
    """An uninterrupted 6-step run (checkpoints every 2 steps): the reference for resumes."""
    tmp = tmp_path_factory.mktemp("whole")
    sha = run_cpu(cpu_argv(ckpt(), tmp / "runs", steps=6, run_name="whole"))
    return sha, tmp / "runs" / "whole"


def test_resume_is_bit_exact(ckpt, tmp_path, whole):
    part = run_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=2, run_name="part"))
    assert part != whole[0]
    saved = ckpt_dir(tmp_path, "part", 2)
    assert {p.name for p in saved.iterdir()} == {"model", "trainer", "rng_rank0.pt", "state.json",
                                                 "run_config.json"}
    state = json.loads((saved / "state.json").read_text())
    assert state["next_step"] == 2 and state["world_size"] == 1
    assert state["data"] == {"task": "arithmetic", "seed": 3, "next_step": 2}
    run_cfg = rl.Config(**json.loads((saved / "run_config.json").read_text()))
    assert state["sampler_seeds"] == [rl.sample_seed(run_cfg, 2, i) for i in range(2)]
    assert run_cfg.lr == 1e-2
    resumed = run_cpu(["--resume", str(saved), "--steps", "6"])
    assert resumed == whole[0]  # the same final weights, bit for bit
    assert metrics(tmp_path / "runs" / "part") == metrics(whole[1])  # and the same metrics, 0..5


def test_latest_is_the_highest_complete_step_even_after_a_kill_during_cleanup(ckpt, tmp_path,
                                                                               whole):
    run_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=4, save_every=1, keep_last=2, run_name="r"))
    root = tmp_path / "runs" / "r" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000003", "step_000004"]
    # a kill while removing the old step_000003: its model/ is gone and its mtime is the newest
    shutil.rmtree(root / "step_000003" / "model")
    os.utime(root / "step_000003", (time.time() + 100, time.time() + 100))
    cfg = rl.Config(resume="latest", run_name="r", log_dir=str(tmp_path / "runs"))
    assert rl.find_checkpoint(cfg) == root / "step_000004"
    assert rl.find_checkpoint(rl.Config(resume="latest", log_dir=str(tmp_path / "runs"))) == \
        root / "step_000004"  # the only run: no --run-name needed
    shutil.rmtree(root / "step_000004" / "trainer")  # a checkpoint without its masters is no use
    with pytest.raises(rl.ConfigError, match="no complete checkpoint"):
        rl.find_checkpoint(cfg)


def test_latest_resumes_to_the_uninterrupted_runs_weights(ckpt, tmp_path, whole):
    run_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=4, save_every=1, keep_last=2, run_name="k"))
    root = tmp_path / "runs" / "k" / "checkpoints"
    shutil.rmtree(root / "step_000003" / "model")  # killed during keep-last cleanup
    assert run_cpu(["--resume", "latest", "--run-name", "k", "--log-dir", str(tmp_path / "runs"),
                    "--steps", "6"]) == whole[0]


def test_latest_needs_a_run_name_when_several_runs_have_checkpoints(ckpt, tmp_path):
    for name in ("x", "y"):
        run_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=2, run_name=name))
    with pytest.raises(rl.ConfigError, match="holds several runs .*--run-name"):
        rl.find_checkpoint(rl.Config(resume="latest", log_dir=str(tmp_path / "runs")))


def test_a_save_that_fails_keeps_the_previous_checkpoint_and_no_temp_dir(ckpt, tmp_path,
                                                                        monkeypatch, capsys):
    from safetensors import torch as st

    real = st.save_file
    calls = {"n": 0}

    def full_disk(tensors, filename, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint's model export
            raise OSError(errno.ENOSPC, "No space left on device", str(filename))
        return real(tensors, filename, *a, **k)

    monkeypatch.setattr(st, "save_file", full_disk)
    code = main_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=6, run_name="c"))
    err = capsys.readouterr().err.strip()
    assert code == 6 and err.startswith("simple_rl: no space left on the device holding ")
    assert "lower --keep-last" in err and "\n" not in err
    root = tmp_path / "runs" / "c" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000002"]  # no .tmp_step_000004
    assert rl.is_complete(root / "step_000002")
    monkeypatch.setattr(st, "save_file", real)
    assert run_cpu(["--resume", str(root / "step_000002"), "--steps", "3"])  # still resumable


@pytest.mark.parametrize("code,words", [(errno.EROFS, "read-only file system"),
                                        (errno.EACCES, "no permission to write")])
def test_file_system_errors_are_one_sentence(tmp_path, code, words):
    stop = rl.disk_error(tmp_path / "x", OSError(code, os.strerror(code), str(tmp_path / "x")))
    assert stop.code == 6 and words in str(stop) and str(tmp_path / "x") in str(stop)


class PoisonAtStep2(TorchEngine):
    """Turns one trainer weight into NaN before step 2's rollout (a stand-in for a blow-up)."""

    trainer_model = None

    def rollout(self, prompts, indices, step):
        if step == 2:
            with torch.no_grad():
                PoisonAtStep2.trainer_model.norm.weight[0] = float("nan")
        return super().rollout(prompts, indices, step)


def test_nan_guard_stops_before_the_optimizer_step(ckpt, tmp_path, monkeypatch, capsys):
    real_build = rl.build_model

    def keep(*a, **k):
        model = real_build(*a, **k)
        PoisonAtStep2.trainer_model = PoisonAtStep2.trainer_model or model
        return model

    PoisonAtStep2.trainer_model = None
    monkeypatch.setattr(rl, "build_model", keep)
    code = main_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=4, run_name="nan"), PoisonAtStep2)
    err = capsys.readouterr().err
    assert code == 3
    assert "step 2: non-finite logprobs; nothing was applied" in err and "step_000002" in err
    run_dir = tmp_path / "runs" / "nan"
    diag = json.loads((run_dir / "nonfinite_step_000002.json").read_text())
    assert diag["step"] == 2 and diag["quantity"] == "logprobs" and diag["prompts"] == [0, 1]
    assert diag["samples"] == list(range(6)) and diag["update"] == 0
    good = rl.read_checkpoint_state(run_dir / "checkpoints" / "step_000002")
    assert good["next_step"] == 2  # the last good checkpoint is untouched
    assert not (run_dir / "final").exists()


def test_nan_at_the_second_update_says_what_was_applied(ckpt, tmp_path, monkeypatch, capsys):
    real_loss = rl.ppo_clip_loss
    calls = {"n": 0}

    def nan_on_second_update(logp, old, adv, eps):
        calls["n"] += 1
        pg, ratio, clipped = real_loss(logp, old, adv, eps)
        return (pg * float("nan") if calls["n"] == 2 else pg), ratio, clipped

    monkeypatch.setattr(rl, "ppo_clip_loss", nan_on_second_update)
    code = main_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=2, updates_per_batch=2,
                             micro_batch_tokens=1024, run_name="u2"))  # one micro-batch each
    err = capsys.readouterr().err
    assert code == 3 and "step 0: non-finite loss" in err
    assert "1 of 2 updates of this step were applied in memory, none saved" in err


def test_non_finite_weights_after_the_step_are_caught_before_saving(ckpt, tmp_path, monkeypatch,
                                                                    capsys):
    real_step = torch.optim.AdamW.step

    def step_to_nan(self, *a, **k):  # an update that overflows, as a huge --lr would
        out = real_step(self, *a, **k)
        with torch.no_grad():
            self.param_groups[0]["params"][-1].fill_(float("inf"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step_to_nan)
    code = main_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=3, save_every=1, run_name="big"))
    err = capsys.readouterr().err
    assert code == 3 and "step 0: non-finite weights after the optimizer step" in err
    assert "update 1 of 1 produced them; nothing was saved" in err
    assert not (tmp_path / "runs" / "big" / "checkpoints").exists()  # nothing non-finite saved


class SignalAtStep1(TorchEngine):
    sig = signal.SIGINT

    def rollout(self, prompts, indices, step):
        if step == 1:
            signal.raise_signal(self.sig)
        return super().rollout(prompts, indices, step)


class TermAtStep1(SignalAtStep1):
    sig = signal.SIGTERM


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("engine,code,name", [(SignalAtStep1, 130, "Ctrl-C"),
                                              (TermAtStep1, 143, "SIGTERM")])
def test_ctrl_c_and_sigterm_save_a_checkpoint_that_resumes_exactly(ckpt, tmp_path, capsys, whole,
                                                                   engine, code, name):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    assert main_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=6, save_every=0, run_name="i"),
                    engine) == code
    captured = capsys.readouterr()
    assert f"{name}: finishing this step" in captured.out and "stopped after step 1" in captured.err
    assert {s: signal.getsignal(s) for s in before} == before  # handlers restored
    saved = ckpt_dir(tmp_path, "i", 2)
    assert rl.read_checkpoint_state(saved)["next_step"] == 2
    acc = EventAccumulator(str(tmp_path / "runs" / "i"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [0, 1]  # flushed and closed
    assert run_cpu(["--resume", str(saved), "--steps", "6"]) == whole[0]


def test_resume_drops_what_was_logged_after_the_checkpoint(ckpt, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=3, run_name="x"))  # ckpt 2, steps 0..2
    run_dir = tmp_path / "runs" / "x"
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "loss"')  # a line half-written when the machine died
    time.sleep(1.1)  # TensorBoard orders event files by the second they were created in
    run_cpu(["--resume", str(ckpt_dir(tmp_path, "x", 2)), "--steps", "4"])
    rows = metrics(run_dir)
    # the first run's final eval (its own row, at step 3) went with the rest after the checkpoint
    assert [m["step"] for m in rows] == [0, 1, 2, 3, 4]
    assert ["loss" in m for m in rows] == [True] * 4 + [False]
    assert ["eval/accuracy" in m for m in rows] == [True, False, False, False, True]
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [0, 1, 2, 3]


def test_final_export_is_atomic(ckpt, tmp_path, monkeypatch, capsys):
    from safetensors import torch as st

    def fail(tensors, filename, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(filename))

    monkeypatch.setattr(st, "save_file", fail)
    assert main_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=1, save_every=0,
                             run_name="f")) == 6
    run_dir = tmp_path / "runs" / "f"
    assert not (run_dir / "final").exists() and not (run_dir / ".tmp_final").exists()
    assert "no space left" in capsys.readouterr().err
