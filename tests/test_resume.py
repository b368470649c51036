"""Resume: bit for bit the uninterrupted run (after Ctrl-C or SIGTERM too), `latest` the highest
complete checkpoint, what was logged after the checkpoint dropped, the flags a resume ignores
named, and the files the run read (model, reward, data) taken again only while unchanged."""

import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

import simple_rl as rl
from helpers import (LORA, ExactEngine, Killed, TorchEngine, copy_checkpoint, copy_run, cpu_argv,
                     edit_json, exits, latest, main_cpu, metrics_rows, one_sentence, refuse,
                     run_cpu)


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


# ---------------------------------------------------------------- bit for bit


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
    assert state["sampler_seeds"] == [rl.request_seed(run_cfg, 2, i) for i in range(2)]
    assert run_cfg.lr == 1e-2
    resumed = run_cpu(["--resume", str(saved), "--steps", "6"])
    assert resumed == whole[0]  # the same final weights, bit for bit
    assert metrics(tmp_path / "runs" / "part") == metrics(whole[1])  # and the same metrics, 0..5


class SignalAtStep1(TorchEngine):
    sig = signal.SIGINT

    def first_turn(self, prompts, indices, step):
        if step == 1:
            signal.raise_signal(self.sig)
        return super().first_turn(prompts, indices, step)


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
    assert f"{name}: finishing this step" in captured.out
    assert "stopped after step 2/6" in captured.err
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


# ---------------------------------------------------------------- latest


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


def test_latest_passes_over_runs_that_never_saved(saved, tmp_path):
    """A run that failed at its start, or ran with --save-every 0, has a folder and no
    checkpoint: --resume latest without --run-name takes the one run that has one."""
    ckpt = copy_checkpoint(saved, tmp_path)
    (ckpt.parents[2] / "a_failed_start").mkdir()
    (ckpt.parents[2] / "z_no_saves" / "checkpoints").mkdir(parents=True)
    assert rl.find_checkpoint(rl.Config(resume="latest", log_dir=str(ckpt.parents[2]))) == ckpt


def test_5_latest_skips_a_checkpoint_that_lost_a_dcp_shard(four, tmp_path):
    run_dir = copy_run(four, tmp_path)
    root = run_dir / "checkpoints"
    assert "trainer/__0_0.distcp" in json.loads((root / "step_000004" / "state.json").read_text(
    ))["files"]
    (root / "step_000004" / "trainer" / "__0_0.distcp").unlink()
    assert not rl.is_complete(root / "step_000004")
    cfg = rl.Config(resume="latest", run_name="r", log_dir=str(tmp_path / "runs"))
    assert rl.find_checkpoint(cfg) == root / "step_000002"


def test_5_a_kill_while_a_resume_re_saves_step_n_leaves_latest_restorable(four, tmp_path,
                                                                          monkeypatch, capsys):
    run_dir = copy_run(four, tmp_path)
    root = run_dir / "checkpoints"
    real_rmtree = shutil.rmtree

    def killed_while_removing(path, *a, **k):  # removes the shards first, then dies
        path = Path(path)
        if path.name in ("step_000004", ".old_step_000004") and path.exists():
            for shard in path.glob("trainer/*.distcp"):
                shard.unlink()
            raise Killed
        return real_rmtree(path, *a, **k)

    monkeypatch.setattr(shutil, "rmtree", killed_while_removing)
    with pytest.raises(Killed):
        main_cpu(["--resume", str(root / "step_000002"), "--steps", "6"])
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    latest = ["--resume", "latest", "--run-name", "r", "--log-dir", str(tmp_path / "runs")]
    assert rl.find_checkpoint(rl.parse_config(latest)[0]) == root / "step_000004"
    assert main_cpu(latest + ["--steps", "5"]) == 0


# ---------------------------------------------------------------- the flags and files it takes


@pytest.mark.parametrize("flag,value", [
    ("eval-every", 7), ("keep-last", 1), ("save-every", 3), ("parity-rows", 2),
    ("parity-every", 5), ("log-param-deltas", None), ("strict-parity", None), ("verbose", None)])
def test_a_resume_takes_where_and_how_often_it_looks_and_saves_from_the_command_line(
        saved, tmp_path, capsys, flag, value):
    """The RESUMABLE flags say how often the run looks, saves, keeps, checks and logs, not
    what it learns: a resume takes the command line's value of each (the checkpoint's is
    another) and says nothing of ignoring it."""
    ckpt = copy_checkpoint(saved, tmp_path)
    name = flag.replace("-", "_")
    was = json.loads((ckpt / "run_config.json").read_text())[name]
    given = [f"--{flag}"] + ([str(value)] if value is not None else [])
    cfg, passed = rl.parse_config(["--resume", str(ckpt), "--steps", "3", *given])
    want = True if value is None else value
    assert was != want and getattr(rl.resume_config(cfg, passed, ckpt), name) == want
    assert "ignores" not in capsys.readouterr().out


def test_a_resume_keeps_the_checkpoints_seed_and_says_it_ignores_the_flag(saved, tmp_path,
                                                                          capsys):
    """--seed decides the prompts and every sample's seed: a resume continues the checkpoint's
    stream, so it takes the saved seed and warns that it ignores the command line's (taking it
    would silently train on other prompts, with sampler seeds the checkpoint never made)."""
    ckpt = copy_checkpoint(saved, tmp_path)
    seed = json.loads((ckpt / "run_config.json").read_text())["seed"]
    cfg, given = rl.parse_config(["--resume", str(ckpt), "--steps", "3", "--seed", str(seed + 1)])
    assert rl.resume_config(cfg, given, ckpt).seed == seed
    assert "ignores the command line's: --seed." in capsys.readouterr().out


def test_resume_names_the_flags_it_ignores(saved, tmp_path, capsys):
    ckpt = copy_checkpoint(saved, tmp_path)
    assert main_cpu(["--resume", str(ckpt), "--steps", "3", "--lr", "0.5", "--group-size", "3",
                     "--save-every", "5"]) == 0
    out = capsys.readouterr().out
    assert "ignores the command line's: --lr." in out  # --group-size 3 is the saved value
    saved_cfg = json.loads((ckpt.parent / "step_000003" / "run_config.json").read_text()) \
        if (ckpt.parent / "step_000003").exists() else None
    assert saved_cfg is None  # --save-every 5 was taken: no checkpoint at step 3


def test_a_checkpoint_from_another_model_is_refused(saved, ckpt, tmp_path, capsys):
    ckpt_dir = copy_checkpoint(saved, tmp_path)
    config = json.loads((ckpt_dir / "run_config.json").read_text())
    config["model"] = str(ckpt(layers=3))  # a model with one more layer
    (ckpt_dir / "run_config.json").write_text(json.dumps(config))
    err = one_sentence(capsys, main_cpu(["--resume", str(ckpt_dir), "--steps", "3"]), 2,
                       last_line=True)
    assert "config.json is not what the run read when" in err  # refused before it is read
    err = one_sentence(capsys, main_cpu(["--resume", str(ckpt_dir), "--steps", "3", "--model",
                                         config["model"], "--allow-changed-files"]), 2,
                       last_line=True)
    assert "was saved from another model" in err


def perturb_one_tensor(model_dir) -> None:
    """One weight's first element nudged in place: the file keeps its size and its mtime."""
    from safetensors.torch import load_file, save_file

    file = model_dir / "model.safetensors"
    stat = file.stat()
    state = load_file(file)
    name = sorted(state)[0]
    state[name].view(-1)[0] += 0.5
    save_file(state, file, metadata={"format": "pt"})
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert file.stat().st_size == stat.st_size


@pytest.mark.parametrize("kind", ["lora", "full fine-tuning's KL reference"])
def test_1_a_resume_on_a_changed_base_is_refused_in_one_sentence(ckpt, tmp_path, capsys, kind):
    model = tmp_path / "model"
    shutil.copytree(ckpt(), model)
    flags = LORA if kind == "lora" else dict(kl_coef=0.05)
    run_cpu(cpu_argv(model, tmp_path / "runs", steps=2, run_name="r", **flags), ExactEngine)
    saved = tmp_path / "runs" / "r" / "checkpoints" / "step_000002"
    recorded = json.loads((saved / "state.json").read_text())["inputs"]["model"]
    assert recorded["model.safetensors"] == rl.sha256_file(model / "model.safetensors")
    perturb_one_tensor(model)
    err = exits(capsys, latest(tmp_path), 2)
    assert f"{model / 'model.safetensors'} is not what the run read when {saved} was saved" in err
    err = exits(capsys, latest(tmp_path, "--model", model), 2)
    assert "pass --allow-changed-files to resume with it." in err
    assert main_cpu(latest(tmp_path, "--model", model, "--allow-changed-files"), ExactEngine) == 0
    out = capsys.readouterr().out
    assert f"warning: {model / 'model.safetensors'} differs from what the run read" in out
    assert [r["step"] for r in metrics_rows(tmp_path / "runs" / "r") if "loss" in r] == [0, 1, 2]


def test_1_a_resume_takes_the_recorded_model_only_while_its_files_are_unchanged(
        saved, ckpt, tmp_path, capsys):
    run_ckpt = copy_checkpoint(saved, tmp_path)
    model = tmp_path / "model"
    shutil.copytree(ckpt(), model)  # the same files: their sha256 are the recorded ones
    edit_json(run_ckpt / "run_config.json", model=str(model))
    assert main_cpu(latest(tmp_path)) == 0  # no --model needed
    edit_json(model / "tokenizer_config.json", model_max_length=7)
    err = refuse(latest(tmp_path, "--steps", 4), capsys)
    assert f"{model / 'tokenizer_config.json'} is not what the run read when" in err
    assert "pass --model to name the files to use" in err
    err = refuse(latest(tmp_path, "--steps", 4, "--model", model), capsys)
    assert "pass --allow-changed-files to resume with it." in err
    assert main_cpu(latest(tmp_path, "--steps", 4, "--model", model,
                           "--allow-changed-files")) == 0


def test_1_your_own_reward_resumes_and_a_changed_one_is_refused(ckpt, tmp_path, capsys):
    mine = tmp_path / "mine.py"
    mine.write_text("def f(completion, answer):\n    return float(len(completion) % 2)\n")
    assert main_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=2, run_name="r",
                             reward=f"{mine}:f", eval_size=0)) == 0
    moved = tmp_path / "moved.py"
    shutil.copy(mine, moved)  # the same file elsewhere: the same sha256, accepted
    assert main_cpu(latest(tmp_path, "--reward", f"{moved}:f")) == 0
    mine.write_text("def f(completion, answer):\n    return 0.5\n")
    err = refuse(latest(tmp_path, "--steps", 4, "--reward", f"{mine}:f"), capsys)
    assert f"{mine} is not what the run read when" in err and "--allow-changed-files" in err


def test_1_a_checkpoint_naming_other_data_is_refused_before_it_is_read(saved, tmp_path, capsys,
                                                                       monkeypatch):
    ckpt = copy_checkpoint(saved, tmp_path)
    data = tmp_path / "other.jsonl"
    data.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n")
    edit_json(ckpt / "run_config.json", task="jsonl", data_files=str(data), eval_size=0)
    monkeypatch.setattr(rl, "read_rows", lambda *a: pytest.fail("read before the check"))
    err = refuse(latest(tmp_path), capsys)
    assert f"{data} is not what the run read when {ckpt} was saved" in err
    assert "pass --data-files to name the files to use" in err


def test_an_input_the_checkpoint_records_no_sha256_for_may_read_no_file(tmp_path, capsys):
    """check_unchanged: for an input its checkpoint records no sha256 of (an older checkpoint's,
    or none read), a resume may read no file either: --data-files FILE is refused, on the
    command line too, unless --allow-changed-files takes it with a warning."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "q", "answer": "1"}\n')
    flags = dict(resume=str(tmp_path / "step_000002"), task="jsonl", data_files=str(data))
    cfg = rl.Config(**flags)
    inputs = {"data_files": {"data": data}}
    for recorded, given, words in ((None, set(), "pass --data-files to name the files"),
                                   ({}, set(), "pass --data-files to name the files"),
                                   ({}, {"data_files"}, "pass --allow-changed-files")):
        with pytest.raises(rl.ConfigError, match=f"^{re.escape(str(data))} is not what the run "
                           f"read when {re.escape(cfg.resume)} was saved .*; {words}"):
            rl.check_unchanged(cfg, inputs, dict(recorded=recorded, given=given))
    allowed = rl.Config(**flags, allow_changed_files=True)
    got = rl.check_unchanged(allowed, inputs, dict(recorded={}, given={"data_files"}))
    assert got == {"data_files": {"data": rl.sha256_file(data)}}
    assert f"warning: {data} differs from what the run read" in capsys.readouterr().out


@pytest.mark.parametrize("module,draw", [("random", "random.random()"),
                                         ("torch", "torch.rand(()).item()")])
def test_a_reward_drawing_from_a_seeded_generator_resumes_bit_exact(ckpt, tmp_path, module, draw):
    """restore_checkpoint sets Python's and torch's RNG to the saved state: a reward that draws
    from `random` or from torch's default generator (both seeded by the run) gives a resumed
    run the uninterrupted run's weights."""
    from helpers import cpu_argv, run_cpu

    mine = tmp_path / "noisy.py"
    mine.write_text(f"import {module}\n\n\ndef f(completion, answer):\n    return {draw}\n")
    flags = dict(reward=f"{mine}:f", eval_size=0)
    whole = run_cpu(cpu_argv(ckpt(), tmp_path / "a", steps=4, run_name="r", **flags))
    part = run_cpu(cpu_argv(ckpt(), tmp_path / "b", steps=2, run_name="r", **flags))
    assert part != whole
    saved = tmp_path / "b" / "r" / "checkpoints" / "step_000002"
    assert run_cpu(["--resume", str(saved), "--steps", "4", "--reward", f"{mine}:f"]) == whole


def test_a_resume_reads_the_model_its_command_line_names(saved, ckpt, tmp_path):
    """--model on a resume (its files the recorded ones: a moved model) is the model the resumed
    run reads and records, not the checkpoint's path."""
    import json

    from helpers import copy_checkpoint, latest, main_cpu

    copy_checkpoint(saved, tmp_path)
    moved = tmp_path / "moved"
    shutil.copytree(ckpt(), moved)
    assert main_cpu(latest(tmp_path, "--steps", 4, "--model", moved)) == 0
    new = tmp_path / "runs" / "r" / "checkpoints" / "step_000004" / "run_config.json"
    assert json.loads(new.read_text())["model"] == str(moved)
