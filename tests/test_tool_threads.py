"""The tools' limits: a call past --tool-timeout is ended, not left running; the calls
that will not end are counted on the step line and stop the run at a bound; a hung --reward
has a timeout and a signal ends it; a tool's own KeyboardInterrupt, GeneratorExit or
signal.alarm is the env's failure, said in one sentence."""

import os
import queue
import threading
import time

import pytest

import simple_rl as rl
from helpers import cpu_argv, main_cpu, metrics_rows

# Envs and rewards that misbehave once the --check call is done (their first).
MISBEHAVING = '''
import os
import signal
import time
from pathlib import Path

RUN = None  # the test's folder: its flag files
calls = [0]


def late():
    calls[0] += 1
    return calls[0] > 1


class Plain:
    def reset(self, problem):
        return problem.question

    def step(self, completion):
        return None, float(len(completion) % 2)


class BusyTenth(Plain):
    """Every tenth call loops in Python, without end, on a free core's worth of work."""

    def step(self, completion):
        if late() and calls[0] % 10 == 0:
            while True:
                pass
        return super().step(completion)


class Stubborn(Plain):
    """Every call after --check's waits for the test's flag, and ignores being abandoned."""

    def step(self, completion):
        if late():
            self.hold()
        return super().step(completion)

    @staticmethod
    def hold():
        # The whole wait is inside the try: the one ToolAbandoned may land in any line of it
        # (the flag's check too), and only the loop's jump back is outside, once it is caught.
        while True:
            try:
                while not (Path(RUN) / "release").exists():
                    time.sleep(0.02)
                return
            except BaseException:
                pass


class Interrupts(Plain):
    def step(self, completion):
        if late():
            raise KeyboardInterrupt
        return super().step(completion)


class Exits(Plain):
    def step(self, completion):
        if late():
            raise GeneratorExit
        return super().step(completion)


class Alarmed(Plain):
    def step(self, completion):
        signal.signal(signal.SIGALRM, lambda *_: None)
        return super().step(completion)


def hangs_once(completion, answer):
    if late() and calls[0] == 3:
        while True:
            pass
    return float(len(completion) % 2)


def busy_after_sigterm(completion, answer):
    """At step 1's first call, a SIGTERM, then 20 s of looping (hung, as far as the run can
    tell)."""
    killed = Path(RUN) / "killed"
    if (Path(RUN) / "r" / "checkpoints" / "step_000001").exists() and not killed.exists():
        killed.write_text(repr(time.time()))
        signal.raise_signal(signal.SIGTERM)
        until = time.time() + 20
        while time.time() < until:
            pass
    return float(len(completion) % 2)


def alarm_timed(completion, answer):
    """Times itself with signal.alarm's timer, as a reward in the main thread may."""
    def expire(signum, frame):
        raise TimeoutError

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, 0.01)
    try:
        while True:
            pass
    except TimeoutError:
        return float(len(completion) % 2)
    finally:
        signal.signal(signal.SIGALRM, previous)
'''


@pytest.fixture
def user(tmp_path):
    """FILE.py:NAME of one of MISBEHAVING's envs or rewards."""
    path = tmp_path / "misbehaving.py"
    (tmp_path / "runs").mkdir(exist_ok=True)
    path.write_text(MISBEHAVING.replace("RUN = None", f"RUN = {str(tmp_path / 'runs')!r}"))
    return lambda name: f"{path}:{name}"


def said(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines()
            if line.startswith("simple_rl")]


def wait_for_threads(most: int, seconds: float = 5.0) -> int:
    t0 = time.perf_counter()
    while rl.abandoned_threads() > most and time.perf_counter() - t0 < seconds:
        time.sleep(0.02)
    return rl.abandoned_threads()


def test_2_a_call_looping_past_the_timeout_is_ended_not_left_running(ckpt, tmp_path, user):
    argv = cpu_argv(ckpt(), tmp_path / "runs", env=user("BusyTenth"), steps=2, eval_size=0,
                    tool_timeout=0.3, run_name="r")
    before = threading.active_count()
    assert main_cpu(argv) == 0
    rows = metrics_rows(tmp_path / "runs" / "r")
    assert sum(r["episode/tool_timeout_frac"] for r in rows) > 0  # some calls were abandoned
    assert wait_for_threads(0) == 0  # each ended (they loop forever otherwise)
    assert threading.active_count() <= before


def test_2_calls_that_will_not_end_show_on_the_step_line_then_stop_the_run_with_7(
        ckpt, tmp_path, user, capsys, monkeypatch):
    monkeypatch.setattr(rl, "MAX_ABANDONED_THREADS", 8)
    assert wait_for_threads(0, 30) == 0  # an earlier test's stopped calls may still be ending
    argv = cpu_argv(ckpt(), tmp_path / "runs", env=user("Stubborn"), steps=3, eval_size=0,
                    tool_timeout=1.0, run_name="r")  # 6 episodes: 6 stuck calls a step
    try:
        assert main_cpu(argv) == 7
        out = capsys.readouterr()
        step1 = [line for line in out.out.splitlines() if line.startswith("step 1/3")]
        assert len(step1) == 1 and " | 6 abandoned tool calls still running (the run stops " \
            "at 8) | " in step1[0], out.out
        err = [line for line in out.err.splitlines() if line.startswith("simple_rl")]
        assert err == [f"simple_rl: step 3/3: the env ({user('Stubborn')}) has 12 calls still "
                       "running past --tool-timeout 1s, abandoned but not ended (the run "
                       "stops at 8); nothing of this step was applied. Last good checkpoint: "
                       f"{tmp_path / 'runs' / 'r' / 'checkpoints' / 'step_000002'}."], err
        assert metrics_rows(tmp_path / "runs" / "r")[1]["tools/abandoned_threads"] == 12
    finally:
        (tmp_path / "runs" / "release").write_text("")
    assert wait_for_threads(0) == 0


def test_5_a_hung_reward_ends_at_the_tool_timeout_and_the_run_goes_on(ckpt, tmp_path, user,
                                                                       monkeypatch):
    kept = []
    plain = rl.episodes_rollout
    monkeypatch.setattr(rl, "episodes_rollout", lambda *a: kept.append(plain(*a)) or kept[-1])
    argv = cpu_argv(ckpt(), tmp_path / "runs", reward=user("hangs_once"), steps=1,
                    eval_size=0, tool_timeout=0.5, run_name="r")
    assert main_cpu(argv) == 0  # the hung call loops forever otherwise
    ended = [e.status for e in kept[0].episodes]
    assert ended[1] == "tool_timeout" and kept[0].episodes[1].reward == 0.0
    assert ended.count("tool_timeout") == 1


def test_5_sigterm_ends_a_hung_reward_saves_the_steps_done_and_exits_143(ckpt, tmp_path,
                                                                           user, capsys):
    argv = cpu_argv(ckpt(), tmp_path / "runs", reward=user("busy_after_sigterm"), steps=2,
                    save_every=1, eval_size=0, tool_timeout=0, run_name="r")
    assert main_cpu(argv) == 143
    assert time.time() - float((tmp_path / "runs" / "killed").read_text()) < 10  # it hangs 20
    ckpt1 = tmp_path / "runs" / "r" / "checkpoints" / "step_000001"
    assert said(capsys) == [f"simple_rl: stopped in step 2/2's reward calls, which were "
                            f"abandoned; checkpoint {ckpt1}; continue with --resume {ckpt1}"]


def test_5_a_reward_timing_itself_with_signal_alarm_still_works(ckpt, tmp_path, user):
    argv = cpu_argv(ckpt(), tmp_path / "runs", reward=user("alarm_timed"), steps=1,
                    eval_size=0, tool_timeout=30, run_name="r")
    assert main_cpu(argv) == 0


@pytest.mark.parametrize("name,raised", [("Interrupts", "KeyboardInterrupt"),
                                         ("Exits", "GeneratorExit")])
def test_6_a_tools_keyboard_interrupt_or_generator_exit_is_its_failure_exit_7(
        ckpt, tmp_path, user, capsys, name, raised):
    argv = cpu_argv(ckpt(), tmp_path / "runs", env=user(name), steps=1, eval_size=0,
                    run_name="r")
    assert main_cpu(argv) == 7
    [line] = said(capsys)
    assert line.startswith(f"simple_rl: step 1/1: the env ({user(name)}) raised {raised} on "
                           "sample 0 of training problem "), line


def test_7_an_env_setting_a_signal_handler_is_told_why_it_cannot(ckpt, tmp_path, user, capsys):
    argv = cpu_argv(ckpt(), tmp_path / "runs", env=user("Alarmed"))
    assert main_cpu(argv + ["--check"]) == 2
    assert said(capsys) == [
        f"simple_rl: error: --env {user('Alarmed')}: on an empty completion it raised "
        "ValueError: signal only works in main thread of the main interpreter (an env's reset "
        "and step run on worker threads, where signal handlers cannot be set: bound a call "
        "with --tool-timeout instead)."]


def test_8_a_timeout_out_of_fp32s_range_is_named_as_that(ckpt, tmp_path, capsys):
    argv = cpu_argv(ckpt(), tmp_path / "runs", tool_timeout=1e300)
    assert main_cpu(argv + ["--check"]) == 2
    assert said(capsys) == ["simple_rl: error: --tool-timeout must be a finite number below "
                            "3e38 in magnitude, fp32's range (got 1e+300)."]


FORKS = '''
import os


class Forks:
    """Its step forks a child that comes back from the call instead of exiting."""

    def reset(self, problem):
        return problem.question

    def step(self, completion):
        pid = os.fork()
        if pid:
            os.waitpid(pid, 0)
        return None, 0.0
'''


def test_8_a_child_a_tool_forks_ends_quietly(ckpt, tmp_path):
    import subprocess
    import sys

    path = tmp_path / "forks.py"
    path.write_text(FORKS)
    argv = cpu_argv(ckpt(), tmp_path / "runs", env=f"{path}:Forks") + ["--check"]
    out = subprocess.run([sys.executable, str(rl.__file__), *argv], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.count("check: config: valid") == 1  # the child did not go on


def test_a_worker_whose_result_was_taken_at_once_goes_on_with_the_calls_left(monkeypatch):
    """--tool-workers 1: the main thread records call 0's result while its worker has just
    handed it over. The worker was not abandoned, so it takes calls 1-4 too (it used to read
    the recorded result as its abandonment and end, leaving the run waiting on calls that
    never start)."""
    class SlowHandOver(queue.SimpleQueue):
        def put(self, item):
            super().put(item)
            time.sleep(0.05)  # the main thread records the result meanwhile

    monkeypatch.setattr(rl.queue, "SimpleQueue", SlowHandOver)
    cfg = rl.Config(env="calc", tool_workers=1, tool_timeout=0)
    got = []
    runner = threading.Thread(target=lambda: got.append(
        rl.call_tools([lambda i=i: i * i for i in range(5)], cfg)), daemon=True)
    runner.start()
    runner.join(timeout=20)
    assert got and [c.value for c in got[0]] == [0, 1, 4, 9, 16]
    assert all(c.error is None for c in got[0])


def test_the_run_stops_once_exactly_max_abandoned_threads_still_run(monkeypatch):
    """MAX_ABANDONED_THREADS stuck calls stop the run (ToolsStuck); one fewer lets calls run."""
    monkeypatch.setattr(rl, "MAX_ABANDONED_THREADS", 2)
    release = threading.Event()
    stuck = [threading.Thread(target=release.wait, daemon=True) for _ in range(2)]
    for t in stuck:
        t.start()
    cfg = rl.Config(env="calc", tool_timeout=0)
    try:
        monkeypatch.setattr(rl, "ABANDONED", list(stuck))
        with pytest.raises(rl.ToolsStuck, match="has 2 calls still running"):
            rl.call_tools([lambda: 1], cfg)
        monkeypatch.setattr(rl, "ABANDONED", stuck[:1])
        assert [c.value for c in rl.call_tools([lambda: 1], cfg)] == [1]
    finally:
        release.set()
        for t in stuck:
            t.join()


def test_without_a_timeout_the_wait_on_calls_still_polls_every_stop_poll_s():
    """With --tool-timeout 0 no call is ever late, and a wait still returns every STOP_POLL_S
    to look for a stop request; with a timeout it returns when the first call turns late."""
    me, now = threading.current_thread(), time.perf_counter()
    assert rl.next_late([me], [now - 100.0], 0) == rl.STOP_POLL_S
    assert rl.next_late([None], [0.0], 0) == rl.STOP_POLL_S
    assert rl.next_late([me], [time.perf_counter()], 100.0) == rl.STOP_POLL_S
    assert rl.next_late([me], [now - 100.0], 1.0) < 0  # already late: no wait
    assert rl.next_late([me], [time.perf_counter()], 0.02) <= 0.02


def test_a_child_forked_in_a_tool_call_exits_with_its_calls_status():
    """A child that comes back from the call exits at once: 0 if the call returned, 1 if it
    raised, which the parent's waitpid sees."""
    def forking(fail: bool):
        def call():
            pid = os.fork()
            if pid == 0:  # the child: return from (or raise out of) the call
                if fail:
                    raise ValueError("in the child")
                return "child"
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        return call

    got = rl.call_tools([forking(False), forking(True)], rl.Config(env="calc", tool_timeout=0))
    assert [(c.value, c.error) for c in got] == [(0, None), (1, None)]


def test_a_call_is_abandoned_as_soon_as_it_has_run_the_timeout(monkeypatch):
    """abandon_late ends a call once it has run --tool-timeout seconds, not later: of two calls
    of a 10 s timeout, the one started 15 s ago gets its ToolTimeout and its thread the
    ToolAbandoned; the one started now runs on. (A laxer bound lets each call of a hung tool
    hold a step far past the flag's seconds.)"""
    monkeypatch.setattr(rl, "ABANDONED", [])
    release, ended = threading.Event(), []
    inside = [threading.Event(), threading.Event()]

    def loop(i: int):  # a tool's call that only an abandon (or the release) ends
        try:
            inside[i].set()
            while not release.is_set():
                time.sleep(0.005)
        except rl.ToolAbandoned:
            ended.append(i)

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(2)]
    for thread, entered in zip(threads, inside):
        thread.start()
        assert entered.wait(5.0)
    results = [None, None]
    now = time.perf_counter()
    try:
        late = rl.abandon_late(threads, [now - 15.0, now], results, 10.0, threading.Lock())
        assert late == 1 and results[1] is None
        assert isinstance(results[0].error, rl.ToolTimeout) and results[0].seconds >= 15.0
        threads[0].join(5.0)
        assert ended == [0] and rl.ABANDONED == [threads[0]] and threads[1].is_alive()
    finally:
        release.set()
        for thread in threads:
            thread.join()
    assert ended == [0]  # the call on time ended by its own release


def test_a_call_that_swallows_its_abandonment_keeps_its_timeout_and_its_thread_ends(monkeypatch):
    """--tool-workers 1, --tool-timeout 0.5: call 0 catches every exception (a tool's bare
    `except:`), so the ToolAbandoned sent at 0.5 s lands in it, and it returns anyway. Its
    result stays the ToolTimeout (the late value is not counted), and its thread takes no
    further call: it ends, while calls 1-5 (call 1 waits until call 0 has returned) run on
    the one thread that took its place, each with its own value."""
    monkeypatch.setattr(rl, "ABANDONED", [])
    ran: dict[int, threading.Thread] = {}
    swallowed, zero_returned = [], threading.Event()

    def zero():
        ran[0] = threading.current_thread()
        try:
            while True:  # Python code between sleeps: the ToolAbandoned lands in here
                time.sleep(0.005)
        except BaseException as e:  # the tool's own catch-all
            swallowed.append(type(e))
        zero_returned.set()
        return "value 0"

    def call(i: int):
        ran[i] = threading.current_thread()
        if i == 1:  # the calls after it wait in the queue while call 0's thread goes on
            assert zero_returned.wait(5.0)
        time.sleep(0.1 if i == 1 else 0.02)
        return f"value {i}"

    calls = [zero] + [lambda i=i: call(i) for i in range(1, 6)]
    got = rl.call_tools(calls, rl.Config(env="calc", tool_workers=1, tool_timeout=0.5))
    assert swallowed == [rl.ToolAbandoned]
    assert isinstance(got[0].error, rl.ToolTimeout) and got[0].value is None
    assert [(c.value, c.error) for c in got[1:]] == [(f"value {i}", None) for i in range(1, 6)]
    assert [i for i, thread in ran.items() if thread is ran[0]] == [0]
    assert {ran[i] for i in range(1, 6)} == {ran[1]}
    ran[0].join(5.0)
    assert not ran[0].is_alive()
