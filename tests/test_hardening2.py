"""Hardening, second pass: real disk faults exit 6, a checkpoint resumes on any Python 3.10-3.13,
and no flag or file makes simple_rl delete what is not its own. One test (or more) per row of
the issue, numbered as there; each ends in one sentence and the documented exit code."""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import simple_rl as rl
from helpers import (TorchEngine, copy_checkpoint, copy_run, cpu_argv, main_cpu, metrics_rows,
                     one_sentence, refuse)

FULL_DISK_DCP = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"  # as seen
FULL_DISK_SAFETENSORS = "Error while serializing: I/O error: No space left on device (os error 28)"


def metrics(run_dir):
    return metrics_rows(run_dir)


# ---------------------------------------------------------------- 1. the run directory


def test_1_a_checkpoint_copied_out_of_its_run_resumes_into_a_new_run(saved, tmp_path,
                                                                     monkeypatch, capsys):
    x = tmp_path / "X"
    shutil.copytree(saved, x / "dl" / "step_000002")
    (x / "final").mkdir()
    (x / "final" / "mine.txt").write_text("mine")
    (x / "metrics.jsonl").write_text("my own notes\n")
    monkeypatch.chdir(tmp_path)
    assert main_cpu(["--resume", str(x / "dl" / "step_000002"), "--steps", "3"]) == 0
    (run,) = (tmp_path / "runs").iterdir()  # LOG_DIR/RUN_NAME: the defaults, a new run
    assert f"as the new run {tmp_path / 'runs' / run.name}" in capsys.readouterr().out
    assert (x / "final" / "mine.txt").read_text() == "mine"
    assert (x / "metrics.jsonl").read_text() == "my own notes\n"
    assert sorted(p.name for p in x.iterdir()) == ["dl", "final", "metrics.jsonl"]
    assert [m["step"] for m in metrics(run) if "loss" in m] == [2]  # and the final eval's row
    assert (run / "final" / "model.safetensors").is_file()


def test_1_a_checkpoint_inside_the_run_it_would_overwrite_is_refused(saved, tmp_path, capsys):
    other = tmp_path / "runs" / "other"  # a copy inside a directory --overwrite would clear
    shutil.copytree(saved, other / "keep" / "step_000002")
    err = refuse(["--resume", str(other / "keep" / "step_000002"), "--steps", "3", "--log-dir",
                  str(tmp_path / "runs"), "--run-name", "other", "--overwrite"], capsys)
    assert "--overwrite would remove" in err and "resume it under another --run-name" in err
    assert rl.is_complete(other / "keep" / "step_000002")


# ---------------------------------------------------------------- 2, 6. --output-dir


@pytest.mark.parametrize("inside", ["r/checkpoints", "r", "."])
def test_2_6_an_output_dir_overlapping_the_run_is_refused_before_anything(ckpt, tmp_path,
                                                                          capsys, inside):
    logs = tmp_path / "logs"
    err = refuse(cpu_argv(ckpt(), logs, steps=2, run_name="r", output_dir=logs / inside), capsys)
    assert "overlaps the run directory" in err
    assert not logs.exists()  # nothing made, nothing trained


def test_2_an_output_dir_inside_a_finished_run_deletes_nothing(four, tmp_path, capsys):
    run_dir = copy_run(four, tmp_path)
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    err = refuse(["--resume", "latest", "--run-name", "r", "--log-dir", str(tmp_path / "runs"),
                  "--steps", "5", "--output-dir", str(run_dir / "checkpoints" / "new")], capsys)
    assert "overlaps the run directory" in err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before


def test_2_the_default_export_replaces_only_an_earlier_export(four, tmp_path, capsys):
    run_dir = copy_run(four, tmp_path)
    latest = ["--resume", "latest", "--run-name", "r", "--log-dir", str(tmp_path / "runs"),
              "--steps", "5"]
    (run_dir / "final" / "notes.txt").write_text("mine")
    err = refuse(latest, capsys)
    assert "holds files a final export does not write" in err
    assert (run_dir / "final" / "notes.txt").read_text() == "mine"
    (run_dir / "final" / "notes.txt").unlink()
    old = (run_dir / "final" / "model.safetensors").read_bytes()
    assert main_cpu(latest) == 0  # its own earlier export: replaced
    assert [m["step"] for m in metrics(run_dir) if "loss" in m] == [0, 1, 2, 3, 4]
    assert (run_dir / "final" / "model.safetensors").read_bytes() != old


# ---------------------------------------------------------------- 3. the run's lock


class OverwriteAtStep1(TorchEngine):
    """Starts a second simple_rl with --overwrite on the same run while this one trains."""

    argv: list = []
    code = None

    def rollout(self, prompts, indices, step):
        if step == 1 and OverwriteAtStep1.code is None:
            OverwriteAtStep1.code = main_cpu(OverwriteAtStep1.argv)
        return super().rollout(prompts, indices, step)


def test_3_a_second_overwrite_cannot_take_a_training_run(ckpt, tmp_path, capsys):
    logs = tmp_path / "logs"
    OverwriteAtStep1.argv = cpu_argv(ckpt(), logs, steps=2, run_name="r", overwrite=True)
    OverwriteAtStep1.code = None
    assert main_cpu(cpu_argv(ckpt(), logs, steps=4, run_name="r"), OverwriteAtStep1) == 0
    assert OverwriteAtStep1.code == 2
    err = capsys.readouterr().err
    assert f"{logs / 'r'} is in use by another simple_rl process (pid {os.getpid()})" in err
    root = logs / "r" / "checkpoints"
    assert [c.name for c in rl.complete_checkpoints(logs / "r")] == ["step_000002", "step_000004"]
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000004"]
    assert [m["step"] for m in metrics(logs / "r") if "loss" in m] == [0, 1, 2, 3]


def test_3_two_runs_of_one_name_started_together_one_is_refused(ckpt, tmp_path, capsys):
    logs = tmp_path / "logs"
    cfg = rl.Config(log_dir=str(logs), run_name="r")
    first = rl.prepare_run_dir(cfg, None)  # the first one, before it has written anything
    try:
        assert sorted(p.name for p in first.iterdir()) == ["simple_rl.lock"]
        err = refuse(cpu_argv(ckpt(), logs, steps=1, run_name="r"), capsys)
        assert "is in use by another simple_rl process" in err
    finally:
        rl.release_run_dir(first)
    assert sorted(p.name for p in first.iterdir()) == ["simple_rl.lock"]


HOLD = ("import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
        "print('held', flush=True); time.sleep(120)")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file locks")
def test_3_the_lock_is_the_os_s_and_a_crashed_holder_leaves_it_free(saved, tmp_path, capsys):
    ckpt = copy_checkpoint(saved, tmp_path)
    lock = ckpt.parent.parent / "simple_rl.lock"
    latest = ["--resume", "latest", "--run-name", "r", "--log-dir", str(tmp_path / "runs"),
              "--steps", "3"]
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        err = one_sentence(capsys, main_cpu(latest), 2)
        assert "is in use by another simple_rl process" in err
    finally:
        holder.kill()  # dies holding the lock: the OS releases it
        holder.wait()
    assert lock.is_file() and main_cpu(latest) == 0


# ---------------------------------------------------------------- 4. paths from a checkpoint


def test_4_a_checkpoints_run_config_chooses_no_path(saved, tmp_path, capsys):
    ckpt = copy_checkpoint(saved, tmp_path)
    config = json.loads((ckpt / "run_config.json").read_text())
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    config.update(output_dir=str(tmp_path / "anywhere" / "deep" / "dir"), log_dir=str(tmp_path),
                  run_name="victim", overwrite=True)
    (ckpt / "run_config.json").write_text(json.dumps(config))
    assert main_cpu(["--resume", str(ckpt), "--steps", "3"]) == 0
    assert not (tmp_path / "anywhere").exists()
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]
    assert (tmp_path / "runs" / "r" / "final" / "model.safetensors").is_file()


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


# ---------------------------------------------------------------- 11-17. one sentence


@pytest.mark.parametrize("seed", [2**50, 2**64 - 1, 2**70])
def test_11_seeds_out_of_range_are_refused_at_parse_time(ckpt, tmp_path, capsys, seed):
    err = refuse(cpu_argv(ckpt(), tmp_path / "logs", seed=seed), capsys)
    assert f"--seed must lie in [0, 2^32) (got {seed})." in err
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("template,kind", [
    ("{{ raise_exception('no chat here') }}", "TemplateError"),
    ("{% set turns = [] %}{{ turns.append(1) }}", "SecurityError"),  # the sandbox's refusal
])
def test_13_a_chat_template_that_fails_is_one_sentence(ckpt, tmp_path, capsys, template, kind):
    m = tmp_path / "m"
    shutil.copytree(ckpt(chat=True), m)
    (m / "chat_template.jinja").write_text(template)
    config = json.loads((m / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (m / "tokenizer_config.json").write_text(json.dumps(config))
    err = refuse(cpu_argv(m, tmp_path / "logs"), capsys)
    assert f"the tokenizer's chat template fails ({kind}: " in err
    assert "pass --chat-template off" in err and not (tmp_path / "logs").exists()


@pytest.mark.parametrize("value", [2**40, 0, "4096", 4096.5])
def test_14_a_max_position_embeddings_out_of_range_is_refused(ckpt, tmp_path, capsys, value):
    m = tmp_path / "m"
    shutil.copytree(ckpt(), m)
    config = json.loads((m / "config.json").read_text())
    config["max_position_embeddings"] = value
    (m / "config.json").write_text(json.dumps(config))
    err = refuse(cpu_argv(m, tmp_path / "logs"), capsys)
    assert f"max_position_embeddings {value!r} must be a whole number in [1, 1,048,576]" in err


@pytest.mark.parametrize("flag,value,needle", [
    ("--adv-eps", "1e-320", "--adv-eps 1e-320 is too small for fp32 (0, or at least 1.18e-38"),
    ("--lr", "1e-45", "--lr 1e-45 is too small for fp32"),
    ("--num-prompts", "10000000", "--num-prompts x --group-size is 30,000,000 samples a step"),
    ("--group-size", "100000", "--num-prompts x --group-size is 200,000 samples a step"),
])
def test_15_values_the_run_cannot_hold_are_refused_at_parse_time(ckpt, tmp_path, capsys, flag,
                                                                 value, needle):
    assert needle in refuse(cpu_argv(ckpt(), tmp_path / "logs") + [flag, value], capsys)


def test_17_an_empty_data_file_says_so(ckpt, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("")
    err = refuse(cpu_argv(ckpt(), tmp_path / "logs", task="gsm8k", data_files=data), capsys)
    assert f"--data-files '{data}' is empty." in err and "offline" not in err


def test_17_a_data_file_that_is_not_jsonl_names_the_file_not_the_network(ckpt, tmp_path,
                                                                        capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("this is not json\n")
    err = refuse(cpu_argv(ckpt(), tmp_path / "logs", task="gsm8k", data_files=data), capsys)
    assert f"--data-files '{data}' line 1 is not valid JSON (JSONDecodeError: Expecting value" \
        in err
    assert "offline" not in err


@pytest.mark.parametrize("question", [None, "  "])
def test_17_a_question_that_is_not_text_is_refused(ckpt, tmp_path, capsys, question):
    data = tmp_path / "train.jsonl"
    rows = [{"question": "What is 2 + 2?", "answer": "4 #### 4"},
            {"question": question, "answer": "so #### 5"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    err = refuse(cpu_argv(ckpt(), tmp_path / "logs", task="gsm8k", data_files=data), capsys,
                 datasets=True)
    assert "a question that is not text" in err
