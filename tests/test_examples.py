"""examples/envs.py, the env the README points to (`--env examples/envs.py:MyEnv`), as a user
meets it: its messages and rewards, `simple_rl.py --check` on it, and a short run through
simple_rl's CLI (the stand-in engine) whose episodes call its tool and go on."""

import subprocess
import sys
from pathlib import Path

import pytest

import simple_rl as rl
from helpers import cpu_argv, main_cpu, make_checkpoint, metrics_rows, supervised_warm_start

ROOT = Path(__file__).resolve().parents[1]
SPEC = "examples/envs.py:MyEnv"  # as the README writes it, relative to the repository root
PROBLEM = rl.Problem("What is 47 * 83 - 5? End with 'Answer: <number>'.", "3896")


def my_env():
    """A fresh MyEnv, made as simple_rl makes one for each episode of --env."""
    return rl.load_env(f"{ROOT / SPEC}", rl.reward)()


def test_the_readme_points_to_the_example_env():
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"**Your environment**: `--env {SPEC}`" in readme
    assert my_env().tool_stop == "</tool_call>"


def test_my_env_answers_each_check_and_scores_the_answer_less_the_checks():
    env = my_env()
    assert env.reset(PROBLEM) == (
        "What is 47 * 83 - 5? End with 'Answer: <number>'. Before answering you may check a "
        "number N with <tool_call>N</tool_call>; each check costs 0.1.")
    assert env.step("47 * 83 is about <tool_call>3900</tool_call>") == ("3900 is too high", None)
    assert env.step("<tool_call>-4</tool_call>") == ("-4 is too low", None)
    assert env.step("<tool_call> 3896 </tool_call>") == ("3896 is right", None)
    assert env.step("so Answer: 3896") == (None, pytest.approx(0.7))  # 1, less 3 checks
    for answer, value in (("Answer: 3896", 1.0), ("Answer: 3895", 0.0), ("", 0.0)):
        env = my_env()
        env.reset(PROBLEM)
        assert env.step(answer) == (None, value)
    env.step("<tool_call>3895</tool_call>")
    assert env.step("Answer: 3895") == (None, pytest.approx(-0.1))  # wrong, after a check
    for bad in ("<tool_call>47 * 83</tool_call>", "<tool_call></tool_call>",
                "<tool_call>1_000</tool_call>", "I check 3896</tool_call>"):
        with pytest.raises(rl.ToolError, match="is not a number"):
            env.step(bad)
    with pytest.raises(ValueError, match="MyEnv checks numbers, and 'blue' is not one"):
        my_env().reset(rl.Problem("What color is the sky?", "blue"))


@pytest.fixture(scope="module")
def tool_ckpt(tmp_path_factory):
    """A tiny random Qwen3 (128 wide: its warm start takes seconds) whose tokenizer holds
    <tool_call> and </tool_call> as one token each, as Qwen3's does."""
    from transformers import AutoTokenizer

    out = make_checkpoint(tmp_path_factory.mktemp("tool"), hidden=128, head_dim=32, inter=256)
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok.encode("</tool_call>", add_special_tokens=False)) > 1  # split until added
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # text, not special: the env reads them
    tok.save_pretrained(out)
    return out


def test_check_passes_on_the_readme_spec_and_a_split_tool_stop_is_refused(
        ckpt, tool_ckpt, tmp_path, capsys):
    argv = cpu_argv(tool_ckpt, tmp_path / "runs", env=SPEC) + ["--check"]
    out = subprocess.run([sys.executable, "simple_rl.py", *argv], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert f"check: env {ROOT / SPEC}: made, reset; on an empty completion its step returned " \
           "(None, 0.0)" in out.stdout
    assert main_cpu(cpu_argv(ckpt(), tmp_path / "runs", env=f"{ROOT / SPEC}")) == 2
    assert capsys.readouterr().err == (
        "simple_rl: error: --tool-stop '</tool_call>' is 12 tokens of the tokenizer, not one (a "
        "turn ends at a token id: add the string to the tokenizer as one token).\n")


def warm_start(src: Path, out: Path) -> Path:
    """40 supervised steps on episodes as simple_rl renders them: check a number near the
    answer, the tool's message (not a target), then the answer."""
    problems = rl.arithmetic_problems(256, 1)
    cfg = rl.Config()

    def batch(tok, rng):
        def ids(text):
            return tok(text, add_special_tokens=False)["input_ids"]

        seqs, labels = [], []
        for p in rng.sample(problems, 16):
            env = my_env()
            prompt = rl.format_prompts([rl.Problem(env.reset(p), "")], tok, cfg)[0]
            call = ids(f" <tool_call>{int(p.answer) + rng.choice((-10, 0, 10))}</tool_call>")
            message, _ = env.step(tok.decode(call))
            parts = [(call, True), (rl.tool_message_ids(tok, [message], cfg)[0], False),
                     (ids(f" Answer: {p.answer}") + [tok.eos_token_id], True)]
            seqs.append(prompt + [t for part, _ in parts for t in part])
            labels.append([-100] * len(prompt) + [t if own else -100 for part, own in parts
                                                  for t in part])
        return seqs, labels

    return supervised_warm_start(src, out, 40, batch)


def test_a_run_plays_episodes_of_several_turns_with_the_envs_messages_and_rewards(
        tool_ckpt, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    model = warm_start(tool_ckpt, tmp_path / "warm")
    played = []
    plain = rl.episodes_rollout
    monkeypatch.setattr(rl, "episodes_rollout", lambda *a: played.append(plain(*a)) or played[-1])
    monkeypatch.chdir(ROOT)  # the spec as the README writes it
    argv = cpu_argv(model, tmp_path / "runs", env=SPEC, steps=2, max_turns=3, max_new_tokens=8,
                    max_model_len=256, micro_batch_tokens=256, lr=1e-4, run_name="r")
    assert main_cpu(argv) == 0
    steps = [r for r in metrics_rows(tmp_path / "runs" / "r") if "loss" in r]
    assert len(steps) == 2 and all(r["episode/turns_mean"] > 1.5 for r in steps), steps
    tok = AutoTokenizer.from_pretrained(model)
    cfg, _ = rl.parse_config(argv)
    episodes = [e for rollout in played for e in rollout.episodes]
    assert len(episodes) == 2 * 2 * 3  # steps x prompts x samples
    for e in episodes:  # a fresh env, given each turn's text, says what the run's env said
        assert tok.decode(e.turns[0].context).endswith("each check costs 0.1.\nA:")
        env = my_env()
        env.reset(rl.Problem("", e.env.answer))
        texts = rl.decode(tok, [turn.out.ids for turn in e.turns])
        for text, turn in zip(texts, e.turns[1:]):
            message, _ = env.step(text)
            assert turn.context == rl.tool_message_ids(tok, [message], cfg)[0]
        if e.status == "tool_error":
            with pytest.raises(rl.ToolError):
                env.step(texts[-1])
            assert e.reward == 0.0
            continue
        message, value = env.step(texts[-1])
        assert e.tool_calls == env.checks
        assert e.reward == (0.0 if message else value)  # a call at --max-turns: no reward
