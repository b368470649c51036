"""Where a rollout's time goes, per decode step: GPU kernels by kind, GPU idle, host work.

For each number of samples per engine (--samples) and each engine (--designs), one process
builds the engine, generates bench_rl's workload (128-token random prompts x 8 samples,
--new-tokens each) once to warm up, once with the engine's host work clocked function by
function, and once under torch.profiler, and prints per decode step:

    wall       the rollout's wall time / its decode steps (the longest completion's length),
               in the timed pass (which also clocks the host: a few us a call)
    gpu        the kernels' time / decode steps, by kind (the profiled pass), and wall - gpu:
               the time the GPU waits for the host
    host       the time spent in each engine function per step (they nest: `engine step`
               holds the rest) and in Python's garbage collections

Engines:  a   simple_rl's (VLLMEngine, as the training loop runs it)
          a0  the same without simple_rl's cuBLASLt route for vLLM's linear layers (vLLM's
              Triton persistent matmul, as before)
          agc the same with Python's garbage collector left on during the rollout
          a512  the same with decode CUDA graphs up to 512 sequences, vLLM's default cap
                (simple_rl captures up to 1024)
          al  the same with vLLM's per-token logprob dicts (simple_rl asks for flat_logprobs)
          afull  the same with vLLM's full garbage collection when the engine goes to sleep
          d   vLLM's defaults (bench_rl's design d: torch.compile, CUDA graphs, default model
              runner, unseeded), in-process

    python benchmarks/profile_rollout.py --model CKPT --samples 64,256,1024 --designs a,d \\
        --out profile.json

--host-profile N adds a fourth pass under cProfile and prints the N Python functions with the
most time of their own per decode step (cProfile's overhead inflates them: compare shares), and
times simple_rl's engine going to sleep and waking up, with the functions its sleep spends on.

Every engine run also reports a sha256 of its token ids and logprobs: every design but d must
agree (the same samples, bit for bit), or the script says so and exits 1. d draws unseeded
noise, so its passes sample other tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# (label, module, class, method) of the engine's host work in one engine step
HOST = [
    ("engine step", "vllm.v1.engine.llm_engine", "LLMEngine", "step"),
    ("schedule", "vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    ("execute_model", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model"),
    ("sample_tokens", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens"),
    ("execute_model", "vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model"),
    ("sample_tokens", "vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "sample_tokens"),
    ("wait + copy out", "vllm.v1.worker.gpu_model_runner", "AsyncGPUModelRunnerOutput",
     "get_output"),
    ("wait + copy out", "vllm.v1.worker.gpu.async_utils", "AsyncOutput", "get_output"),
    ("update_from_output", "vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output"),
    ("process_outputs", "vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs"),
]
# kernel name fragment -> kind (first match wins)
KINDS = [
    ("reshape_and_cache", "kv write"), ("flash", "attention"),
    ("matmul_kernel_persistent", "gemm"), ("gemm", "gemm"), ("nvjet", "gemm"),
    ("xmma", "gemm"), ("cutlass", "gemm"),
    ("rms", "norm"), ("rotary", "rope"), ("silu", "act"), ("softmax", "sampler"),
    ("gumbel", "sampler"), ("temperature", "sampler"), ("ranks", "sampler"),
    ("exponential", "sampler"), ("argmax", "sampler"), ("sample", "sampler"),
    ("gather", "sampler"), ("topk", "sampler"), ("reduce", "sampler"), ("memcpy", "copy"),
    ("memset", "copy"), ("copy", "copy"),
]


def clock_host() -> dict[str, list[float]]:
    """Wrap each HOST function with a timer; returns label -> seconds per call (filled live)."""
    spent: dict[str, list[float]] = {}
    for label, module, cls, method in HOST:
        try:
            owner = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError):
            continue
        plain = getattr(owner, method)
        calls = spent.setdefault(label, [])

        def timed(*a, _plain=plain, _calls=calls, **k):
            t0 = time.perf_counter()
            try:
                return _plain(*a, **k)
            finally:
                _calls.append(time.perf_counter() - t0)

        setattr(owner, method, timed)
    return spent


def kind(name: str) -> str:
    low = name.lower()
    return next((k for frag, k in KINDS if frag in low), "other")


def gpu_time_by_kind(prof) -> dict[str, float]:
    """Seconds of kernel time by kind, over the profiled pass."""
    out: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) or 0
        if us > 0 and e.device_type.name == "CUDA":
            out[kind(e.key)] = out.get(kind(e.key), 0.0) + us / 1e6
    return out


def top_kernels(prof, n: int = 12) -> list[tuple[str, float, int]]:
    rows = [(e.key, (e.self_device_time_total or 0) / 1e6, e.count)
            for e in prof.key_averages() if e.device_type.name == "CUDA"]
    return sorted(rows, key=lambda r: -r[1])[:n]


def build_engine(design: str, model: str, samples: int, new_tokens: int, prompt_len: int):
    import bench_rl
    import simple_rl as rl

    ranks = rl.init_ranks("cuda")
    cfg = rl.Config(model=model, num_prompts=samples // 8, group_size=8,
                    max_new_tokens=new_tokens, max_model_len=prompt_len + new_tokens + 1)
    files = rl.load_model_files(cfg)
    if design == "a0":
        rl.route_vllm_linear_through_cublaslt = lambda: None
    if design == "agc":
        rl.gc_paused = contextlib.nullcontext
    if design == "a512":
        rl.CUDA_GRAPH_MAX_BATCH = 512
    if design == "al":
        list_logprobs(rl)
    if design == "afull":
        rl.young_collections_only = contextlib.nullcontext
    engine = (bench_rl.user_engine_class() if design == "d" else rl.VLLMEngine)(cfg, files, ranks)
    vocab = min(files.args.vocab_size, len(files.tokenizer))
    prompts = bench_rl.workload_prompts(cfg.num_prompts, prompt_len, vocab, 0)
    return engine, prompts


def list_logprobs(rl) -> None:
    """Design al: vLLM's default logprobs (a dict and a Logprob object per token)."""
    plain = rl.VLLMEngine.sampling_params

    def sampling_params(self, seed, **kw):
        params = plain(self, seed, **kw)
        params.flat_logprobs = False
        return params

    rl.VLLMEngine.sampling_params = sampling_params
    rl.completion_logprobs = lambda c: [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]


def top_functions(stats, steps: int, n: int) -> list[tuple[str, float, int]]:
    """(file:line(function), ms of its own time per decode step, calls per step), most first."""
    rows = [(f"{Path(f).name}:{line}({fn})", 1e3 * tt / steps, nc / steps)
            for (f, line, fn), (_, nc, tt, _, _) in stats.stats.items()]
    return sorted(rows, key=lambda r: -r[1])[:n]


def sleep_and_wake(engine, n: int) -> dict:
    """Seconds for simple_rl's engine to sleep (under cProfile) and to wake its weights and KV
    (as push_weights wakes it; no trainer holds memory here). {} for an engine that never
    sleeps (d)."""
    import cProfile
    import pstats

    import torch

    if not engine.cfg.engine_sleep:
        return {}
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(engine.sleep)
    t1 = time.perf_counter()
    engine.llm.wake_up(tags=["weights"])
    engine.llm.wake_up(tags=["kv_cache"])
    torch.cuda.synchronize()
    engine.asleep = False
    return dict(sleep_s=t1 - t0, wake_s=time.perf_counter() - t1,
                sleep_top=top_functions(pstats.Stats(prof), 1, n))


def worker(design: str, model: str, samples: int, new_tokens: int, prompt_len: int,
           host_profile: int = 0) -> dict:
    import torch

    engine, prompts = build_engine(design, model, samples, new_tokens, prompt_len)
    indices = list(range(len(prompts)))

    def rollout():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = engine.first_turn(prompts, indices, 0)
        torch.cuda.synchronize()
        return [c for cs in outs for c in cs], time.perf_counter() - t0  # one per sample

    samples, _ = rollout()  # warm-up
    spent = clock_host()
    collections = []  # seconds of each garbage collection during the timed pass
    started = [0.0]

    def clock_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections.append(time.perf_counter() - started[0])

    gc.callbacks.append(clock_gc)
    samples, wall = rollout()
    gc.callbacks.remove(clock_gc)
    completions = [c.ids for c in samples]
    generated = sum(map(len, completions))
    steps = max(map(len, completions))
    host = {k: sum(v) / steps for k, v in spent.items() if v}
    calls = {k: len(v) / steps for k, v in spent.items() if v}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        rollout()
    gpu = {k: v / steps for k, v in gpu_time_by_kind(prof).items()}
    extra = {}
    if host_profile:
        import cProfile
        import pstats

        cprof = cProfile.Profile()
        cprof.runcall(rollout)
        extra = dict(host_top=top_functions(pstats.Stats(cprof), steps, host_profile),
                     **sleep_and_wake(engine, host_profile))
    digest = hashlib.sha256()
    for c in completions:
        digest.update(torch.tensor(c, dtype=torch.int64).numpy().tobytes())
    logprobs = [x for c in samples for x in c.logprobs]  # fp32 values, as the trainer's tensor
    digest.update(torch.tensor(logprobs, dtype=torch.float32).numpy().tobytes())
    return dict(design=design, samples=samples, wall_s=wall, decode_steps=steps,
                generated=generated, tok_s=generated / wall, step_ms=1e3 * wall / steps,
                gpu_ms={k: 1e3 * v for k, v in gpu.items()},
                gpu_busy_ms=1e3 * sum(gpu.values()),
                host_ms={k: 1e3 * v for k, v in host.items()}, host_calls=calls,
                gc_ms=1e3 * sum(collections) / steps, gc_collections=len(collections),
                top_kernels=top_kernels(prof), bits=digest.hexdigest(), **extra)


def differing_samples(rows: list[dict]) -> list[int]:
    """The sample counts at which simple_rl's engine variants (all but d) drew different bits."""
    ours = [r for r in rows if r["design"] != "d"]
    return sorted({r["samples"] for r in ours for q in ours
                   if q["samples"] == r["samples"] and q["bits"] != r["bits"]})


def table(rows: list[dict]) -> str:
    kinds = sorted({k for r in rows for k in r["gpu_ms"]}, key=lambda k: -max(
        r["gpu_ms"].get(k, 0) for r in rows))
    labels = [h[0] for h in HOST if any(h[0] in r["host_ms"] for r in rows)]
    labels = list(dict.fromkeys(labels))
    head = ["ms per decode step", *(f"{r['design']} @ {r['samples']}" for r in rows)]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]

    def line(name, values):
        lines.append(" | ".join([name, *values]))

    line("wall", [f"{r['step_ms']:.2f}" for r in rows])
    line("GPU busy (kernels)", [f"{r['gpu_busy_ms']:.2f}" for r in rows])
    line("GPU idle (wall - busy)", [f"{r['step_ms'] - r['gpu_busy_ms']:.2f}" for r in rows])
    for k in kinds:
        line(f"  kernels: {k}", [f"{r['gpu_ms'].get(k, 0):.2f}" for r in rows])
    for k in labels:
        line(f"  host: {k}", [f"{r['host_ms'].get(k, 0):.2f}" for r in rows])
    line("  host: garbage collection", [f"{r['gc_ms']:.2f} ({r['gc_collections']})"
                                         for r in rows])
    line("generated tok/s", [f"{r['tok_s']:,.0f}" for r in rows])
    line("bits (sha256 of ids + logprobs)", [r["bits"][:12] for r in rows])
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--samples", default="64,256,1024")
    p.add_argument("--designs", default="a,d")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--out", default="profile_rollout.json")
    p.add_argument("--host-profile", type=int, default=0, metavar="N",
                   help="also profile the host with cProfile and print the top N functions")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        design, samples = a.worker.split("@")
        Path(a.out).write_text(json.dumps(worker(design, a.model, int(samples), a.new_tokens,
                                                 a.prompt_len, a.host_profile)))
        return
    rows = []
    for samples in map(int, a.samples.split(",")):
        for design in a.designs.split(","):
            out = Path(a.out).with_suffix(f".{design}{samples}.json")
            env = dict(os.environ, VLLM_BATCH_INVARIANT="0" if design == "d" else "1",
                       VLLM_ENABLE_V1_MULTIPROCESSING="0")
            subprocess.run([sys.executable, __file__, "--model", a.model, "--new-tokens",
                            str(a.new_tokens), "--prompt-len", str(a.prompt_len),
                            "--host-profile", str(a.host_profile), "--worker",
                            f"{design}@{samples}", "--out", str(out)], check=True, env=env)
            rows.append(json.loads(out.read_text()))
            print(table(rows[-1:]), flush=True)
    Path(a.out).write_text(json.dumps({"rows": rows}, indent=1))
    differ = differing_samples(rows)
    print(table(rows))
    for r in rows:
        print(f"\n{r['design']} @ {r['samples']}: top kernels (s over the rollout, calls)")
        for name, s, n in r["top_kernels"]:
            print(f"  {s:8.3f} {n:7d}  {name[:110]}")
        if "host_top" in r:
            print(f"{r['design']} @ {r['samples']}: host functions under cProfile (own ms per "
                  "decode step, calls per step)")
            for name, ms, n in r["host_top"]:
                print(f"  {ms:8.3f} {n:7.1f}  {name[:110]}")
        if "sleep_s" in r:
            print(f"{r['design']} @ {r['samples']}: sleep {r['sleep_s']:.3f} s, wake "
                  f"{r['wake_s']:.3f} s; the sleep's own time by function (ms, calls):")
            for name, sec, n in r["sleep_top"]:
                print(f"  {sec:8.3f} {n:7.0f}  {name[:110]}")
    if differ:
        print(f"simple_rl's engine variants sampled different bits at {differ} samples")
        sys.exit(1)


if __name__ == "__main__":
    main()
