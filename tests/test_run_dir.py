"""The run directory: simple_rl writes and removes only what is its own (run names, --overwrite,
--output-dir, symbolic links, the paths a checkpoint names, a reward that changes directory),
one process a run (the OS's file lock), and its final export replaces only an earlier one."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import simple_rl as rl
from helpers import (TorchEngine, copy_checkpoint, copy_run, cpu_argv, latest, main_cpu,
                     metrics_rows, one_sentence, refuse, run_cpu)


def metrics(run_dir):
    return metrics_rows(run_dir)


# ---------------------------------------------------------------- nothing outside the run


@pytest.mark.parametrize("name", ["/abs/victim", ".", "..", "a/b", "../victim", "=-x"])
def test_run_names_that_escape_the_log_dir_are_refused(ckpt, tmp_path, capsys, name):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    logs = tmp_path / "logs"
    (logs / "other").mkdir(parents=True)
    (logs / "other" / "keep.txt").write_text("another run")
    argv = cpu_argv(ckpt(), logs, overwrite=True)
    argv += ["--run-name" + name] if name.startswith("=") else ["--run-name", name]
    err = refuse(argv, capsys, last_line=True)
    assert "--run-name" in err and "plain name" in err
    assert (victim / "keep.txt").read_text() == "precious"
    assert (logs / "other" / "keep.txt").read_text() == "another run"


def test_a_symlinked_run_dir_is_refused(ckpt, tmp_path, capsys):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "link").symlink_to(victim)
    err = refuse(cpu_argv(ckpt(), tmp_path / "logs", run_name="link", overwrite=True),
                 capsys, last_line=True)
    assert "symbolic link" in err and (victim / "keep.txt").read_text() == "precious"


def test_a_failed_start_leaves_no_run_directory(ckpt, tmp_path, capsys):
    assert rl.main(["--model", str(ckpt()), "--log-dir", str(tmp_path / "logs")]) == 2
    capsys.readouterr()
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())


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


def test_1_only_a_run_directory_simple_rl_made_is_continued_in_place(saved, tmp_path):
    """resume_location continues a run in place only where the checkpoint lies in
    RUN/checkpoints/ of a directory simple_rl made (its lock file): a copy into X/checkpoints/
    of any other X gets the defaults (--log-dir, a new run's name), not X."""
    x = tmp_path / "X" / "checkpoints" / "step_000002"
    shutil.copytree(saved, x)
    cfg, given = rl.parse_config(["--resume", str(x)])
    assert rl.resume_location(cfg, given, x) == (cfg.log_dir, "")
    ckpt = copy_checkpoint(saved, tmp_path)  # the run's own directory, lock file and all
    cfg, given = rl.parse_config(["--resume", str(ckpt)])
    assert rl.resume_location(cfg, given, ckpt) == (str(tmp_path / "runs"), "r")


def test_2_an_output_dir_inside_the_checkpoint_resumed_is_refused(saved, tmp_path):
    """check_run_paths: the export never goes into the checkpoint being resumed (a copy outside
    any run, resumed as a new run), even where that place is new and so empty."""
    x = tmp_path / "X" / "step_000002"
    shutil.copytree(saved, x)
    flags = dict(log_dir=str(tmp_path / "runs"), run_name="new", resume=str(x))
    with pytest.raises(rl.ConfigError, match="^--output-dir .*/export overlaps the checkpoint "):
        rl.check_run_paths(rl.Config(**flags, output_dir=str(x / "export")), x)
    run_dir = rl.check_run_paths(rl.Config(**flags, output_dir=str(tmp_path / "out")), x)
    assert run_dir == tmp_path / "runs" / "new"


def test_7_a_reward_that_changes_directory_does_not_move_the_run(ckpt, tmp_path, monkeypatch,
                                                                 capsys):
    away = tmp_path / "away"
    away.mkdir()
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "r.py").write_text(
        f"import os\ndef f(completion, answer):\n    os.chdir({str(away)!r})\n    return 0.0\n")
    monkeypatch.chdir(tmp_path / "work")
    argv = cpu_argv(ckpt(), "runs", steps=2, run_name="r", reward="r.py:f")
    assert main_cpu(argv) == 0
    assert list(away.iterdir()) == []
    assert (tmp_path / "work" / "runs" / "r" / "final" / "model.safetensors").is_file()
    config = json.loads((tmp_path / "work" / "runs" / "r" / "checkpoints" / "step_000002" /
                         "run_config.json").read_text())
    assert config["reward"] == f"{tmp_path / 'work' / 'r.py'}:f"
    assert config["log_dir"] == str(tmp_path / "work" / "runs")
    monkeypatch.chdir(tmp_path / "work")  # the reward left the process in away/
    cfg, _ = rl.parse_config(["--env", "e.py:E"])  # an env file too; the calculator is no file
    assert cfg.env == f"{tmp_path / 'work' / 'e.py'}:E"
    assert rl.parse_config(["--env", "calc"])[0].env == "calc"


# ---------------------------------------------------------------- --overwrite


def test_overwrite_removes_only_its_run_and_only_after_every_check(ckpt, tmp_path, capsys):
    logs = tmp_path / "logs"
    for run in ("mine", "other"):
        (logs / run).mkdir(parents=True)
        (logs / run / "notes.txt").write_text(run)
    # a check that fails after the config (no GPU here, with the real engine): nothing removed
    assert rl.main(["--model", str(ckpt()), "--log-dir", str(logs), "--run-name", "mine",
                    "--overwrite"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err or torch.cuda.is_available()
    assert (logs / "mine" / "notes.txt").read_text() == "mine"
    # a bad weight file, found before the run directory is touched: nothing removed
    bad = tmp_path / "bad"
    shutil.copytree(ckpt(), bad)
    (bad / "model.safetensors").write_bytes(b"garbage")
    refuse(cpu_argv(bad, logs, run_name="mine", overwrite=True), capsys, last_line=True)
    assert (logs / "mine" / "notes.txt").read_text() == "mine"
    # all checks pass: the run directory (and nothing else) is replaced
    run_cpu(cpu_argv(ckpt(), logs, steps=1, run_name="mine", overwrite=True))
    assert not (logs / "mine" / "notes.txt").exists() and (logs / "mine" / "final").is_dir()
    assert (logs / "other" / "notes.txt").read_text() == "other"


def test_1_a_checkpoint_inside_the_run_it_would_overwrite_is_refused(saved, tmp_path, capsys):
    other = tmp_path / "runs" / "other"  # a copy inside a directory --overwrite would clear
    shutil.copytree(saved, other / "keep" / "step_000002")
    err = refuse(["--resume", str(other / "keep" / "step_000002"), "--steps", "3", "--log-dir",
                  str(tmp_path / "runs"), "--run-name", "other", "--overwrite"], capsys)
    assert "--overwrite would remove" in err and "resume it under another --run-name" in err
    assert rl.is_complete(other / "keep" / "step_000002")


# ---------------------------------------------------------------- --output-dir and the export


def test_a_non_empty_output_dir_is_refused_even_with_overwrite(ckpt, tmp_path, capsys):
    out = tmp_path / "final"
    out.mkdir()
    (out / "model.safetensors").write_text("old")
    err = refuse(cpu_argv(ckpt(), tmp_path / "logs", output_dir=out, overwrite=True),
                 capsys, last_line=True)
    assert "is not empty" in err and (out / "model.safetensors").read_text() == "old"


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


def test_8_final_has_the_mode_of_the_checkpoints(ckpt, tmp_path):
    umask = os.umask(0o022)
    try:
        run_cpu(cpu_argv(ckpt(), tmp_path, steps=2, run_name="m"))
    finally:
        os.umask(umask)
    mode = (tmp_path / "m" / "final").stat().st_mode & 0o777
    assert mode == 0o755
    assert mode == (tmp_path / "m" / "checkpoints" / "step_000002").stat().st_mode & 0o777


# ---------------------------------------------------------------- the run's lock


class OverwriteAtStep1(TorchEngine):
    """Starts a second simple_rl with --overwrite on the same run while this one trains."""

    argv: list = []
    code = None

    def first_turn(self, prompts, indices, step):
        if step == 1 and OverwriteAtStep1.code is None:
            OverwriteAtStep1.code = main_cpu(OverwriteAtStep1.argv)
        return super().first_turn(prompts, indices, step)


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


@pytest.mark.parametrize("hook", ["check_run_paths", "lock_run_dir"])
def test_4_an_overwrite_between_a_resumes_start_and_its_lock_cannot_mix_two_runs(
        saved, ckpt, tmp_path, monkeypatch, capsys, hook):
    copy_checkpoint(saved, tmp_path)
    run_dir = tmp_path / "runs" / "r"
    overwrite = cpu_argv(ckpt(), tmp_path / "runs", steps=2, run_name="r", overwrite=True,
                         seed=5)
    real = getattr(rl, hook)
    codes = []

    def other_process_runs_first(*a, **k):  # the overwrite runs to its end before this one
        if not codes:
            codes.append(None)
            codes[0] = main_cpu(overwrite)
        return real(*a, **k)

    monkeypatch.setattr(rl, hook, other_process_runs_first)
    assert main_cpu(latest(tmp_path, "--save-every", 1)) == 0
    seeds = {json.loads((c / "run_config.json").read_text())["seed"]
             for c in rl.complete_checkpoints(run_dir)}
    assert len(seeds) == 1, f"checkpoints of two runs in one directory (overwrite: {codes})"
    rows = metrics_rows(run_dir)
    assert [m["step"] for m in rows if "loss" in m] == [0, 1, 2]
