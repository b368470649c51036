"""The lookup task (--env lookup, issue 40): a generated table and questions that are the same
on every machine, each needing two or three dependent <search> calls, and its warm start."""

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

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
    assert len(held) == 512 and len(pool) == 2 * rl.LOOKUP_PEOPLE - 512
    assert not {p.question for p in held} & {p.question for p in pool}


def chain(env: rl.LookupEnv, question: str) -> list[str]:
    """The tool's entries as a model that always searches the last name it read gets them."""
    name = re.search(r"of (\w+)\?", question).group(1)
    entries = []
    for _ in range(3):
        message, reward = env.step(f"I look up <search>{name}</search>")
        assert reward is None
        entries.append(message)
        name = ENTRY.fullmatch(message).group(2)
    return entries


def test_every_question_needs_two_or_three_calls_each_reading_the_last():
    problems = rl.lookup_problems(rl.lookup_table())[:400]
    hops = [2 + p.question.count("the mentor of the mentor") for p in problems]
    assert 150 < hops.count(3) < 250 and hops.count(2) == 400 - hops.count(3)
    early = 0
    for p, calls in zip(problems, hops):
        env = rl.LookupEnv()
        assert env.reset(p) == p.question
        ages = [ENTRY.fullmatch(e).group(3) for e in chain(env, p.question)]
        assert ages[calls - 1] == p.answer  # the entry of the last call the question needs
        early += p.answer in ages[:calls - 1]  # an earlier entry gives it only by chance
        assert env.step(f"so Answer: {p.answer}") == (None, 1.0)
    assert early <= 10
    assert rl.LookupEnv().step("<search>Nobody</search>") == ("no one is called 'Nobody'", None)


def test_the_lookup_warm_start_chains_the_calls_as_the_episode_renders_them():
    sys.path.insert(0, str(ROOT / "examples"))
    import warm_start

    tok = warm_start.make_tokenizer(512, 0, "lookup")
    assert len(tok("</search>", add_special_tokens=False)["input_ids"]) == 1
    table = rl.lookup_table()
    for p in rl.lookup_problems(table)[:20]:
        calls = 2 + p.question.count("the mentor of the mentor")
        right = warm_start.lookup_answer(p, tok, chain=True)
        short = warm_start.lookup_answer(p, tok, chain=False)
        assert [own for _, own in right] == [True, False] * calls + [True]
        assert [own for _, own in short] == [True, False, True]
        assert tok.decode(right[-1][0]) == f"Answer: {p.answer}"
        age = ENTRY.fullmatch(rl.search(table, re.search(r"of (\w+)\?", p.question)[1]))[3]
        assert tok.decode(short[-1][0]) == f"Answer: {age}"  # the first entry's
        env = rl.LookupEnv()
        env.reset(p)
        for call, tool in zip(right[0:-1:2], right[1:-1:2]):  # the env answers each call so
            message, _ = env.step(tok.decode(call[0]))
            assert tool[0] == rl.tool_message_ids(tok, [message], rl.Config())[0]
