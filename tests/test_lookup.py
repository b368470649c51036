"""The lookup task (--env lookup, issue 40): a generated table and questions that are the same
on every machine, each needing two to five dependent <search> calls, and its warm start."""

import hashlib
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

import simple_rl as rl

ROOT = Path(__file__).resolve().parents[1]
ENTRY = re.compile(r"(\w+): mentor (\w+), age (\d+)")


def digest() -> str:
    table = rl.lookup_table()
    return hashlib.sha256(json.dumps([table, [p.question + p.answer for p in
                                              rl.lookup_problems(table)]]).encode()).hexdigest()


def test_the_table_and_questions_are_the_same_in_every_process():
    code = "import simple_rl as rl, test_lookup as t; print(t.digest())"
    got = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT / "tests", check=True,
                          env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "PYTHONHASHSEED": seed}
                          ).stdout.strip() for seed in ("1", "2")}
    assert got == {digest()}
    table = rl.lookup_table()
    assert len(table) == rl.LOOKUP_PEOPLE and all(m != p for p, (m, _) in table.items())
    pool, held = rl.lookup_split(rl.Config(env="lookup", eval_size=512, seed=0))
    assert (pool, held) == rl.lookup_split(rl.Config(env="lookup", eval_size=512, seed=7))
    assert len(held) == 512 and len(pool) == rl.LOOKUP_HOPS * rl.LOOKUP_PEOPLE - 512
    assert not {p.question for p in held} & {p.question for p in pool}


def chain(env: rl.LookupEnv, question: str) -> list[str]:
    """The tool's entries as a model that always searches the last name it read gets them."""
    name = re.search(r"of (\w+)\?", question).group(1)
    entries = []
    for _ in range(rl.LOOKUP_HOPS + 1):
        message, reward = env.step(f"I look up <search>{name}</search>")
        assert reward is None
        entries.append(message)
        name = ENTRY.fullmatch(message).group(2)
    return entries


def test_every_question_needs_two_to_five_calls_each_reading_the_last():
    assert rl.LOOKUP_HOPS == 4
    problems = rl.lookup_problems(rl.lookup_table())[:400]
    calls = [1 + p.question.count("the mentor of") for p in problems]
    assert all(70 < calls.count(c) < 130 for c in (2, 3, 4, 5)) and min(calls) == 2
    early = 0
    for p, need in zip(problems, calls):
        env = rl.LookupEnv()
        assert env.reset(p) == p.question
        ages = [ENTRY.fullmatch(e).group(3) for e in chain(env, p.question)]
        assert ages[need - 1] == p.answer  # the entry of the last call the question needs
        early += p.answer in ages[:need - 1]  # an earlier entry gives it only by chance
        assert env.step(f"so Answer: {p.answer}") == (None, 1.0)
    assert early <= 20
    assert rl.LookupEnv().step("<search>Nobody</search>") == ("no one is called 'Nobody'", None)


def test_the_lookup_warm_start_chains_the_calls_as_the_episode_renders_them():
    """Each answer's calls, the env's entries between them and the answer, as an episode
    renders them; its labels are -100 over the prompt and each entry (the env writes those:
    training on them would teach the model to write the table's answers instead of calling the
    tool) and the token ids over each call, the answer and the eos."""
    import warm_start

    tok = warm_start.make_tokenizer(512, 0, "lookup")
    assert len(tok("</search>", add_special_tokens=False)["input_ids"]) == 1
    table = rl.lookup_table()
    for p in rl.lookup_problems(table)[:20]:
        need = 1 + p.question.count("the mentor of")
        right = warm_start.lookup_answer(p, tok, need)
        short = warm_start.lookup_answer(p, tok, need - 1)
        assert [own for _, own in right] == [True, False] * need + [True]
        assert [own for _, own in short] == [True, False] * (need - 1) + [True]
        assert tok.decode(right[-1][0]) == f"Answer: {p.answer}"
        ages = [ENTRY.fullmatch(rl.search(table, n))[3] for n in rl.lookup_chain(
            table, re.search(r"of (\w+)\?", p.question)[1], need - 1)]
        assert ages[-1] == p.answer
        assert tok.decode(short[-1][0]) == f"Answer: {ages[-2]}"  # one link short
        env = rl.LookupEnv()
        env.reset(p)
        for call, tool in zip(right[0:-1:2], right[1:-1:2]):  # the env answers each call so
            message, _ = env.step(tok.decode(call[0]))
            assert tool[0] == rl.tool_message_ids(tok, [message], rl.Config())[0]
        ids, mask, labels = warm_start.batch_of([p], [right], tok, "cpu")
        prompt = rl.format_prompts([p], tok, rl.Config())[0]
        trained = [t if own else -100 for piece, own in right for t in piece]
        assert labels[0].tolist() == [-100] * len(prompt) + trained + [tok.eos_token_id]
        assert ids[0].tolist() == prompt + [t for piece, _ in right for t in piece] + [
            tok.eos_token_id]
        assert mask[0].tolist() == [1] * (len(prompt) + len(trained) + 1)


def test_the_lookup_warm_start_rarely_chains_as_far_as_the_question_needs():
    import warm_start

    problems = rl.lookup_problems(rl.lookup_table())[:4000]
    need = [1 + p.question.count("the mentor of") for p in problems]
    rng = random.Random(0)
    shown = [warm_start.lookup_calls(p, rng, 0.7, 0.3) for p in problems]
    assert all(1 <= s <= n for s, n in zip(shown, need))  # never past what it needs
    right = {n: sum(s == n for s, m in zip(shown, need) if m == n) / need.count(n)
             for n in (2, 3, 4, 5)}
    assert abs(right[2] - 0.3) < 0.04 and abs(right[3] - 0.09) < 0.03  # 0.3, 0.3 * 0.3, ...
    assert right[5] < 0.02 and sum(s == 1 for s in shown) / len(shown) > 0.65
    assert [warm_start.lookup_calls(p, rng, 0.0, 1.0) for p in problems[:50]] == need[:50]
    assert {warm_start.lookup_calls(p, rng, 1.0, 1.0) for p in problems[:50]} == {1}


def test_a_lookup_run_needs_room_for_its_deepest_question():
    rl.validate(rl.Config(env="lookup", max_turns=rl.LOOKUP_HOPS + 2))  # 5 searches, the answer
    with pytest.raises(rl.ConfigError, match="the lookup task holds out at most 2048"):
        rl.validate(rl.Config(env="lookup", max_turns=6, eval_size=rl.LOOKUP_PEOPLE // 2 + 1))
    # the real command line, as a script: one sentence, exit 2, nothing started
    run = subprocess.run([sys.executable, str(ROOT / "simple_rl.py"), "--env", "lookup",
                          "--max-turns", "5", "--check"], capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "simple_rl: error: --max-turns 5: the lookup task's questions need up to 5 searches and "
        "an answer; give --max-turns 6.")


def test_a_search_reads_the_turns_last_call_whatever_the_spaces_around_the_name():
    """A turn ending in </search> searches the name in its last <search> tag, stripped of the
    spaces and newlines a model writes around it: "<search> Name\\n</search>" finds Name, and a
    tag the turn mentions before its call does not swallow the call. Else a model that writes
    its calls so is told "no one is called ..." for a person in the table, and its episodes
    fail for want of a character."""
    table = rl.lookup_table()
    name, (mentor, age) = sorted(table.items())[0]
    entry = f"{name}: mentor {mentor}, age {age}"
    env = rl.LookupEnv()
    env.reset(rl.lookup_problems(table)[0])
    assert env.step(f"<search>{name}</search>") == (entry, None)
    assert env.step(f"Let me look.\n<search> {name}\n</search>") == (entry, None)
    assert env.step(f"I call <search>NAME</search> with a name: <search>{name}</search>") == (
        entry, None)


def test_the_lookup_task_may_hold_out_exactly_half_its_people():
    """--env lookup --eval-size LOOKUP_PEOPLE // 2 (2048) is taken, as its error says ("at most
    2048"); more is refused in the lookup task's sentence, not the arithmetic task's (--task's
    default, which a lookup run does not read), whatever --task says."""
    for task in ("arithmetic", "gsm8k"):
        rl.validate(rl.Config(env="lookup", task=task, max_turns=6, eval_size=2048))
        with pytest.raises(rl.ConfigError, match="^--eval-size 3000: the lookup task holds"):
            rl.validate(rl.Config(env="lookup", task=task, max_turns=6, eval_size=3000))
    run = subprocess.run([sys.executable, str(ROOT / "simple_rl.py"), "--env", "lookup",
                          "--max-turns", "6", "--eval-size", "3000", "--check"],
                         capture_output=True, text=True)  # the script: one sentence, exit 2
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "simple_rl: error: --eval-size 3000: the lookup task holds out at most 2048 questions.")
