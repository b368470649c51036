"""Checkpoints, bit-exact resume, the NaN guard, Ctrl-C/SIGTERM and disk errors (CPU, stand-in
engine, the real `main`)."""

import errno
import json
import os

import pytest
import torch

import simple_rl as rl
from helpers import TorchEngine, cpu_argv, main_cpu, run_cpu


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
