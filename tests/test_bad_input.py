"""Bad input is refused in one sentence (exit 2) before the engine starts or a run directory is
made: flags out of range or past what fp32 and a step can hold, damaged or incomplete model
files, a chat template that fails, and data files that are empty or not JSON lines. (The
parser's own errors and the environment's: test_config.py.)"""

import json
import re
import shutil

import pytest
import torch

import simple_rl as rl
from helpers import copy_checkpoint, cpu_argv, latest, refuse


# ---------------------------------------------------------------- flags


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
    ("--max-tool-tokens", "=-1", "--max-tool-tokens must be >= 0"),
    ("--parity-every", "0", "--parity-every >= 1"),
])
def test_bad_floats_and_ranges(ckpt, tmp_path, capsys, flag, value, needle):
    given = [flag + value] if value.startswith("=") else [flag, value]
    assert needle in refuse(cpu_argv(ckpt(), tmp_path / "logs") + given, capsys, last_line=True)


@pytest.mark.parametrize("seed", [2**50, 2**64 - 1, 2**70])
def test_11_seeds_out_of_range_are_refused_at_parse_time(ckpt, tmp_path, capsys, seed):
    err = refuse(cpu_argv(ckpt(), tmp_path / "logs", seed=seed), capsys)
    assert f"--seed must lie in [0, 2^32) (got {seed})." in err
    assert not (tmp_path / "logs").exists()


def test_every_seed_below_2_to_the_32_is_taken():
    """--seed is taken anywhere in [0, 2^32), the half past 2^31 too, and refused at 2^32."""
    for seed in (0, 2**31, 2**32 - 1):
        rl.validate_numbers(rl.Config(seed=seed))
    with pytest.raises(rl.ConfigError, match=r"^--seed must lie in \[0, 2\^32\) "
                       r"\(got 4294967296\)\.$"):
        rl.validate_numbers(rl.Config(seed=2**32))


@pytest.mark.parametrize("flag,value,needle", [
    ("--adv-eps", "1e-320", "--adv-eps 1e-320 is too small for fp32 (0, or at least 1.18e-38"),
    ("--lr", "1e-45", "--lr 1e-45 is too small for fp32"),
    ("--num-prompts", "10000000", "--num-prompts x --group-size is 30,000,000 samples a step"),
    ("--group-size", "100000", "--num-prompts x --group-size is 200,000 samples a step"),
])
def test_15_values_the_run_cannot_hold_are_refused_at_parse_time(ckpt, tmp_path, capsys, flag,
                                                                 value, needle):
    assert needle in refuse(cpu_argv(ckpt(), tmp_path / "logs") + [flag, value], capsys)


# ---------------------------------------------------------------- model files


def test_a_model_dir_without_tokenizer(ckpt, tmp_path, capsys):
    shutil.copytree(ckpt(), tmp_path / "m")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / "m" / name).unlink(missing_ok=True)
    err = refuse(cpu_argv(tmp_path / "m", tmp_path / "logs"), capsys, last_line=True)
    assert "has no tokenizer (tokenizer.json, or vocab.json + merges.txt)" in err
    assert not (tmp_path / "logs").exists()


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
    err = refuse(cpu_argv(m, tmp_path / "logs"), capsys, last_line=True)
    assert needle in err
    assert not (tmp_path / "logs").exists()  # no run directory for a run that never started


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


# ---------------------------------------------------------------- data files


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
                 last_line=True)
    assert "a question that is not text" in err


# ---------------------------------------------------------------- Qwen3.5 checkpoints


def edited_q35(q35, tmp_path, change, **kw):
    """A copy of a tiny Qwen3.5 checkpoint with change(config) applied to its config.json (to
    its text_config for a vision-language one)."""
    m = tmp_path / "m"
    shutil.copytree(q35(**kw), m)
    raw = json.loads((m / "config.json").read_text())
    change(raw.get("text_config", raw))
    (m / "config.json").write_text(json.dumps(raw))
    return m


TURNED = ("must lie in (0, 1] and turn an even number of a head's 32 dims (vLLM turns "
          "int(head_dim x factor) dims, in pairs).")


@pytest.mark.parametrize("key,value,words", [
    ("partial_rotary_factor", 2.0, f"partial_rotary_factor 2.0 {TURNED}"),
    ("partial_rotary_factor", -0.25, f"partial_rotary_factor -0.25 {TURNED}"),
    ("partial_rotary_factor", 0.3, f"partial_rotary_factor 0.3 {TURNED}"),  # 9 dims
    ("partial_rotary_factor", None, f"partial_rotary_factor None {TURNED}"),
    ("rope_theta", 0, "rope_theta 0 must be a finite number > 0."),
    ("rope_theta", None, "rope_theta None must be a finite number > 0."),
    ("rms_norm_eps", -1.0, "rms_norm_eps -1.0 must be a finite number > 0."),
])
def test_q35_numbers_that_fail_at_the_first_forward_are_refused(q35, tmp_path, capsys, key,
                                                                value, words):
    """Before: a traceback (a factor of None), a traceback or NaN after the engine's start (a
    factor above 1 or below 0, a theta of 0), or a silent run (9 of 32 dims turned)."""
    def change(c):
        (c if key == "rms_norm_eps" else c["rope_parameters"])[key] = value

    m = edited_q35(q35, tmp_path, change)
    err = refuse(cpu_argv(m, tmp_path / "logs"), capsys)
    assert err == f"simple_rl: error: {m / 'config.json'}: {words}"
    assert not (tmp_path / "logs").exists()


def test_a_text_model_type_with_a_text_config_is_refused(q35, tmp_path, capsys):
    """A vision-language Qwen3.5 whose config.json says a text model's model_type: transformers
    reads its text_config as a dict (before: AttributeError, a traceback)."""
    m = tmp_path / "m"
    shutil.copytree(q35(vision=True), m)
    raw = json.loads((m / "config.json").read_text())
    raw.update(model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"])
    (m / "config.json").write_text(json.dumps(raw))
    err = refuse(cpu_argv(m, tmp_path / "logs") + ["--check"], capsys)
    assert err == (f"simple_rl: error: {m / 'config.json'}: a 'qwen3_5_text' model has no "
                   "text_config (a Qwen3.5 with a vision tower says model_type 'qwen3_5' or "
                   "'qwen3_5_moe'); remove one or the other.")


@pytest.mark.parametrize("flag,words", [
    ("--prefix-caching", "--prefix-caching: a Qwen3.5 reads no prefix cache (a "
     "cached prefix resumes its linear attention from a saved state, a split the trainer does "
     "not replay); drop the flag."),
    ("--debug-parity", "--debug-parity: the op-by-op debugger does not follow a Qwen3.5's "
     "schedule (a prompt prefilled whole, then a step a token) yet; drop the flag (every step's "
     "parity check still compares every token)."),
])
def test_check_refuses_the_flags_a_qwen35_run_refuses(q35, tmp_path, capsys, flag, words):
    """The run refuses them before vLLM starts; --check passed them (exit 0)."""
    err = refuse(cpu_argv(q35(), tmp_path / "logs") + [flag, "--check"], capsys)
    assert err == f"simple_rl: error: {words}"


def test_a_qwen3_run_resumed_onto_a_qwen35_stops_before_the_engine(saved, q35, tmp_path,
                                                                   capsys):
    """--resume of a Qwen3 run with --model a Qwen3.5 (--allow-changed-files: the base changed
    on purpose): before, the engine started and the restore then refused, and --check passed;
    now both stop at the checkpoint's shapes, and the run keeps its checkpoint."""
    ckpt = copy_checkpoint(saved, tmp_path)
    for check in ([], ["--check"]):
        argv = latest(tmp_path, "--model", q35(), "--allow-changed-files", *check)
        err = refuse(argv, capsys)
        assert err == (f"simple_rl: error: {ckpt} holds other weights than --model {q35()} "
                       "under its run_config.json makes (layers.0.attention.A_log: saved None, "
                       "here [4]): it was saved from another model, or its files were edited.")
    assert rl.is_complete(ckpt)


def test_a_text_weight_held_twice_is_refused(q35, tmp_path, capsys):
    """A vision-language Qwen3.5 holding a text weight under model. beside its
    model.language_model. copy: before, one of the two was trained, silently."""
    from safetensors.torch import load_file, save_file

    m = tmp_path / "m"
    shutil.copytree(q35(vision=True), m)
    state = load_file(m / "model.safetensors")
    state["model.layers.0.linear_attn.A_log"] = torch.full((4,), 50.0)
    save_file(state, m / "model.safetensors")
    err = refuse(cpu_argv(m, tmp_path / "logs") + ["--check"], capsys)
    assert err == (f"simple_rl: error: {m} holds the text model's "
                   "model.layers.0.linear_attn.A_log twice (model.language_model.layers.0."
                   "linear_attn.A_log, model.layers.0.linear_attn.A_log): which one is trained "
                   "would be chance; keep one.")


@pytest.mark.parametrize("k,v", [(2, 3), (0, 4), (2, "8")])
def test_q35_linear_heads_that_do_not_share_k_heads_evenly_are_refused(q35, tmp_path, capsys,
                                                                       k, v):
    """Each k head serves linear_num_value_heads / linear_num_key_heads v heads: a whole
    number of them, from at least one k head."""
    def change(c):
        c.update(linear_num_key_heads=k, linear_num_value_heads=v)

    m = edited_q35(q35, tmp_path, change)
    err = refuse(cpu_argv(m, tmp_path / "logs"), capsys)
    assert err == (f"simple_rl: error: {m / 'config.json'}: linear_num_key_heads ({k!r}) must "
                   f"be a whole number >= 1 and linear_num_value_heads ({v!r}) a multiple of it.")


@pytest.mark.parametrize("key,value", [
    ("linear_key_head_dim", -16), ("linear_value_head_dim", 0), ("hidden_size", -1),
    ("vocab_size", -1), ("intermediate_size", 2.5), ("head_dim", -32),
])
def test_q35_sizes_below_one_are_refused(q35, tmp_path, capsys, key, value):
    """Before: a traceback from the weight headers' shape check (a negative size), or a sentence
    that blamed partial_rotary_factor (a negative head_dim)."""
    m = edited_q35(q35, tmp_path, lambda c: c.update({key: value}))
    err = refuse(cpu_argv(m, tmp_path / "logs") + ["--check"], capsys)
    assert err == (f"simple_rl: error: {m / 'config.json'}: {key} {value!r} must be a whole "
                   "number >= 1.")


@pytest.mark.parametrize("width", [1, 8, 0, "4"])
def test_q35_conv_widths_vllm_cannot_run_are_refused(q35, tmp_path, capsys, width):
    """vLLM's causal conv kernels run widths 2 to 7 (Qwen3.5's is 4): before, a width of 0 with
    matching conv weights passed --check and failed at the first forward (an IndexError), and 1
    or 8 would have failed in vLLM after its start."""
    m = edited_q35(q35, tmp_path, lambda c: c.update(linear_conv_kernel_dim=width))
    err = refuse(cpu_argv(m, tmp_path / "logs") + ["--check"], capsys)
    assert err == (f"simple_rl: error: {m / 'config.json'}: linear_conv_kernel_dim {width!r} "
                   "must be a whole number from 2 to 7 (the widths vLLM's causal conv kernels "
                   "run).")


def test_an_A_log_whose_exp_overflows_is_refused_before_the_engine(q35, tmp_path, capsys):
    """A_log = 100 is finite, but -exp(A_log), the decay, is -inf in fp32: before, the checks
    passed and the first step gave NaN after the engine's start."""
    from safetensors.torch import load_file, save_file

    m = tmp_path / "m"
    shutil.copytree(q35(), m)
    state = load_file(m / "model.safetensors")
    key = "model.layers.0.linear_attn.A_log"
    state[key] = torch.full_like(state[key], 100.0)
    save_file(state, m / "model.safetensors")
    err = refuse(cpu_argv(m, tmp_path / "logs"), capsys)
    assert err == (f"simple_rl: error: {m}: {key} hold values above 88.72, where exp(A_log), "
                   "the decay's rate, overflows fp32 (NaN at the first step).")
    assert not (tmp_path / "logs").exists()


def test_an_infinite_rms_norm_eps_is_refused(ckpt, tmp_path):
    """check_config_numbers: rms_norm_eps must be finite (inf would zero every norm's output)."""
    path = tmp_path / "m"
    shutil.copytree(ckpt(), path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "rms_norm_eps": float("inf")}))
    with pytest.raises(rl.ConfigError, match="rms_norm_eps inf must be a finite number > 0"):
        rl.read_qwen3_config(path)


@pytest.mark.parametrize("change,needle", [
    (dict(beta1=1.0), "--beta1 and --beta2 must lie in [0, 1) (got 1.0, 0.999)."),
    (dict(beta2=1.0), "--beta1 and --beta2 must lie in [0, 1) (got 0.9, 1.0)."),
    (dict(keep_last=0), "--save-every must be >= 0 and --keep-last >= 1."),
])
def test_the_upper_and_lower_edges_of_betas_and_keep_last_are_refused(change, needle):
    ok = {k: (0.0 if isinstance(v, float) else 1) for k, v in change.items()}
    rl.validate_numbers(rl.Config(**ok))  # beta 0 and --keep-last 1 are taken
    with pytest.raises(rl.ConfigError, match="^" + re.escape(needle) + "$"):
        rl.validate_numbers(rl.Config(**change))


def test_max_turns_at_its_edges():
    """--max-turns 0 would score no episode (every reward 0, nothing learned, no error)."""
    for turns in (1, rl.MAX_TURNS):
        rl.validate_task(rl.Config(max_turns=turns))  # taken
    for turns in (0, rl.MAX_TURNS + 1):
        needle = f"--max-turns must lie in [1, {rl.MAX_TURNS}] (got {turns})."
        with pytest.raises(rl.ConfigError, match="^" + re.escape(needle) + "$"):
            rl.validate_task(rl.Config(max_turns=turns))


def test_the_most_samples_a_step_holds_is_taken_and_one_prompt_more_is_not():
    most = rl.MAX_SAMPLES // 8
    rl.validate_numbers(rl.Config(num_prompts=most, group_size=8))
    with pytest.raises(rl.ConfigError, match=f"^--num-prompts x --group-size is {8 * most + 8:,} "):
        rl.validate_numbers(rl.Config(num_prompts=most + 1, group_size=8))


@pytest.mark.parametrize("taken,refused,needle", [
    (dict(tool_workers=0), dict(tool_workers=-1), "--tool-workers, --tool-timeout and "
     "--max-tool-tokens must be >= 0"),
    (dict(entropy_coef=0.0), dict(entropy_coef=-0.01), "--kl-coef and --entropy-coef must be "
     ">= 0."),
    (dict(updates_per_batch=1), dict(updates_per_batch=0), "--updates-per-batch must be at "
     "least 1."),
    (dict(num_prompts=1), dict(num_prompts=0), "--num-prompts must be at least 1 (got 0)."),
    (dict(parity_rows=0), dict(parity_rows=-1), "--parity-rows must be >= 0"),
    (dict(save_every=0), dict(save_every=-1), "--save-every must be >= 0"),
    (dict(grad_clip=0.0), dict(grad_clip=-0.5), "--grad-clip must be >= 0 (got -0.5)."),
    (dict(steps=0), dict(steps=-1), "--steps must be >= 0 (got -1)."),
])
def test_each_numbers_edge_is_taken_and_one_past_it_refused(taken, refused, needle):
    """validate at each number's edge: the edge (0 meaning off, or 1 where one is the least a
    run needs) is taken, one step past it refused in its sentence. --updates-per-batch 0 or
    --num-prompts 0 would train on nothing without a word; a negative --entropy-coef would
    reward low entropy, a negative --tool-workers start no worker and hang the first turn's
    tool calls; --parity-rows 0 (the table's
    header only), --save-every 0 (only on a stop) and --grad-clip 0 (no clip) are options the
    help offers."""
    rl.validate(rl.Config(**taken))
    with pytest.raises(rl.ConfigError, match=re.escape(needle)):
        rl.validate(rl.Config(**refused))


def test_the_arithmetic_tasks_eval_size_bound_holds_for_it_only():
    """--eval-size past EVAL_CANDIDATES // 2 is refused for the arithmetic task, whose held-out
    stream it would exhaust, not for --task jsonl (a file of 10,000 problems may hold out
    3,000; validate does not read the file)."""
    rl.validate(rl.Config(task="jsonl", data_files="rows.jsonl", eval_size=3000))
    with pytest.raises(rl.ConfigError, match="the arithmetic task holds out at most 2048"):
        rl.validate(rl.Config(eval_size=3000))
