"""Hardening, second pass: real disk faults exit 6, a checkpoint resumes on any Python 3.10-3.13,
and no flag or file makes simple_rl delete what is not its own. One test (or more) per row of
the issue, numbered as there; each ends in one sentence and the documented exit code."""

import errno
import os
from pathlib import Path

import pytest

import simple_rl as rl
from helpers import copy_checkpoint, cpu_argv, main_cpu, one_sentence

FULL_DISK_DCP = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"  # as seen
FULL_DISK_SAFETENSORS = "Error while serializing: I/O error: No space left on device (os error 28)"


# ---------------------------------------------------------------- 7, 8, 9. real disk faults


def test_7_a_full_disk_in_dcp_save_exits_6(ckpt, tmp_path, monkeypatch, capsys):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    real_save = dcp.save
    root = tmp_path / "runs" / "c" / "checkpoints"

    def full_disk(state, storage_writer):
        if (root / "step_000002").exists():  # the second checkpoint: the disk is full now
            (root / ".tmp_step_000004" / "trainer").mkdir(parents=True, exist_ok=True)
            (root / ".tmp_step_000004" / "trainer" / "__0_0.distcp").write_bytes(b"PK partial")
            failure = RuntimeError(FULL_DISK_DCP)
            raise CheckpointException("CheckpointException ranks:dict_keys([0])",
                                      {0: (failure, [])})
        return real_save(state, storage_writer=storage_writer)

    monkeypatch.setattr(dcp, "save", full_disk)
    err = one_sentence(capsys, main_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=6,
                                                 run_name="c")), 6)
    assert err.startswith(f"simple_rl: no space left on the device holding {root}")
    assert sorted(p.name for p in root.iterdir()) == ["step_000002"]  # no temp dir left
    assert rl.is_complete(root / "step_000002")


def test_7_a_full_disk_in_the_final_export_exits_6(ckpt, tmp_path, monkeypatch, capsys):
    from safetensors import SafetensorError
    from safetensors import torch as st

    real = st.save_file
    run_dir = tmp_path / "runs" / "f"

    def full_disk(tensors, filename, *a, **k):
        if (run_dir / "checkpoints" / "step_000002").exists():  # the export after the save
            Path(filename).write_bytes(b"partial")
            raise SafetensorError(FULL_DISK_SAFETENSORS)
        return real(tensors, filename, *a, **k)

    monkeypatch.setattr(st, "save_file", full_disk)
    err = one_sentence(capsys, main_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=2,
                                                 run_name="f")), 6)
    assert f"no space left on the device holding {run_dir / 'final'}" in err
    assert sorted(p.name for p in run_dir.iterdir() if not p.name.startswith("events")) == [
        "checkpoints", "metrics.jsonl", "simple_rl.lock"]  # no final, no temp dir
    assert rl.is_complete(run_dir / "checkpoints" / "step_000002")


@pytest.mark.parametrize("code,words", [(errno.EROFS, "is on a read-only file system"),
                                        (errno.EACCES, "no permission to write")])
def test_8_checkpoints_turning_unwritable_mid_run_exit_6(ckpt, tmp_path, monkeypatch, capsys,
                                                         code, words):
    real_mkdir = Path.mkdir

    def unwritable(self, *a, **k):
        if self.name == ".tmp_step_000004":
            raise OSError(code, os.strerror(code), str(self))
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", unwritable)
    err = one_sentence(capsys, main_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=6,
                                                 run_name="ro")), 6)
    root = tmp_path / "runs" / "ro" / "checkpoints"
    assert words in err and str(root / ".tmp_step_000004") in err
    assert sorted(p.name for p in root.iterdir()) == ["step_000002"]
    assert rl.is_complete(root / "step_000002")


@pytest.mark.parametrize("where", ["tensorboard", "lock file"])
def test_9_resuming_on_a_read_only_log_dir_exits_6(saved, tmp_path, monkeypatch, capsys, where):
    ckpt = copy_checkpoint(saved, tmp_path)
    run_dir = tmp_path / "runs" / "r"

    def read_only(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    if where == "tensorboard":
        import torch.utils.tensorboard as tb

        monkeypatch.setattr(tb, "SummaryWriter", lambda log_dir, **k: read_only(log_dir))
    else:
        real_open = os.open

        def open_read_only(path, flags, *a, **k):
            if Path(path).name == "simple_rl.lock" and flags & os.O_CREAT:
                read_only(path)
            return real_open(path, flags, *a, **k)

        monkeypatch.setattr(os, "open", open_read_only)
    err = one_sentence(capsys, main_cpu(["--resume", str(ckpt), "--steps", "3"]), 6)
    assert f"{run_dir}" in err and "is on a read-only file system" in err
