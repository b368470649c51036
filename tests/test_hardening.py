"""Hostile but fair input: a checkpoint is data, nothing outside the run is deleted, and every
bad input ends in one sentence (exit 2) before anything slow starts."""

import json
import shutil
import struct

import pytest
import torch

from helpers import cpu_argv, refuse_last_line


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
