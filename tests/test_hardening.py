"""Hostile but fair input: a checkpoint is data, nothing outside the run is deleted, and every
bad input ends in one sentence (exit 2) before anything slow starts."""

import json
import shutil
import struct

import pytest
import torch

import simple_rl as rl
from helpers import cpu_argv, refuse_last_line, run_cpu


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
    err = refuse_last_line(argv, capsys)
    assert "--run-name" in err and "plain name" in err
    assert (victim / "keep.txt").read_text() == "precious"
    assert (logs / "other" / "keep.txt").read_text() == "another run"


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
    refuse_last_line(cpu_argv(bad, logs, run_name="mine", overwrite=True), capsys)
    assert (logs / "mine" / "notes.txt").read_text() == "mine"
    # all checks pass: the run directory (and nothing else) is replaced
    run_cpu(cpu_argv(ckpt(), logs, steps=1, run_name="mine", overwrite=True))
    assert not (logs / "mine" / "notes.txt").exists() and (logs / "mine" / "final").is_dir()
    assert (logs / "other" / "notes.txt").read_text() == "other"


def test_a_symlinked_run_dir_is_refused(ckpt, tmp_path, capsys):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "link").symlink_to(victim)
    err = refuse_last_line(cpu_argv(ckpt(), tmp_path / "logs", run_name="link", overwrite=True),
                           capsys)
    assert "symbolic link" in err and (victim / "keep.txt").read_text() == "precious"


def test_a_failed_start_leaves_no_run_directory(ckpt, tmp_path, capsys):
    assert rl.main(["--model", str(ckpt()), "--log-dir", str(tmp_path / "logs")]) == 2
    capsys.readouterr()
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())


def test_a_non_empty_output_dir_is_refused_even_with_overwrite(ckpt, tmp_path, capsys):
    out = tmp_path / "final"
    out.mkdir()
    (out / "model.safetensors").write_text("old")
    err = refuse_last_line(cpu_argv(ckpt(), tmp_path / "logs", output_dir=out, overwrite=True),
                           capsys)
    assert "is not empty" in err and (out / "model.safetensors").read_text() == "old"


# ---------------------------------------------------------------- bad input, before anything slow


@pytest.mark.parametrize("flag,value,needle", [
    ("--temperature", "inf", "--temperature must be a finite number"),
    ("--lr", "inf", "--lr must be a finite number"),
    ("--lr", "nan", "--lr must be a finite number"),
    ("--lr", "1e39", "--lr must be a finite number"),
    ("--beta1", "2", "--beta1 and --beta2 must lie in [0, 1)"),
    ("--beta2", "nan", "--beta2 must be a finite number"),
    ("--weight-decay", "-5", "--weight-decay must be >= 0"),
    ("--grad-clip", "-1", "--grad-clip must be >= 0"),
    ("--clip-eps", "0", "--clip-eps must be > 0"),
    ("--adv-eps", "=-1e-6", "--adv-eps must be > 0"),
    ("--kv-cache-gib", "=-2", "--kv-cache-gib must be >= 0"),
    ("--parity-every", "0", "--parity-every >= 1"),
])
def test_bad_floats_and_ranges(ckpt, tmp_path, capsys, flag, value, needle):
    given = [flag + value] if value.startswith("=") else [flag, value]
    assert needle in refuse_last_line(cpu_argv(ckpt(), tmp_path / "logs") + given, capsys)


def test_a_model_dir_without_tokenizer(ckpt, tmp_path, capsys):
    shutil.copytree(ckpt(), tmp_path / "m")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / "m" / name).unlink(missing_ok=True)
    err = refuse_last_line(cpu_argv(tmp_path / "m", tmp_path / "logs"), capsys)
    assert "has no tokenizer (tokenizer.json, or vocab.json + merges.txt)" in err
    assert not (tmp_path / "logs").exists()


def write_header_only(path, header: dict, data_bytes: int):
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + b"\0" * data_bytes)


@pytest.mark.parametrize("damage,needle", [
    ("truncate", "is not a readable safetensors file"),
    ("garbage", "is not a readable safetensors file"),
    ("nan", "hold NaN or Inf values"),
    ("shape", "has shape [7], config.json implies [256]"),
    ("missing", "weights missing for config.json's model: model.layers.1.mlp.down_proj.weight"),
    ("config", "config.json is not valid JSON"),
])
def test_damaged_weights_fail_before_the_engine_starts(ckpt, tmp_path, capsys, damage, needle):
    from safetensors.torch import load_file, save_file

    m = tmp_path / "m"
    shutil.copytree(ckpt(), m)
    file = m / "model.safetensors"
    state = load_file(file)
    if damage == "truncate":
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    elif damage == "garbage":
        file.write_bytes(b"\x00\x01not a safetensors file at all" * 10)
    elif damage == "nan":
        state["model.layers.0.mlp.up_proj.weight"][3, 3] = float("nan")
        save_file(state, file)
    elif damage == "shape":
        state["model.norm.weight"] = torch.ones(7)
        save_file(state, file)
    elif damage == "missing":
        del state["model.layers.1.mlp.down_proj.weight"]
        save_file(state, file)
    else:
        (m / "config.json").write_text("{not json")
    err = refuse_last_line(cpu_argv(m, tmp_path / "logs"), capsys)
    assert needle in err
    assert not (tmp_path / "logs").exists()  # no run directory for a run that never started
