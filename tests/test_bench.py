"""The benchmark harness on CPU: FLOPs by hand (dense and MoE), small runs of designs a and c,
and of a and d on a tiny Qwen3-MoE (stand-in engine), the MoE layer bench's CPU path and table."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_rl  # noqa: E402
import plot_run  # noqa: E402
import simple_rl as rl  # noqa: E402
from helpers import TorchEngine, cpu_argv, main_cpu, metrics_rows, run_cpu  # noqa: E402


def test_flops_by_hand():
    args = SimpleNamespace(
        dim=4, head_dim=2, n_heads=2, n_kv_heads=1, hidden_dim=8, n_layers=3, vocab_size=10
    )
    per_layer = 4 * (2 + 2) * 2 + 2 * 2 * 4 + 3 * 4 * 8  # qkv 32, o 16, mlp 96 -> 144
    want = 6 * 3 * per_layer * (5 + 7) + 6 * 10 * 4 * 6 + 6 * 3 * 2 * 2 * (25 + 49)
    assert bench_rl.flops_per_step(args, [5, 7], 6) == want


def test_moe_flops_count_the_router_and_the_k_experts_a_token_runs():
    moe = SimpleNamespace(top_k=2, num_experts=8)
    args = SimpleNamespace(dim=4, head_dim=2, n_heads=2, n_kv_heads=1, hidden_dim=8, n_layers=3,
                           vocab_size=10, sparse_layers=(0, 2), moe_inter_dim=3, moe_args=moe)
    per_token = 3 * 32 + 3 * 16 + 3 * 4 * 8 + 2 * (2 * 3 * 4 * 3 + 4 * 8)  # attn, 1 dense, 2 sparse
    want = 6 * per_token * (5 + 7) + 6 * 10 * 4 * 6 + 6 * 3 * 2 * 2 * (25 + 49)
    assert bench_rl.flops_per_step(args, [5, 7], 6) == want


def test_qwen3_1p7b_flops_per_token_is_about_6n():
    args = SimpleNamespace(
        dim=2048,
        head_dim=128,
        n_heads=16,
        n_kv_heads=8,
        hidden_dim=6144,
        n_layers=28,
        vocab_size=151936,
    )
    f = bench_rl.flops_per_step(args, [1], 1)  # one token: attention negligible
    assert abs(f / 6 - 1.72e9) / 1.72e9 < 0.02  # 1.72B parameters (tied head counted once)


def test_qwen35_flops_by_hand():
    """A Qwen3.5 of 4 layers (3 Gated DeltaNet, 1 gated full attention): attention's quadratic
    term over its one full layer, the q projection twice as wide (the gate), the linear layers'
    projections and their rule's 18 Hv Dk Dv a token."""
    c = SimpleNamespace(layer_types=("linear_attention",) * 3 + ("full_attention",), k_heads=1,
                        v_heads=2, k_dim=3, v_dim=5)
    args = SimpleNamespace(dim=4, head_dim=2, n_heads=2, n_kv_heads=1, hidden_dim=8, n_layers=4,
                           vocab_size=10, qwen35=c)
    full = 4 * (2 * 2 + 2) * 2 + 2 * 2 * 4  # q and gate, k, v 48; o 16
    linear = 4 * (2 * 1 * 3 + 3 * 2 * 5 + 2 * 2)  # q k v z and b a in, out: 160
    per_token = full + 3 * linear + 4 * 3 * 4 * 8  # + 4 MLPs
    rule = 18 * 3 * 2 * 3 * 5  # 3 layers, 2 v heads
    want = 6 * per_token * 12 + rule * 12 + 6 * 10 * 4 * 6 + 6 * 1 * 2 * 2 * (25 + 49)
    assert bench_rl.flops_per_step(args, [5, 7], 6) == want


def test_qwen35_4b_flops_per_token_are_about_6n():
    """Qwen3.5-4B's exact shape: one token's training FLOPs are 6x its parameters (the tied
    head counted once; the norms, conv taps and gates' few parameters aside) plus the rule's."""
    from test_qwen35_memory import qwen35_args

    args = qwen35_args("qwen3.5-4b")
    rule = 18 * 24 * 32 * 128 * 128  # 24 Gated DeltaNet layers
    f = bench_rl.flops_per_step(args, [1], 1) - rule
    assert abs(f / 6 / rl.count_params(args) - 1) < 0.01


def test_plain_attention_matches_reference():
    import batch_invariant_backward as bib

    q, k, v = torch.randn(20, 4, 16), torch.randn(20, 2, 16), torch.randn(20, 2, 16)
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    got = bench_rl.plain_kernels().attention(q, k, v, cu, 12, 0.25)
    torch.testing.assert_close(
        got, bib.ref_attention(q, k, v, cu, 12, 0.25)[0], atol=1e-5, rtol=1e-5
    )


def test_harness_runs_designs_a_and_c_on_cpu(ckpt, tmp_path, monkeypatch):
    kw = dict(
        steps=1,
        warmup=1,
        prompts_n=2,
        group=2,
        prompt_len=6,
        new_tokens=4,
        micro_batch_tokens=64,
        engine_factory=TorchEngine,
        device_type="cpu",
    )
    packed = rl.micro_batches
    steps_run = []  # the benchmark times simple_rl's own step, not a copy of it
    real_step = rl.rl_step
    monkeypatch.setattr(rl, "rl_step", lambda t, s: steps_run.append(s) or real_step(t, s))
    results = [
        bench_rl.measure(d, str(ckpt()), **kw, profile_to=tmp_path / f"{d}.txt") for d in "ac"
    ]
    profile = (tmp_path / "a.txt").read_text()
    assert profile.startswith("== rollout (4 samples, 4 decode steps): wall ")
    assert "== update (1 micro-batches): wall " in profile
    assert "aten::mm" in profile.split("== update")[1]  # the profile names the costly ops
    assert rl.micro_batches is packed  # design c's per-sample patch is undone
    assert steps_run == [0, 1, 0, 1]  # warm-up and measured step of a, then of c
    for r in results:
        assert r["generated_tokens"] == 2 * 2 * 4 and r["trained_tokens"] == 4 * (6 + 4)
        assert r["samples"] == 4 and r["samples_s"] > 0 and r["nproc"] == 1
        assert r["fwd_bwd_s"] > 0 and r["rollout_tok_s"] > 0 and r["mfu"] > 0
        assert len(r["steps"]) == 2
    table = bench_rl.table(results)
    assert "bitwise" in table and "seed" in table and "trainer MFU (a)" in table
    # (a) with LoRA: simple_rl's own path (the base frozen, the adapters trained), 4 FLOPs a
    # parameter and token for the base's GEMMs (no weight gradient) where full training has 6
    lora = bench_rl.measure("a", str(ckpt()), **kw, lora_rank=8)
    assert lora["name"] == "bitwise+lora8" and lora["trained_tokens"] == 4 * (6 + 4)
    assert 0.6 < lora["flops"] / results[0]["flops"] < 0.75


def test_table_reports_ratios_against_the_users_stack():
    row = dict(
        nproc=1,
        step_s=2.0,
        rollout_s=1.0,
        fwd_bwd_s=0.9,
        optimizer_s=0.01,
        push_s=0.03,
        samples_s=10.0,
        rollout_tok_s=1.0,
        trainer_tok_s=1.0,
        mfu=0.4,
        peak_gib=1.0,
        mismatched=0,
    )
    timings = ("step_s", "rollout_s", "fwd_bwd_s")
    steps = [dict(warmup=True, **dict.fromkeys(timings, 9.0))] + [
        dict(warmup=False, step_s=t, rollout_s=t / 2, fwd_bwd_s=t / 4) for t in (2.0, 2.4)
    ]
    results = [
        dict(row, design="a", name="bitwise", steps=steps),
        dict(row, design="d", name="user", step_s=4.0, rollout_s=2.0, fwd_bwd_s=1.8),
        dict(row, design="a", name="bitwise", nproc=2, samples_s=19.0, all_gather_gb_s=300.0),
    ]
    text = bench_rl.table(results)
    assert "step 0.50x, rollout 0.50x, trainer 0.50x" in text
    assert "(a) on 2 GPUs: 1.90x the samples/s of 1 GPU; all-gather 300 GB/s" in text
    # the warm-up step's 9 s is not part of the spread
    assert "bitwise per measured step, min-max s: step_s 2.00-2.40, rollout_s 1.00-1.20, " \
        "fwd_bwd_s 0.50-0.60" in text
    moe = [dict(results[0], experts="vllm + moe_experts_backward", optimizer_s=0.1),
           dict(results[1], experts="transformers grouped_mm")]
    assert "MoE (a): update 1.00x the rollout (target <= 1.0x; step <= 0.6x (d)'s); experts: " \
        "bitwise vllm + moe_experts_backward, user transformers grouped_mm" in bench_rl.table(moe)


@pytest.fixture(scope="module")
def resumed_run(ckpt, tmp_path_factory):
    """A one-step tiny CPU run (held-out evals before and after its step) resumed for a second
    step: a run directory with two event files, as a resumed run has."""
    runs = tmp_path_factory.mktemp("resumed") / "runs"
    run_cpu(cpu_argv(ckpt(), runs, steps=1, save_every=1, run_name="r"))
    assert main_cpu(["--resume", str(runs / "r" / "checkpoints" / "step_000001"),
                     "--steps", "2"]) == 0
    return runs / "r"


# logged on CUDA only, and for Qwen3-MoE only: a CPU run of a dense model has none of them
NOT_ON_CPU = ["memory/in_use_gib", "memory/peak_allocated_gib", "determinism/routing_mismatch",
              "determinism/routing_tokens"]


def test_every_dashboard_chart_draws_exactly_one_logged_tag(resumed_run):
    """TensorBoard matches a Multiline chart's tag as a regex at the start of each logged tag
    (`re.match`), and a Margin chart's three tags as `(value)|(lower)|(upper)`, escaped: each
    chart must pick out exactly its own tags of a real run (unanchored,
    `determinism/mismatched_tokens` drew `..._total` too)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(resumed_run), size_guidance={"scalars": 0})
    acc.Reload()
    logged = acc.Tags()["scalars"] + NOT_ON_CPU
    layout = rl.tensorboard_layout(routes=True)
    for title, (kind, tags) in [c for group in layout.values() for c in group.items()]:
        if kind == "Margin":
            pattern = "|".join(f"({re.escape(t)})" for t in tags)
            assert sorted(t for t in logged if re.match(pattern, t)) == sorted(tags), title
        else:
            assert len(tags) == 1, title  # one series: TensorBoard shows no legend
            assert len([t for t in logged if re.match(tags[0], t)]) == 1, title
    drawn = [plot_run.series(kind, tags, logged) for kind, tags in layout["simple_rl"].values()]
    assert drawn == [["reward_mean"], ["eval/accuracy_pct", "eval/accuracy_low_pct",
                     "eval/accuracy_high_pct"], ["loss"], ["kl_div"], ["entropy"],
                     ["determinism/mismatched_tokens_total"], ["time/step_s"],
                     ["determinism/routing_mismatch"]]


def tensorboard_view(kind: str, values: list[float], lower=(), upper=()):
    """What TensorBoard 2.x draws by default (smoothing 0.6, outliers ignored): the line's
    values (a Multiline chart's debiased moving average; a Margin chart is never smoothed) and
    the y range, the 5th to 95th percentile of every value drawn (line, lower, upper)."""
    line = list(values)
    if kind == "Multiline" and len(set(values)) > 1:
        ema = 0.0
        for i, v in enumerate(values):
            ema = 0.6 * ema + 0.4 * v
            line[i] = ema / (1 - 0.6 ** (i + 1))
    drawn = torch.tensor([*line, *lower, *upper], dtype=torch.float64)
    return line, torch.quantile(drawn, 0.05).item(), torch.quantile(drawn, 0.95).item()


def test_held_out_chart_shows_every_eval_at_its_value_in_tensorboards_defaults():
    """The README run's held-out accuracy (512 problems, greedy, before steps 0, 25, ..., 100
    and after 120): on the dashboard's chart every point is drawn at its value and in view.
    As a smoothed Multiline chart it spanned 0.48-0.64 and hid 0.246 and 0.684."""
    acc = [0.24609375, 0.65625, 0.6484375, 0.662109375, 0.64453125, 0.68359375]
    kind, tags = rl.tensorboard_layout()["simple_rl"]["held-out accuracy (greedy, %, 95% interval)"]
    half = [1.96 * (p * (1 - p) / 512) ** 0.5 for p in acc]  # evaluate's interval, 0/1 rewards
    pct = [100 * p for p in acc]
    line, low, high = tensorboard_view(kind, pct, [100 * (p - h) for p, h in zip(acc, half)],
                                       [100 * (p + h) for p, h in zip(acc, half)])
    assert line == pytest.approx(pct) and low <= min(pct) and high >= max(pct)
    assert tags[0] == "eval/accuracy_pct"


def test_plot_run_draws_the_dashboards_charts_at_readme_width(resumed_run, tmp_path):
    """plot_run.py on a tiny CPU run that was resumed (two event files): one panel per chart of
    the dashboard's first group with data, axes labelled, the held-out accuracy in percent, 800
    pixels wide; with --charts, only those."""
    from matplotlib.image import imread

    rows = metrics_rows(resumed_run)
    out = tmp_path / "curves.png"
    fig = plot_run.plot(plot_run.read_scalars(str(resumed_run)), str(out))
    panels = [ax for ax in fig.axes if ax.get_visible()]
    titles = [title for title, _, _ in plot_run.charts()]
    assert [ax.get_title().replace("\n", " ") for ax in panels] == titles[:7]  # no MoE routing
    assert all(ax.get_xlabel() == "step" and ax.get_ylabel() for ax in panels)
    reward, held_out = panels[0].lines[0], panels[1].lines[0]
    assert list(reward.get_xdata()) == [r["step"] for r in rows if "reward_mean" in r] == [0, 1]
    assert list(reward.get_ydata()) == pytest.approx([r["reward_mean"] for r in rows
                                                      if "reward_mean" in r], abs=1e-6)
    evals = {r["step"]: 100 * r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    steps = list(held_out.get_xdata())
    assert steps[0] == 0 and steps[-1] == 2  # the first eval and the one after the last step
    assert list(held_out.get_ydata()) == pytest.approx([evals[s] for s in steps])
    assert panels[1].get_ylabel() == "accuracy (%)"
    assert imread(out).shape[:2] == (plot_run.DPI * 2.6 * 3, 800)
    fig = plot_run.plot(plot_run.read_scalars(str(resumed_run)), str(out), only=["reward",
                                                                               "held-out"])
    assert len([ax for ax in fig.axes if ax.get_visible()]) == 2
    assert imread(out).shape[:2] == (260, 800)


def test_user_stack_picks_the_rows_that_fit_beside_its_awake_engine():
    """Design (d) at Qwen3-1.7B's shape on an H200 (143,771 MiB), 32 x 8 samples of 128 + N
    tokens: 21 full rows (8085 tokens) at N = 256, where its 8192-token micro-batch peaked at
    93-105 GiB; 2 rows at N = 2048, where the 3 rows that 8192 tokens hold ran out of memory
    (the engine's KV cache, awake through the update, grows from 11 to 60 GiB)."""
    from transformers import Qwen3Config

    hf = Qwen3Config(vocab_size=151936, hidden_size=2048, num_hidden_layers=28,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                     intermediate_size=6144, tie_word_embeddings=True)
    args, h200, gib = rl.model_args_from_hf(hf), 143771 * 2**20, 2**30

    def cfg(new_tokens):
        return rl.Config(num_prompts=32, group_size=8, max_new_tokens=new_tokens,
                         max_model_len=128 + new_tokens + 1)

    short, long = cfg(256), cfg(2048)
    assert bench_rl.user_micro_batch(short, args, h200) == 21 * 385
    assert 93 <= bench_rl.user_peak(short, args, 8192) / gib <= 107  # as measured
    assert bench_rl.user_micro_batch(long, args, h200) == 2 * 2177
    assert bench_rl.user_peak(long, args, 3 * 2177) > h200  # the out-of-memory run
    assert bench_rl.user_micro_batch(long, args, float("inf")) == 3 * 2177  # at most 8192
    assert bench_rl.user_micro_batch(cfg(4096), args, h200) == 4225  # nothing fits: one row


def test_plain_trainer_takes_at_most_8192_tokens_or_one_row():
    import simple_rl as rl

    def cfg(mbt, seq):
        return rl.Config(micro_batch_tokens=mbt, max_model_len=seq)

    assert bench_rl.plain_micro_batch(cfg(24576, 2177)) == 8192  # ran out of memory at 24576
    assert bench_rl.plain_micro_batch(cfg(4096, 385)) == 4096
    assert bench_rl.plain_micro_batch(cfg(16384, 12000)) == 12000


def test_rounds_pool_into_medians_over_every_measured_step():
    """Two rounds of one design: one row over all 4 measured steps (warm-ups left out), each
    timing their median, so one slow step of a noisy host does not move it."""

    def step(warmup, t, mismatched=0):
        return dict(warmup=warmup, rollout_s=t, fwd_bwd_s=t / 2, optimizer_s=0.01, push_s=0.1,
                    step_s=t * 1.5, sleep_s=t / 10, generated_tokens=100, trained_tokens=200,
                    samples=4,
                    flops=1e12, peak_gib=t, mismatched=mismatched)

    rounds = [
        bench_rl.summarize([step(True, 50.0), step(False, 2.0), step(False, 9.0, 1)], "a", 1,
                           "fa3-varlen"),
        bench_rl.summarize([step(True, 50.0), step(False, 3.0), step(False, 2.5)], "a", 1,
                           "fa3-varlen"),
    ]
    assert rounds[0]["rollout_s"] == 5.5  # two steps: the median is their mean
    row = bench_rl.pool(rounds)
    assert len(row["steps"]) == 6 and row["mismatched"] == 1
    assert row["rollout_s"] == 2.75 and row["fwd_bwd_s"] == 1.375  # median of 2, 2.5, 3, 9
    assert row["step_s"] == 2.75 * 1.5 and row["samples_s"] == 4 / (2.75 * 1.5)
    assert row["sleep_s"] == 0.275
    assert row["mfu"] == 1e12 / 1.375 / bench_rl.PEAK_FLOPS
    assert row["peak_gib"] == 50.0  # the warm-up's peak counts: memory is not noise


def test_rounds_run_the_designs_in_turn_and_profile_once(tmp_path, monkeypatch, capsys):
    """--designs ad --rounds 2: workers a, d, a, d, each writing its own file; --profile only in
    the first round; the table's rows pool both rounds."""
    calls = []

    def worker(cmd, check, env):
        design, out = cmd[cmd.index("--worker") + 1], Path(cmd[cmd.index("--out") + 1])
        calls.append((design, out.name, "--profile" in cmd, env["VLLM_BATCH_INVARIANT"]))
        t = float(len(calls))  # later workers are slower: a drifting machine
        steps = [dict(warmup=w, rollout_s=t, fwd_bwd_s=t, optimizer_s=0.0, push_s=0.0, step_s=t,
                      sleep_s=0.0, generated_tokens=10, trained_tokens=20, samples=2, flops=1e9,
                      peak_gib=1.0, mismatched=0) for w in (True, False)]
        out.write_text(json.dumps(bench_rl.summarize(steps, design, 1, "x")))
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(bench_rl.subprocess, "run", worker)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the workers are stand-ins
    out = tmp_path / "b.json"
    monkeypatch.setattr(sys, "argv", ["bench_rl.py", "--model", "M", "--designs", "ad",
                                      "--rounds", "2", "--profile", "--out", str(out)])
    bench_rl.main()
    assert calls == [("a", "b.a1.json", True, "1"), ("d", "b.d1.json", True, "0"),
                     ("a", "b.a1.r1.json", False, "1"), ("d", "b.d1.r1.json", False, "0")]
    saved = json.loads(out.read_text())
    assert saved["workload"]["rounds"] == 2
    a, d = saved["results"]
    assert len(a["steps"]) == 4 and a["rollout_s"] == 2.0  # median of rounds 1 and 3
    assert d["rollout_s"] == 3.0  # rounds 2 and 4: each design saw the drift alike
    assert "step 0.67x" in capsys.readouterr().out


def test_a_failed_design_leaves_the_others_reported(tmp_path, monkeypatch, capsys):
    """--designs ad where (d)'s worker dies (out of memory, say): (a)'s row is still saved and
    printed, and the run exits naming (d)."""
    def worker(cmd, check, env):
        design, out = cmd[cmd.index("--worker") + 1], Path(cmd[cmd.index("--out") + 1])
        if design == "d":
            return SimpleNamespace(returncode=1)
        steps = [dict(warmup=w, rollout_s=1.0, fwd_bwd_s=1.0, optimizer_s=0.0, push_s=0.0,
                      step_s=2.0, sleep_s=0.0, generated_tokens=10, trained_tokens=20,
                      samples=2, flops=1e9, peak_gib=1.0, mismatched=0) for w in (True, False)]
        out.write_text(json.dumps(bench_rl.summarize(steps, design, 1, "x")))
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(bench_rl.subprocess, "run", worker)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the workers are stand-ins
    out = tmp_path / "b.json"
    monkeypatch.setattr(sys, "argv", ["bench_rl.py", "--model", "M", "--designs", "ad", "--out",
                                      str(out)])
    with pytest.raises(SystemExit, match=r"\(d\) exited 1"):
        bench_rl.main()
    assert [r["design"] for r in json.loads(out.read_text())["results"]] == ["a"]
    assert "\nbitwise " in capsys.readouterr().out


def test_trainer_bench_finds_the_gpus_idle_gaps_and_packs_the_workload():
    """Kernels at 0-10, 12-30 (inside it 15-20), 100-110, 200-205 us: the 2 us gap is launch
    latency, the 70 us and 90 us gaps are idle time, each named by the kernels around it."""
    from torch.autograd import DeviceType

    import bench_trainer

    def kernel(name, start, end):
        return SimpleNamespace(name=name, device_type=DeviceType.CUDA,
                               time_range=SimpleNamespace(start=start, end=end))

    cpu = SimpleNamespace(name="aten::mm", device_type=DeviceType.CPU,
                          time_range=SimpleNamespace(start=0, end=500))
    events = [kernel("gemm", 0, 10), kernel("norm", 12, 30), kernel("inner", 15, 20),
              kernel("attn", 100, 110), kernel("gemm", 200, 205), cpu]
    text = bench_trainer.idle_gaps(SimpleNamespace(events=lambda: events))
    assert text.startswith("GPU idle 0.2 ms of 0.2 ms in gaps > 20 us")
    lines = text.splitlines()[1:]
    assert lines[0].split() == ["0.1", "attn", "->", "gemm"]  # 90 us
    assert lines[1].split() == ["0.1", "norm", "->", "attn"]  # 70 us: after norm, not inner
    assert len(lines) == 2
    packed = bench_trainer.synthetic_batch(4, 3, 5, 50, seed=0)
    assert packed.cu_seqlens.tolist() == [0, 8, 16, 24, 32] and len(packed.targets) == 20


class _Clocked:
    def step(self, x):
        return x + 1


def test_rollout_profile_sorts_kernels_clocks_host_calls_and_tables_per_step(monkeypatch):
    import profile_rollout as pr

    kinds = {"void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90":
             "attention", "nvjet_sm90_tst_64x64_64x13_2x1_v_bz_TNT": "gemm",
             "matmul_kernel_persistent": "gemm", "_topk_log_softmax_kernel": "sampler",
             "_gumbel_sample_kernel": "sampler", "_temperature_kernel": "sampler",
             "_ranks_kernel": "sampler", "vllm::fused_add_rms_norm_kernel": "norm",
             "memcpy32_post": "copy", "vllm::rotary_embedding_kernel": "rope",
             "vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>": "kv write",
             "some_new_kernel": "other"}
    assert {name: pr.kind(name) for name in kinds} == kinds

    monkeypatch.setattr(pr, "HOST", [("step", __name__, "_Clocked", "step"),
                                     ("absent", "no_such_module_here", "X", "y")])
    monkeypatch.setattr(_Clocked, "step", _Clocked.step)  # undone after the test
    spent = pr.clock_host()
    assert _Clocked().step(1) == 2 and _Clocked().step(5) == 6  # still the function it wraps
    assert list(spent) == ["step"] and len(spent["step"]) == 2 and min(spent["step"]) >= 0

    row = dict(design="a", samples=256, step_ms=8.5, gpu_busy_ms=6.7, tok_s=30000.0,
               gpu_ms={"gemm": 1.7, "attention": 2.7}, host_ms={"step": 8.2},
               gc_ms=0.1, gc_collections=1, bits="c" * 64)
    lines = pr.table([row, dict(row, design="d", step_ms=12.0)]).splitlines()
    assert lines[0] == "ms per decode step | a @ 256 | d @ 256"
    assert "GPU idle (wall - busy) | 1.80 | 5.30" in lines
    assert lines.index("  kernels: attention | 2.70 | 2.70") < lines.index(
        "  kernels: gemm | 1.70 | 1.70")  # the largest kind first
    assert "  host: step | 8.20 | 8.20" in lines  # the clocked functions, in HOST order
    assert "  host: garbage collection | 0.10 (1) | 0.10 (1)" in lines
    same = [dict(row, design=d, samples=n) for d in ("a", "a0", "agc") for n in (64, 256)]
    assert pr.differing_samples(same + [dict(row, design="d", bits="e" * 64)]) == []
    assert pr.differing_samples(same + [dict(row, design="a0", samples=256, bits="f" * 64)]) == [
        256]
    stats = SimpleNamespace(stats={  # cProfile's: (file, line, function) -> (cc, nc, tt, ct, _)
        ("/site/vllm/v1/core/sched/scheduler.py", 425, "schedule"): (256, 256, 0.3, 2.0, {}),
        ("~", 0, "<built-in method builtins.len>"): (9, 2560, 0.5, 0.5, {})})
    assert pr.top_functions(stats, steps=256, n=2) == [  # own ms and calls per decode step
        ("~:0(<built-in method builtins.len>)", 1e3 * 0.5 / 256, 10.0),
        ("scheduler.py:425(schedule)", 1e3 * 0.3 / 256, 1.0)]


def test_floor_of_each_phase_by_hand():
    # 2 layers, dim 4, 2 q heads and 1 kv head of 2, FFN 8, vocab 10, tied
    args = SimpleNamespace(dim=4, head_dim=2, n_heads=2, n_kv_heads=1, hidden_dim=8, n_layers=2,
                           vocab_size=10, enable_weight_tying=True)
    params = 2 * (4 * 8 + 4 * 4 + 3 * 4 * 8 + 8 + 4) + 10 * 4 + 4  # blocks, embedding, norm
    assert rl.count_params(args) == params
    bw, peak = bench_rl.HBM_BYTES_S, bench_rl.PEAK_FLOPS
    f = bench_rl.floors(args, samples=6, prompt_len=3, new_tokens=2, update_flops=1e12, world=2)
    gemm = max(2 * params / bw, 2 * params * 3 / peak)  # 3 samples a rank
    kv = 3 * (3 + 4) * (2 * 2 * 1 * 2 * 2) / bw  # contexts of 3 and 4 tokens, 16 bytes a token
    logits = 2 * bench_rl.LOGIT_PASSES * 3 * 10 * 4 / bw
    assert f["rollout_s"] == pytest.approx(2 * gemm + kv + logits, rel=1e-12)
    assert f["fwd_bwd_s"] == pytest.approx(1e12 / (2 * peak))
    assert f["push_s"] == pytest.approx(6 * params / bw)
    assert f["step_s"] == pytest.approx(f["rollout_s"] + f["fwd_bwd_s"] + f["push_s"])
    assert bench_rl.floors(SimpleNamespace(sparse_layers=(0,)), 6, 3, 2, 1e12) is None


def a3b_args(layers: int):
    """simple_rl's args for Qwen/Qwen3-30B-A3B's config.json with `layers` of its 48."""
    from transformers import Qwen3MoeConfig

    return rl.model_args_from_hf(Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False))


def test_moe_flops_of_qwen3_30b_a3b_count_its_3b_active_parameters_not_its_30b():
    """Qwen3-30B-A3B (48 layers, 128 experts, top-8): one token's training FLOPs are 6x its
    3.3B activated parameters less the embedding (a lookup, no GEMM); counting every expert, as
    count_params does for memory, would make the MFU 10x too high."""
    args = a3b_args(layers=48)
    attn = 2048 * (32 + 2 * 4) * 128 + 32 * 128 * 2048  # qkv, o: 18,874,368
    moe = 8 * 3 * 2048 * 768 + 2048 * 128  # 8 experts' gate/up/down + router: 38,010,880
    head = 151936 * 2048
    want = 6 * (48 * (attn + moe) + head) + 6 * 48 * 32 * 128 * 1  # + attention over L = 1
    assert bench_rl.flops_per_step(args, [1], 1) == want
    assert abs((48 * (attn + moe) + 2 * head) / 3.3e9 - 1) < 0.02  # the 3.3B activated
    assert rl.count_params(args) > 30e9


def test_user_stack_rule_fits_qwen3_30b_a3b_layers_as_measured():
    """Design (d) on Qwen3-30B-A3B's 4 layers on an H200: its memory rule picks the full
    8192-token cap (31 rows of 257 at 16 x 8, 128 new tokens; 21 of 385 at 32 x 8, 256), and
    its peak at 8085 tokens is within 15% of the 88.9 GiB it measured there (results/h200_moe)."""
    args, h200, gib = a3b_args(layers=4), 143771 * 2**20, 2**30

    def cfg(prompts, new_tokens):
        return rl.Config(num_prompts=prompts, group_size=8, max_new_tokens=new_tokens,
                         max_model_len=128 + new_tokens + 1)

    assert bench_rl.user_micro_batch(cfg(16, 128), args, h200) == 31 * 257
    assert bench_rl.user_micro_batch(cfg(32, 256), args, h200) == 21 * 385
    assert abs(bench_rl.user_peak(cfg(32, 256), args, 21 * 385) / gib / 88.9 - 1) < 0.15


def test_harness_runs_the_moe_row_on_cpu(tmp_path):
    """Designs a and d on a tiny Qwen3-MoE (stand-in engine): (d) trains transformers'
    Qwen3MoeForCausalLM; each row names the experts its trainer ran and its memory rule's
    estimate, and the table gives the issue's MoE targets."""
    from helpers import make_moe_checkpoint
    from test_moe_model import TINY_MOE

    ckpt = make_moe_checkpoint(tmp_path / "moe", **TINY_MOE)
    kw = dict(steps=1, warmup=1, prompts_n=2, group=2, prompt_len=6, new_tokens=4,
              micro_batch_tokens=64, engine_factory=TorchEngine, device_type="cpu")
    a, d = (bench_rl.measure(design, str(ckpt), **kw) for design in "ad")
    args = rl.model_args_from_hf(rl.read_qwen3_config(ckpt))
    assert a["experts"] == "reference" and d["experts"].startswith("transformers ")
    for r in (a, d):
        assert r["trained_tokens"] == 4 * (6 + 4) and r["fwd_bwd_s"] > 0 and r["mfu"] > 0
        assert r["flops"] == bench_rl.flops_per_step(args, [10] * 4, r["generated_tokens"])
    cfg = rl.Config(model=str(ckpt), num_prompts=2, group_size=2, max_new_tokens=4,
                    max_model_len=11, micro_batch_tokens=64, dtype="float32")
    assert a["estimate_gib"] == rl.memory_estimate(cfg, args, 1, (6, 6))["peak"] / 2**30
    assert d["estimate_gib"] == bench_rl.user_peak(cfg, args, 64) / 2**30
    user = bench_rl.HFTrainer(ckpt, cfg, torch.device("cpu")).model
    assert type(user).__name__ == "Qwen3MoeForCausalLM" and not user.config.output_router_logits
    text = bench_rl.table([a, d])
    assert "MoE (a): update " in text and "experts: bitwise reference, user transformers " in text


def test_harness_runs_a_qwen35_row_on_cpu(tmp_path):
    """Designs a and d on a tiny Qwen3.5 (stand-in engine): (d) trains transformers'
    Qwen3_5ForCausalLM; both count the Gated DeltaNet layers' FLOPs."""
    from helpers import make_qwen35_checkpoint

    ckpt = make_qwen35_checkpoint(tmp_path / "q35")
    kw = dict(steps=1, warmup=1, prompts_n=2, group=2, prompt_len=6, new_tokens=4,
              micro_batch_tokens=64, engine_factory=TorchEngine, device_type="cpu")
    a, d = (bench_rl.measure(design, str(ckpt), **kw) for design in "ad")
    args = rl.model_args_from_hf(rl.read_qwen3_config(ckpt))
    for r in (a, d):
        assert r["trained_tokens"] == 4 * (6 + 4) and r["fwd_bwd_s"] > 0 and r["mfu"] > 0
        assert r["flops"] == bench_rl.flops_per_step(args, [10] * 4, r["generated_tokens"])
    cfg = rl.Config(model=str(ckpt), num_prompts=2, group_size=2, max_new_tokens=4,
                    max_model_len=11, micro_batch_tokens=64, dtype="float32")
    user = bench_rl.HFTrainer(ckpt, cfg, torch.device("cpu")).model
    assert type(user).__name__ == "Qwen3_5ForCausalLM"
    assert a["floor"]["rollout_s"] > 0 and d["floor"] == a["floor"]


TINY_LAYER = ["--device", "cpu", "--dim", "64", "--experts", "8", "--top-k", "2",
              "--moe-inter", "32", "--repeats", "2"]


def test_moe_layer_bench_times_simple_rls_layer_with_each_experts_backward(tmp_path,
                                                                          monkeypatch):
    """--backward both on CPU at a tiny shape: simple_rl.MoE's own forward each call; the loop
    rows run moe_experts_backward, the grouped rows whatever TRITON_BACKWARDS names (here a
    stand-in whose w2 gradient is twice the loop's: its difference from the loop is 1.0 of the
    loop's largest), 1 warm-up + 2 repeats a row, each repeat's gradients bit-equal."""
    import batch_invariant_backward as bib
    import bench_moe_layer

    calls = {"forward": 0, "loop": 0, "grouped": 0}
    loop, forward = bib.moe_experts_backward, rl.MoE.forward

    def counted_loop(*a):
        calls["loop"] += 1
        return loop(*a)

    def grouped_stand_in(*a):
        calls["grouped"] += 1
        dx, dw13, dw2, dw = loop(*a)
        return dx, dw13, 2 * dw2, dw

    def counted_forward(self, x):
        calls["forward"] += 1
        return forward(self, x)

    monkeypatch.setattr(bib, "moe_experts_backward", counted_loop)
    monkeypatch.setitem(bib.TRITON_BACKWARDS, "moe_experts", grouped_stand_in)
    monkeypatch.setattr(rl.MoE, "forward", counted_forward)
    out = tmp_path / "moe.json"
    rows = bench_moe_layer.main(TINY_LAYER + ["--tokens", "16", "48", "--out", str(out)])
    assert calls == {"forward": 12, "loop": 6, "grouped": 6}  # 2 kinds x 2 sizes x 3 calls
    assert [(r["backward"], r["function"], r["tokens"]) for r in rows] == [
        ("loop", "counted_loop", 16), ("loop", "counted_loop", 48),
        ("grouped", "grouped_stand_in", 16), ("grouped", "grouped_stand_in", 48)]
    assert all(r["repeatable"] and r["fwd_ms"] > 0 for r in rows)
    assert all(r["bwd_over_fwd"] == r["bwd_ms"] / r["fwd_ms"] for r in rows)
    assert "diff_vs_loop" not in rows[0] and [r["diff_vs_loop"] for r in rows[2:]] == [1.0, 1.0]
    saved = json.loads(out.read_text())
    assert saved["shape"] == dict(dim=64, experts=8, top_k=2, moe_inter=32)
    assert saved["rows"] == rows and saved["device"] == "cpu"


def test_moe_layer_bench_records_a_failing_row_and_runs_the_rest(tmp_path, monkeypatch, capsys):
    """A grouped backward that fails at one token count (an assert, out of memory): that row
    holds the error, every other row is timed and saved, and the run exits naming it."""
    import batch_invariant_backward as bib
    import bench_moe_layer

    def fails_at_48(x, *a):
        assert x.shape[0] != 48, "no tile for 48 rows"
        return bib.moe_experts_backward(x, *a)

    monkeypatch.setitem(bib.TRITON_BACKWARDS, "moe_experts", fails_at_48)
    out = tmp_path / "moe.json"
    with pytest.raises(SystemExit, match="failed: grouped at 48; the other rows are in"):
        bench_moe_layer.main(TINY_LAYER + ["--tokens", "16", "48", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert ["error" in r for r in rows] == [False, False, False, True]
    assert rows[3]["error"].startswith("AssertionError: no tile for 48 rows")
    assert rows[2]["diff_vs_loop"] == 0.0 and rows[2]["repeatable"]
    assert "grouped (fails_at_48)" in capsys.readouterr().out.splitlines()[-2]


def test_moe_layer_bench_table_and_target():
    import bench_moe_layer

    row = dict(backward="grouped", function="grouped_moe_backward", tokens=8192, fwd_ms=2.7,
               bwd_ms=6.75, bwd_over_fwd=2.5, saved_gib=1.234, peak_gib=5.0, repeatable=True,
               diff_vs_loop=3.2e-3)
    assert bench_moe_layer.table_row(row).split() == [
        "grouped", "(grouped_moe_backward)", "8192", "2.70", "6.75", "2.5", "1.23", "5.00", "yes",
        "3.2e-03"]
    loop = dict(row, backward="loop", bwd_over_fwd=19.0, repeatable=False)
    del loop["diff_vs_loop"]
    assert bench_moe_layer.table_row(loop).split()[-2:] == ["NO", "-"]
    assert bench_moe_layer.summary([loop, row, dict(row, tokens=1024, bwd_over_fwd=9.0)]) == (
        "backward / forward at 8192 tokens: loop 19.0x, grouped 2.5x (target <= 3x)")
    assert bench_moe_layer.HEADER.split()[:3] == ["backward", "tokens", "fwd"]


def test_plot_run_reads_older_runs_and_says_what_it_left_out(tmp_path, capsys):
    """The committed event files of runs logged before today's tags: the held-out accuracy as
    a fraction (`eval/accuracy`) without its interval (drawn from --eval-size), no run total
    of mismatched tokens, no step time (the sum of its phases), KL at 0."""
    run = ROOT / "results" / "learning_h200" / "runs" / "n2"
    out = tmp_path / "not" / "yet" / "curves.png"  # its folder is made
    scalars = plot_run.read_scalars(str(run), eval_size=512)
    fig = plot_run.plot(scalars, str(out))
    panels = [ax for ax in fig.axes if ax.get_visible()]
    titles = [title for title, _, _ in plot_run.charts()]
    assert [ax.get_title().replace("\n", " ") for ax in panels] == [titles[i] for i in
                                                                    (0, 1, 2, 4, 5, 6)]
    band = panels[1].collections[0].get_paths()[0].vertices[:, 1]  # the 95% interval's edge
    half = 196 * (0.24609375 * (1 - 0.24609375) / 512) ** 0.5
    assert band.min() == pytest.approx(24.609375 - half)
    step_s = [v for _, v in scalars["time/step_s"]]
    phases = [scalars[f"time/{phase}_s"][0][1] for phase in ("rollout", "train", "push")]
    assert len(step_s) == 120 and step_s[0] == pytest.approx(sum(phases))
    assert out.exists()
    held_out = panels[1].lines[0]
    assert list(held_out.get_xdata()) == [0, 25, 50, 75, 100, 120]
    assert list(held_out.get_ydata()) == pytest.approx([24.609375, 66.40625, 63.0859375,
                                                        67.96875, 64.84375, 66.9921875])
    mismatched = panels[4].lines[0]  # the running sum of the per-step counts
    assert list(mismatched.get_xdata()) == list(range(120))
    assert list(mismatched.get_ydata()) == [0.0] * 120
    assert capsys.readouterr().err == ("plot_run: left out KL to the initial policy: every "
                                       "value is 0 (--kl-coef 0)\n")
    logged = plot_run.plot(plot_run.read_scalars(str(run)), str(out))
    assert not logged.axes[1].collections  # without --eval-size: no band, as it was logged
    capsys.readouterr()
    old = ROOT / "results" / "h200_reorder_check" / "runs" / "a"
    fig = plot_run.plot(plot_run.read_scalars(str(old)), str(out), only=["reward", "held-out"])
    assert len([ax for ax in fig.axes if ax.get_visible()]) == 2
    with pytest.raises(SystemExit, match="no chart is called 'bogus'; --charts takes the first "
                       "words of: reward, held-out, loss, KL, entropy, mismatched, step, tokens"):
        plot_run.plot(plot_run.read_scalars(str(old)), str(out), only=["bogus"])
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="cannot make the folder .*/file for --out: File exists"):
        plot_run.plot(plot_run.read_scalars(str(old)), str(tmp_path / "file" / "x.png"))


def test_bench_rl_without_a_gpu_says_so_in_one_sentence(ckpt, tmp_path):
    """On a machine without CUDA the harness stops before launching a design (whose vLLM
    would end in 'Torch not compiled with CUDA enabled')."""

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_rl.py"), "--model",
                          str(ckpt()), "--designs", "a", "--steps", "1", "--out",
                          str(tmp_path / "b.json")], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == ("bench_rl: no CUDA GPU found; it measures simple_rl on GPUs (its "
                          "designs' CPU test: python -m pytest tests/test_bench.py).\n")
    assert not (tmp_path / "b.json").exists()


def test_gdn_bench_times_the_rules_forward_and_backward(tmp_path):
    """benchmarks/bench_gdn.py on CPU at a tiny shape (fp32-bwd only: the reference forms under
    GatedDeltaRuleFn): a row per batch size, timed, its gradients taken, saved."""
    import bench_gdn

    out = tmp_path / "gdn.json"
    rows = bench_gdn.main(["--device", "cpu", "--samples", "1", "3", "--prompt", "5",
                           "--completion", "4", "--k-heads", "2", "--v-heads", "4", "--dim", "8",
                           "--repeats", "2", "--out", str(out)])
    assert [(r["samples"], r["tokens"], r["design"]) for r in rows] == [
        (1, 9, "fp32-bwd"), (3, 27, "fp32-bwd")]
    assert all(r["forward_ms"] > 0 and r["backward_ms"] > 0 and r["grad_rel"] is None
               for r in rows)
    assert json.loads(out.read_text())["rows"] == rows


def test_a_rows_rates_and_mfu_divide_the_right_counts_over_every_gpu():
    """summarize's rates as the table reports them: generated tokens over the rollout's
    seconds, trained tokens over the update's, samples over the step's; MFU the update's FLOPs
    over its seconds and `world` GPUs' peak (two ranks at one FLOP/s are half one's MFU)."""
    step = dict(warmup=False, rollout_s=2.0, fwd_bwd_s=4.0, optimizer_s=0.5, push_s=0.25,
                step_s=8.0, sleep_s=0.1, generated_tokens=100, trained_tokens=300, samples=16,
                flops=2e15, peak_gib=1.0, mismatched=0)
    r = bench_rl.summarize([step], "a", 2, "x")
    assert (r["rollout_tok_s"], r["trainer_tok_s"], r["samples_s"]) == (50, 75, 2)
    assert r["mfu"] == 2e15 / 4.0 / (2 * bench_rl.PEAK_FLOPS)


def test_gdn_bench_times_the_forward_and_the_backward_each_as_its_own(monkeypatch):
    """bench_gdn.timed on a clock that makes each forward take 1 s and each backward 3 s: the
    forward is 1000 ms and the backward 3000, not the other way round (the warm-up uncounted)."""
    import bench_gdn

    ticks = iter(range(0, 1000, 4))
    times = iter(t + d for t in ticks for d in (0, 1, 4))  # t0, t1 = t0 + 1, t2 = t0 + 4
    monkeypatch.setattr(bench_gdn, "clock", lambda device: next(times))
    x = [torch.ones(3, requires_grad=True)]
    r = bench_gdn.timed(lambda x: x[0] * 2, x, torch.ones(3), repeats=2, device="cpu")
    assert (r["forward_ms"], r["backward_ms"]) == (1000.0, 3000.0)
