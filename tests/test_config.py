"""Config and CLI: grouped --help, choices, booleans, and bad input as one sentence (exit 2)."""

import dataclasses
import math
import os
import json
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import simple_rl as rl
from helpers import cpu_argv, main_cpu, run_cpu

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def help_text():
    return subprocess.run([sys.executable, str(ROOT / "simple_rl.py"), "--help"],
                          capture_output=True, text=True, check=True).stdout


def error_of(argv, capsys):
    assert main_cpu(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("simple_rl: error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_help_is_grouped_by_config_section(help_text):
    groups = [g for g in re.findall(r"^(\w+):$", help_text, flags=re.M) if g != "examples"]
    assert groups == ["options", "model", "lora", "task", "generation", "grpo", "optim", "eval",
                      "logging", "checkpoints"]
    for f in dataclasses.fields(rl.Config):  # every field, in its section
        section = help_text.split(f"\n{f.metadata['group']}:\n")[1].split("\n\n")[0]
        assert "--" + f.name.replace("_", "-") in section, f.name


def test_help_shows_defaults_once_choices_and_examples(help_text):
    flat = " ".join(help_text.split())
    assert "(default: Qwen/Qwen3-1.7B)" in flat and "(default: 8)" in flat
    assert "(default: )" not in flat
    # each option's entry (wrapping ignored) ends with its default, 0 too, or "on" for a flag
    # that --no- turns off; a plain flag and an empty default show none but the help's own
    entries = {e.split()[0].rstrip(","): "".join(e.split())
               for e in re.split(r"\n  (?=--)|\n\n", help_text) if e.strip()}
    for f in dataclasses.fields(rl.Config):
        entry = entries["--" + f.name.replace("_", "-")]
        if f.default is True:
            assert entry.endswith("(default:on)"), entry
        elif f.default is False or f.default == "":
            assert entry.count("(default:") <= 1, entry
        else:
            assert entry.endswith(f"(default:{f.default})".replace(" ", "")), entry
            assert entry.count("(default:") == 1, entry
    assert "{bfloat16,float32}" in flat and "{auto,vllm,reference}" in flat
    assert "{arithmetic,gsm8k,jsonl}" in flat and "{auto,on,off}" in flat
    assert "--cuda-graphs, --no-cuda-graphs" in flat  # on by default: --no- means something
    for flag in ("debug-parity", "strict-parity", "overwrite", "verbose", "enable-thinking"):
        assert f"--{flag}" in flat and f"--no-{flag}" not in flat  # plain flags
    examples = help_text.split("examples:")[1].strip().splitlines()
    assert len(examples) == 4 and any("torchrun" in e for e in examples)


def test_cli_parses_types_booleans_and_records_what_was_given():
    cfg, given = rl.parse_config(["--group-size", "4", "--temperature", "0.7",
                                  "--no-std-normalize", "--model", "x", "--strict-parity"])
    assert cfg.group_size == 4 and cfg.temperature == 0.7 and cfg.std_normalize is False
    assert cfg.model == str(Path("x").absolute()) and cfg.strict_parity is True  # a path
    assert given == {"group_size", "temperature", "std_normalize", "model", "strict_parity"}
    assert rl.parse_config([]) == (rl.Config(log_dir=str(Path("runs").absolute())), set())


@pytest.mark.parametrize("argv,needle", [
    (["--group-size", "1"], "--group-size must be at least 2"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--max-new-tokens", "2000", "--max-model-len", "1024"], "leaves no room for a prompt"),
    (["--max-new-tokens", "1024", "--max-model-len", "1024"], "leaves no room for a prompt"),
    (["--micro-batch-tokens", "100"], "must hold one full sequence"),
    (["--kernels", "fast"], "argument --kernels: invalid choice: 'fast'"),
    (["--dtype", "float16"], "argument --dtype: invalid choice"),
    (["--model", "/no/such/dir"], "is not a directory"),
    (["--data-files", "x.jsonl"], "--data-files goes with --task gsm8k"),
    (["--enable-thinking", "--chat-template", "off"], "--enable-thinking needs a chat template"),
    (["--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
])
def test_config_errors(argv, needle, capsys):
    assert needle in error_of(argv, capsys)


@pytest.mark.parametrize("template", ["auto", "on"])
def test_enable_thinking_is_taken_with_a_chat_template(template):
    """--enable-thinking goes with the default --chat-template auto and with on (refused only
    with off, above)."""
    rl.validate(rl.Config(enable_thinking=True, chat_template=template))


def test_non_qwen3_checkpoint_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama",
                                                      "architectures": ["LlamaForCausalLM"]}))
    err = error_of(["--model", str(tmp_path)], capsys)
    assert "'llama' model (LlamaForCausalLM)" in err and "Qwen3" in err
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"


def test_directory_without_config_or_weights(ckpt, tmp_path, capsys):
    assert "has no config.json" in error_of(["--model", str(tmp_path)], capsys)
    shutil.copy(ckpt() / "config.json", tmp_path / "config.json")
    assert "has no *.safetensors weights" in error_of(["--model", str(tmp_path)], capsys)


def test_max_model_len_beyond_positions(ckpt, capsys):
    err = error_of(["--model", str(ckpt()), "--max-model-len", "4096",
                    "--micro-batch-tokens", "4096"], capsys)
    assert "exceeds the model's max_position_embeddings (2048)" in err


def test_tokenizer_larger_than_vocab(ckpt, tmp_path, capsys):
    shutil.copytree(ckpt(), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["vocab_size"] = 300  # the tokenizer has 320 tokens; the weights say 384
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    err = error_of(["--model", str(tmp_path / "m")], capsys)
    assert "has shape [384, 256], config.json implies [300, 256]" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_missing_cuda_says_what_is_needed(ckpt, tmp_path, capsys):
    assert rl.main(["--model", str(ckpt()), "--log-dir", str(tmp_path / "runs")]) == 2
    assert "no CUDA GPU found" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # nothing left behind


@pytest.mark.parametrize("name, value", [("VLLM_BATCH_INVARIANT", "0"),
                                         ("VLLM_LORA_ENABLE_DUAL_STREAM", "1")])
def test_contradicting_env_is_refused(monkeypatch, name, value):
    """VLLM_LORA_ENABLE_DUAL_STREAM=1: vLLM would add a LoRA's delta computed on a side stream
    after the base GEMM, not in the expand kernel the trainer calls."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv(name, value)
    with pytest.raises(rl.ConfigError, match=f"{name}={value} breaks bitwise parity"):
        rl.prepare_environment(rl.Config())


def test_unset_env_is_set_and_missing_vllm_is_named(monkeypatch):
    import os

    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "4096")  # split-K would be possible
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    with pytest.raises(rl.ConfigError, match="vLLM is not installed; run `pip install -r"):
        rl.prepare_environment(rl.Config())
    assert os.environ["VLLM_BATCH_INVARIANT"] == "1"
    # cuBLASLt without split-K from the first GEMM on, as vLLM sets it when its engine starts
    assert os.environ["CUBLASLT_WORKSPACE_SIZE"] == "1"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_prompt_too_long_fails_before_the_run_directory(ckpt, tmp_path, capsys):
    argv = cpu_argv(ckpt(), tmp_path / "runs", max_model_len=24, micro_batch_tokens=24,
                    max_new_tokens=8)
    err = error_of(argv, capsys)
    assert "the longest prompt has" in err and "exceeds --max-model-len 24" in err
    assert not (tmp_path / "runs").exists()


def test_a_longest_prompt_that_leaves_exactly_max_new_tokens_is_taken(ckpt):
    """load_task takes a task whose longest prompt plus --max-new-tokens is exactly
    --max-model-len (the engine's limit counts the last token in), and refuses it one token
    shorter, naming the three numbers."""
    path = ckpt()
    tokenizer = rl.load_tokenizer(path, rl.model_args_from_hf(rl.read_qwen3_config(path)))
    task = rl.load_task(rl.Config(max_new_tokens=8), tokenizer)
    longest = max(len(p) for p in task.prompt_ids + task.eval_prompt_ids)
    fits = rl.load_task(rl.Config(max_new_tokens=8, max_model_len=longest + 8), tokenizer)
    assert fits.prompt_ids == task.prompt_ids and fits.eval_prompt_ids == task.eval_prompt_ids
    with pytest.raises(rl.ConfigError, match=f"^the longest prompt has {longest} tokens; with "
                       f"--max-new-tokens 8 it exceeds --max-model-len {longest + 7}\\.$"):
        rl.load_task(rl.Config(max_new_tokens=8, max_model_len=longest + 7), tokenizer)


def test_readme_documents_every_option_and_the_test_command():
    readme = (ROOT / "README.md").read_text()
    for f in dataclasses.fields(rl.Config):
        assert f"`--{f.name.replace('_', '-')}`" in readme, f.name
    command = "python -m pip install -q -r requirements-cpu.txt && python -m pytest -q"
    assert command in readme and command in (ROOT / ".ci" / "run").read_text()


def test_stop_ids_gather_every_eos(ckpt, tmp_path):
    """The engine stops at the tokenizer's eos, config.json's and generation_config.json's (an
    int or a list each), once each, sorted. Qwen3 names <|im_end|> in one file and
    <|endoftext|> in another: a stop id left out lets a completion run on past its end to
    --max-new-tokens, trained on as if it were the answer."""
    shutil.copytree(ckpt(), tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 1]}))
    assert rl.load_model_files(rl.Config(model=str(tmp_path / "m"))).eos_ids == [0, 1]
    eos = types.SimpleNamespace
    assert rl.stop_token_ids(tmp_path, eos(eos_token_id=5), eos(eos_token_id=[7, 5])) == [5, 7]
    assert rl.stop_token_ids(tmp_path, eos(eos_token_id=None), eos(eos_token_id=7)) == [7]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 3]}))
    assert rl.stop_token_ids(tmp_path, eos(eos_token_id=5), eos(eos_token_id=11)) == [3, 5, 9, 11]


def test_world_larger_than_the_prompts_is_refused(ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rl, "init_ranks", lambda device_type: rl.Ranks(0, 4, torch.device("cpu")))
    err = error_of(cpu_argv(ckpt(), tmp_path / "runs", num_prompts=2), capsys)
    assert "4 ranks but --num-prompts 2: every rank needs at least one prompt" in err


def test_every_rank_is_sized_for_the_most_prompts_a_rank_gets():
    """5 prompts on 2 ranks: rank 0 generates 3 of them (prompt i on rank i mod 2), so each
    rank's KV cache and micro-batches are sized for 3 x G samples, not 2 x G."""
    most = max(len(rl.my_prompts(5, rl.Ranks(r, 2, torch.device("cpu")))) for r in range(2))
    cfg = rl.Config(num_prompts=5, group_size=8)
    assert most == 3 and rl.samples_per_rank(cfg, 2) == most * 8
    assert rl.samples_per_rank(cfg, 1) == 40


QWEN3_8B = types.SimpleNamespace(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
                                 hidden_dim=12288, vocab_size=151936, enable_weight_tying=False)


def gpu_of(monkeypatch, gib: float) -> None:
    """check_memory sees a GPU of `gib` GiB."""
    props = types.SimpleNamespace(total_memory=gib * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)


def qwen3(dim, layers, heads, inter, tied=True):
    """A Qwen3's TorchTitan args (LoRA's parameter count builds the model on meta from them)."""
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

    return Qwen3ModelArgs(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=8, head_dim=128,
                          hidden_dim=inter, vocab_size=151936, enable_weight_tying=tied,
                          norm_eps=1e-6, rope_theta=1e6, max_seq_len=40960)


def test_memory_estimate_and_the_advice_it_gives(monkeypatch):
    qwen3_8b = QWEN3_8B
    assert abs(rl.count_params(qwen3_8b) / 8.19e9 - 1) < 0.01
    cfg = rl.Config(micro_batch_tokens=4096)
    one, two = rl.memory_estimate(cfg, qwen3_8b, 1), rl.memory_estimate(cfg, qwen3_8b, 2)
    assert one["trainer state"] == 2 * two["trainer state"] and one["peak"] > 140 * 2**30
    assert two["peak"] < 130 * 2**30  # fits an H200 (measured on two: see README)
    gpu_of(monkeypatch, 143)
    with pytest.raises(rl.ConfigError) as err:
        rl.check_memory(cfg, qwen3_8b, rl.Ranks(0, 1, torch.device("cpu")))
    assert "a model of 8.19B parameters needs about" in str(err.value)  # any architecture
    assert "torchrun --nproc-per-node 2 simple_rl.py" in str(err.value)
    fits = rl.check_memory(cfg, qwen3_8b, rl.Ranks(0, 2, torch.device("cpu")))  # no error
    assert fits == f"~{two['peak'] / 2**30:.0f} of 143 GiB per GPU"  # the banner's words


def test_auto_micro_batch_is_the_largest_that_the_estimate_fits():
    """--micro-batch-tokens 0 on a 140 GiB GPU: 24576 tokens at 1.7B, 8192 at 4B (the sizes
    measured to fit: see README), 4096 for 8B on two GPUs; never more than a step needs, never
    less than one sequence; the smallest when nothing fits (check_memory then explains)."""
    h200 = 140 * 2**30
    cfg = rl.Config()  # 16 prompts x 8 samples, max_model_len 1024
    q17, q4, q8 = qwen3(2048, 28, 16, 6144), qwen3(2560, 36, 32, 9728), \
        qwen3(4096, 36, 32, 12288, tied=False)
    assert rl.auto_micro_batch(cfg, q17, 1, h200) == 24576
    assert rl.auto_micro_batch(cfg, q4, 1, h200) == 8192
    assert rl.auto_micro_batch(cfg, q8, 2, h200) == 4096
    assert rl.auto_micro_batch(cfg, q8, 1, h200) == 1024  # nothing fits: the smallest
    # under LoRA the base is the engine's and only adapters train: Qwen3-32B fits at 4096
    q32 = qwen3(5120, 64, 64, 25600, tied=False)
    assert rl.auto_micro_batch(rl.Config(lora_rank=16), q32, 1, h200) == 4096
    for model, world in ((q17, 1), (q4, 1), (q8, 2)):  # what it picks passes check_memory's test
        size = rl.auto_micro_batch(cfg, model, world, h200)
        grown = rl.dataclasses.replace(cfg, micro_batch_tokens=size + 4096)
        assert rl.memory_estimate(rl.dataclasses.replace(cfg, micro_batch_tokens=size), model,
                                  world)["peak"] <= h200
        assert size == 32768 or rl.memory_estimate(grown, model, world)["peak"] > h200
    small = rl.dataclasses.replace(cfg, num_prompts=1, group_size=2, max_model_len=1500)
    assert rl.auto_micro_batch(small, q17, 1, h200) == 4096  # 2 x 1500 tokens: one micro-batch
    assert rl.auto_micro_batch(small, q17, 1, math.inf) == 4096
    long = rl.dataclasses.replace(cfg, max_model_len=40000)
    assert rl.auto_micro_batch(long, q17, 1, math.inf) == 40000  # one full sequence at least
    explicit = rl.dataclasses.replace(cfg, micro_batch_tokens=2048)
    cpu = rl.Ranks(0, 1, torch.device("cpu"))
    assert rl.with_micro_batch(explicit, q17, cpu) is explicit
    assert rl.with_micro_batch(cfg, q17, cpu).micro_batch_tokens == 32768  # CPU: no memory bound


def test_the_micro_batch_a_gpu_picks_counts_the_tasks_prompt_lengths(monkeypatch):
    """with_micro_batch on a (pretended) 140 GiB GPU hands the task's prompt lengths to the
    estimate: Qwen3-1.7B's shape picks 28672 tokens for prompts of 64-200 tokens, where prompts
    of unknown length leave room for 24576."""
    q17 = qwen3(2048, 28, 16, 6144)
    gpu_of(monkeypatch, 140)
    gpu = rl.Ranks(0, 1, torch.device("cuda"))
    assert rl.with_micro_batch(rl.Config(), q17, gpu, (64, 200)).micro_batch_tokens == 28672
    assert rl.with_micro_batch(rl.Config(), q17, gpu).micro_batch_tokens == 24576


def test_auto_micro_batch_is_kept_in_the_run_config(ckpt, tmp_path, capsys):
    """The choice is printed and saved with the run: a resume on another GPU trains with the
    same micro-batches (they set the order of the gradient sums)."""
    run_cpu(cpu_argv(ckpt(), tmp_path / "runs", micro_batch_tokens=0, steps=2, run_name="auto"))
    saved = json.loads((tmp_path / "runs/auto/checkpoints/step_000002/run_config.json").read_text())
    assert saved["micro_batch_tokens"] == 4096  # 6 samples of at most 128 tokens: the smallest
    assert "| micro-batch 4096 tokens |" in capsys.readouterr().out


def test_the_allocator_grows_its_segments_in_place_unless_the_user_chose():
    """simple_rl sets PyTorch's expandable segments before torch loads (the update's memory
    steady from step to step); a PYTORCH_CUDA_ALLOC_CONF of the user's own is kept."""
    show = "import os, simple_rl; print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])"

    def conf(**env):
        base = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
        return subprocess.run([sys.executable, "-c", show], cwd=ROOT, env={**base, **env},
                              capture_output=True, text=True, check=True).stdout.strip()

    assert conf() == "expandable_segments:True"
    assert conf(PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:512") == "max_split_size_mb:512"


def test_a_leftover_v1_runner_variable_is_dropped_in_one_line(monkeypatch, capsys):
    """vLLM 0.34 raises on VLLM_USE_V2_MODEL_RUNNER=0 (its V1 runner is gone): simple_rl drops
    it with one sentence and goes on to the next check."""
    import os

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    monkeypatch.setitem(sys.modules, "vllm", None)  # the next check: vLLM not installed
    with pytest.raises(rl.ConfigError, match="vLLM is not installed"):
        rl.prepare_environment(rl.Config())
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
    out = capsys.readouterr().out
    assert out == ("VLLM_USE_V2_MODEL_RUNNER=0 ignored: vLLM 0.34 has only its V2 model runner, "
                   "the one simple_rl's parity is measured on.\n")


def test_an_older_vllm_is_refused_with_the_command_that_installs_the_right_one(monkeypatch):
    import types

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    logger = types.SimpleNamespace(DEFAULT_LOGGING_CONFIG={"handlers": {"vllm": {}}})
    for version, ok in (("0.26.0", False), ("0.33.1", False), ("0.34.0", True),
                        ("0.35.0+cu130", True)):
        monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version,
                                                                      logger=logger))
        monkeypatch.setitem(sys.modules, "vllm.logger", logger)
        if ok:
            rl.prepare_environment(rl.Config())
            continue
        with pytest.raises(rl.ConfigError, match=rf"^vLLM {version} is installed; simple_rl "
                           r"computes what vLLM 0.34 computes: run `pip install -r "
                           r"requirements.txt` \(vllm==0.34.0, torch==2.14.0"):
            rl.prepare_environment(rl.Config())
    assert not rl.version_at_least("dev", 0, 34) and rl.version_at_least("1.0", 0, 34)


@pytest.mark.parametrize("gib, hint", [(120, "--micro-batch-tokens 2048 (about 109 GiB)"),
                                       (105, "--micro-batch-tokens 1024 (about 101 GiB)")])
def test_check_memory_suggests_the_largest_micro_batch_that_fits(monkeypatch, gib, hint):
    """Qwen3-8B on two GPUs at 16384 tokens (~218 GiB): the hint is the largest halving that
    fits (2048 at 120 GiB), down to one sequence (at 105 GiB only --max-model-len's 1024)."""
    gpu_of(monkeypatch, gib)
    with pytest.raises(rl.ConfigError) as err:
        rl.check_memory(rl.Config(micro_batch_tokens=16384), QWEN3_8B,
                        rl.Ranks(0, 2, torch.device("cpu")))
    assert f"run with {hint}" in str(err.value)


def test_the_arithmetic_task_may_hold_out_exactly_half_its_candidates():
    """--eval-size EVAL_CANDIDATES // 2 (2048) is the documented maximum, so it is accepted;
    one more is refused."""
    rl.validate(rl.Config(task="arithmetic", eval_size=rl.EVAL_CANDIDATES // 2))
    with pytest.raises(rl.ConfigError, match="holds out at most 2048"):
        rl.validate(rl.Config(task="arithmetic", eval_size=rl.EVAL_CANDIDATES // 2 + 1))


def test_data_files_are_made_absolute_at_start(tmp_path, monkeypatch):
    """--data-files is read (and hashed for a resume) from the directory the run started in,
    whatever a reward's chdir does later."""
    monkeypatch.chdir(tmp_path)
    cfg, passed = rl.parse_config(["--task", "jsonl", "--data-files", "train.jsonl"])
    assert cfg.data_files == str(tmp_path / "train.jsonl") and "data_files" in passed
    assert rl.parse_config([])[0].data_files == ""  # none given: stays empty
