"""An environment to copy: simple_rl's arithmetic task, with a checker the model may call.

    VLLM_BATCH_INVARIANT=1 python simple_rl.py --env examples/envs.py:MyEnv  # Qwen3-1.7B

simple_rl makes a fresh MyEnv for each episode and calls reset(problem) once: its text is the
user's first message. After each of the model's turns it calls step with that turn's text:

  * a turn that ends in <tool_call>N</tool_call> asks whether N is the answer: step returns the
    tool's message ("3900 is too high") and no reward, and the model goes on in a new turn;
  * a turn without a call is the answer: step returns no message and the reward, which is
    simple_rl's (1 if the number after 'Answer:' is right, else 0) less CHECK_COST for each
    check, so working the value out pays more than finding it by checks.

A call whose N is not a number raises simple_rl.ToolError: the episode ends there, reward 0.
tool_stop is the string that ends a turn to call the tool: it must be one token of the model's
tokenizer (Qwen3's holds </tool_call> as one). The env keeps nothing across episodes and reads
no clock: a step depends on the episode's texts alone, so a resumed run repeats the bits.
"""

import re
from decimal import Decimal, InvalidOperation

from simple_rl import ToolError, reward

CHECK_COST = 0.1  # taken off the answer's reward for each check
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")  # what a check may ask about: 3896, -4, 2.5


class MyEnv:
    tool_stop = "</tool_call>"  # ends a turn that calls the tool (--tool-stop overrides it)

    def reset(self, problem) -> str:
        """The user's first message. problem is a task row: problem.question, problem.answer."""
        try:
            self.value = Decimal(problem.answer.replace(",", ""))
        except InvalidOperation:
            raise ValueError(f"MyEnv checks numbers, and {problem.answer!r} is not one") from None
        self.answer = problem.answer
        self.checks = 0  # calls so far in this episode
        return (f"{problem.question} Before answering you may check a number N with "
                f"<tool_call>N</tool_call>; each check costs {CHECK_COST}.")

    def step(self, completion: str) -> tuple[str | None, float | None]:
        """(the tool's message, None) if the turn ends in a call: the model goes on; else
        (None, the reward): the episode ends."""
        if not completion.endswith(self.tool_stop):
            return None, reward(completion, self.answer) - CHECK_COST * self.checks
        asked = completion[: -len(self.tool_stop)].rsplit("<tool_call>", 1)[-1].strip()
        if not NUMBER.fullmatch(asked):
            raise ToolError(f"{asked[:40]!r} is not a number")
        self.checks += 1
        guess = Decimal(asked)
        if guess == self.value:
            return f"{asked} is right", None
        return f"{asked} is too {'low' if guess < self.value else 'high'}", None
