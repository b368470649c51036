"""The embedded task: generator and reward parser."""

from decimal import Decimal

import pytest

import simple_rl as rl


def test_arithmetic_problems_are_seeded_and_exact():
    a, b = rl.arithmetic_problems(50, 3), rl.arithmetic_problems(50, 3)
    assert a == b and a != rl.arithmetic_problems(50, 4)
    for p in a:
        expr = p.prompt.split("What is ")[1].split("?")[0]
        assert str(eval(expr)) == p.answer and p.prompt.endswith("A:")  # Python's precedence agrees
    assert {p.prompt.split()[4] for p in a} == {"+", "-", "*"}


@pytest.mark.parametrize("text,value", [
    (" 42", "42"),
    (" Let me think. 3 * 4 = 12, then 12 + 30 = 42. Answer: 42", "42"),
    (" Answer: -17.", "-17"),
    (" Answer: **1,234**", "1234"),
    (" Answer: $56", "56"),
    (" Answer: 12.0", "12"),
    (" 7 then 8\nQ: What is 1 + 1?\nA: 2", "8"),  # ignores the model's next question
    (" Answer: 5 (not 6)", "5"),
    (" no idea", None),
    ("", None),
])
def test_parse_answer(text, value):
    got = rl.parse_answer(text)
    assert got == (None if value is None else Decimal(value))


@pytest.mark.parametrize("text,answer,r", [
    (" Answer: 1,234", "1234", 1.0), (" Answer: 12.0", "12", 1.0), (" Answer: 12.5", "12", 0.0),
    (" Answer: -3", "3", 0.0), (" 99", "99", 1.0), (" nothing", "0", 0.0),
])
def test_reward(text, answer, r):
    assert rl.reward(text, answer) == r
