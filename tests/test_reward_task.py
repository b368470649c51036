"""Your own reward (--reward FILE.py:FUNCTION) and task (--task jsonl), and their bad input: a
reward that raises, exits or overflows fp32 ends the run as its failure (exit 7), never as a
success."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch

import simple_rl as rl
from helpers import TorchEngine, cpu_argv, exits, main_cpu, metrics_rows, refuse, run_cpu

ROOT = Path(__file__).resolve().parents[1]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def rows(run_dir: Path) -> list[dict]:
    return metrics_rows(run_dir)


def test_your_reward_scores_every_sample_and_the_eval(ckpt, tmp_path):
    """A reward of len(completion) / 100: the logged means are its values, not ours."""
    fn = write(tmp_path / "my_reward.py",
               "def score(completion, answer):\n    return len(completion) / 100\n")
    assert run_cpu(cpu_argv(ckpt(), tmp_path / "runs", steps=2, save_every=0, run_name="r",
                            reward=f"{fn}:score"))
    got = rows(tmp_path / "runs" / "r")
    assert [r["step"] for r in got] == [0, 1, 2]
    steps = [r for r in got if "loss" in r]
    assert all(0 < r["reward_mean"] <= 0.5 for r in steps)  # 5 tokens of text, not 0 or 1
    assert 0 < got[-1]["eval/accuracy"] <= 0.5 and got[-1]["eval/accuracy"] != 1.0


def test_jsonl_task_holds_out_problems_and_trains(ckpt, tmp_path):
    data = tmp_path / "mine.jsonl"
    problems = [{"question": f"What is {i} + 1?", "answer": i + 1} for i in range(20)]
    write(data, "".join(json.dumps(p) + "\n" for p in problems))
    cfg = rl.Config(task="jsonl", data_files=str(data), eval_size=5, chat_template="off")
    from transformers import AutoTokenizer

    task = rl.load_task(cfg, AutoTokenizer.from_pretrained(ckpt()))
    assert len(task.problems) == 15 and len(task.eval_problems) == 5
    assert not {p.question for p in task.problems} & {p.question for p in task.eval_problems}
    assert task.problems[0] == rl.Problem("What is 0 + 1?", "1")  # written as is; numbers read
    # the same held-out problems whatever the seed
    again = rl.load_task(rl.Config(**{**cfg.__dict__, "seed": 7}),
                         AutoTokenizer.from_pretrained(ckpt()))
    assert again.eval_problems == task.eval_problems
    assert run_cpu(cpu_argv(ckpt(), tmp_path / "runs", task="jsonl", data_files=data,
                            eval_size=5, steps=1, save_every=0, run_name="j"))
    got = rows(tmp_path / "runs" / "j")
    assert [r["step"] for r in got] == [0, 1] and got[0]["determinism/tokens"] == 2 * 3 * 5


def test_a_held_out_question_a_file_repeats_is_never_trained_on():
    """20 questions, each written twice: every copy of a held-out question leaves the pool (the
    run would otherwise train on what it is scored on)."""
    problems = [rl.Problem(f"What is {i % 20} + 1?", str(i % 20 + 1)) for i in range(40)]
    pool, heldout = rl.split_heldout(problems, 5, "mine.jsonl")
    asked = {p.question for p in heldout}
    assert len(heldout) == 5 and len(pool) == 40 - 2 * len(asked)
    assert not asked & {p.question for p in pool}


@pytest.mark.parametrize("text, expected", [
    ("x = 1\n", "has no function 'score'"),
    ("def score(completion):\n    return 1.0\n", "must take (completion, answer)"),
    ("def score(completion, answer)\n", "importing"),
    ("import no_such_module_here\n", "ModuleNotFoundError"),
    ("def score(completion, answer):\n    return None\n", "returned None, not a finite number"),
    ("def score(completion, answer):\n    return float('nan')\n", "returned nan"),
    ("def score(completion, answer):\n    return 'yes'\n", "returned 'yes'"),
    ("def score(completion, answer):\n    return completion[0]\n", "raised IndexError"),
    ("import sys\nsys.exit(3)\n", "SystemExit"),
])
def test_a_bad_reward_is_one_sentence_before_anything_starts(ckpt, tmp_path, capsys, text,
                                                             expected):
    fn = write(tmp_path / "bad_reward.py", text)
    argv = cpu_argv(ckpt(), tmp_path / "runs", reward=f"{fn}:score")
    assert main_cpu(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("simple_rl: error: --reward") and expected in \
        err[0], err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("spec, expected", [
    ("reward.py", "FILE.py:FUNCTION"),
    ("reward.txt:score", "FILE.py:FUNCTION"),
    ("/no/such/reward.py:score", "is not a file"),
])
def test_a_bad_reward_spec_is_one_sentence(ckpt, tmp_path, capsys, spec, expected):
    assert main_cpu(cpu_argv(ckpt(), tmp_path / "runs", reward=spec)) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("value, expected", [
    ("raise ValueError('boom')", "raised ValueError: boom"),
    ("return float('inf')", "returned inf"),
])
def test_a_reward_that_fails_mid_run_stops_naming_the_sample(ckpt, tmp_path, capsys, value,
                                                              expected):
    """It passes the first call on '' and fails once training has begun: exit 7, the sample
    and its completion named, the last checkpoint kept and resumable."""
    # calls: the probe, the first eval (4 problems), 2 steps of 2 x 3 samples; then it fails
    fn = write(tmp_path / "late.py", "CALLS = [0]\n\ndef score(completion, answer):\n"
               "    CALLS[0] += 1\n    if CALLS[0] > 1 + 4 + 2 * 6:\n"
               f"        {value}\n    return 0.0\n")
    argv = cpu_argv(ckpt(), tmp_path / "runs", steps=4, save_every=1, run_name="late",
                    reward=f"{fn}:score")
    assert main_cpu(argv) == rl.EXIT_REWARD
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("simple_rl: step 3/4: the reward (") and expected in err, err
    assert "sample 0 of training problem" in err and "completion '" in err
    assert err.endswith("step_000002.")  # the last good checkpoint, named
    assert rl.is_complete(tmp_path / "runs" / "late" / "checkpoints" / "step_000002")
    assert [r["step"] for r in rows(tmp_path / "runs" / "late")] == [0, 1]


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
    assert f"step 1/2: the reward ({file}:f) " in err and "on sample " in err
    want = {"exit": "raised SystemExit: 0", "huge int": "returned 1000000000",
            "string": "returned 'correct', not a finite number in fp32",
            "overflows fp32": "returned 1e+308, not a finite number in fp32",
            "overflows the group": "returned 3e+38, so large that its group's advantages"}[kind]
    assert want in err
    assert not (tmp_path / "runs" / "r" / "checkpoints").exists()


@pytest.mark.parametrize("group", [(0.0, 3e38, 3e38, -1.0), (0.0, -3e38, -3e38, 1.0),
                                   (0.0, 3.3e38, -3e38, 2e38)])
def test_an_overflowing_group_names_its_largest_reward_not_its_first_sample(group):
    """Rewards of +-3e38 overflow their group's fp32 mean (or, mixed, r - mean while the std
    stays finite: only some advantages are not finite): the sample named is the group's largest
    in magnitude (sample 5), not the group's first (4), nor its largest signed value (1.0), nor
    the first non-finite advantage's (sample 6 in the last)."""
    cfg = rl.Config(group_size=4)
    rewards = torch.tensor([0.0, 1.0, 0.0, 1.0, *group])
    with pytest.raises(rl.RewardError) as e:
        rl.finite_advantages(rewards, cfg, lambda i: f"completion {i}")
    assert str(e.value) == (f"returned {group[1]:.3g}, so large that its group's advantages are "
                            "not finite")
    assert (e.value.sample, e.value.completion) == (5, "completion 5")


def test_2_a_reward_that_exits_at_the_first_call_is_refused_at_start(ckpt, tmp_path, capsys):
    file = tmp_path / "r.py"
    file.write_text("import sys\ndef f(completion, answer):\n    sys.exit(0)\n")
    err = refuse(cpu_argv(ckpt(), tmp_path / "runs", reward=f"{file}:f"), capsys)
    assert "on an empty completion it raised SystemExit: 0." in err


@pytest.mark.parametrize("line, expected", [
    ({"question": None, "answer": "1"}, "question"),
    ({"question": "  ", "answer": "1"}, "question"),
    ({"question": "q?", "answer": None}, "no answer text or number"),
    ({"question": "q?", "answer": True}, "no answer text or number"),
])
def test_bad_jsonl_rows_are_one_sentence(ckpt, tmp_path, capsys, line, expected):
    data = tmp_path / "bad.jsonl"
    good = [{"question": f"q{i}?", "answer": str(i)} for i in range(8)]
    write(data, "".join(json.dumps(r) + "\n" for r in good + [line]))
    argv = cpu_argv(ckpt(), tmp_path / "runs", task="jsonl", data_files=data, eval_size=2)
    assert main_cpu(argv) == 2
    assert expected in capsys.readouterr().err.strip().splitlines()[-1]


def test_jsonl_needs_a_file_and_room_for_training(ckpt, tmp_path, capsys):
    assert main_cpu(cpu_argv(ckpt(), tmp_path / "runs", task="jsonl")) == 2
    assert "--task jsonl reads your problems from --data-files" in capsys.readouterr().err
    data = write(tmp_path / "few.jsonl", "".join(json.dumps({"question": f"q{i}", "answer": i})
                                                 + "\n" for i in range(4)))
    assert main_cpu(cpu_argv(ckpt(), tmp_path / "runs", task="jsonl", data_files=data,
                             eval_size=4)) == 2
    assert "has 4 problems; --eval-size 4 leaves none to train on" in capsys.readouterr().err
    assert main_cpu(cpu_argv(ckpt(), tmp_path / "runs", eval_size=5000)) == 2
    assert "holds out at most 2048" in capsys.readouterr().err


def test_the_default_reward_reads_text_answers_too():
    assert rl.reward("so it is Answer: Paris", "Paris") == 1.0
    assert rl.reward("Answer: 1,234", "1234") == 1.0 and rl.reward("Answer: 12", "1234") == 0.0


def test_warm_start_saves_a_checkpoint_simple_rl_loads(tmp_path):
    """The warm-start script at a tiny size: a progress line each --log-every steps (loss,
    time, ETA), a Qwen3 checkpoint that load_model_files accepts, a tokenizer that splits digits,
    prompts exactly simple_rl's, and solutions the reward scores 1."""
    import subprocess

    out = tmp_path / "warm"
    cmd = [sys.executable, str(ROOT / "examples" / "warm_start.py"), "--out", str(out),
           "--device", "cpu", "--layers", "1", "--dim", "64", "--ffn", "128", "--batch", "8",
           "--steps", "2", "--eval-every", "2", "--eval-size", "4", "--log-every", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("warm start | ") and "" not in lines, done.stdout  # no blanks
    clock = r"\d+s \(\d+\.\d\d s/step\) \| ETA \d+s"  # one format, eval or not
    assert re.fullmatch(rf"step 1/2 \| loss \d+\.\d{{4}} \| {clock}", lines[1]), lines[1]
    assert re.fullmatch(rf"step 2/2 \| loss \d+\.\d{{4}} \| held-out greedy accuracy "
                        rf"\d\.\d{{3}} \| {clock}", lines[2]), lines[2]
    files = rl.load_model_files(rl.Config(model=str(out)))
    assert files.args.n_layers == 1 and files.args.enable_weight_tying
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]  # the default --arch
    tok = files.tokenizer
    assert tok.convert_ids_to_tokens(tok.encode("3901", add_special_tokens=False)) == \
        list("3901")
    assert set(files.eos_ids) == {tok.convert_tokens_to_ids("<|im_end|>"),
                                  tok.convert_tokens_to_ids("<|endoftext|>")}
    import warm_start

    report = json.loads((out / "warm_start.json").read_text())
    assert report["history"][-1]["step"] == 2 and report["params"] > 0
    problems = rl.arithmetic_problems(300, 5)
    for p in problems:
        assert rl.reward(warm_start.worked_solution(p.question), p.answer) == 1.0
        assert rl.reward(warm_start.direct_answer(p), p.answer) == 1.0
    text = tok.decode(rl.format_prompts(problems[:1], tok, rl.Config())[0])
    assert text.startswith("<|im_start|>user\nWhat is ") and text.endswith("</think>\n\n")


@pytest.mark.parametrize("sample", [0, 1])
def test_a_failing_reward_names_its_sample_of_the_ranks_own_prompt(ckpt, tmp_path, capsys,
                                                                  monkeypatch, sample):
    """Rank r plays the step's prompts r, r + world, ...: a reward that fails on sample 0 or 1
    of its first prompt (G = 3) names that sample of that prompt's problem, not sample 0 nor
    the step's first prompt's (a user would look at the wrong one). One process plays rank 1
    of 2's prompts here (my_prompts)."""
    monkeypatch.setattr(rl, "my_prompts", lambda n, ranks: list(range(1, n, 2)))
    fn = write(tmp_path / "late.py", "CALLS = [0]\n\ndef score(completion, answer):\n"
               f"    CALLS[0] += 1\n    if CALLS[0] > {sample + 1}:\n"
               "        raise ValueError('boom')\n    return 0.0\n")  # the probe on '' passes
    argv = cpu_argv(ckpt(), tmp_path / "runs", steps=1, eval_size=0, run_name="r",
                    reward=f"{fn}:score")
    cfg, _ = rl.parse_config(argv)
    pool, _ = rl.arithmetic_split(cfg)
    chosen = rl.step_problems(len(pool), cfg.num_prompts, 0, cfg.seed)
    assert cfg.num_prompts == 2 and cfg.group_size == 3 and chosen[0] != chosen[1]
    assert main_cpu(argv) == rl.EXIT_REWARD
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.findall(r"sample (\d+) of training problem (\d+)", err) == [
        (str(sample), str(chosen[1]))], err


def test_an_overflowing_episode_is_named_with_its_last_turns_text():
    """A group of 4 episodes whose rewards overflow fp32: the RewardError names episode 1 (the
    largest |reward|) and quotes its last turn, the one the env scored, not its first (a tool
    call): the sentence shows what the env rewarded."""
    class Letters:  # a tokenizer of 26 ids: id i decodes to the i-th letter
        def __len__(self):
            return 26

        def batch_decode(self, ids, skip_special_tokens):
            return ["".join(chr(97 + t) for t in c) for c in ids]

    def episode(reward, *turns):
        return rl.Episode(None, [rl.Turn([0], rl.Completion(ids, [0.0] * len(ids), True))
                                 for ids in turns], status="completed", reward=reward)

    episodes = [episode(0.0, [1]), episode(3e38, [2, 2], [7, 14]), episode(2e38, [3]),
                episode(-1.0, [4])]
    trainer = rl.Trainer(rl.Config(group_size=4), None, Letters(), *[None] * 5)
    with pytest.raises(rl.RewardError) as raised:
        rl.rewards_and_advantages(trainer, rl.episodes_rollout(episodes, routes=False))
    assert (raised.value.sample, raised.value.completion) == (1, "ho")
