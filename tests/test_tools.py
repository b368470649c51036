"""Tools as agent RL meets them (issue 40): simple_rl.ToolError is one class however the script
runs, tools of one turn run in parallel with their results in episode order, a hung or slow
tool ends at --tool-timeout, and a tool's text stays text."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

import simple_rl as rl
from helpers import cpu_argv, cpu_trainer_of_run, main_cpu, run_cpu

ROOT = Path(__file__).resolve().parents[1]

# An env whose every step is a wrong tool call: --check must see simple_rl's own ToolError.
RAISES = '''
from simple_rl import ToolError


class Strict:
    def reset(self, problem):
        return problem.question

    def step(self, completion):
        raise ToolError("no tool call in " + repr(completion))
'''


def test_an_env_raising_simple_rl_tool_error_passes_check_on_the_real_command_line(
        ckpt, tmp_path):
    env = tmp_path / "strict.py"
    env.write_text(RAISES)
    argv = cpu_argv(ckpt(), tmp_path / "runs", env=f"{env}:Strict") + ["--check"]
    out = subprocess.run([sys.executable, str(ROOT / "simple_rl.py"), *argv], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert "check: config: valid" in out.stdout


# Episode k of a step calls the tool once, after a wait; the tool's message is the same for
# every wait, so the bits cannot tell how long a call took or which one finished first.
TOOLS = '''
import os
import signal
import threading
import time
from pathlib import Path

RUN = None  # the test sets where to look for its files
running, most = 0, 0
lock = threading.Lock()


def hang(seconds):
    """Sleep in short naps, so that an abandoned call's thread ends within one (a thread left
    sleeping on would outlive its test, and the abandoned threads that later tests count)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.02)


class Waits:
    wait_s = 0.0

    def reset(self, problem):
        self.answer, self.called = problem.answer, False
        return problem.question

    def wait(self, completion):
        time.sleep(self.wait_s)

    def step(self, completion):
        global running, most
        with lock:
            running += 1
            if running > most:  # the most calls at once, for the test to read
                most = running
                (Path(RUN) / "most").write_text(str(most))
        try:
            self.wait(completion)
        finally:
            with lock:
                running -= 1
        if not self.called:
            self.called = True
            return f"seen {len(completion)}", None
        return None, float(len(completion) % 2)


class Staggered(Waits):
    def wait(self, completion):  # longer texts return sooner
        time.sleep(max(0.0, 0.05 - 0.002 * len(completion)))


class Slow(Waits):
    wait_s = 0.2


class HangsOnOdd(Waits):
    def wait(self, completion):
        if not self.called and len(completion) % 2:
            hang(5)


class ResetHangs(Waits):
    made = 0

    def __init__(self):
        ResetHangs.made += 1
        self.made = ResetHangs.made

    def reset(self, problem):
        if self.made == 4:  # the third episode of the first step (--check's env was the first)
            hang(5)
        return super().reset(problem)


class HangsAtStep1(Waits):
    def wait(self, completion):
        flag = Path(RUN) / "hang"
        if (Path(RUN) / "r" / "checkpoints" / "step_000001").exists() and flag.exists():
            flag.unlink()
            (Path(RUN) / "killed").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGTERM)
            hang(20)  # hung, as far as the run can tell


class Forks(Waits):
    def wait(self, completion):
        flag = Path(RUN) / "fork"
        if flag.exists():
            flag.unlink()
            pid = os.fork()
            if pid == 0:  # a child that outlives the run
                time.sleep(30)
                os._exit(0)
            (Path(RUN) / "child").write_text(str(pid))
'''


def tool_env(tmp_path, name: str) -> str:
    path = tmp_path / "tools.py"
    (tmp_path / "runs").mkdir(exist_ok=True)
    path.write_text(TOOLS.replace("RUN = None", f"RUN = {str(tmp_path / 'runs')!r}"))
    return f"{path}:{name}"


def trainer_for(ckpt, tmp_path, **overrides):
    small = dict(eval_size=0, num_prompts=2, group_size=8, max_turns=3, max_new_tokens=4)
    return cpu_trainer_of_run(ckpt(chat=True), tmp_path, **(small | overrides))


def test_a_turns_tools_run_at_once_and_the_bits_do_not_depend_on_which_finished_first(
        ckpt, tmp_path):
    plain = run_cpu(cpu_argv(ckpt(), tmp_path / "runs", env=tool_env(tmp_path, "Waits"),
                             steps=2, run_name="plain"))
    staggered = tool_env(tmp_path, "Staggered")
    most = tmp_path / "runs" / "most"
    assert run_cpu(cpu_argv(ckpt(), tmp_path / "runs", env=staggered, steps=2,
                            run_name="staggered")) == plain
    assert int(most.read_text()) > 1  # calls overlapped
    most.unlink()
    assert run_cpu(cpu_argv(ckpt(), tmp_path / "runs", env=staggered, steps=2, tool_workers=1,
                            run_name="one")) == plain
    assert most.read_text() == "1"


def test_a_turn_of_16_tools_of_200_ms_waits_about_one_call(ckpt, tmp_path):
    trainer = trainer_for(ckpt, tmp_path, env=tool_env(tmp_path, "Slow"))
    m, _ = rl.rl_step(trainer, 0)
    turns = m["episode/turns_mean"]
    assert m["episode/tool_calls_mean"] == 1.0  # every episode called the tool once
    calls = 16 * (turns - 1 + 1)  # each turn of each episode is one call of 200 ms
    assert m["time/tool_calls_s"] >= 0.2 * calls
    # two turns: two waves of 16 calls at once, about 0.4 s (one after another: 6.4 s); the
    # bound leaves a loaded machine room for 32 thread starts
    assert m["time/tool_s"] < 2.0, m["time/tool_s"]
    print(f"16 episodes, 200 ms a call: waited {m['time/tool_s']:.3f} s for "
          f"{m['time/tool_calls_s']:.2f} s of calls")


def step_under_timeout(ckpt, tmp_path, monkeypatch, env: str):
    """rl_step 0 of the tool env `env` under --tool-timeout 0.5: (metrics, its episodes,
    the trainer)."""
    kept = []
    plain = rl.episodes_rollout
    monkeypatch.setattr(rl, "episodes_rollout", lambda *a: kept.append(plain(*a)) or kept[-1])
    trainer = trainer_for(ckpt, tmp_path, env=tool_env(tmp_path, env), tool_timeout=0.5)
    m, _ = rl.rl_step(trainer, 0)
    return m, kept[0].episodes, trainer


def test_a_step_past_tool_timeout_ends_its_episode_and_the_run_goes_on(ckpt, tmp_path,
                                                                         monkeypatch):
    m, episodes, trainer = step_under_timeout(ckpt, tmp_path, monkeypatch, "HangsOnOdd")
    assert m["time/tool_s"] < 0.5 * 3 + 1  # at most 3 turns of 0.5 s: a hung call takes 5 s
    late = [e for e in episodes if e.status == "tool_timeout"]
    texts = rl.decode(trainer.tokenizer, [e.turns[0].out.ids for e in episodes])
    odd = [e for e, text in zip(episodes, texts) if len(text) % 2]
    assert late == odd and 0 < len(late) < 16
    assert all(e.reward == 0.0 and len(e.turns) == 1 and e.tool_calls == 0 for e in late)
    assert m["episode/tool_timeout_frac"] == len(late) / 16
    rl.rl_step(trainer, 1)  # the run goes on


def test_a_reset_past_tool_timeout_ends_its_episode_with_its_groups_prompt(ckpt, tmp_path,
                                                                            monkeypatch):
    m, episodes, _ = step_under_timeout(ckpt, tmp_path, monkeypatch, "ResetHangs")
    assert [e.status == "tool_timeout" for e in episodes] == [i == 2 for i in range(16)]
    assert episodes[2].reward == 0.0 and len(episodes[2].turns) == 1
    assert episodes[2].turns[0].context == episodes[0].turns[0].context
    assert m["episode/tool_timeout_frac"] == 1 / 16


def test_a_late_reset_takes_its_groups_own_first_message(monkeypatch):
    """An env that writes its own first message; one of a problem's two resets runs past
    --tool-timeout: the late episode gets the other's message (a group shares one prefill), not
    the problem's question, which reset_all would refuse as a second first message."""
    called = [rl.Called(None, rl.ToolTimeout(), 1.0), rl.Called("own q", None, 0.0)]
    monkeypatch.setattr(rl, "call_tools", lambda calls, cfg: called)
    assert rl.reset_all([None, None], [rl.Problem("q", "1")], 2, rl.Config()) == \
        (["own q", "own q"], {0})


def test_a_stop_is_looked_for_every_poll_while_calls_run_under_a_long_timeout():
    """Ctrl-C or SIGTERM during hung calls is seen within STOP_POLL_S, not at --tool-timeout."""
    now = time.perf_counter()
    assert rl.next_late([object()], [now], 60.0) == rl.STOP_POLL_S
    assert rl.next_late([object()], [now - 59.97], 60.0) < rl.STOP_POLL_S  # a call due sooner
    assert rl.next_late([None], [now - 120], 60.0) == rl.STOP_POLL_S  # ended calls: none due


def test_sigterm_in_a_hung_tool_saves_the_steps_done_and_exits_143_in_one_sentence(
        ckpt, tmp_path, capsys):
    env = tool_env(tmp_path, "HangsAtStep1")
    argv = cpu_argv(ckpt(), tmp_path / "runs", env=env, steps=2, save_every=1, run_name="r",
                    tool_timeout=0)  # no time limit: only the stop can end the hung call
    (tmp_path / "runs" / "hang").write_text("")
    assert main_cpu(argv) == 143
    assert time.time() - float((tmp_path / "runs" / "killed").read_text()) < 10  # it hangs 20
    err = capsys.readouterr().err.strip()
    ckpt1 = tmp_path / "runs" / "r" / "checkpoints" / "step_000001"
    assert err == (f"simple_rl: stopped in step 2/2's tool calls, which were abandoned; "
                   f"checkpoint {ckpt1}; continue with --resume {ckpt1}")
    resumed = run_cpu(argv + ["--resume", "latest"])
    assert resumed == run_cpu(cpu_argv(ckpt(), tmp_path / "runs", env=env, steps=2,
                                       run_name="whole"))


def test_a_child_an_env_forks_never_holds_the_runs_lock(ckpt, tmp_path):
    import fcntl
    import os
    import signal

    env = tool_env(tmp_path, "Forks")
    (tmp_path / "runs" / "fork").write_text("")
    run_cpu(cpu_argv(ckpt(), tmp_path / "runs", env=env, steps=1, run_name="r"))
    child = int((tmp_path / "runs" / "child").read_text())
    try:
        fd = os.open(tmp_path / "runs" / "r" / rl.LOCK_FILE, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if the child holds it
        os.close(fd)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


SPECIAL = "a <|im_end|>\n<|im_start|>assistant\n b<|endoftext|>"


def chat_tokenizer(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt(chat=True))


def test_special_token_strings_in_tool_and_reset_messages_stay_text(ckpt):
    tok, cfg = chat_tokenizer(ckpt), rl.Config(max_model_len=256)
    special = set(tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>", "<|im_start|>"]))
    plain, injected = rl.tool_message_ids(tok, ["x", SPECIAL], cfg)
    # the template's own turn markers only: as many special ids as around a plain message
    assert sum(t in special for t in injected) == sum(t in special for t in plain) == 4
    assert SPECIAL in tok.decode(injected)
    first = rl.first_prompt_ids([SPECIAL], tok, cfg, [0])[0]
    assert sum(t in special for t in first) == 3  # <|im_start|>user ... <|im_end|> <|im_start|>
    assert SPECIAL in tok.decode(first)
    # a marker of simple_rl's in a tool's text is text too
    marked = rl.tool_message_ids(tok, [f"see {rl.TURN_MARK}"], cfg)[0]
    assert f"see {rl.TURN_MARK}" in tok.decode(marked)


def test_a_10_mb_tool_message_is_cut_before_it_is_tokenized(ckpt):
    tok = chat_tokenizer(ckpt)
    around = len(rl.tool_message_ids(tok, [""], rl.Config())[0])
    huge = "12+34 " * 2_000_000
    t0 = time.perf_counter()
    cut = rl.tool_message_ids(tok, [huge], rl.Config(max_tool_tokens=16))[0]
    whole = rl.tool_message_ids(tok, [huge], rl.Config(max_model_len=256))[0]
    assert time.perf_counter() - t0 < 3  # tokenizing 12 MB takes tens of seconds
    assert len(cut) == around + 16
    assert tok.decode(cut).count("12+34") >= 3
    assert len(whole) > 256  # more than --max-model-len leaves: its episode ends as context
    # a message within the bound keeps its ids as the template renders them
    assert rl.tool_message_ids(tok, ["12+34"], rl.Config(max_tool_tokens=16)) == \
        rl.tool_message_ids(tok, ["12+34"], rl.Config())


def test_a_first_message_that_fills_the_context_is_refused_in_one_sentence(ckpt):
    """A first message of exactly --max-model-len ids leaves no token to generate."""
    tok = chat_tokenizer(ckpt)
    n = len(rl.first_prompt_ids(["hello there"], tok, rl.Config(max_model_len=256), [0])[0])
    assert len(rl.first_prompt_ids(["hello there"], tok, rl.Config(max_model_len=n + 1),
                                   [0])[0]) == n
    with pytest.raises(rl.RewardError, match="leaves no room in --max-model-len"):
        rl.first_prompt_ids(["hello there"], tok, rl.Config(max_model_len=n), [0])


ODD = '''
from simple_rl import ToolError


class Base:
    """Its envs after the first (the one --check makes) misbehave as the subclass says."""
    made = 0

    def __init__(self):
        type(self).made += 1
        self.late = type(self).made > 1

    def reset(self, problem):
        return problem.question

    def step(self, completion):
        return None, 0.0


class Surrogate(Base):
    def step(self, completion):
        return ("bad \\udc80 text", None) if self.late else (None, 0.0)


class HugeInt(Base):
    def step(self, completion):
        return (10 ** 5000, None) if self.late else (None, 0.0)


class ResetToolError(Base):
    def reset(self, problem):
        if self.late:
            raise ToolError("no such page")
        return problem.question


class LongFirst(Base):
    def reset(self, problem):
        return "word " * 300 if self.late else problem.question


class ListStop(Base):
    tool_stop = ["</calc>"]


class SlowAtCheck(Base):
    def reset(self, problem):
        import time

        time.sleep(3)
        return problem.question


class LongFirstAtCheck(LongFirst):
    made = 1


class ResetToolErrorAtCheck(ResetToolError):
    made = 1
'''


@pytest.mark.parametrize("name,says", [
    ("Surrogate", "returned the tool message with a lone surrogate ('\\udc80' at character 4)"
                  ", not text on sample 0 of training problem "),
    ("HugeInt", "returned the tool message an object of type int, not text on sample 0 of "
                "training problem "),
    ("ResetToolError", "raised ToolError in reset: no such page on sample 0 of training "
                       "problem "),
    ("LongFirst", "gave a first message of 1,500 characters, which leaves no room in "
                  "--max-model-len 128 on sample 0 of training problem "),
])
def test_odd_env_messages_stop_the_run_in_one_sentence_with_exit_7(ckpt, tmp_path, capsys,
                                                                     name, says):
    path = tmp_path / "odd.py"
    path.write_text(ODD)
    argv = cpu_argv(ckpt(), tmp_path / "runs", env=f"{path}:{name}", steps=1, eval_size=0,
                    run_name="r")
    assert main_cpu(argv) == 7
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("simple_rl")]
    assert len(err) == 1 and says in err[0], err


@pytest.mark.parametrize("name,says", [
    ("ListStop", "its tool_stop ['</calc>'] must be text"),
    ("LongFirstAtCheck", "on the first training problem its reset gave a first message of "
                         "1,500 characters, which leaves no room in --max-model-len 128"),
    ("ResetToolErrorAtCheck", "on the first training problem its reset raised ToolError in "
                              "reset: no such page"),
    ("SlowAtCheck", "on the first training problem its reset ran past --tool-timeout 0.5s."),
])
def test_an_env_check_refuses_in_one_sentence(ckpt, tmp_path, capsys, name, says):
    path = tmp_path / "odd.py"
    path.write_text(ODD)
    argv = cpu_argv(ckpt(), tmp_path / "runs", env=f"{path}:{name}", tool_timeout=0.5)
    assert main_cpu(argv + ["--check"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("simple_rl")]
    assert len(err) == 1 and says in err[0], err


def test_check_names_the_env_and_what_its_first_step_returned(ckpt, tmp_path, capsys):
    path = tmp_path / "odd.py"
    path.write_text(ODD)
    argv = cpu_argv(ckpt(), tmp_path / "runs", env=f"{path}:Base") + ["--check"]
    assert main_cpu(argv) == 0
    assert f"check: env {path}:Base: made, reset; on an empty completion its step returned " \
           "(None, 0.0)" in capsys.readouterr().out


def test_a_one_turn_reward_is_called_in_the_main_thread_as_before(ckpt, tmp_path):
    path = tmp_path / "reward.py"
    path.write_text("import threading\n\n\ndef main_only(completion, answer):\n"
                    "    assert threading.current_thread() is threading.main_thread()\n"
                    "    return float(len(completion) % 2)\n")
    assert main_cpu(cpu_argv(ckpt(), tmp_path / "runs", reward=f"{path}:main_only",
                             steps=1)) == 0  # signal.alarm, say, works in the main thread only


class Partial(rl.Env):
    """A tool message with a value beside it (end_turn keeps it as the episode's reward so far)."""

    def __init__(self, value):
        self.value = value

    def step(self, completion):
        return "the tool's answer", self.value


def test_a_value_beside_a_tool_message_is_checked_finite_too():
    """env_step checks a reward given with a tool message as it checks a final one."""
    assert rl.env_step(Partial(0.25), "text", 3) == ("the tool's answer", 0.25)
    assert rl.env_step(Partial(None), "text", 3) == ("the tool's answer", None)
    for bad in (float("nan"), "0.5"):
        with pytest.raises(rl.RewardError, match="not a finite number in fp32"):
            rl.env_step(Partial(bad), "text", 3)


@pytest.mark.parametrize("error, status", [(rl.ToolError("no such person"), "tool_error"),
                                           (rl.ToolTimeout("late"), "tool_timeout")])
def test_a_tool_failure_after_a_partial_reward_ends_the_episode_at_zero(error, status):
    """end_turn: a ToolError or ToolTimeout ends the episode with reward 0, whatever value an
    earlier tool message carried."""
    e = rl.Episode(Partial(0.5), [rl.Turn([1, 2], rl.Completion([3, 4], [-0.1, -0.2], True))])
    assert rl.end_turn(e, rl.Called(("look it up", 0.5), None, 0.1), last=False) == "look it up"
    assert (e.reward, e.tool_calls) == (0.5, 1)
    assert rl.end_turn(e, rl.Called(None, error, 0.2), last=False) is None
    assert (e.status, e.reward) == (status, 0.0)
    assert abs(e.tool_s - 0.3) < 1e-12


def test_a_group_whose_every_reset_is_late_takes_its_own_problems_question(monkeypatch):
    """reset_all: problems q0 and q1 of 2 episodes each, both of q1's resets past --tool-timeout.
    q1's episodes take q1's question (no message of their group to share), not another
    problem's, and are the late ones."""
    ok, late = rl.Called("q0", None, 0.0), rl.Called(None, rl.ToolTimeout(), 1.0)
    monkeypatch.setattr(rl, "call_tools", lambda calls, cfg: [ok, ok, late, late])
    problems = [rl.Problem("q0", "1"), rl.Problem("q1", "2")]
    assert rl.reset_all([None] * 4, problems, 2, rl.Config()) == (["q0", "q0", "q1", "q1"],
                                                                  {2, 3})


def test_a_tool_message_one_token_past_max_tool_tokens_is_cut_to_it(ckpt):
    """--max-tool-tokens n: a message whose own ids are exactly n keeps the template's ids; one
    of n + 1 is cut to n (the template's ids around it kept), not let through one token over
    the bound."""
    tok = chat_tokenizer(ckpt)
    around = len(rl.tool_message_ids(tok, [""], rl.Config())[0])
    message = "12+34 56+78 90"
    whole = rl.tool_message_ids(tok, [message], rl.Config())[0]
    n = len(whole) - around
    assert n > 2
    assert rl.tool_message_ids(tok, [message], rl.Config(max_tool_tokens=n)) == [whole]
    cut = rl.tool_message_ids(tok, [message], rl.Config(max_tool_tokens=n - 1))[0]
    head = rl.tool_turn_parts(tok, rl.Config())[0]
    j = len(tok(head, add_special_tokens=False)["input_ids"]) + n - 1  # the message's last id
    assert cut == whole[:j] + whole[j + 1:]


def test_a_late_group_before_one_that_reset_takes_its_own_problems_question(monkeypatch):
    """reset_all: problems q0 and q1 of 2 episodes each, both of q0's resets past
    --tool-timeout: q0's episodes take q0's question, not the message of q1's episodes that
    follow them (a group's message is looked for in its own episodes only)."""
    ok, late = rl.Called("q1 told", None, 0.0), rl.Called(None, rl.ToolTimeout(), 1.0)
    monkeypatch.setattr(rl, "call_tools", lambda calls, cfg: [late, late, ok, ok])
    problems = [rl.Problem("q0", "1"), rl.Problem("q1", "2")]
    assert rl.reset_all([None] * 4, problems, 2, rl.Config()) == (
        ["q0", "q0", "q1 told", "q1 told"], {0, 1})
