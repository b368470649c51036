"""Episodes of several turns on CPU: the episode loop over the stand-in engine (turns, tool
messages appended as ids, masks, seeds, parity over every turn), the calculator env, and the
bad input of --env."""

import pytest
import torch

import simple_rl as rl
from helpers import (cpu_argv, cpu_trainer_of_run, first_turns, main_cpu, run_cpu,
                     supervised_warm_start)

# A turn-1 text of c characters makes the episode call the tool c % 3 times: 1 to 3 turns,
# mixed within a prompt's group, the same on any number of ranks.
SCRIPTED = '''
class Scripted:
    def reset(self, problem):
        self.calls, self.answered = None, 0
        return problem.question

    def step(self, completion):
        if self.calls is None:
            self.calls = len(completion) % 3
        if self.answered < self.calls:
            self.answered += 1
            return f"tool says {self.answered}", None
        return None, float(len(completion) % 2)


class Counted(Scripted):
    """Episode k (in the order simple_rl makes them) calls the tool k % 3 times."""
    made = 0

    def __init__(self):
        Counted.made += 1
        self.made = Counted.made

    def reset(self, problem):
        question = super().reset(problem)
        self.calls = self.made % 3
        return question


class Forever(Scripted):
    def step(self, completion):
        return "again", None
'''


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "envs.py"
    path.write_text(SCRIPTED)
    return path


class Recorder:
    """Keeps what rl_step's episodes became (rl.episodes_rollout's result)."""

    def __init__(self, monkeypatch):
        self.rollouts = []
        plain = rl.episodes_rollout

        def keep(*a, **k):
            self.rollouts.append(plain(*a, **k))
            return self.rollouts[-1]

        monkeypatch.setattr(rl, "episodes_rollout", keep)


def test_episodes_of_one_to_three_turns_append_tool_ids_and_train_on_the_models_tokens(
        ckpt, tmp_path, env_file, monkeypatch):
    seen = Recorder(monkeypatch)
    trainer = cpu_trainer_of_run(ckpt(chat=True), tmp_path, env=f"{env_file}:Counted", max_turns=3,
                                 num_prompts=2, group_size=4, max_new_tokens=4, eval_size=0,
                                 kl_coef=0.0, max_model_len=256, micro_batch_tokens=256)
    cfg, tok, engine = trainer.cfg, trainer.tokenizer, trainer.engine
    m, parity = rl.rl_step(trainer, 0)
    ro = seen.rollouts[-1]
    eps = ro.episodes
    turns = [len(e.turns) for e in eps]
    assert turns == [3, 1, 2, 3, 1, 2, 3, 1], turns  # mixed, within groups too (check_env made 1)
    for e in eps:
        assert len(e.turns) == 1 + e.env.calls and e.tool_calls == e.env.calls
        assert e.status in ("completed", "length")
    # one generate per turn over every live episode: G samples per prompt, then one each
    calls = engine.calls
    assert [c[1] for c in calls] == [4, 1, 1] and len(calls[0][0]) == 2
    mine = rl.my_prompts(cfg.num_prompts, trainer.ranks)
    assert calls[0][2] == [rl.request_seed(cfg, 0, i) for i in mine]  # today's first turn
    assert [len(c[0]) for c in calls[1:]] == [sum(t > k for t in turns) for k in (1, 2)]
    # turn k is generated after the episode's ids so far and the tool's message, as ids: the
    # template's end of the assistant turn, the tool turn and the next generation prompt
    for k in (1, 2):
        live = [i for i, t in enumerate(turns) if t > k]
        want = rl.tool_message_ids(tok, [f"tool says {k}"], cfg)[0]
        assert tok.decode(want) == (f"<|im_end|>\n<|im_start|>tool\ntool says {k}<|im_end|>\n"
                                    "<|im_start|>assistant\n<think>\n\n</think>\n\n")
        for i, prompt, seed in zip(live, calls[k][0], calls[k][2]):
            e = eps[i]
            assert e.turns[k].context == want
            assert prompt == [t for turn in e.turns[:k] for t in turn.context + turn.out.ids] \
                + want
            assert seed == rl.turn_seed(cfg, 0, mine[i // 4], i % 4, k)
    # every sample's seed differs from every other of the step, across turns
    seeds = [s + j for _, n, ss, _, _ in calls for s in ss for j in range(n)]
    assert len(seeds) == len(set(seeds)) == 8 + sum(t - 1 for t in turns)
    # the packed episode: the targets are exactly the model's tokens of every turn
    packed = rl.pack(ro.prompts, ro.completions, ro.generated)
    generated = [t for e in eps for turn in e.turns for t in turn.out.ids]
    assert packed.targets.tolist() == generated == [
        t for c, mask in zip(ro.completions, ro.generated) for t, own in zip(c, mask) if own]
    assert len(ro.logprobs) == len(generated) == parity.n_tokens == m["determinism/tokens"]
    assert [m[f"determinism/tokens_turn{k}"] for k in (1, 2, 3)] == [
        sum(len(e.turns[k].out.ids) for e in eps if len(e.turns) > k) for k in range(3)]
    assert sum(not own for mask in ro.generated for own in mask) == \
        m["episode/tool_tokens_mean"] * 8
    assert packed.tokens.tolist() == [t for e in eps for t in e.ids()]
    assert parity.max_abs_diff < 1e-4  # the stand-in's logprobs of every turn, as the trainer's
    assert m["episode/turns_mean"] == sum(turns) / 8
    assert m["episode/tool_calls_mean"] == sum(t - 1 for t in turns) / 8
    assert m["episode/tool_call_frac"] == sum(t > 1 for t in turns) / 8
    assert m["completion_len_mean"] == len(generated) / 8
    rewards = torch.tensor([e.reward for e in eps])
    assert m["reward_mean"] == pytest.approx(rewards.mean().item())
    trainer.writer.close()


def test_a_model_that_never_stops_calling_ends_at_max_turns_and_tool_messages_past_the_context(
        ckpt, tmp_path, env_file, monkeypatch):
    seen = Recorder(monkeypatch)
    trainer = cpu_trainer_of_run(ckpt(), tmp_path, env=f"{env_file}:Forever", max_turns=3,
                                 eval_size=0)
    m, _ = rl.rl_step(trainer, 0)
    eps = seen.rollouts[-1].episodes
    assert [(len(e.turns), e.status, e.reward) for e in eps] == [(3, "max_turns", 0.0)] * 6
    assert m["episode/max_turns_frac"] == 1.0
    # a tool message longer than what --max-model-len leaves ends the episode, counted
    chosen = rl.step_problems(len(trainer.task.problems), 2, 1, trainer.cfg.seed)
    longest = max(len(trainer.task.prompt_ids[i]) for i in chosen)
    trainer.cfg.max_model_len = longest + trainer.cfg.max_new_tokens + 1
    m, _ = rl.rl_step(trainer, 1)
    assert m["episode/max_model_len_frac"] > 0
    assert all(len(e.ids()) <= trainer.cfg.max_model_len for e in seen.rollouts[-1].episodes)
    trainer.writer.close()


def test_a_first_message_leaving_less_than_max_new_tokens_caps_the_first_turn(
        ckpt, tmp_path, env_file, monkeypatch):
    """An env's first message need only leave room for one token: the first turn may generate
    what --max-model-len leaves (as vLLM stops it there) and, ended at that limit, ends the
    episode as max_model_len, not as length."""
    seen = Recorder(monkeypatch)
    trainer = cpu_trainer_of_run(ckpt(), tmp_path, env=f"{env_file}:Scripted", eval_size=0)
    cfg = trainer.cfg
    assert trainer.engine.cfg is cfg and cfg.max_new_tokens > 2
    chosen = rl.step_problems(len(trainer.task.problems), cfg.num_prompts, 0, cfg.seed)
    cfg.max_model_len = max(len(trainer.task.prompt_ids[i]) for i in chosen) + 2
    rl.rl_step(trainer, 0)
    eps = seen.rollouts[-1].episodes
    assert all(len(e.ids()) <= cfg.max_model_len for e in eps)
    cut = [e for e in eps if len(e.turns[0].context) + 2 == cfg.max_model_len]
    assert cut and all(e.turns[0].capped and len(e.turns[0].out.ids) <= 2 for e in cut)
    assert {e.status for e in cut if not e.turns[0].out.stopped} == {"max_model_len"}
    trainer.writer.close()


def test_a_held_out_prompt_leaving_less_than_max_new_tokens_caps_its_greedy_turn(
        ckpt, tmp_path, monkeypatch):
    """The eval's first turns, as the rollout's: each may generate what --max-model-len leaves
    after its prompt (max_model_len - len(prompt), here 2 for the longest), not
    --max-new-tokens, and such a turn is capped."""
    trainer = cpu_trainer_of_run(ckpt(), tmp_path, eval_size=4)
    cfg, task = trainer.cfg, trainer.task
    cfg.max_model_len = max(len(p) for p in task.eval_prompt_ids) + 2
    assert cfg.max_new_tokens > 2
    asked, generate = [], trainer.engine.generate

    def recording(prompts, n, seeds, max_tokens, temperature):
        asked.append(list(max_tokens))
        return generate(prompts, n, seeds, max_tokens, temperature)

    monkeypatch.setattr(trainer.engine, "generate", recording)
    eps = rl.greedy_episodes(trainer, [0, 1, 2, 3])
    want = [min(cfg.max_new_tokens, cfg.max_model_len - len(p)) for p in task.eval_prompt_ids]
    assert asked[0] == want and min(want) == 2
    assert all(e.turns[0].capped == (w < cfg.max_new_tokens) for e, w in zip(eps, want))
    assert all(len(e.turns[0].out.ids) <= w for e, w in zip(eps, want))
    trainer.writer.close()


def test_a_tool_message_that_leaves_no_room_for_a_token_ends_the_episode(monkeypatch):
    """--max-model-len 10: episodes of 8 ids; a message of 2 ids fills the context (no token
    left: the episode ends as max_model_len), one of 1 leaves a turn of 1 token."""
    monkeypatch.setattr(rl, "tool_message_ids",
                        lambda tokenizer, messages, cfg: [[9] * int(m) for m in messages])
    cfg = rl.Config(max_model_len=10, max_new_tokens=4)
    episodes = [rl.Episode(None, [rl.Turn([1] * 5, rl.Completion([2] * 3, [0.0] * 3, True))])
                for _ in range(2)]
    going = rl.going_on(episodes, {0: "2", 1: "1"}, None, cfg)
    assert [(g.episode, g.max_tokens) for g in going] == [(1, 1)]
    assert episodes[0].status == "max_model_len" and episodes[1].status == "running"


def test_a_later_turn_capped_by_the_context_ends_as_max_model_len_at_its_limit():
    """A later turn asked for 2 tokens (what --max-model-len 12 left, under --max-new-tokens 4)
    that used them all is capped: the env ending it makes the episode max_model_len."""
    class Full(rl.Engine):  # every request generates its whole limit, no stop id
        def generate(self, prompts, n, seeds, max_tokens, temperature):
            return [[rl.Completion([5] * m, [0.0] * m, False)] for m in max_tokens]

    cfg = rl.Config(max_model_len=12, max_new_tokens=4)
    episodes = [rl.Episode(None, [rl.Turn([1] * 5, rl.Completion([2] * 3, [0.0] * 3, True))])]
    rl.next_turns(Full(), episodes, [rl.Going(0, [9], 2)], [None], 1.0, cfg)
    assert episodes[0].turns[-1].capped and episodes[0].turns[-1].out.ids == [5, 5]
    assert rl.end_turn(episodes[0], rl.Called((None, 0.0), None, 0.0), last=False) is None
    assert episodes[0].status == "max_model_len"


def test_the_last_reward_an_env_gives_is_the_episodes_not_their_sum():
    episode = rl.Episode(None, [rl.Turn([1], rl.Completion([3], [-0.1], True))])
    assert rl.end_turn(episode, rl.Called(("go on", 0.5), None, 0.0), last=False) == "go on"
    assert rl.end_turn(episode, rl.Called((None, 1.0), None, 0.0), last=False) is None
    assert (episode.status, episode.reward, episode.tool_calls) == ("completed", 1.0, 1)


def test_only_completed_episodes_count_as_stopped():
    """completion_stopped_frac: an episode that ended at a stop id but as max_turns (or by a
    tool) did not complete."""
    ends = ["completed", "max_turns", "tool_error", "tool_timeout", "max_model_len", "length"]
    episodes = [rl.Episode(None, [rl.Turn([1], rl.Completion([3], [-0.1], True))], status=s)
                for s in ends]
    assert rl.episodes_rollout(episodes, routes=False).completed == [True] + [False] * 5


def test_each_problem_is_prompted_with_its_own_envs_first_message(monkeypatch):
    """Two problems of 2 episodes each, an env that writes its own first message: problem j's
    prompt is the message of its episodes (2 j, 2 j + 1), not of episode j."""
    monkeypatch.setattr(rl, "first_prompt_ids", lambda messages, tokenizer, cfg, samples:
                        [[ord(c) for c in m] for m in messages])

    class Own:
        def reset(self, problem):
            return "own " + problem.question

        def step(self, completion):
            return None, 0.0

    trainer = rl.Trainer(rl.Config(env="envs.py:Own", tool_timeout=0), *[None] * 7,
                         make_env=Own)
    problems = [rl.Problem("a", "1"), rl.Problem("b", "2")]
    envs, prompts = rl.new_episodes(trainer, problems, [[0], [0]], 2)
    assert ["".join(map(chr, p)) for p in prompts] == ["own a", "own b"] and len(envs) == 4


def test_one_turn_episodes_pack_exactly_as_the_engines_rollout(ckpt, tmp_path, monkeypatch):
    """Without --env a step trains on exactly what the engine's rollout samples, as before
    episodes: the same samples, logprobs, stops and Packed."""
    seen = Recorder(monkeypatch)
    trainer = cpu_trainer_of_run(ckpt(), tmp_path, eval_size=0)
    cfg = trainer.cfg
    chosen = rl.step_problems(len(trainer.task.problems), cfg.num_prompts, 0, cfg.seed)
    want = first_turns(trainer.engine, [trainer.task.prompt_ids[i] for i in chosen], [0, 1], 0)
    m, _ = rl.rl_step(trainer, 0)
    ro = seen.rollouts[-1]
    assert ro.prompts == want.prompts and ro.completions == want.completions
    assert torch.equal(ro.logprobs, want.logprobs) and ro.completed == want.completed
    a = rl.pack(ro.prompts, ro.completions, ro.generated)
    b = rl.pack(want.prompts, want.completions)
    for f in ("tokens", "positions", "cu_seqlens", "gen_index", "targets", "seq"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert not any(k.startswith("episode/") for k in m)  # single-turn logs as before
    trainer.writer.close()


def test_the_calculator_answers_and_scores_the_last_turn():
    env = rl.CalcEnv()
    assert env.reset(rl.Problem("What is 47 * 83 - 5?", "3896")) == "What is 47 * 83 - 5?"
    assert env.step("I need <calc>47 * 83 - 5</calc>") == ("3896", None)
    assert env.step("<calc>(2 + -3) * 4</calc>") == ("-4", None)
    assert env.step("Answer: 3896") == (None, 1.0)
    assert env.step("Answer: 3") == (None, 0.0)
    for bad in ("<calc>2 ** 99</calc>", "<calc>__import__('os')</calc>", "<calc>1 +</calc>",
                "<calc>" + "1+" * 60 + "1</calc>", "<calc>2 / 3</calc>"):
        with pytest.raises(rl.ToolError):
            env.step(bad)


BAD_ENVS = '''
MADE = [0]


class LateFailure:
    """Episodes after the first step's (and check_env's) raise at their second turn."""

    def __init__(self):
        MADE[0] += 1
        self.late, self.turn = MADE[0] > 7, 0

    def reset(self, problem):
        return problem.question

    def step(self, completion):
        self.turn += 1
        if self.turn == 1:
            return "go on", None
        if self.late:
            raise RuntimeError("the tool broke")
        return None, 1.0


class NotText(LateFailure):
    def step(self, completion):
        return (["go on"], None) if self.late else (None, 0.0)


class NoStep:
    def reset(self, problem):
        return problem.question


class TwoArgs:
    def reset(self, problem):
        return problem.question

    def step(self, completion, answer):
        return None, 0.0
'''


@pytest.mark.parametrize("name,says", [
    ("LateFailure", "raised RuntimeError: the tool broke on sample "),
    ("NotText", "returned the tool message ['go on'], not text on sample "),
])
def test_an_env_that_fails_mid_run_stops_with_exit_7_naming_episode_and_turn(
        ckpt, tmp_path, capsys, name, says):
    path = tmp_path / "bad.py"
    path.write_text(BAD_ENVS)
    argv = cpu_argv(ckpt(), tmp_path / "runs", steps=3, save_every=1, eval_size=0,
                    env=f"{path}:{name}", run_name="r")
    assert main_cpu(argv) == 7
    err = capsys.readouterr().err
    assert f"step 2/3: the env ({path}:{name}) {says}" in err, err
    turn = "turn 2" if name == "LateFailure" else "turn 1"
    assert "of training problem " in err and f", {turn}, completion " in err
    assert "Last good checkpoint: " in err and "step_000001" in err
    assert (tmp_path / "runs" / "r" / "checkpoints" / "step_000001").is_dir()


@pytest.mark.parametrize("spec,says", [
    ("{dir}/missing.py:Env", "--env: {dir}/missing.py is not a file."),
    ("{dir}/bad.py:Nothing", "--env: {dir}/bad.py has no class 'Nothing'."),
    ("{dir}/bad.py:NoStep", "--env {dir}/bad.py:NoStep: its env has no method step(completion)."),
    ("{dir}/bad.py:TwoArgs", "--env {dir}/bad.py:TwoArgs: step(completion, answer) must take "
                             "(completion)."),
    ("calc.py", "--env 'calc.py' must be calc, lookup or name a Python file and a class in it"),
])
def test_a_bad_env_is_refused_before_the_engine_starts(ckpt, tmp_path, capsys, spec, says):
    from helpers import CountingEngine

    (tmp_path / "bad.py").write_text(BAD_ENVS)
    CountingEngine.made = 0
    argv = cpu_argv(ckpt(), tmp_path / "runs", env=spec.format(dir=tmp_path))
    assert main_cpu(argv, CountingEngine) == 2
    assert says.format(dir=tmp_path) in capsys.readouterr().err
    assert CountingEngine.made == 0


def test_a_tool_stop_of_several_tokens_is_refused(ckpt, tmp_path, capsys):
    from helpers import CountingEngine

    CountingEngine.made = 0
    assert main_cpu(cpu_argv(ckpt(), tmp_path / "runs", env="calc"), CountingEngine) == 2
    assert "--tool-stop '</calc>' is " in capsys.readouterr().err  # the test tokenizer splits it
    assert CountingEngine.made == 0


# The learning task: "Q: <3 letters>\nA:", answer a digit that only the tool knows. The model
# either looks (" look<look>": the env answers " <digit>\n", the model takes it with " ok")
# or guesses (" guess <digit>"). The warm start looks 3 times in 10, so greedy decoding
# guesses, right about 1 time in 10; GRPO must learn to look.
LOOK = '''
class Look:
    tool_stop = "<look>"

    def reset(self, problem):
        self.answer = problem.answer
        return problem.question

    def step(self, completion):
        if completion.endswith("<look>"):
            self.looked = True
            return f" {self.answer}\\n", None
        if getattr(self, "looked", False):
            return None, float(completion.strip() == "ok")
        return None, float(completion.strip()[-1:] == self.answer)
'''


def look_task(tmp, n: int = 400):
    import json
    import random

    from helpers import make_checkpoint

    rng = random.Random(0)
    rows = [{"question": "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=3)),
             "answer": str(rng.randrange(10))} for _ in range(n)]
    (tmp / "look.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "look.py").write_text(LOOK)
    base = make_checkpoint(tmp / "random", layers=2, hidden=128, heads=4, kv_heads=2,
                           head_dim=32, inter=256, vocab=384)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    tok.add_tokens(["<look>"])  # one token, and not a special one: the env reads it as text
    tok.save_pretrained(base)
    return base, rows


def look_warm_start(src, out, rows, steps: int = 80, look_fraction: float = 0.3):
    """Supervised steps on both kinds of answer, the loss on the model's tokens only; the
    tool's message is in the sequence as the episode loop renders it (the text as is)."""
    def batch(tok, rng):
        def ids(text):
            return tok(text, add_special_tokens=False)["input_ids"]

        seqs, labels = [], []
        for r in rng.sample(rows, 32):
            prompt = ids(f"Q: {r['question']}\nA:")
            if rng.random() < look_fraction:
                parts = [(ids(" look<look>"), True), (ids(f" {r['answer']}\n"), False),
                         (ids(" ok") + [tok.eos_token_id], True)]
            else:
                parts = [(ids(f" guess {rng.randrange(10)}") + [tok.eos_token_id], True)]
            seqs.append(prompt + [t for p, _ in parts for t in p])
            labels.append([-100] * len(prompt) + [t if own else -100 for p, own in parts
                                                  for t in p])
        return seqs, labels

    return supervised_warm_start(src, out, steps, batch)


def tool_token_logprob(path, rows) -> float:
    """Mean logprob the model gives the tool's '\\n' after ' look<look> <digit>' (the tool's
    text: never a training target)."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(path)
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = []
    for r in rows:
        seq = tok(f"Q: {r['question']}\nA: look<look> {r['answer']}\n",
                  add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq])).logits[0, -2].float()
        out.append(torch.log_softmax(logits, -1)[seq[-1]].item())
    return sum(out) / len(out)


LOOK_RUN = dict(dtype="float32", task="jsonl", chat_template="off", max_turns=2, num_prompts=16,
                group_size=8, max_new_tokens=6, max_model_len=64, micro_batch_tokens=4096,
                lr=1e-3, steps=6, eval_every=3, eval_size=24, seed=0, save_every=0)


def learn_to_look(model, task_dir, log_dir, name: str) -> str:
    argv = ["--model", str(model), "--log-dir", str(log_dir), "--run-name", name,
            "--data-files", str(task_dir / "look.jsonl"), "--env", f"{task_dir / 'look.py'}:Look"]
    for k, v in LOOK_RUN.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return run_cpu(argv)


@pytest.fixture(scope="module")
def look(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("look")
    base, rows = look_task(tmp)
    return look_warm_start(base, tmp / "warm", rows), tmp, rows


def test_grpo_learns_to_call_the_tool_on_held_out_problems(look, tmp_path):
    """Greedy held-out accuracy (tools included) and the tool-call rate rise, and the tool's own
    tokens are not learned: the test fails if they are trained on, or if each episode's
    reward is given to another episode."""
    from helpers import metrics_rows

    model, tmp, rows = look
    learn_to_look(model, tmp, tmp_path, "look")
    out = metrics_rows(tmp_path / "look")
    acc = {r["step"]: r["eval/accuracy"] for r in out if "eval/accuracy" in r}
    calls = {r["step"]: r["eval/tool_call_frac"] for r in out if "eval/tool_call_frac" in r}
    print(acc, calls, [r.get("episode/tool_call_frac") for r in out])
    assert acc[0] < 0.3 and calls[0] < 0.2  # the warm start guesses
    assert acc[6] >= acc[0] + 0.5 and calls[6] >= 0.8, (acc, calls)
    steps = [r for r in out if "loss" in r]
    assert steps[-1]["episode/tool_call_frac"] > steps[0]["episode/tool_call_frac"] + 0.3
    assert all(r["determinism/tokens"] == r["episode/generated_tokens_mean"] * 128
               for r in steps)
    before = tool_token_logprob(model, rows[:50])
    after = tool_token_logprob(tmp_path / "look" / "final", rows[:50])
    print("tool token logprob", before, after)
    assert after < before + 1.0, (before, after)


def test_two_ranks_play_the_episodes_one_rank_plays(ckpt, tmp_path, env_file):
    """N = 2 on gloo: the same episodes (turns, tool calls, ends, tokens, rewards) as N = 1,
    and the same losses up to the order of fp32 sums."""
    from test_distributed import launch, metrics

    base = cpu_argv(ckpt(chat=True), tmp_path / "runs", num_prompts=3, steps=2, save_every=0,
                    env=f"{env_file}:Scripted", max_turns=3, max_model_len=256,
                    micro_batch_tokens=256)
    for n in (1, 2):
        launch(n, "main", *base, "--run-name", f"n{n}")
    one, two = metrics(tmp_path / "runs" / "n1"), metrics(tmp_path / "runs" / "n2")
    exact = [k for k in one[0] if k.startswith(("episode/", "reward", "determinism/tokens",
                                                "completion", "eval/"))]
    assert any(r["episode/turns_mean"] > 1 for r in one if "loss" in r)
    assert [[r.get(k) for k in exact] for r in two] == [[r.get(k) for k in exact] for r in one]
    for a, b in zip(one, two):
        if "loss" in a:
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)


def test_the_tool_warm_start_calls_the_calculator_as_the_episode_loop_renders_it():
    """examples/warm_start.py --tool: <calc> and </calc> are single tokens the env reads, and
    a tool answer's sequence is the prompt, the call, the tool's message as simple_rl appends
    it (not a target) and the answer: what an episode of `--env calc` holds."""
    import warm_start as ws

    tok = ws.make_tokenizer(512, 0, tool=True)
    assert len(tok.encode("</calc>", add_special_tokens=False)) == 1
    problem = rl.Problem("What is 47 * 83 - 5? End with 'Answer: <number>'.", "3896")
    parts = ws.answer_parts([problem], [False], tok, tool=True)
    ids, _, labels = ws.batch_of([problem], parts, tok, torch.device("cpu"))
    call = tok("<calc>47 * 83 - 5</calc>", add_special_tokens=False)["input_ids"]
    prompt = rl.format_prompts([problem], tok, rl.Config())[0]
    tool = rl.tool_message_ids(tok, ["3896"], rl.Config())[0]
    assert ids[0].tolist()[:len(prompt) + len(call) + len(tool)] == prompt + call + tool
    trained = [t for t in labels[0].tolist() if t != -100]
    assert tok.decode(trained) == "<calc>47 * 83 - 5</calc>Answer: 3896<|im_end|>"
    env = rl.CalcEnv()
    env.reset(problem)
    assert env.step(tok.decode(call, skip_special_tokens=True)) == ("3896", None)


class TracedLLM:
    """vLLM's LLM as the parity debugger reaches it, on CPU. Its model is modules under vLLM's
    names that return their inputs; generate runs an episode's turn by feeding them rows of a
    trace made beforehand (the trainer's, on the whole episode), as vLLM computes a turn: a
    prefill of what its prefix cache (blocks of 16 tokens) lacks, in chunks of 8 rows, then a
    row per decode step, then one row of junk past the end (async scheduling's extra step)."""

    class Echo(torch.nn.Module):
        def forward(self, *xs):
            return xs if len(xs) > 1 else xs[0]

    class Model(torch.nn.Module):
        def __init__(self, names):
            super().__init__()
            self.named = {theirs: TracedLLM.Echo() for _, theirs in names}

        def named_modules(self, *args, **kwargs):
            return iter(self.named.items())

    def __init__(self, names, trace, script, logprobs):
        self.ours = dict(names)
        self.model, self.trace = self.Model(names), trace
        self.script, self.logprobs = script, logprobs
        self.fed = 0  # positions whose KV the cache holds
        self.extra = 1  # decode steps past a turn's end (async scheduling: one)

    def apply_model(self, fn):
        return [fn(self.model)]

    def reset_prefix_cache(self):
        self.fed = 0

    def feed(self, rows: slice):
        for ours, theirs in self.ours.items():
            self.model.named[theirs](*[t[rows] for t in self.trace[ours]])

    def generate(self, prompts):
        from types import SimpleNamespace

        (prefix,) = prompts
        k = next(k for k in range(len(self.script))
                 if sum(len(c) + len(g) for c, g in self.script[:k + 1]) > len(prefix))
        ids = self.script[k][1]
        cached = min(self.fed // 16 * 16, len(prefix))
        for start in range(cached, len(prefix), 8):
            self.feed(slice(start, min(start + 8, len(prefix))))
        for row in range(len(prefix), len(prefix) + len(ids) - 1):
            self.feed(slice(row, row + 1))
        for _ in range(self.extra):  # the step past the end: no trainer row is its counterpart
            self.feed(slice(0, 1))
        self.fed = len(prefix) + len(ids) - 1
        return [SimpleNamespace(num_cached_tokens=cached, ids=ids, logprobs=self.logprobs[k])]


def test_the_debugger_follows_every_turn_of_an_episode_through_the_prefix_cache(ckpt):
    """debug_parity on a 4-turn episode (the last of one token): vLLM's rows of turns 2-4
    start where its prefix cache ends (32, 32, 48 cached tokens) and are laid against the
    trainer's rows at the same positions: nothing differs; a one-ulp change at one position is
    named, op and rows (turn 3 computed it, and turn 4 again: it was past the cached blocks);
    rows it cannot place are refused."""
    from test_model import trainer

    model = trainer(ckpt())
    g = torch.Generator().manual_seed(0)
    script = [(torch.randint(1, 300, (n,), generator=g).tolist(),
               torch.randint(1, 300, (m,), generator=g).tolist()) for n, m in ((21, 13), (5, 9),
                                                                                 (7, 6), (5, 1))]
    episode = rl.Episode(rl.RewardEnv(), [rl.Turn(c, rl.Completion(ids, [], True))
                                          for c, ids in script])
    names = rl.trace_names(model.args.n_layers)
    rollout = rl.episodes_rollout([episode], routes=False)
    packed = rl.pack(rollout.prompts, rollout.completions, rollout.generated)
    fed = rl.pack([episode.ids()[:-1]], [[]])
    with rl.recording(model, {n: n for n, _ in names}) as calls, torch.no_grad():
        model.hidden(fed)
        logp, _ = model(packed, 1.0)
    trace = rl.concat_calls({k: v[:1] for k, v in calls.items()})
    logprobs = logp.split([len(ids) for _, ids in script])
    llm = TracedLLM(names, trace, script, [lp.tolist() for lp in logprobs])

    class Engine:
        cfg = rl.Config(temperature=1.0)

        def __init__(self):
            self.llm = llm

        def generate(self, prompts, n, seeds, max_tokens, temperature):
            return [[rl.Completion(o.ids, o.logprobs, True)] for o in self.llm.generate(prompts)]

    def play_one():
        played = rl.Episode(rl.RewardEnv(), [])
        for context, _ in script:
            (out,), = Engine.generate(engine, [played.ids() + context], 1, [None], [99], 1.0)
            played.turns.append(rl.Turn(context, out))
        return played

    engine = Engine()
    rows, n_bad, turns = rl.debug_parity(engine, model, play_one)
    assert turns == [(33, 0), (15, 32), (28, 32), (18, 48)]  # turn 4: 1 token generated
    assert rl.first_divergence(rows) is None and n_bad == 0
    assert all(r["numel"] > 0 for r in rows) and len(rows) == len(names)

    def bump(module, inputs, output):  # position 59: turn 3's last fed row
        output = output.clone()
        output[59].view(torch.int32)[3] += 1
        return output

    handle = model.layers[1].feed_forward.act_fn.register_forward_hook(bump)
    try:
        rows, _, _ = rl.debug_parity(engine, model, play_one)
    finally:
        handle.remove()
    first = next(r for r in rows if r["n_diff"])
    assert first["op"] == "layers.1.feed_forward.act_fn"
    assert first["rows"] == [33 + 15 + 59 - 32, 33 + 15 + 28 + 59 - 48]
    llm.extra = 2  # rows the debugger cannot place: refused, not compared out of line
    with pytest.raises(rl.ConfigError, match=r"computed \[35, 17, 30, 20\] rows"):
        rl.debug_parity(engine, model, play_one)


def test_the_warm_starts_progress_is_one_format_with_an_eta_and_no_blank_lines(capfd):
    """examples/warm_start.py: training its tokenizer prints nothing (its progress bar printed
    three blank lines), and a line with an eval and one without share a format and an ETA."""
    import warm_start as ws

    capfd.readouterr()
    ws.make_tokenizer(512, 0)
    assert capfd.readouterr().out == ""
    assert ws.progress(5, 20, 1.23456, 1.5) == \
        "step 5/20 | loss 1.2346 | 2s (0.30 s/step) | ETA 4s"
    assert ws.progress(100, 500, 0.5, 250.0, acc=0.219) == \
        "step 100/500 | loss 0.5000 | held-out greedy accuracy 0.219 | 4m10s (2.50 s/step) | " \
        "ETA 16m40s"


def test_turn_seeds_worked_example_holds():
    """turn_seed's docstring: seed 0, G = 8, step 1, prompt 3, sample 2."""
    cfg = rl.Config(seed=0, group_size=8)
    assert rl.request_seed(cfg, 1, 3) == 80_080
    assert [rl.turn_seed(cfg, 1, 3, 2, k) for k in (0, 1)] == [80_082, 80_082 + 2**48]


@pytest.mark.parametrize("seed, group", [(0, 8), (123_456_789, 7), (4_000_000_000, 12)])
def test_no_two_samples_of_a_step_share_a_seed_and_turns_never_meet(seed, group):
    """request_seed's promise at any seed, G a power of two or not (a large seed makes its
    product pass 2^48): each request's seed is a multiple of G, no two alike, so its G seeds
    are its own; all stay below 2^48, so a later turn's (+ t 2^48) never meets a first turn's."""
    cfg = rl.Config(seed=seed, group_size=group)
    for step in (0, 5, 10**6):
        firsts = [rl.request_seed(cfg, step, i) for i in range(64)]
        assert all(f % group == 0 for f in firsts) and len(set(firsts)) == 64
    seeds = [rl.turn_seed(cfg, 5, i, g, 0) for i in range(64) for g in range(group)]
    assert len(set(seeds)) == len(seeds) and max(seeds) < 2**48 and min(seeds) >= 0


def test_only_a_problem_whose_env_rewrote_its_question_gets_a_prompt_of_its_own(monkeypatch):
    """new_episodes keeps the task's prompt ids where an env's first message is the problem's
    question, and renders one (first_prompt_ids) only where the env rewrote it: three problems
    of 2 episodes each, b's rewritten. Re-rendering the others would split special-token text in
    a question into plain tokens, for some problems and not others. The default env renders
    nothing."""
    calls = []

    def render(messages, tokenizer, cfg, samples):
        calls.append((list(messages), list(samples)))
        return [[1000 + ord(m[-1])] for m in messages]

    class Rewrites:
        def reset(self, problem):
            return "own " + problem.question if problem.question == "b" else problem.question

        def step(self, completion):
            return None, 0.0

    monkeypatch.setattr(rl, "first_prompt_ids", render)
    problems, task_ids = [rl.Problem(q, "1") for q in "abc"], [[11], [12], [13]]
    trainer = rl.Trainer(rl.Config(env="envs.py:Rewrites", tool_timeout=0), *[None] * 7,
                         make_env=Rewrites)
    envs, prompts = rl.new_episodes(trainer, problems, task_ids, 2)
    assert prompts == [[11], [1000 + ord("b")], [13]] and len(envs) == 6
    assert calls == [(["own b"], [2])]  # b's message, for its first episode: sample 2
    calls.clear()
    envs, prompts = rl.new_episodes(rl.Trainer(rl.Config(), *[None] * 7), problems, task_ids, 4)
    assert prompts == task_ids and len(envs) == 12 and not any(m for m, _ in calls)


def test_a_final_reward_of_zero_replaces_an_earlier_partial_reward():
    """The last reward an env gives is the episode's, 0 included: 0.5 on a tool turn, then 0."""
    episode = rl.Episode(None, [rl.Turn([1], rl.Completion([3], [-0.1], True))])
    assert rl.end_turn(episode, rl.Called(("go on", 0.5), None, 0.0), last=False) == "go on"
    assert episode.reward == 0.5
    assert rl.end_turn(episode, rl.Called((None, 0.0), None, 0.0), last=False) is None
    assert (episode.status, episode.reward, episode.tool_calls) == ("completed", 0.0, 1)


def test_an_episode_with_a_turn_the_engine_gave_no_experts_for_is_not_routed():
    """routes=True: an episode whose every turn has experts gets them concatenated; one whose
    later turn has none gets None (not compared), not an error."""
    def turn(context, ids, routed):
        return rl.Turn(context, rl.Completion(ids, [-0.5] * len(ids), True, routed))

    r = torch.arange(8, dtype=torch.int32).view(1, 4, 2)  # (1 token, 4 layers, k = 2)
    both = rl.Episode(None, [turn([1], [3], r), turn([9], [4], r + 8)], status="completed")
    half = rl.Episode(None, [turn([1], [3], r), turn([9], [4], None)], status="completed")
    ro = rl.episodes_rollout([both, half], routes=True)
    assert ro.routed[1] is None
    assert torch.equal(ro.routed[0], torch.cat([r, r + 8]))


def test_the_warm_starts_accuracy_is_the_share_of_problems_answered_right():
    """examples/warm_start.py's held-out accuracy (the number its log and warm_start.json
    report): right answers over problems, the problems decoded in groups of one prompt length.
    A stand-in model answers every prompt with the first problem's answer: asked that problem
    twice and two others, it scores 2 of 4, 0.5, however many groups the lengths make."""
    import warm_start as ws

    tok = ws.make_tokenizer(512, 0)
    p = rl.arithmetic_problems(3, 1)
    problems = [p[0], p[0], p[1], p[2]]
    assert len({p[0].answer, p[1].answer, p[2].answer}) == 3
    said = tok(f"Answer: {p[0].answer}", add_special_tokens=False)["input_ids"]

    class Model:
        def eval(self):
            return self

        def train(self):
            return self

        def generate(self, input_ids, **kw):
            tail = torch.tensor([said + [tok.eos_token_id]]).expand(len(input_ids), -1)
            return torch.cat([input_ids, tail], 1)

    assert ws.greedy_accuracy(Model(), tok, problems, torch.device("cpu")) == 0.5


def test_the_calculator_computes_the_turns_last_call_not_one_it_wrote_before():
    """A turn that writes a call, its result and then the call it stops at: the env computes
    the last <calc> tag's expression (the one the stop id ended), as LookupEnv searches the
    last <search> tag. Read from the first tag it would parse '1 + 1</calc> is 2 ... <calc>47
    * 83 - 5' and end the episode as a tool error, on a well-made call."""
    env = rl.CalcEnv()
    env.reset(rl.Problem("What is 47 * 83 - 5?", "3896"))
    assert env.step("First <calc>1 + 1</calc> is 2, then <calc>47 * 83 - 5</calc>") == (
        "3896", None)


def test_the_calculator_takes_integer_literals_only_not_true_or_false():
    """`True + 1` parses to constants that are ints to isinstance (bool is a subclass of int):
    the calculator, whose expressions are integers with + - * and parentheses, refuses it as
    a tool error, as it refuses '2 / 3', rather than answering 2."""
    env = rl.CalcEnv()
    env.reset(rl.Problem("What is 1 + 1?", "2"))
    for bad in ("<calc>True + 1</calc>", "<calc>False</calc>", "<calc>-True</calc>"):
        with pytest.raises(rl.ToolError, match="is not an integer expression"):
            env.step(bad)
    assert env.step("<calc>1 + 1</calc>") == ("2", None)


def test_every_way_an_episode_ends_has_its_fraction_and_they_sum_to_one():
    """episode_metrics logs episode/<end>_frac for each of EPISODE_ENDS, completed included:
    6 episodes, one per ending, each 1/6."""
    rows = [(1, 0, end, [3], 0, 0.0) for end in rl.EPISODE_ENDS]
    m = rl.episode_metrics(rows)
    fracs = {k: v for k, v in m.items() if k.endswith("_frac") and k != "episode/tool_call_frac"}
    assert fracs == {f"episode/{end}_frac": pytest.approx(1 / 6) for end in rl.EPISODE_ENDS}
