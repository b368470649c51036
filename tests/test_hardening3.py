"""Hardening, third pass: a checkpoint runs no code and chooses no file it cannot vouch for, a
reward cannot end a run as a success, every write fails in one sentence, a resume cannot mix
two runs, a signal after the last step saves it, and jsonl answers stay as written. One test
(or more) per row of the issue, numbered as there."""

import json

import pytest

import simple_rl as rl
from helpers import TorchEngine, cpu_argv, exits, refuse

# ---------------------------------------------------------------- 2. a reward cannot end a run


REWARDS = {
    "exit": "import sys\n    sys.exit(0)",
    "huge int": "return 10**400",
    "string": "return 'correct'",
    "overflows fp32": "return 1e308",
    "overflows the group": "return 3e38",
}


@pytest.mark.parametrize("kind", list(REWARDS))
def test_2_a_reward_that_exits_or_overflows_is_a_reward_failure(ckpt, tmp_path, capsys, kind):
    file = tmp_path / "r.py"
    file.write_text("calls = [0]\ndef f(completion, answer):\n    calls[0] += 1\n"
                    f"    if calls[0] == 1:  # the check at start\n        return 0.0\n"
                    f"    {REWARDS[kind]}\n")
    argv = cpu_argv(ckpt(), tmp_path / "runs", steps=2, run_name="r", reward=f"{file}:f",
                    eval_size=0, max_new_tokens=3)
    err = exits(capsys, argv, 7, TorchEngine)
    assert f"step 0: the reward ({file}:f) " in err and "on sample " in err
    want = {"exit": "raised SystemExit: 0", "huge int": "returned 1000000000",
            "string": "returned 'correct', not a finite number in fp32",
            "overflows fp32": "returned 1e+308, not a finite number in fp32",
            "overflows the group": "returned 3e+38, so large that its group's advantages"}[kind]
    assert want in err
    assert not (tmp_path / "runs" / "r" / "checkpoints").exists()


def test_2_a_reward_that_exits_at_the_first_call_is_refused_at_start(ckpt, tmp_path, capsys):
    file = tmp_path / "r.py"
    file.write_text("import sys\ndef f(completion, answer):\n    sys.exit(0)\n")
    err = refuse(cpu_argv(ckpt(), tmp_path / "runs", reward=f"{file}:f"), capsys)
    assert "on an empty completion it raised SystemExit: 0." in err


# ---------------------------------------------------------------- 6. answers as written


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
