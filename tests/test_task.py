"""Tasks: the arithmetic generator, the reward parser, the chat template, GSM8K files, and
answers kept as written (jsonl, GSM8K, parquet)."""

import json
import sys
from decimal import Decimal

import pytest

import simple_rl as rl
from helpers import cpu_argv, main_cpu, run_cpu


def test_arithmetic_problems_are_seeded_and_exact():
    a, b = rl.arithmetic_problems(50, 3), rl.arithmetic_problems(50, 3)
    assert a == b and a != rl.arithmetic_problems(50, 4)
    for p in a:
        expr = p.question.split("What is ")[1].split("?")[0]
        assert str(eval(expr)) == p.answer  # Python's precedence agrees
        assert p.question.endswith("End with 'Answer: <number>'.")
    assert {p.question.split()[3] for p in a} == {"+", "-", "*"}


def test_steps_walk_through_shuffled_epochs():
    n, k = 10, 4
    seen = [i for step in range(5) for i in rl.step_problems(n, k, step, seed=0)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert seen[:10] != seen[10:20]  # each epoch in its own order
    assert rl.step_problems(n, k, 3, 0) == rl.step_problems(n, k, 3, 0)  # a function of step
    assert rl.step_problems(n, k, 3, 0) != rl.step_problems(n, k, 3, 1)


@pytest.mark.parametrize("text,value", [
    (" 42", "42"),
    (" Let me think. 3 * 4 = 12, then 12 + 30 = 42. Answer: 42", "42"),
    (" Answer: -17.", "-17"),
    (" Answer: **1,234**", "1234"),
    (" Answer: $56", "56"),
    (" Answer: 12.0", "12"),
    (" 7 then 8\nQ: What is 1 + 1?\nA: 2", "8"),  # ignores the model's next question
    (" Answer: 5 (not 6)", "5"),
    ("<think>\nAnswer: 3? no, 9\n</think>\n\nAnswer: 4", "4"),  # the final answer, after thinking
    ("<think>so 11</think>The result is 12", "12"),
    ("<think>a</think>Answer: 3 <think>no</think> 4", "4"),  # after the last thinking block
    (" no idea", None),
    ("", None),
])
def test_parse_answer(text, value):
    assert rl.parse_answer(text) == (None if value is None else Decimal(value))


@pytest.mark.parametrize("text,answer,r", [
    (" Answer: 1,234", "1234", 1.0), (" Answer: 12.0", "12", 1.0), (" Answer: 12.5", "12", 0.0),
    (" Answer: -3", "3", 0.0), (" 99", "99", 1.0), (" nothing", "0", 0.0),
])
def test_reward(text, answer, r):
    assert rl.reward(text, answer) == r


def tokenizer_of(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def decoded(cfg, path):
    tok = tokenizer_of(path)
    problem = rl.Problem("What is 2 + 3? End with 'Answer: <number>'.", "5")
    return tok.decode(rl.format_prompts([problem], tok, cfg)[0])


def test_chat_template_auto_on_off(ckpt):
    chat, plain = ckpt(chat=True), ckpt()
    want_chat = ("<|im_start|>user\nWhat is 2 + 3? End with 'Answer: <number>'.<|im_end|>\n"
                 "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert decoded(rl.Config(), chat) == want_chat  # auto: the template, thinking off
    assert decoded(rl.Config(chat_template="on"), chat) == want_chat
    assert decoded(rl.Config(chat_template="off"), chat).startswith("Q: What is 2 + 3?")
    thinking = decoded(rl.Config(enable_thinking=True), chat)
    assert thinking.endswith("<|im_start|>assistant\n") and "<think>" not in thinking
    assert decoded(rl.Config(), plain) == "Q: What is 2 + 3? End with 'Answer: <number>'.\nA:"
    with pytest.raises(rl.ConfigError, match="--chat-template on, but the tokenizer has no"):
        decoded(rl.Config(chat_template="on"), plain)


def test_a_run_with_the_chat_template_trains_and_stops_at_im_end(ckpt, tmp_path):
    path = ckpt(chat=True)
    files = rl.load_model_files(rl.Config(model=str(path)))
    assert files.eos_ids == [0]  # the test tokenizer ends at <|endoftext|>
    assert run_cpu(cpu_argv(path, tmp_path / "runs", steps=1, run_name="chat"))


def write_gsm8k(path, rows):
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


GSM8K_ROWS = [{"question": f"Tom has {n} apples and buys {n + 1} more. How many now?",
               "answer": f"He has {n} + {n + 1} = <<{n}+{n + 1}={2 * n + 1}>>{2 * n + 1}.\n"
                         f"#### {2 * n + 1}"} for n in range(1, 7)]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_gsm8k_from_local_files_trains_one_step(ckpt, tmp_path, suffix):
    data = tmp_path / f"train{suffix}"
    write_gsm8k(data, GSM8K_ROWS)
    problems = rl.gsm8k_problems(str(data))
    assert [p.answer for p in problems] == [str(2 * n + 1) for n in range(1, 7)]
    assert problems[0].question.startswith("Tom has 1 apples") and "Answer: <number>" in \
        problems[0].question
    argv = cpu_argv(ckpt(), tmp_path / "runs", task="gsm8k", data_files=data, steps=1,
                    max_model_len=160, micro_batch_tokens=512, run_name="g", eval_size=0)
    assert run_cpu(argv)
    rows = (tmp_path / "runs" / "g" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1 and json.loads(rows[0])["determinism/tokens"] == 2 * 3 * 5


def test_gsm8k_errors_are_one_sentence(ckpt, tmp_path, capsys, monkeypatch):
    def err(argv):
        assert main_cpu(argv) == 2
        return capsys.readouterr().err.strip().splitlines()[-1]

    base = cpu_argv(ckpt(), tmp_path / "runs", task="gsm8k", max_model_len=160,
                    micro_batch_tokens=512, eval_size=0)
    assert "--data-files '/no/file.jsonl' is not a file" in err(base + ["--data-files",
                                                                         "/no/file.jsonl"])
    bad = tmp_path / "bad.jsonl"
    write_gsm8k(bad, [{"q": "x", "a": "1"}])
    assert "GSM8K rows need 'question' and 'answer'" in err(base + ["--data-files", str(bad)])
    write_gsm8k(bad, [{"question": "x", "answer": "just 1"}])
    assert "an answer without '#### <number>'" in err(base + ["--data-files", str(bad)])
    parquet = tmp_path / "bad.parquet"
    write_gsm8k(parquet, [{"question": "x", "answer": "just 1"}])
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    assert "an answer without '#### <number>'" in err(base + ["--data-files", str(bad)])
    assert "--task gsm8k needs the `datasets` package" in err(base + ["--data-files",
                                                                      str(parquet)])
    assert not (tmp_path / "runs").exists()


def test_an_unreachable_hub_is_one_sentence_within_seconds(ckpt, tmp_path, capsys, monkeypatch):
    """GSM8K from the hub with no network (and not in the cache): the error at once, not after
    30 s of retries; a hub model id the same."""
    import socket
    import time

    def no_network(*a, **k):
        raise OSError("Name or service not known")

    path = ckpt()
    capsys.readouterr()
    monkeypatch.setattr(socket, "create_connection", no_network)
    t0 = time.perf_counter()
    assert main_cpu(cpu_argv(path, tmp_path / "runs", task="gsm8k")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert time.perf_counter() - t0 < 10
    assert err == ["simple_rl: error: could not load GSM8K (openai/gsm8k): the hub cannot be "
                   "reached and it is not in the cache; download it and pass --data-files."]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main_cpu(["--model", "Qwen/Qwen3-0.6B", "--log-dir", str(tmp_path / "r2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "could not fetch 'Qwen/Qwen3-0.6B'" in err[0]


def test_6_jsonl_answers_are_kept_as_written(tmp_path):
    answers = [3, 2.5, 4, 12345678901234567891, "x", 4.0, -0.10, 1e5, "7"]
    lines = [f'{{"question": "q{i}", "answer": {json.dumps(a) if isinstance(a, str) else a}}}'
             for i, a in enumerate(answers)]
    lines[5] = '{"question": "q5", "answer": 4.0}'
    lines[6] = '{"question": "q6", "answer": -0.10}'
    data = tmp_path / "mixed.jsonl"
    data.write_text("\n".join(lines) + "\n")
    got = [p.answer for p in rl.jsonl_problems(str(data))]
    assert got == ["3", "2.5", "4", "12345678901234567891", "x", "4.0", "-0.10", "100000.0", "7"]
    assert rl.reward("Answer: 12345678901234567891", got[3]) == 1.0
    assert rl.reward("Answer: 12345678901234567890", got[3]) == 0.0


def test_6_gsm8k_and_parquet_answers_are_kept_as_written(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "gsm8k.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "so #### 12345678901234567891"}) +
                    "\n")
    assert [p.answer for p in rl.gsm8k_problems(str(data))] == ["12345678901234567891"]
    table = pa.table({"question": ["a", "b"],
                      "answer": pa.array([3, 12345678901234567], pa.int64())})
    pq.write_table(table, tmp_path / "ints.parquet")
    got = [p.answer for p in rl.jsonl_problems(str(tmp_path / "ints.parquet"))]
    assert got == ["3", "12345678901234567"]


@pytest.mark.parametrize("text,answer", [
    (" Answer: -$5", "-5"),  # a negative amount of money: the sign is before the $
    (" Answer: 1234", "1,234"),  # an expected answer written with a thousands separator
    (" Answer: Paris", " Paris\n"),  # a text answer as a file wrote it, spaces around it
])
def test_the_default_reward_reads_money_separators_and_spaced_text_answers(text, answer):
    """reward: '$' is dropped before the number is read (else '-$5' reads as 5); the expected
    answer's thousands separators are dropped as the completion's are (1,234 == 1234 both
    ways); a text answer is compared stripped on both sides."""
    assert rl.reward(text, answer) == 1.0


def test_two_seeds_never_walk_the_same_orders_an_epoch_apart():
    """step_problems seeds epoch e of --seed s with 1,000,003 s + e: seed 0's second epoch is
    not seed 1's first (with s + e it would be: two runs of neighbouring seeds would train on
    the same sequence of problems, one epoch apart)."""
    n = 50
    assert rl.step_problems(n, n, 1, seed=0) != rl.step_problems(n, n, 0, seed=1)
    assert rl.step_problems(n, n, 2, seed=0) != rl.step_problems(n, n, 0, seed=2)


def test_6_jsonl_answers_keep_the_spaces_written_around_them(tmp_path):
    """A jsonl answer is the text written in the file, spaces and newlines included: a
    --reward FILE.py:FUNCTION gets it as written (the default reward strips both sides
    itself)."""
    data = tmp_path / "spaced.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": " 42 "}) + "\n" +
                    json.dumps({"question": "r", "answer": "Paris\n"}) + "\n")
    assert [p.answer for p in rl.jsonl_problems(str(data))] == [" 42 ", "Paris\n"]
