"""Config, CLI and bad input: one clear sentence, exit code 2, nothing touched."""

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import simple_rl as rl

ROOT = Path(__file__).resolve().parents[1]


def error_of(argv, capsys):
    assert rl.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("simple_rl: error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_help_lists_every_field_with_default():
    out = subprocess.run([sys.executable, str(ROOT / "simple_rl.py"), "--help"], capture_output=True, text=True, check=True).stdout
    flat = " ".join(out.split())
    for f in dataclasses.fields(rl.Config):
        assert "--" + f.name.replace("_", "-") in out, f.name
    assert "(default: Qwen/Qwen3-1.7B)" in flat and "(default: 8)" in flat


def test_cli_parses_types_and_booleans():
    cfg = rl.parse_config(["--group-size", "4", "--temperature", "0.7", "--no-std-normalize", "--model", "x"])
    assert cfg.group_size == 4 and cfg.temperature == 0.7 and cfg.std_normalize is False and cfg.model == "x"
    assert rl.parse_config([]) == rl.Config()


@pytest.mark.parametrize("argv,needle", [
    (["--group-size", "1"], "--group-size must be at least 2"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--max-new-tokens", "2000", "--max-model-len", "1024"], "leaves no room for a prompt"),
    (["--micro-batch-tokens", "100"], "must hold one full sequence"),
    (["--kernels", "fast"], "--kernels must be auto, vllm or reference"),
    (["--dtype", "float16"], "--dtype must be one of"),
    (["--model", "/no/such/dir"], "is not a directory"),
])
def test_config_errors(argv, needle, capsys):
    assert needle in error_of(argv, capsys)


def test_non_qwen3_checkpoint_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    err = error_of(["--model", str(tmp_path)], capsys)
    assert "'llama' model (LlamaForCausalLM)" in err and "Qwen3" in err
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"  # untouched


def test_directory_without_config_or_weights(ckpt, tmp_path, capsys):
    assert "has no config.json" in error_of(["--model", str(tmp_path)], capsys)
    shutil.copy(ckpt() / "config.json", tmp_path / "config.json")
    with pytest.raises(rl.ConfigError, match="no \\*.safetensors weights"):
        rl.load_hf_state_dict(tmp_path)


def test_max_model_len_beyond_positions(ckpt, capsys):
    assert "exceeds the model's max_position_embeddings (2048)" in error_of(["--model", str(ckpt()), "--max-model-len", "4096", "--micro-batch-tokens", "4096"], capsys)


def test_tokenizer_larger_than_vocab(ckpt, tmp_path, capsys):
    shutil.copytree(ckpt(), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["vocab_size"] = 100  # the tokenizer has 320 tokens
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    assert "does not fit the model's vocab of 100" in error_of(["--model", str(tmp_path / "m")], capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_missing_cuda_says_what_is_needed(ckpt, capsys):
    err = error_of(["--model", str(ckpt())], capsys)
    assert "no CUDA GPU found" in err


def test_contradicting_env_is_refused(ckpt, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    err = error_of(["--model", str(ckpt())], capsys)
    assert "VLLM_BATCH_INVARIANT=0 breaks bitwise parity" in err


def test_prompt_too_long_for_model_len(ckpt, tmp_path):
    from test_loop import make_trainer

    tr = make_trainer(ckpt(), tmp_path / "tb", max_model_len=16, micro_batch_tokens=16)
    with pytest.raises(rl.ConfigError, match="exceeds --max-model-len 16"):
        rl.rl_step(tr, 0)


def test_cli_error_is_one_line_without_traceback():
    r = subprocess.run([sys.executable, str(ROOT / "simple_rl.py"), "--model", "/no/such/dir"], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == "simple_rl: error: --model '/no/such/dir' is not a directory."


def test_readme_documents_every_option():
    readme = (ROOT / "README.md").read_text()
    for f in dataclasses.fields(rl.Config):
        assert f"| `--{f.name.replace('_', '-')}` |" in readme, f.name
    assert "python -m pip install -q -r requirements-cpu.txt && python -m pytest -q" in readme
    assert "python -m pip install -q -r requirements-cpu.txt && python -m pytest -q" in (ROOT / ".ci" / "run").read_text()


def test_stop_ids_gather_every_eos(ckpt, tmp_path):
    shutil.copytree(ckpt(), tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 1]}))
    cfg = rl.Config(model=str(tmp_path / "m"))
    assert rl.load_model_files(cfg)[3] == [0, 1]  # tokenizer eos 0, config eos 0, generation config [0, 1]
