"""simple_rl as a new user first meets it: what an env's `problem` is, --reward beside one's
own --env, --check's LoRA line and progress, the stand-in engine exact in every turn, and a
bad input under torchrun."""

import pytest

import simple_rl as rl
from helpers import ExactEngine, cpu_argv, main_cpu, metrics_rows

ENVS = '''
class TwoTurns:
    """Answers the first turn with a tool message, scores the second."""

    def reset(self, problem):
        self.answer, self.turn = problem["answer"], 0
        return problem["question"]

    def step(self, completion):
        self.turn += 1
        if self.turn == 1:
            return "the tool says 42", None
        return None, float(len(completion) % 2)


class Misread(TwoTurns):
    def reset(self, problem):
        return problem["prompt"]
'''


@pytest.fixture
def envs(tmp_path):
    path = tmp_path / "envs.py"
    path.write_text(ENVS)
    return lambda name: f"{path}:{name}"


def errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines()
            if line.startswith("simple_rl")]


def test_9_an_envs_problem_reads_as_a_row_and_a_wrong_field_is_named(ckpt, tmp_path, envs,
                                                                      capsys):
    problem = rl.Problem("What is 1 + 1?", "2")
    assert (problem["question"], problem["answer"]) == (problem.question, problem.answer)
    argv = cpu_argv(ckpt(), tmp_path / "runs", env=envs("Misread")) + ["--check"]
    assert main_cpu(argv) == 2
    assert errors(capsys) == [f"simple_rl: error: --env {envs('Misread')}: on the first "
                              "training problem its reset raised KeyError: \"'prompt': a problem "
                              "has the fields 'question' and 'answer'\"."]


def test_10_reward_beside_your_own_env_is_refused_and_check_says_what_trains(
        ckpt, tmp_path, envs, capsys):
    spec = tmp_path / "reward.py"
    spec.write_text("def score(completion, answer):\n    return 0.0\n")
    argv = cpu_argv(ckpt(), tmp_path / "runs", env=envs("TwoTurns")) + ["--check"]
    assert main_cpu(argv + ["--reward", f"{spec}:score"]) == 2
    assert errors(capsys) == [f"simple_rl: error: --reward {spec}:score would not be used: "
                              f"your --env {envs('TwoTurns')} gives the rewards (its step "
                              "returns them); drop --reward."]
    assert main_cpu(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert not [line for line in lines if line.startswith("check: reward")]  # not used
    assert "check: LoRA: off (full fine-tuning: 1.7M params trained)" in lines
    lora = cpu_argv(ckpt(), tmp_path / "runs", reward=f"{spec}:score", lora_rank=8,
                    lora_alpha=16, lora_targets="q_proj,v_proj") + ["--check"]
    assert main_cpu(lora) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"check: reward {spec}:score: takes (completion, answer), gives 0 on an empty " \
        "completion" in lines
    trained = rl.lora_params(rl.parse_config(lora)[0], rl.load_model_files(
        rl.parse_config(lora)[0], rl.resolve_checkpoint(str(ckpt()))).args)
    assert trained > 0
    assert ("check: LoRA: rank 8, alpha 16 (scale alpha / r = 2) on q_proj, v_proj: "
            f"{trained / 1e6:.2f}M params trained, the base frozen") in lines


def test_15_the_stand_in_engine_is_exact_in_every_turn_of_an_episode(ckpt, tmp_path, envs):
    argv = cpu_argv(ckpt(), tmp_path / "runs", env=envs("TwoTurns"), max_turns=2, steps=2,
                    eval_size=0, save_every=0, run_name="r")
    assert main_cpu(argv, ExactEngine) == 0
    rows = metrics_rows(tmp_path / "runs" / "r")
    assert len(rows) == 2
    for row in rows:
        assert row["episode/turns_mean"] == 2.0 and row["determinism/tokens_turn2"] > 0
        assert row["determinism/mismatched_tokens"] == 0, row


def test_14_check_prints_each_check_as_it_passes(ckpt, tmp_path, capsys):
    spec = tmp_path / "reward.py"
    spec.write_text("def score(completion, answer):\n    return float('nan')\n")
    argv = cpu_argv(ckpt(), tmp_path / "runs", reward=f"{spec}:score") + ["--check"]
    assert main_cpu(argv) == 2
    out = capsys.readouterr()
    passed = [line.split(":")[1].split()[0] for line in out.out.splitlines()]
    assert passed == ["config", "run", "model", "tokenizer", "data"]  # then the reward failed
    assert out.err.startswith(f"simple_rl: error: --reward {spec}:score: on an empty "
                              "completion it returned nan")


def test_12_a_bad_input_under_torchrun_is_its_summarys_cause(ckpt, tmp_path):
    """Each rank exits 2 in one sentence; torchrun (which exits 1 for any failed rank, and
    prints its own traceback) gives that sentence as each failure's cause."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
           str(rl.__file__), "--model", str(ckpt()), "--group-size", "1"]
    out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    said = ("simple_rl: error: --group-size must be at least 2 (got 1): GRPO normalises "
            "rewards within a group.")
    causes = [line.strip() for line in out.stderr.splitlines() if "traceback :" in line]
    # the ranks never meet: one may end before the other has said it, and torchrun's SIGTERM
    # to the other is that one's cause
    assert f"traceback : {said}" in causes and all(
        c == f"traceback : {said}" or c.startswith("traceback : Signal 15 (SIGTERM)")
        for c in causes), out.stderr[-3000:]
    assert "exitcode  : 2" in out.stderr and out.returncode == 1
