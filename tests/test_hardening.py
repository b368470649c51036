"""Hostile but fair input: a checkpoint is data, nothing outside the run is deleted, and every
bad input ends in one sentence (exit 2) before anything slow starts."""

import json
import pickle
import shutil
import struct

import pytest
import torch

import simple_rl as rl
from helpers import (copy_checkpoint, cpu_argv, main_cpu, one_line_error,
                     refuse_last_line, run_cpu)


class Boom:
    """A pickle that runs code when loaded: writes a marker file."""

    marker = None

    def __reduce__(self):
        return (open, (str(Boom.marker), "w"))


# ---------------------------------------------------------------- a checkpoint is data


def test_crafted_dcp_metadata_is_refused_and_runs_nothing(saved, tmp_path, capsys):
    ckpt = copy_checkpoint(saved, tmp_path)
    Boom.marker = tmp_path / "pwned"
    (ckpt / "trainer" / ".metadata").write_bytes(pickle.dumps(Boom()))
    err = one_line_error(main_cpu(["--resume", str(ckpt), "--steps", "3"]), capsys)
    assert "cannot be restored (" in err and "io.open is not allowed in a checkpoint" in err
    assert not Boom.marker.exists()


def test_crafted_rng_and_tensor_files_are_refused_and_run_nothing(saved, tmp_path, capsys):
    ckpt = copy_checkpoint(saved, tmp_path)
    Boom.marker = tmp_path / "pwned"
    torch.save({"torch": Boom()}, ckpt / "rng_rank0.pt")
    assert main_cpu(["--resume", str(ckpt), "--steps", "3"]) == 2
    assert "cannot be restored" in capsys.readouterr().err and not Boom.marker.exists()
    ckpt = copy_checkpoint(saved, tmp_path / "b")
    shard = ckpt / "trainer" / "__0_0.distcp"
    torch.save(Boom(), shard)  # DCP reads tensors with torch.load: forced weights_only
    assert main_cpu(["--resume", str(ckpt), "--steps", "3"]) == 2
    assert "cannot be restored" in capsys.readouterr().err and not Boom.marker.exists()


def test_real_checkpoints_load_with_the_data_only_readers(saved):
    with rl.data_only_loading():
        rng = torch.load(saved / "rng_rank0.pt", weights_only=True)
        meta = rl.CheckpointUnpickler(open(saved / "trainer" / ".metadata", "rb")).load()
    assert rng["torch"].dtype == torch.uint8 and len(meta.state_dict_metadata) > 10


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


# ---------------------------------------------------------------- bad resume input


def test_a_truncated_trainer_shard_is_one_sentence(saved, tmp_path, capsys):
    ckpt = copy_checkpoint(saved, tmp_path)
    shard = ckpt / "trainer" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    err = one_line_error(main_cpu(["--resume", str(ckpt), "--steps", "3"]), capsys)
    assert f"{ckpt} cannot be restored" in err and "resume from an earlier checkpoint" in err


def test_a_checkpoint_from_another_model_is_refused(saved, ckpt, tmp_path, capsys):
    ckpt_dir = copy_checkpoint(saved, tmp_path)
    config = json.loads((ckpt_dir / "run_config.json").read_text())
    config["model"] = str(ckpt(layers=3))  # a model with one more layer
    (ckpt_dir / "run_config.json").write_text(json.dumps(config))
    err = one_line_error(main_cpu(["--resume", str(ckpt_dir), "--steps", "3"]), capsys)
    assert "config.json is not what the run read when" in err  # refused before it is read
    err = one_line_error(main_cpu(["--resume", str(ckpt_dir), "--steps", "3", "--model",
                                   config["model"], "--allow-changed-files"]), capsys)
    assert "was saved from another model" in err


@pytest.mark.parametrize("text,needle", [
    ("{oops", "run_config.json is damaged or from another version"),
    ('{"no_such_field": 1}', "run_config.json is damaged or from another version"),
    ('{"lr": -1.0}', "holds an invalid config: --lr must be > 0"),
])
def test_a_bad_run_config_is_refused(saved, tmp_path, capsys, text, needle):
    ckpt = copy_checkpoint(saved, tmp_path)
    if text.startswith('{"lr"'):
        config = json.loads((ckpt / "run_config.json").read_text())
        text = json.dumps(dict(config, lr=-1.0))
    (ckpt / "run_config.json").write_text(text)
    assert needle in one_line_error(main_cpu(["--resume", str(ckpt), "--steps", "3"]), capsys)


def test_a_damaged_state_json_is_refused(saved, tmp_path, capsys):
    ckpt = copy_checkpoint(saved, tmp_path)
    (ckpt / "state.json").write_text('{"next_step": "two"}')
    assert "state.json is damaged" in one_line_error(
        main_cpu(["--resume", str(ckpt), "--steps", "3"]), capsys)


def test_resume_names_the_flags_it_ignores(saved, tmp_path, capsys):
    ckpt = copy_checkpoint(saved, tmp_path)
    assert main_cpu(["--resume", str(ckpt), "--steps", "3", "--lr", "0.5", "--group-size", "3",
                     "--save-every", "5"]) == 0
    out = capsys.readouterr().out
    assert "ignores the command line's: --lr." in out  # --group-size 3 is the saved value
    saved_cfg = json.loads((ckpt.parent / "step_000003" / "run_config.json").read_text()) \
        if (ckpt.parent / "step_000003").exists() else None
    assert saved_cfg is None  # --save-every 5 was taken: no checkpoint at step 3


def test_a_checkpoint_of_another_stack_says_so_in_one_line_and_goes_on(saved, tmp_path, capsys):
    """Checkpoints record the versions whose kernels decide the samples; one written before they
    did (vLLM 0.26 / torch 2.11) resumes with one sentence: the weights go on, the samples not
    bit for bit."""
    ckpt = copy_checkpoint(saved, tmp_path)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["stack"] == rl.stack_versions() == {"torch": torch.__version__}  # no vLLM here
    assert rl.stack_change(state["stack"]) is None
    assert rl.stack_change({"vllm": "0.34.0", "torch": "2.14.0"}) == \
        f"vLLM 0.34.0 / torch 2.14.0 (now torch {torch.__version__})"
    del state["stack"]
    (ckpt / "state.json").write_text(json.dumps(state))
    assert main_cpu(["--resume", str(ckpt), "--steps", "3"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "was made with" in line]
    assert said == [f"step_000002 was made with vLLM 0.26 / torch 2.11 (now torch "
                    f"{torch.__version__}): its weights and optimizer state go on exactly, its "
                    "samples will not continue bit for bit."]
