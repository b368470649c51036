"""Episodes of several turns on CPU: the episode loop over the stand-in engine (turns, tool
messages appended as ids, masks, seeds, parity over every turn), the calculator env, and the
bad input of --env."""

import pytest
import torch

import simple_rl as rl
from helpers import TorchEngine, cpu_argv, main_cpu, run_cpu

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


def make_trainer(path, tmp_path, **overrides):
    cfg, given = rl.parse_config(cpu_argv(path, tmp_path / "runs", **overrides))
    rl.validate(cfg)
    trainer, _, _, _ = rl.setup(cfg, given, TorchEngine, "cpu")
    return trainer


def test_episodes_of_one_to_three_turns_append_tool_ids_and_train_on_the_models_tokens(
        ckpt, tmp_path, env_file, monkeypatch):
    seen = Recorder(monkeypatch)
    trainer = make_trainer(ckpt(chat=True), tmp_path, env=f"{env_file}:Scripted", max_turns=3,
                           num_prompts=4, group_size=4, max_new_tokens=6, eval_size=0, seed=5,
                           max_model_len=256, micro_batch_tokens=256)
    cfg, tok, engine = trainer.cfg, trainer.tokenizer, trainer.engine
    m, parity = rl.rl_step(trainer, 0)
    ro = seen.rollouts[-1]
    eps = ro.episodes
    turns = [len(e.turns) for e in eps]
    assert sorted(set(turns)) == [1, 2, 3], turns  # mixed lengths, within groups too
    assert any(len(set(turns[j:j + 4])) > 1 for j in range(0, 16, 4))
    for e in eps:
        assert len(e.turns) == 1 + e.env.calls and e.tool_calls == e.env.calls
        assert e.status in ("completed", "length")
    # one generate per turn over every live episode: G samples per prompt, then one each
    calls = engine.calls
    assert [c[1] for c in calls] == [4, 1, 1] and len(calls[0][0]) == 4
    mine = rl.my_prompts(cfg.num_prompts, trainer.ranks)
    assert calls[0][2] == [rl.sample_seed(cfg, 0, i) for i in mine]  # today's first turn
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
    assert len(seeds) == len(set(seeds)) == 16 + sum(t - 1 for t in turns)
    # the packed episode: the targets are exactly the model's tokens of every turn
    packed = rl.pack(ro.prompts, ro.completions, ro.model)
    generated = [t for e in eps for turn in e.turns for t in turn.out.ids]
    assert packed.targets.tolist() == generated == [
        t for c, mask in zip(ro.completions, ro.model) for t, own in zip(c, mask) if own]
    assert len(ro.logprobs) == len(generated) == parity.n_tokens == m["determinism/tokens"]
    assert sum(not own for mask in ro.model for own in mask) == m["episode/tool_tokens_mean"] * 16
    assert packed.tokens.tolist() == [t for e in eps for t in e.ids()]
    assert parity.max_abs_diff < 1e-4  # the stand-in's logprobs of every turn, as the trainer's
    assert m["episode/turns_mean"] == sum(turns) / 16
    assert m["episode/tool_calls_mean"] == sum(t - 1 for t in turns) / 16
    assert m["episode/tool_call_frac"] == sum(t > 1 for t in turns) / 16
    assert m["completion_len_mean"] == len(generated) / 16
    rewards = torch.tensor([e.reward for e in eps])
    assert m["reward_mean"] == pytest.approx(rewards.mean().item())
    trainer.writer.close()


def test_a_model_that_never_stops_calling_ends_at_max_turns_and_tool_messages_past_the_context(
        ckpt, tmp_path, env_file, monkeypatch):
    seen = Recorder(monkeypatch)
    trainer = make_trainer(ckpt(), tmp_path, env=f"{env_file}:Forever", max_turns=3,
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
    assert m["episode/context_frac"] > 0
    assert all(len(e.ids()) <= trainer.cfg.max_model_len for e in seen.rollouts[-1].episodes)
    trainer.writer.close()


def test_one_turn_episodes_pack_exactly_as_the_engines_rollout(ckpt, tmp_path, monkeypatch):
    """Without --env a step trains on exactly what the engine's rollout samples, as before
    episodes: the same samples, logprobs, stops and Packed."""
    seen = Recorder(monkeypatch)
    trainer = make_trainer(ckpt(), tmp_path, eval_size=0)
    cfg = trainer.cfg
    chosen = rl.step_problems(len(trainer.task.problems), cfg.num_prompts, 0, cfg.seed)
    want = trainer.engine.rollout([trainer.task.prompt_ids[i] for i in chosen], [0, 1], 0)
    m, _ = rl.rl_step(trainer, 0)
    ro = seen.rollouts[-1]
    assert ro.prompts == want.prompts and ro.completions == want.completions
    assert torch.equal(ro.logprobs, want.logprobs) and ro.stopped == want.stopped
    a, b = rl.pack(ro.prompts, ro.completions, ro.model), rl.pack(want.prompts, want.completions)
    for f in ("tokens", "positions", "cu_seqlens", "gen_index", "targets", "sample"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert not any(k.startswith("episode/") for k in m)  # single-turn logs as before
    trainer.writer.close()


# The weights sha256 of the run below, recorded before the episode loop existed (the rollout
# was then one engine call per step): a single-turn run still trains to exactly these bits.
BEFORE_EPISODES = {False: "878086fda92ef108ebc2e9d2ae1cf37cc05c42775026c194d27328fa66f0ff50",
                   True: "f9348fcb8dbeb945576785d77f632e195d2b3479d0e96efcd5693689ca4a5eed"}


@pytest.mark.parametrize("chat", [False, True])
def test_a_single_turn_run_gives_the_weights_it_gave_before_episodes(ckpt, tmp_path, chat):
    """Recorded with one thread, on x86 (more threads sum the CPU's matmuls in other orders)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        digest = run_cpu(cpu_argv(ckpt(chat=chat), tmp_path / "runs", steps=3, save_every=0,
                                  eval_every=2, run_name="r"))
    finally:
        torch.set_num_threads(threads)
    assert digest == BEFORE_EPISODES[chat]


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
    assert f"step 1: the env ({path}:{name}) {says}" in err, err
    turn = "turn 2" if name == "LateFailure" else "turn 1"
    assert f"of training problem " in err and f", {turn}, completion " in err
    assert "Last good checkpoint: " in err and "step_000001" in err
    assert (tmp_path / "runs" / "r" / "checkpoints" / "step_000001").is_dir()


@pytest.mark.parametrize("spec,says", [
    ("{dir}/missing.py:Env", "--env: {dir}/missing.py is not a file."),
    ("{dir}/bad.py:Nothing", "--env: {dir}/bad.py has no class 'Nothing'."),
    ("{dir}/bad.py:NoStep", "--env {dir}/bad.py:NoStep: its env has no method step(completion)."),
    ("{dir}/bad.py:TwoArgs", "--env {dir}/bad.py:TwoArgs: step(completion, answer) must take "
                             "(completion)."),
    ("calc.py", "--env 'calc.py' must be calc or name a Python file and a class in it"),
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
