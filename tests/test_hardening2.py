"""Hardening, second pass: bad input ends in one sentence (exit 2) before anything starts. One
test (or more) per row of the issue, numbered as there."""

import json
import shutil

import pytest

from helpers import TorchEngine, cpu_argv, main_cpu


class CountingEngine(TorchEngine):
    """The stand-in engine, counting how often it was started."""

    made = 0

    def __init__(self, *a, **k):
        CountingEngine.made += 1
        super().__init__(*a, **k)


def one_sentence(capsys, code: int, want: int, datasets: bool = False) -> str:
    """The run's stderr is one line, without a traceback, and the exit code is `want`
    (`datasets`: its progress bars and logs, printed before simple_rl's line, are left out)."""
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    if datasets:
        err = err[-1:]
    assert code == want, err
    assert len(err) == 1 and err[0].startswith("simple_rl: "), err
    assert datasets or "Traceback" not in captured.out + captured.err
    return err[0]


def refuse(argv, capsys, datasets: bool = False) -> str:
    """main on argv: exit 2 in one sentence, before the engine starts."""
    capsys.readouterr()  # what came before (a checkpoint made for the test) is not the run's
    CountingEngine.made = 0
    err = one_sentence(capsys, main_cpu(argv, CountingEngine), 2, datasets)
    assert CountingEngine.made == 0, "the engine started before the error"
    return err


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
    err = refuse(cpu_argv(ckpt(), tmp_path / "logs", task="gsm8k", data_files=data), capsys,
                 datasets=True)
    assert f"--data-files '{data}' is not readable as jsonl (ArrowInvalid: JSON parse " in err
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
