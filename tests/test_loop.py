"""The training loop end to end on CPU: stand-in engine, reference kernels, TensorBoard tags."""

import math
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import simple_rl as rl
from helpers import cpu_trainer_of_run, first_turns, two_ranks

TAGS = ["loss", "pg_loss", "kl_div", "entropy", "reward_mean", "reward_std", "ratio_mean",
        "ratio_clipped_frac", "grad_norm", "determinism/mismatched_tokens", "determinism/tokens",
        "determinism/max_abs_diff", "completion_len_mean", "completion_stopped_frac",
        "time/rollout_s", "time/engine_sleep_s", "time/train_s", "time/push_s",
        "time/engine_wake_s", "time/step_s", "determinism/mismatched_tokens_total"]


def test_two_steps_log_every_tag_and_push_weights(ckpt, tmp_path):
    trainer = cpu_trainer_of_run(ckpt(), tmp_path, max_new_tokens=6, seed=1)
    run_dir = tmp_path / "runs" / trainer.cfg.run_name
    w0 = trainer.model.layers[0].attention.wqkv.weight.detach().clone()
    push = trainer.engine.push

    def waking_push(weights):  # an engine that says it spent 20 ms of its push waking
        push(weights)
        time.sleep(0.02)
        return 0.02

    trainer.engine.push = waking_push
    for step in range(2):
        m, parity = rl.rl_step(trainer, step)
        assert parity.n_tokens == m["determinism/tokens"] == 36
        assert 0 <= m["time/engine_sleep_s"] <= m["time/rollout_s"]  # timed within it
        assert m["time/engine_wake_s"] == 0.02 <= m["time/push_s"]  # and this within the push
        assert parity.max_abs_diff < 1e-4  # the CPU stand-in is close, not bitwise
        assert m["kl_div"] >= 0 and m["entropy"] > 0 and 0 <= m["ratio_clipped_frac"] <= 1
        cfg = trainer.cfg  # the logged loss is the objective's terms (both coefficients > 0)
        assert m["loss"] == pytest.approx(m["pg_loss"] + cfg.kl_coef * m["kl_div"]
                                          - cfg.entropy_coef * m["entropy"], rel=1e-5, abs=1e-7)
    assert trainer.engine.sleeps == 2  # the engine slept through each update
    w1 = trainer.model.layers[0].attention.wqkv.weight.detach()
    assert not torch.equal(w0, w1)  # the entropy bonus moves the weights
    assert torch.equal(trainer.engine.model.layers[0].attention.wqkv.weight, w1)  # pushed
    assert m["kl_div"] > 0  # after one update the policy has left the frozen reference
    trainer.writer.close()
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for t in TAGS:
        assert t in tags, t
        assert [e.step for e in acc.Scalars(t)] == [0, 1]
    per_layer = {t for t in tags if t.startswith("weight_delta/")}
    layers = ["layers.0", "layers.1", "norm", "tok_embeddings"]
    assert per_layer == {f"weight_delta/{n}/{k}" for n in layers
                         for k in ("magnitude", "relative_change")}  # per layer, not per tensor
    assert acc.Scalars("weight_delta/layers.0/magnitude")[0].value > 0


def test_the_held_out_accuracy_interval_and_length_of_stubbed_episodes(ckpt, tmp_path,
                                                                        monkeypatch):
    """evaluate over stubbed greedy episodes. One of the n held-out problems solved: accuracy
    p = 1/n, its 95% interval 100 (p +- 1.96 sqrt(p (1 - p) / n)) in percent. Every problem
    scoring 0.5 (a partial reward): mean(r^2) - mean(r)^2 = 0, so 50 +- 0, not the binomial
    50 +- 196 sqrt(0.25 / n); those episodes' turns generate 2 and 1 tokens with a tool
    message of 3 between them: eval/completion_len_mean 3 (not the last turn's 1, nor 3 + 3)."""
    trainer = cpu_trainer_of_run(ckpt(), tmp_path)
    n = len(trainer.task.eval_problems)

    def evaluate(turns, rewards):
        def greedy(trainer, mine):
            episodes = [rl.Episode(None, turns()) for _ in mine]
            for e, r in zip(episodes, rewards(len(mine))):
                e.reward = r
            return episodes

        monkeypatch.setattr(rl, "greedy_episodes", greedy)
        return rl.evaluate(trainer, 0)

    m = evaluate(lambda: [rl.Turn([1], rl.Completion([2], [0.0], True))],
                 lambda k: [1.0] + [0.0] * (k - 1))
    p = 1 / n
    half = 1.96 * math.sqrt(p * (1 - p) / n)
    assert m["eval/accuracy"] == pytest.approx(p)
    assert m["eval/accuracy_low_pct"] == pytest.approx(100 * (p - half))
    assert m["eval/accuracy_high_pct"] == pytest.approx(100 * (p + half))
    m = evaluate(lambda: [rl.Turn([1], rl.Completion([2, 3], [0.0, 0.0], False)),
                          rl.Turn([7, 7, 7], rl.Completion([4], [0.0], True))],
                 lambda k: [0.5] * k)
    assert m["eval/accuracy_pct"] == pytest.approx(50.0)
    assert m["eval/accuracy_low_pct"] == pytest.approx(50.0)
    assert m["eval/accuracy_high_pct"] == pytest.approx(50.0)
    assert m["eval/completion_len_mean"] == 3.0


def test_weight_deltas_from_the_optimizer_equal_the_true_change(ckpt, tmp_path, monkeypatch):
    """||W_new - W_old|| reconstructed from AdamW's state equals the measured one, summed over
    chunks of a parameter (1000 values here, a partial last one)."""
    monkeypatch.setattr(rl, "DELTA_CHUNK", 1000)
    trainer = cpu_trainer_of_run(ckpt(), tmp_path, weight_decay=0.1)
    named = dict(trainer.model.named_parameters())
    before = {n: p.detach().clone() for n, p in named.items()}
    rl.rl_step(trainer, 0)
    rl.rl_step(trainer, 1)
    before = {n: p.detach().clone() for n, p in named.items()}
    m, _ = rl.rl_step(trainer, 2)
    got = rl.weight_deltas(trainer.optimizer, named, per_param=True)
    for name, p in named.items():
        true = (p.detach() - before[name]).norm().item()
        want = got[f"weight_delta/{name}/magnitude"]
        assert abs(want - true) <= 1e-4 * max(true, 1e-6) + 1e-7, name
    layer = sum((named[n].detach() - before[n]).square().sum() for n in named
                if n.startswith("layers.1.")).sqrt().item()
    assert abs(m["weight_delta/layers.1/magnitude"] - layer) <= 1e-4 * layer


def test_the_optimizer_is_adamw_on_the_trainable_weights_at_the_configs_settings():
    """--lr, --beta1, --beta2 and --weight-decay reach a decoupled AdamW, which holds the
    trainable weights only (a LoRA base stays out)."""
    model = torch.nn.Linear(2, 2)
    model.bias.requires_grad_(False)  # frozen, as a LoRA base is
    cfg = rl.Config(lr=1e-3, beta1=0.8, beta2=0.95, weight_decay=0.1)
    optimizer = rl.make_optimizer(model, cfg)
    assert type(optimizer) is torch.optim.AdamW
    (group,) = optimizer.param_groups
    assert [id(p) for p in group["params"]] == [id(model.weight)]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-3, (0.8, 0.95), 0.1)


def test_update_logprobs_equal_a_fresh_forward(ckpt, tmp_path):
    """The logprobs handed to the parity check are exactly the first pass's forward."""
    trainer = cpu_trainer_of_run(ckpt(), tmp_path, updates_per_batch=2)
    ro = first_turns(trainer.engine, [[5, 6, 7], [8, 9]], [0, 1], 0)
    p = rl.pack(ro.prompts, ro.completions)
    with torch.no_grad():
        want, _ = trainer.model(p, trainer.cfg.temperature)
    adv = torch.linspace(-1, 1, len(ro.completions))
    got = rl.update(trainer.model, trainer.ref_model, trainer.optimizer, p, ro.logprobs, adv,
                    trainer.cfg)
    torch.testing.assert_close(got.logprobs, want, atol=1e-6, rtol=0)
    assert got.grad_norm > 0


def test_micro_batching_and_padding_micro_batches_do_not_change_the_gradient(ckpt, tmp_path):
    grads = []
    for mbt, n_micro in ((32, 3), (4096, 1), (4096, 3)):  # 3 real; 1 real; 1 real + 2 padding
        trainer = cpu_trainer_of_run(ckpt(), tmp_path / f"{mbt}_{n_micro}",
                                     micro_batch_tokens=mbt, max_model_len=32)
        ro = first_turns(trainer.engine, [[5, 6, 7, 8, 9, 10, 11, 12]] * 2, [0, 1], 0)
        p = rl.pack(ro.prompts, ro.completions)
        assert len(rl.plan_micro_batches(p, trainer.cfg)) == (1 if mbt == 4096 else 3)
        trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.0)
        trainer.optimizer.zero_grad = lambda set_to_none=True: None  # keep the grads to compare
        rl.update(trainer.model, trainer.ref_model, trainer.optimizer, p, ro.logprobs,
                  torch.linspace(-1, 1, 6), trainer.cfg, n_micro=n_micro)
        grads.append(torch.cat([q.grad.flatten() for q in trainer.model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)
    assert torch.equal(grads[1], grads[2])  # zero-weight micro-batches add exactly nothing


def test_parity_report_flags_nan():
    nan = torch.tensor([float("nan")])
    rep = rl.parity_report(torch.tensor([-1.0]), nan, torch.tensor([3]), [1], 1)
    assert rep.n_mismatch == 1


def test_a_sleeping_engine_gets_the_allocators_cache_back_only_when_it_needs_it(monkeypatch):
    """push_weights on a sleeping engine: the trainer's cached blocks are released before the
    wake-up exactly when the free memory is less than what the engine maps again; each wake-up
    (vLLM 0.34's runs gc.collect()) sees young collections only, and gc.collect is restored.
    Under LoRA always (kept, they would sit beside the whole KV cache through the rollout), and
    the weights are never woken: the adapter is checked in its slot, the KV cache mapped."""
    import gc

    events, plain = [], gc.collect

    class LLM:
        def wake_up(self, tags):
            events.append(("wake", *tags, gc.collect is not plain))

        def apply_model(self, fn):
            events.append("load")

        def reset_prefix_cache(self):
            events.append("reset")

    class Engine:
        llm, wake_bytes, adapter_ptrs = LLM(), 30 * 2**30, set()

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    monkeypatch.setattr(rl, "map_kv_cache", lambda awake: events.append(("map_kv", awake)))
    full = [("wake", "weights", True), "load", ("wake", "kv_cache", True), "reset"]
    for lora, free_gib, want in ((None, 10, ["empty_cache", *full]), (None, 40, full),
                                 (object(), 40, ["empty_cache", ("map_kv", True), "reset"])):
        events.clear()
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (free_gib * 2**30, 141 * 2**30))
        engine = Engine()
        engine.asleep, engine.lora = True, lora
        rl.push_weights(engine, iter([]))
        assert events == want, lora
        assert not engine.asleep and gc.collect is plain


def three_seqs() -> rl.Packed:
    """3 sequences of 5 tokens (prompts of 3, 4, 2), 6 generated tokens in all."""
    return rl.pack([[1] * 3, [2] * 4, [3] * 2], [[4] * 2, [5], [6] * 3])


def test_a_rank_pads_to_exactly_n_micro_micro_batches():
    """One real micro-batch, n_micro 1..3: 0, 1 and 2 uncounted copies of sequence 0."""
    p = three_seqs()
    cfg = rl.Config(micro_batch_tokens=16)
    assert rl.micro_batch_parts(p, cfg, None, "cpu")[0].seqs == range(0, 3)
    for n_micro in (1, 2, 3):
        parts = rl.micro_batch_parts(p, cfg, n_micro, "cpu")
        assert [m.real for m in parts] == [True] + [False] * (n_micro - 1)
        assert [m.seqs for m in parts[1:]] == [range(0, 1)] * (n_micro - 1)


def test_every_rank_runs_the_most_micro_batches_and_divides_by_all_tokens(monkeypatch):
    """batch_over_ranks beside a second rank (helpers.two_ranks): the larger micro-batch count
    (MAX) and the generated tokens of both (SUM)."""
    p = three_seqs()
    cfg = rl.Config(micro_batch_tokens=10)  # 2 micro-batches here
    two_ranks(monkeypatch, [3], [7])
    assert rl.batch_over_ranks(p, cfg, "cpu") == (3, 13)
    two_ranks(monkeypatch, [1], [7])
    assert rl.batch_over_ranks(p, cfg, "cpu") == (2, 13)


def test_a_padding_micro_batch_runs_the_kl_reference_too(ckpt):
    """With --kl-coef > 0 every micro-batch, a padding one included, runs the reference's
    forward: the reference is sharded as the policy is (build_models), so its forward is FSDP
    collectives that every rank must reach as many times as the others (a rank that skipped it
    on its padding micro-batches would hang the ranks that did not pad). 1 real micro-batch and
    2 padding ones: 3 reference forwards, the first over the real batch's 6 targets."""
    from helpers import cpu_trainer

    model = cpu_trainer(ckpt())
    calls = []

    def reference(batch, temperature):
        calls.append(len(batch.targets))
        return model(batch, temperature)

    p = three_seqs()
    cfg = rl.Config(micro_batch_tokens=16, kl_coef=0.5)
    parts = rl.micro_batch_parts(p, cfg, 3, "cpu")
    old = torch.zeros(len(p.targets))
    got = rl.accumulate_gradients(model, reference, parts, old, torch.ones(3), cfg, 1.0)
    assert calls == [6, 2, 2]  # the real batch's 6 targets, then sequence 0's 2, twice
    assert got.sums[1] == pytest.approx(0, abs=1e-6)  # the reference is the policy: k3 KL 0
