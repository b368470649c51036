"""Every check that needs no GPU runs before the GPU is looked for, `--check` runs them all on
any machine, and the console stays quiet for file tasks (issue 30, items 5 and 6)."""

import json

import pytest
import torch

import simple_rl as rl
from helpers import copy_checkpoint, cpu_argv, main_cpu

NO_GPU = "no CUDA GPU found"


def on_this_machine(capsys, argv) -> tuple[int, str, str]:
    """simple_rl.main as a user runs it (vLLM's engine, the GPU), here on whatever this is."""
    capsys.readouterr()
    code = rl.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_check_a_good_run_prints_one_line_per_check_and_makes_nothing(ckpt, tmp_path, capsys):
    logs = tmp_path / "logs"
    code, out, err = on_this_machine(capsys, cpu_argv(ckpt(), logs, run_name="r") + ["--check"])
    assert code == 0 and err == ""
    lines = out.strip().splitlines()
    assert [line.split(":")[1].split()[0] for line in lines] == [
        "config", "run", "model", "tokenizer", "data", "reward", "LoRA", "GPU"]
    assert "check: LoRA: off (full fine-tuning: 1.7M params trained)" in lines
    assert all(line.startswith("check: ") for line in lines)
    assert f"check: run directory {logs / 'r'}: is made when the run starts" in lines
    assert "check: reward simple_rl.reward: takes (completion, answer), gives 0 on an empty " \
           "completion" in lines
    assert not logs.exists()


def test_check_a_resume_reads_its_checkpoint_and_writes_nothing(saved, tmp_path, capsys):
    ckpt = copy_checkpoint(saved, tmp_path)
    run_dir = ckpt.parent.parent
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    code, out, _ = on_this_machine(capsys, ["--resume", "latest", "--run-name", "r",
                                            "--log-dir", str(tmp_path / "runs"), "--check"])
    assert code == 0
    assert f"check: run directory {run_dir}: continues step_000002" in out
    assert f"check: checkpoint {ckpt}: state, DCP metadata and RNG readable" in out
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before


def bad_inputs(ckpt, tmp_path):
    """(argv, the sentence it must get) for each kind of bad input."""
    not_a_model = tmp_path / "not_a_model"
    not_a_model.mkdir()
    (not_a_model / "weights.bin").write_bytes(b"\0" * 64)
    wrong = tmp_path / "wrong.py"
    wrong.write_text("def f(completion):\n    return 1.0\n")
    logs = tmp_path / "logs"
    return {
        "not a model": (cpu_argv(not_a_model, logs), f"{not_a_model} has no config.json; "
                        "--model must be a Hugging Face checkpoint directory."),
        "missing data file": (cpu_argv(ckpt(), logs, task="jsonl",
                                       data_files=tmp_path / "nope.jsonl"),
                              f"--data-files '{tmp_path / 'nope.jsonl'}' is not a file."),
        "no data file": (cpu_argv(ckpt(), logs, task="jsonl"), "--task jsonl reads your "
                         "problems from --data-files FILE"),
        "missing reward": (cpu_argv(ckpt(), logs, reward=tmp_path / "nope.py:f"),
                           f"--reward: {tmp_path / 'nope.py'} is not a file."),
        "wrong signature": (cpu_argv(ckpt(), logs, reward=f"{wrong}:f"),
                            f"--reward: f(completion) in {wrong} must take (completion, answer)."),
    }


@pytest.mark.parametrize("kind", ["not a model", "missing data file", "no data file",
                                  "missing reward", "wrong signature"])
@pytest.mark.parametrize("check", [False, True])
def test_check_bad_input_is_named_before_the_gpu_is_looked_for(ckpt, tmp_path, capsys, kind,
                                                               check):
    argv, sentence = bad_inputs(ckpt, tmp_path)[kind]
    code, out, err = on_this_machine(capsys, argv + (["--check"] if check else []))
    assert code == 2 and NO_GPU not in err
    assert err.startswith("simple_rl: error: ") and sentence in err and len(err.splitlines()) == 1
    assert not (tmp_path / "logs").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="here the run would start")
def test_check_without_a_gpu_a_good_run_ends_at_the_gpu_check(ckpt, tmp_path, capsys):
    code, _, err = on_this_machine(capsys, cpu_argv(ckpt(), tmp_path / "logs"))
    assert code == 2 and NO_GPU in err
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_file_task_prints_no_progress_bars(ckpt, tmp_path, capfd, kind):
    rows = [{"question": f"What is {i} + 1?", "answer": f"so #### {i + 1}"} for i in range(6)]
    data = tmp_path / f"train.{kind}"
    if kind == "jsonl":
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), data)
    argv = cpu_argv(ckpt(), tmp_path / "runs", steps=0, task="gsm8k", data_files=data,
                    eval_size=2)
    capfd.readouterr()  # what came before (the checkpoint made for the test) is not the run's
    assert main_cpu(argv) == 0
    err = capfd.readouterr().err
    assert "Generating train split" not in err and "%|" not in err, err


ENVS = '''
class Good:
    tool_stop = ""

    def reset(self, problem):
        return problem.question

    def step(self, completion):
        return None, 0.0


class ResetNumber(Good):
    def reset(self, problem):
        return 5


class ResetRaises(Good):
    def reset(self, problem):
        raise ValueError("no such problem")
'''


@pytest.mark.parametrize("name,said", [
    ("ResetNumber", "on the first training problem its reset returned 5, not text."),
    ("ResetRaises", "on the first training problem its reset raised ValueError: no such "
                    "problem."),
])
def test_an_env_whose_reset_fails_is_named_by_reset(ckpt, tmp_path, capsys, name, said):
    (tmp_path / "envs.py").write_text(ENVS)
    spec = f"{tmp_path / 'envs.py'}:{name}"
    argv = cpu_argv(ckpt(), tmp_path / "logs", env=spec) + ["--check"]
    code, _, err = on_this_machine(capsys, argv)
    assert code == 2 and err == f"simple_rl: error: --env {spec}: {said}\n"


def test_check_with_an_env_says_it_checked_the_env(ckpt, tmp_path, capsys):
    (tmp_path / "envs.py").write_text(ENVS)
    spec = f"{tmp_path / 'envs.py'}:Good"
    logs = ["--run-name", "r", "--check"]  # one run directory line for both
    code, out, _ = on_this_machine(capsys, cpu_argv(ckpt(), tmp_path / "logs", env=spec) + logs)
    without = on_this_machine(capsys, cpu_argv(ckpt(), tmp_path / "logs") + logs)[1]
    assert code == 0
    added = [line for line in out.splitlines() if line not in without.splitlines()]
    assert added == [f"check: env {spec}: made, reset; on an empty completion its step "
                     "returned (None, 0.0)"]


@pytest.mark.parametrize("flag,value,said", [
    ("eval_size", -5, "--eval-size must be >= 0 (got -5; 0: no eval)."),
    ("eval_every", -1, "--eval-every must be >= 0 (got -1)."),
])
def test_a_negative_eval_flag_is_named_with_its_value(ckpt, tmp_path, capsys, flag, value,
                                                      said):
    code, _, err = on_this_machine(capsys, cpu_argv(ckpt(), tmp_path / "logs", **{flag: value})
                                   + ["--check"])
    assert code == 2 and err == f"simple_rl: error: {said}\n"


def test_check_measures_the_longest_prompt_held_out_ones_too(ckpt, tmp_path, capsys):
    """--check's data line names the longest prompt, the held-out ones included (greedy eval
    plays them too, under the same --max-model-len): moving the one long question between the
    training pool and the held-out problem leaves the number as it is."""
    long = "What is " + " + ".join(["1"] * 30) + "?"
    shorts = ["What is 2 + 2?", "What is 3 + 3?"]
    found = []
    for at in range(3):  # the long question at each place: held out at one of them
        questions = shorts[:at] + [long] + shorts[at:]
        data = tmp_path / f"d{at}.jsonl"
        data.write_text("".join(json.dumps({"question": q, "answer": "4"}) + "\n"
                                for q in questions))
        argv = cpu_argv(ckpt(), tmp_path / "logs", task="jsonl", data_files=data, eval_size=1,
                        run_name="r") + ["--check"]
        code, out, _ = on_this_machine(capsys, argv)
        assert code == 0, out
        [line] = [x for x in out.splitlines() if x.startswith("check: data")]
        found.append(line.split("the longest prompt (")[1].split(" tokens")[0])
    assert len(set(found)) == 1 and int(found[0]) > 12, found
