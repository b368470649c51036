"""Qwen3.5 on vLLM, what can be checked without a GPU: the engine's arguments (with those every
model's engine shares: CUDA graphs), environment and patches (vLLM replaced by stand-ins that
record them), the push's names and dtypes, the adoption of the engine's tensors, Packed's prefill
lengths, the refusals, the preemption check, and vLLM's schedule of the gated delta rule replayed
with the reference forms standing in for vLLM's kernels, forward and backward."""

import importlib.util
import json
import sys
import types

import pytest
import torch
import triton
import triton.language as tl

import batch_invariant_backward as bib
import simple_rl as rl
from helpers import ExactEngine, cpu_argv, main_cpu, metrics_rows

F64 = dict(dtype=torch.float64)


def model_args(path):
    return rl.model_args_from_hf(rl.read_qwen3_config(path))


# --- the engine ----------------------------------------------------------------------------


class Scheduler:
    def __init__(self):
        self.preempted = []

    def _preempt_request(self, request, timestamp, drop_stale_output=False):
        self.preempted.append(request)


@triton.jit
def launch_configs_kernel(x, n, BLOCK: tl.constexpr):  # never launched: its autotuners' stand-in
    pass


def autotuned(under_heuristics: bool = False):
    """A kernel Triton would autotune over three launch configs (the lightest first), as vLLM's
    prefill kernels are declared; the pin's is the third (64-wide, then the fewest warps)."""
    configs = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((32, 1), (64, 4), (64, 2))]
    tuner = triton.autotune(configs=configs, key=["n"])(launch_configs_kernel)
    return triton.heuristics({"n": lambda args: 1})(tuner) if under_heuristics else tuner


def fake_vllm(monkeypatch) -> dict:
    """Stand-ins for the vLLM modules VLLMEngine imports; returns what they recorded: the LLM's
    keyword arguments, the GDN backend class and the gated norm's module."""
    seen = {}

    class LLM:
        def __init__(self, **kwargs):
            seen["kwargs"] = kwargs
            seen["env"] = dict(rl.os.environ)
            scheduler = Scheduler()
            seen["scheduler"] = scheduler
            core = types.SimpleNamespace(scheduler=scheduler)
            self.llm_engine = types.SimpleNamespace(
                engine_core=types.SimpleNamespace(engine_core=core))

    class GDNAttentionBackend:
        @classmethod
        def supports_batch_invariance(cls):
            return False

    gated_norm = types.SimpleNamespace(calc_rows_per_block=lambda n_rows, device: 4)
    modules = {
        "vllm": types.SimpleNamespace(LLM=LLM, SamplingParams=types.SimpleNamespace),
        "vllm.config": types.SimpleNamespace(CompilationConfig=dict, CompilationMode=None,
                                             CUDAGraphMode=None),
        "vllm.v1.attention.backends.gdn_attn": types.SimpleNamespace(
            GDNAttentionBackend=GDNAttentionBackend),
        "vllm.models.qwen3_5.nvidia.ops": types.SimpleNamespace(fused_gdn_gated_norm=gated_norm),
    }
    prefill = {bib.VLLM_FLA + m: types.SimpleNamespace(kernel=autotuned(), helper=len,
                                                      gated=autotuned(under_heuristics=True))
               for m in bib.VLLM_PREFILL_AUTOTUNED}  # the prefill's modules, two kernels each
    for name, module in {**modules, **prefill}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(rl, "route_vllm_add_rms_norm_through_padded_rows", lambda: None)
    monkeypatch.setattr(rl, "route_vllm_linear_through_cublaslt", lambda: None)
    monkeypatch.setattr(rl, "engine_memory", lambda cfg, args, ranks, lora: (dict(
        max_num_seqs=8, max_num_batched_tokens=rl.batched_tokens(cfg, args, 8)), 0))
    tuners = [m.kernel for m in prefill.values()] + [m.gated.fn for m in prefill.values()]
    seen.update(backend=GDNAttentionBackend, gated_norm=gated_norm, tuners=tuners)
    return seen


def start_engine(path, monkeypatch, **cfg):
    seen = fake_vllm(monkeypatch)
    monkeypatch.delenv(rl.PACKED_DECODE, raising=False)
    files = types.SimpleNamespace(args=model_args(path), path=path, eos_ids=[0], tool_ids=[])
    config = rl.Config(model=str(path), cuda_graphs=False, **{"max_model_len": 9000, **cfg})
    engine = rl.VLLMEngine(config, files, rl.Ranks(0, 1, torch.device("cpu")))
    return engine, seen


def test_a_qwen35_engine_gets_the_schedule_the_trainer_replays(q35, monkeypatch):
    """LLM() gets fla's chunked prefill, fp32 recurrent states, bf16 conv states, prompts
    prefilled whole (a budget that holds the longest), no prefix cache, the text model only;
    before it starts, the GDN backend accepts batch-invariant mode, packed decode is off and
    the gated norm takes one row a block and each autotuned prefill kernel keeps one launch
    config alone, the pin's."""
    engine, seen = start_engine(q35(), monkeypatch)
    kw = seen["kwargs"]
    assert {k: kw[k] for k in rl.QWEN35_ENGINE_ARGS} == dict(
        gdn_prefill_backend="triton", mamba_ssm_cache_dtype="float32", mamba_cache_dtype="auto",
        enable_chunked_prefill=False, language_model_only=True)
    assert kw["enable_prefix_caching"] is False and engine.reads_cache is False
    assert kw["max_num_batched_tokens"] >= 9000  # --max-model-len: the longest prompt fits
    assert kw["attention_backend"] == "FLASH_ATTN" and kw["enable_return_routed_experts"] is False
    assert seen["env"][rl.PACKED_DECODE] == "0"
    assert seen["backend"].supports_batch_invariance() is True
    assert seen["gated_norm"].calc_rows_per_block(600, None) == 1
    assert len(seen["tuners"]) == 14 and all(
        [(c.kwargs, c.num_warps) for c in t.configs] == [({"BLOCK": 64}, 2)]
        for t in seen["tuners"])
    assert engine.preempted is not None and engine.preempted() == 0


@pytest.mark.parametrize("max_len", [200, 2048, 9000])
def test_a_qwen35_moe_engine_keeps_an_unread_prefix_cache_for_its_routes(q35, monkeypatch,
                                                                         max_len):
    """vLLM returns a token's experts only with its prefix cache on: a Qwen3.5-MoE's engine has
    it on, never read, with the chunked prefill it needs and a block of at least
    --max-model-len tokens that one step holds, so that no prompt is split at a block's end
    (the tiny model's own block is 64 tokens: 200 rounds up to 256, a multiple of 128; 2,048 as
    the A3B GPU test's block-2048 run). The dense one has none."""
    path = q35(experts=8, top_k=2, moe_inter=32, shared_inter=48)
    engine, seen = start_engine(path, monkeypatch, max_model_len=max_len)
    kw, block = seen["kwargs"], {200: 256, 2048: 2048, 9000: 9088}[max_len]
    assert rl.hybrid_block_tokens(model_args(path), max_len) == block == kw["block_size"]
    assert kw["enable_prefix_caching"] is True and kw["enable_chunked_prefill"] is True
    assert kw["enable_return_routed_experts"] is True and engine.returns_routes
    assert kw["max_num_batched_tokens"] == max(8192, block)
    assert engine.reads_cache is False  # the trainer replays no cache hit
    params = engine.sampling_params(3)
    assert params.skip_reading_prefix_cache is True
    assert {k: kw[k] for k in rl.QWEN35_ENGINE_ARGS if k != "enable_chunked_prefill"} == {
        k: v for k, v in rl.QWEN35_ENGINE_ARGS.items() if k != "enable_chunked_prefill"}
    dense, seen = start_engine(q35(), monkeypatch, max_model_len=max_len)
    assert "block_size" not in seen["kwargs"] and not dense.returns_routes
    assert dense.sampling_params(3).skip_reading_prefix_cache is True  # no cache to read


def test_a_qwen3_engine_is_untouched(tmp_path, monkeypatch):
    from helpers import make_checkpoint

    path = make_checkpoint(tmp_path / "q3")
    engine, seen = start_engine(path, monkeypatch)
    kw = seen["kwargs"]
    assert not set(rl.QWEN35_ENGINE_ARGS) & set(kw)
    assert kw["enable_prefix_caching"] is True and engine.preempted is None
    assert engine.sampling_params(3).skip_reading_prefix_cache is False  # it reads its cache
    assert seen["backend"].supports_batch_invariance() is False
    assert rl.PACKED_DECODE not in seen["env"]
    assert all(len(t.configs) == 3 for t in seen["tuners"])  # Triton autotunes as it would


def test_cuda_graphs_replay_decode_steps_of_up_to_every_sample_and_the_debugger_stays_eager(
        tmp_path, monkeypatch):
    """--cuda-graphs (the default): vLLM runs eager (no compiler) but replays captured decode
    steps, captured for every batch up to max_num_seqs (the step's samples) and no more than
    CUDA_GRAPH_MAX_BATCH; --no-cuda-graphs and --debug-parity (its hooks see eager steps only)
    run every step eagerly. Guards the flag's sense and the capture size: graphs left off cost
    a real run half its decode speed, and graphs for fewer sequences than a step decodes leave
    the larger batches eager, both silently."""
    from helpers import make_checkpoint

    path = make_checkpoint(tmp_path / "q3")
    config = types.SimpleNamespace(
        CompilationConfig=dict, CompilationMode=types.SimpleNamespace(NONE="none"),
        CUDAGraphMode=types.SimpleNamespace(FULL_DECODE_ONLY="full decode only"))

    def llm_kwargs(seqs: int, **cfg) -> dict:
        seen = fake_vllm(monkeypatch)
        monkeypatch.setitem(sys.modules, "vllm.config", config)
        monkeypatch.setattr(rl, "engine_memory", lambda cfg, args, ranks, lora: (dict(
            max_num_seqs=seqs, max_num_batched_tokens=8192), 0))
        files = types.SimpleNamespace(args=model_args(path), path=path, eos_ids=[0], tool_ids=[])
        rl.VLLMEngine(rl.Config(model=str(path), **cfg), files,
                      rl.Ranks(0, 1, torch.device("cpu")))
        return seen["kwargs"]

    kw = llm_kwargs(8)
    assert kw["enforce_eager"] is False
    assert kw["compilation_config"] == dict(
        mode="none", cudagraph_mode="full decode only", max_decode_cudagraph_capture_requests=8,
        cudagraph_specialize_lora=False)
    capped = llm_kwargs(4096)["compilation_config"]
    assert capped["max_decode_cudagraph_capture_requests"] == rl.CUDA_GRAPH_MAX_BATCH == 1024
    for eager in (dict(cuda_graphs=False), dict(debug_parity=True)):
        kw = llm_kwargs(8, **eager)
        assert kw["enforce_eager"] is True and kw["compilation_config"] is None


def test_the_prefill_pin_is_one_config_on_either_tile_list():
    """chunk_o's candidates as vLLM builds them after its shared-memory probe passed ([64, 128]
    tiles) and where it failed before CUDA started ([32, 64]), 2 or 4 warps, 2 to 4 stages:
    the pin keeps one config on both, 64-wide and light; the lists' first configs differ."""
    def configs(tiles):
        return [triton.Config({"BK": k, "BV": v}, num_warps=w, num_stages=s)
                for k in tiles for v in tiles for w in (2, 4) for s in (2, 3, 4)]

    lists = [configs([64, 128]), configs([32, 64])]
    pins = [min(c, key=bib.prefill_pin_order) for c in lists]
    assert [(p.kwargs, p.num_warps, p.num_stages) for p in pins] == [
        ({"BK": 64, "BV": 64}, 2, 2)] * 2
    assert lists[0][0].kwargs != lists[1][0].kwargs
    solve = [triton.Config({}, num_warps=w, num_stages=s) for w in (1, 2) for s in (2, 3)]
    assert min(solve, key=bib.prefill_pin_order) is solve[0]  # no tiles: the lightest


def test_packed_decode_set_to_one_is_refused(q35, monkeypatch):
    seen = fake_vllm(monkeypatch)
    monkeypatch.setenv(rl.PACKED_DECODE, "1")
    with pytest.raises(rl.ConfigError, match=r"^VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=1 gives "
                       r"a Qwen3.5's decode steps a kernel the trainer does not replay; unset it "
                       r"or set VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=0\.$"):
        rl.prepare_qwen35_engine()
    assert seen["backend"].supports_batch_invariance() is False  # nothing patched


def test_a_preemption_stops_the_generate_in_one_sentence(q35, monkeypatch):
    """The scheduler's preemptions are counted (since last asked); a generate after which one
    happened raises, naming the cause and what to change."""
    engine, seen = start_engine(q35(), monkeypatch)
    scheduler = seen["scheduler"]
    scheduler._preempt_request("r1", 0.0)
    scheduler._preempt_request("r2", 0.0)
    assert scheduler.preempted == ["r1", "r2"]  # the wrapped method still preempts
    assert engine.preempted() == 2 and engine.preempted() == 0

    def generate(prompts, params, use_tqdm, lora_request=None):
        scheduler._preempt_request("r3", 0.0)
        return []

    engine.llm.generate = generate
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(
        TokensPrompt=dict, SamplingParams=lambda **k: k))
    with pytest.raises(RuntimeError, match=r"^vLLM preempted 1 request\(s\) of this generate "
                       r"\(its KV cache ran out\) and prefilled them again, which a Qwen3\.5's "
                       r"trainer does not replay bit for bit: give it more KV cache "
                       r"\(--kv-cache-gib\) or fewer samples a step\.$"):
        engine.generate([[1, 2]], 1, [0], [4], 1.0)


# --- refusals ------------------------------------------------------------------------------


def test_the_debugger_and_an_explicit_prefix_cache_are_refused_for_a_qwen35(q35, tmp_path, capsys,
                                                                            monkeypatch):
    path = q35()
    args = model_args(path)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "fla" else find_spec(name, *a))
    pinned = []  # fla's kernels pinned by every Qwen3.5 check that passes, before vLLM starts
    monkeypatch.setattr(rl.bib, "pin_fla", lambda: pinned.append(1))
    rl.check_qwen35_engine(rl.Config(env="calc"), set(), args)  # episodes: each turn replayed
    with pytest.raises(rl.ConfigError, match=r"^--debug-parity: the op-by-op debugger does not "
                       r"follow a Qwen3\.5's schedule \(a prompt prefilled whole, then a step "
                       r"a token\) yet; drop the flag \(every step's parity check still compares "
                       r"every token\)\.$"):
        rl.check_qwen35_engine(rl.Config(debug_parity=True), set(), args)
    rl.check_qwen35_engine(rl.Config(), set(), args)  # prefix caching on by default: turned off
    rl.check_qwen35_engine(rl.Config(prefix_caching=False), {"prefix_caching"}, args)
    rl.check_qwen35_engine(rl.Config(env="calc"), {"prefix_caching"}, None)  # Qwen3: nothing
    rl.check_qwen35_engine(rl.Config(kernels="reference"), set(), args)  # no fla
    assert len(pinned) == 3
    capsys.readouterr()
    argv = cpu_argv(path, tmp_path / "logs", run_name="r", prefix_caching=True)
    assert rl.main(argv, device_type="cpu") == 2  # a run that would start vLLM
    assert capsys.readouterr().err == (
        "simple_rl: error: --prefix-caching: a Qwen3.5 reads no prefix cache (a "
        "cached prefix resumes its linear attention from a saved state, a split the trainer "
        "does not replay); drop the flag.\n")
    assert not (tmp_path / "logs" / "r").exists()


def test_a_qwen35_without_fla_is_refused_unless_on_the_reference_kernels(q35, monkeypatch):
    """The rule's backward on the GPU is fla's: without the package a Qwen3.5 is refused before
    vLLM starts (not at its first backward), naming the install; --kernels reference runs."""
    args = model_args(q35())
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "fla" else find_spec(name, *a))
    with pytest.raises(rl.ConfigError, match=r"^a Qwen3\.5's linear attention takes its backward "
                       r"from flash-linear-attention's kernels: pip install "
                       r"flash-linear-attention==0\.6\.0$"):
        rl.check_qwen35_engine(rl.Config(), set(), args)
    rl.check_qwen35_engine(rl.Config(kernels="reference"), set(), args)
    rl.check_qwen35_engine(rl.Config(check=True), set(), args)  # --check: no GPU question
    rl.check_qwen35_engine(rl.Config(), set(), None)  # a Qwen3: nothing asked


def test_pin_fla_refuses_an_fla_that_took_its_fast_exp_at_import(monkeypatch):
    """fla picks its exp and log once, at import (FLA_USE_FAST_OPS=1: libdevice's approximate
    ones, other gradient bits): pin_fla reads the one fla took, whatever the environment says
    now, and refuses the fast one; the exact one passes."""
    import triton.language.extra.libdevice as tldevice

    @triton.jit
    def fast(x):
        return tldevice.fast_expf(x.to(tl.float32))

    @triton.jit
    def exact(x):
        return tl.exp(x.to(tl.float32))

    for name in bib.FLA_ENV:  # pin_fla sets them: restored after the test
        monkeypatch.setenv(name, "0")
    monkeypatch.setattr(bib, "FLA_KERNELS", {})
    monkeypatch.setitem(sys.modules, "fla.ops.utils.op", types.SimpleNamespace(exp=fast))
    pin_fla = bib.pin_fla.__wrapped__  # not its process-wide cache
    with pytest.raises(RuntimeError, match=r"^fla was imported with FLA_USE_FAST_OPS=1 "):
        pin_fla()
    monkeypatch.setitem(sys.modules, "fla.ops.utils.op", types.SimpleNamespace(exp=exact))
    assert pin_fla() == {}


# --- weights -------------------------------------------------------------------------------

# What vLLM's Qwen3_5ForCausalLM (vllm/models/qwen3_5/nvidia/model.py) names its parameters,
# layer by layer: Gated DeltaNet (QwenGatedDeltaNetAttention) and gated attention
# (Qwen3NextAttention), each with Qwen3NextMLP and two Qwen3_5RMSNorms.
VLLM_GDN = ("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight",
            "linear_attn.conv1d.weight", "linear_attn.A_log", "linear_attn.dt_bias",
            "linear_attn.norm.weight", "linear_attn.out_proj.weight")
VLLM_ATTN = ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
             "self_attn.k_norm.weight")
VLLM_LAYER = ("input_layernorm.weight", "post_attention_layernorm.weight",
              "mlp.gate_up_proj.weight", "mlp.down_proj.weight")
# What its load_weights takes from a checkpoint (the hub's names, which Qwen3_5Model's mapper
# stacks: in_proj_qkv -> in_proj_qkvz shards 0-2, in_proj_z -> 3, in_proj_b/a -> in_proj_ba,
# q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj).
HF_GDN = ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
          "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight",
          "linear_attn.conv1d.weight", "linear_attn.A_log", "linear_attn.dt_bias",
          "linear_attn.norm.weight", "linear_attn.out_proj.weight")
HF_ATTN = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
           "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight")
HF_LAYER = ("input_layernorm.weight", "post_attention_layernorm.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def names(per_layer, prefix, layers=4):
    gdn, attn, every = per_layer
    return {f"{prefix}layers.{i}.{n}" for i in range(layers)
            for n in (gdn if i < 3 else attn) + every}


@pytest.mark.parametrize("tied", [True, False])
def test_the_push_sends_what_vllms_qwen35_loader_takes(q35, tied):
    """hf_weights names every tensor as the hub does (vLLM's loader stacks the parts itself),
    A_log in fp32 (vLLM's parameter and the trainer's forward), the rest in the compute dtype;
    a vision-language engine (Qwen3_5ForConditionalGeneration) gets them under
    model.language_model. (lm_head as it is: its mapper moves it)."""
    path = q35(tied=tied)
    args = model_args(path)
    state = rl.hf_to_trainer(rl.load_hf_state_dict(path), args)
    model = rl.build_model(args, state, bib.reference_kernels(), torch.bfloat16, "cpu")
    pushed = dict(rl.hf_weights(model))
    head = set() if tied else {"lm_head.weight"}
    assert set(pushed) == names((HF_GDN, HF_ATTN, HF_LAYER), "model.") | head | {
        "model.embed_tokens.weight", "model.norm.weight"}
    for name, t in pushed.items():
        assert t.dtype == (torch.float32 if name.endswith("A_log") else torch.bfloat16), name
    text = types.SimpleNamespace()
    assert rl.engine_names(text, iter(pushed.items())) is not None
    assert {n for n, _ in rl.engine_names(text, iter(pushed.items()))} == set(pushed)
    vl = types.SimpleNamespace(language_model=None)
    renamed = {n for n, _ in rl.engine_names(vl, iter(pushed.items()))}
    assert renamed == {n.replace("model.", "model.language_model.", 1) if n.startswith("model.")
                       else n for n in pushed}
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in renamed


@pytest.mark.parametrize("vision", [False, True])
def test_the_engines_qwen35_tensors_are_adopted_under_the_trainers_names(q35, vision):
    """engine_weights maps vLLM's parameter names (text model; under a vision tower,
    language_model.model. and a dropped visual.) onto every trainer weight, and keeps the
    engine's tensors as they are: A_log fp32, dt_bias bf16."""
    path = q35(tied=False)
    args = model_args(path)
    prefix = "language_model." if vision else ""
    shapes = {k: v.shape for k, v in rl.hf_to_trainer(rl.load_hf_state_dict(path), args).items()}
    params = {n: torch.zeros(1, dtype=torch.float32 if n.endswith("A_log") else torch.bfloat16)
              for n in names((VLLM_GDN, VLLM_ATTN, VLLM_LAYER), prefix + "model.")}
    params.update({prefix + n: torch.zeros(1, dtype=torch.bfloat16) for n in (
        "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")})
    if vision:
        params["visual.blocks.0.attn.qkv.weight"] = torch.zeros(1)
    llm = types.SimpleNamespace(apply_model=lambda fn: [fn(types.SimpleNamespace(
        named_parameters=lambda: params.items()))])
    adopted = rl.engine_weights(llm, args, torch.bfloat16)
    assert set(adopted) == set(shapes)
    assert adopted["layers.0.attention.A_log"].dtype == torch.float32
    assert adopted["layers.0.attention.dt_bias"].dtype == torch.bfloat16


# --- Packed --------------------------------------------------------------------------------


def test_packed_holds_each_samples_prefill_length():
    """Worked example: prompts of 3 and 1 tokens, completions of 2 and 3: the prefill lengths
    are the prompt lengths (3, 1), and a micro-batch keeps its samples' (sub_pack)."""
    p = rl.pack([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]])
    assert p.prefill.tolist() == [3, 1]
    assert p.cu_seqlens.tolist() == [0, 5, 9]
    part, _ = rl.sub_pack(p, range(1, 2))
    assert part.prefill.tolist() == [1] and part.cu_seqlens.tolist() == [0, 4]
    three = rl.pack([[1, 2, 3], [4], [5, 6]], [[7, 8], [9, 10, 11], [12]])
    for r in (range(0, 1), range(0, 2), range(1, 2), range(1, 3), range(2, 3)):
        part, _ = rl.sub_pack(three, r)  # a micro-batch holds its own sequences' lengths only
        assert part.prefill.tolist() == [3, 1, 2][r.start:r.stop] == three.prefill[r].tolist()
    rows, cu, decoded, counts = bib.prefill_schedule(p.cu_seqlens, p.prefill)
    assert rows.tolist() == [0, 1, 2, 5] and cu.tolist() == [0, 3, 4]
    assert decoded.tolist() == [3, 4, 6, 7, 8]  # the rows vLLM decoded, one a step
    assert counts.tolist() == [2, 3]


def test_the_decode_slot_index_is_a_power_of_two_wide_and_contiguous():
    """Row n of gdn_decode_vllm's index names slot n + 1 at every one of its W >= max(lens)
    columns, W a power of two, in contiguous memory (vLLM's kernel strides rows by W only)."""
    for lens, width in (([3, 1, 5], 8), ([1], 1), ([128, 2], 128), ([129], 256), ([2], 2)):
        index = bib.decode_slot_index(lens, "cpu")
        assert index.shape == (len(lens), width) and index.dtype == torch.int32, lens
        assert index.is_contiguous() and index.stride() == (width, 1)
        assert index.tolist() == [[n + 1] * width for n in range(len(lens))]


def worked_episodes(routed=None) -> list:
    """The worked example's episodes: 0 of one turn, 1 of three; routed[k]: turn k's experts."""
    routed = routed or [None] * 4

    def turn(ctx, ids, r):
        return rl.Turn(ctx, rl.Completion(ids, [0.0] * len(ids), True, r))

    return [rl.Episode(None, [turn([1, 2], [3], routed[0])]),
            rl.Episode(None, [turn([4], [5, 6], routed[1]), turn([7], [8], routed[2]),
                              turn([9, 10], [11, 12], routed[3])])]


def test_a_qwen35s_episodes_are_packed_a_turn_a_sample_with_its_whole_request():
    """Worked example: episode 0 of one turn (prompt [1, 2], out [3]); episode 1 of three (prompt
    [4], out [5, 6]; tool [7], out [8]; tool [9, 10], out [11, 12]). By turn, each turn is a
    sample prompted with its request as vLLM got it (every earlier turn and tool message), all
    of it prefilled; the targets are the outs in the order of the engine's logprobs. Not by
    turn (Qwen3): an episode a sample, the tools' ids context, not targets."""
    rollout = rl.episodes_rollout(worked_episodes(), False)
    p, episode = rl.pack_rollout(rollout, by_turn=True)
    assert episode.tolist() == [0, 1, 1, 1]
    assert p.cu_seqlens.tolist() == [0, 3, 6, 11, 20]
    assert p.tokens.tolist() == [1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8,
                                 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert p.prefill.tolist() == [2, 1, 4, 7]
    assert p.targets.tolist() == [3, 5, 6, 8, 11, 12] and p.seq.tolist() == [0, 1, 1, 2, 3, 3]
    assert p.tokens[p.gen_index + 1].tolist() == p.targets.tolist()  # each predicts the next
    whole, episode = rl.pack_rollout(rollout, by_turn=False)
    assert episode.tolist() == [0, 1] and whole.cu_seqlens.tolist() == [0, 3, 12]
    assert whole.targets.tolist() == [3, 5, 6, 8, 11, 12] and whole.prefill.tolist() == [2, 1]


def test_an_episodes_routes_are_its_turns_or_none_where_a_turn_has_none():
    """With routes (vLLM returned experts): an episode's are its turns' concatenated, (C, L, k);
    None where any turn has none (as generated_routing gives for a turn it cannot place)."""
    r = [torch.full((n, 2, 1), t) for t, n in enumerate([1, 2, 1, 2])]
    rollout = rl.episodes_rollout(worked_episodes(r), routes=True)
    assert rollout.routed[0].tolist() == r[0].tolist()
    assert torch.equal(rollout.routed[1], torch.cat(r[1:]))
    rollout = rl.episodes_rollout(worked_episodes([r[0], r[1], None, r[3]]), routes=True)
    assert rollout.routed[0] is not None and rollout.routed[1] is None
    assert rl.episodes_rollout(worked_episodes(r), routes=False).routed is None


def test_a_non_finite_update_of_a_qwen35_names_episodes_and_prompts_not_turns(q35, monkeypatch,
                                                                            tmp_path):
    """By turn, packed sample 3 is turn 3 of episode 1: a non-finite error in it names episode
    1 and its prompt (mine[1 // G]), not sample 3 (there are two episodes), and so does the
    diagnostic file."""
    args = rl.model_args_from_hf(rl.read_qwen3_config(q35()))

    def poisoned(*_, **__):
        raise rl.NonFiniteError("loss", [3], 0, 1)

    monkeypatch.setattr(rl, "update", poisoned)
    cfg = rl.Config(group_size=2, micro_batch_tokens=64)
    trainer = types.SimpleNamespace(cfg=cfg, ranks=rl.Ranks(0, 1, torch.device("cpu")),
                                    model=types.SimpleNamespace(args=args), ref_model=None,
                                    optimizer=None)
    rollout = rl.episodes_rollout(worked_episodes(), routes=False)
    with pytest.raises(rl.NonFiniteError) as e:
        rl.update_with_parity(trainer, rollout, torch.zeros(2), mine=[7])
    assert (e.value.seqs, e.value.episodes, e.value.prompts) == ([3], [1], [7])
    stop = rl.nonfinite_stop(e.value, 5, "step 6/9", tmp_path)
    diag = json.loads((tmp_path / "nonfinite_step_000005.json").read_text())
    assert (diag["samples"], diag["prompts"], stop.code) == ([1], [7], rl.EXIT_NONFINITE)


def test_a_qwen35_plays_episodes_of_several_turns_every_token_equal(q35, tmp_path):
    """Two steps on the stand-in engine, episodes of 1-3 turns (tool messages between them):
    the run's plumbing with a sample a turn (its requests, each with its episode's advantage),
    every token equal. The stand-in packs as the trainer does, so the bits against vLLM's
    schedule are tests/test_qwen35_parity_gpu.py's."""
    from test_episodes import SCRIPTED

    (tmp_path / "envs.py").write_text(SCRIPTED)
    seen = []
    plain = rl.pack_rollout

    def keep(rollout, by_turn):  # the update's packing (the stand-in engine packs alike)
        packed = plain(rollout, by_turn)
        if sys._getframe(1).f_code.co_name == "update_with_parity":
            seen.append((by_turn, len(rollout.episodes), *packed))
        return packed

    argv = cpu_argv(q35(chat=True), tmp_path / "runs", steps=2, eval_size=0, save_every=0,
                    env=f"{tmp_path / 'envs.py'}:Counted", max_turns=3, max_model_len=256,
                    micro_batch_tokens=256, run_name="r")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(rl, "pack_rollout", keep)
        assert main_cpu(argv, ExactEngine) == 0
    rows = [r for r in metrics_rows(tmp_path / "runs" / "r") if "loss" in r]
    assert len(rows) == 2 and any(r["episode/turns_mean"] > 1 for r in rows)
    for r in rows:
        assert r["determinism/tokens"] > 0 and r["determinism/mismatched_tokens"] == 0, r
    assert len(seen) == 2
    for by_turn, n_episodes, packed, episode in seen:
        assert by_turn and len(packed.prefill) > n_episodes == 6
        assert episode.tolist() == sorted(episode.tolist())


# --- vLLM's schedule, on the reference forms ----------------------------------------------


def rule_batch(lengths, prefill, Hk=2, Hv=4, Dk=16, Dv=8, seed=0, dtype=torch.float32):
    """A packed batch's gated delta rule arguments (random, as after the conv), with grads."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)

    def r(*shape, s=1.0):
        return (s * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)

    x = [r(T, Hk, Dk), r(T, Hk, Dk), r(T, Hv, Dv), r(T, Hv), r(T, Hv), r(Hv, s=0.5), r(Hv)]
    for t in x:
        t.requires_grad_()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return x, cu, max(lengths), torch.tensor(prefill)


SCHEDULES = {"one-token prompts": ([5, 3], [1, 1]), "whole samples": ([9, 70], [9, 70]),
             "across chunks": ([150, 1, 66], [70, 1, 64])}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_prompt_chunked_then_completion_recurrent_is_the_whole_rule(schedule):
    """replay_gated_delta_rule with the reference forms standing in for vLLM's kernels (each
    prompt chunked from zero, then its completion token by token from the prompt's state)
    equals the rule over each whole sequence: exactly in float64's rounding, and within 2e-6 in
    fp32 (outputs of size about 1)."""
    lengths, prefill = SCHEDULES[schedule]
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        x, cu, L, P = rule_batch(lengths, prefill, dtype=dtype)
        whole = bib.ref_gated_delta_rule(*x, cu, L)
        replayed = bib.replay_gated_delta_rule(*x, cu, P, bib.ref_prefill_form,
                                               bib.ref_decode_form)
        assert whole.abs().max() > 0.1
        torch.testing.assert_close(replayed, whole, atol=tol, rtol=0)


def replayed_forwards() -> bib.Kernels:
    """The reference forward set with vLLM's schedule of the gated delta rule (the reference
    forms in place of vLLM's kernels): what vllm_forwards computes, in fp32."""
    ref = bib.reference_forwards()

    def rule(q, k, v, a, b, A_log, dt_bias, cu, L, prefill):
        return bib.replay_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, cu, prefill,
                                           bib.ref_prefill_form, bib.ref_decode_form)

    return bib.Kernels(**{**ref.__dict__, "gated_delta_rule": rule})


def test_the_rules_backward_is_the_references_autograd():
    """GatedDeltaRuleFn around the replayed forward: its gradients (recomputed through the
    fp32 reference) equal autograd's through the reference, for every input."""
    x, cu, L, P = rule_batch(*SCHEDULES["across chunks"], seed=1)
    ops = bib.custom_backward_kernels(replayed_forwards())
    gy = torch.randn(x[2].shape, generator=torch.Generator().manual_seed(2))
    o = ops.gated_delta_rule(*x, cu, L, P)
    ours = torch.autograd.grad(o, x, gy)
    theirs = torch.autograd.grad(bib.ref_gated_delta_rule(*x, cu, L), x, gy)
    for a, b in zip(ours, theirs):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_the_rules_backward_is_the_kernel_sets():
    """GatedDeltaRuleFn hands the kernel set's backward (on the GPU: fla's chunked one) the
    saved inputs, cu_seqlens, the longest sample and the output's gradient, and returns its
    gradients as the inputs' own."""
    x, cu, L, P = rule_batch(*SCHEDULES["across chunks"], seed=1)
    seen = []

    def backward(*args):
        seen.append(args)
        return tuple(torch.full_like(t, n + 1.0) for n, t in enumerate(args[:7]))

    ops = bib.custom_backward_kernels(replayed_forwards(),
                                      {**bib.TORCH_BACKWARDS, "gated_delta_rule": backward})
    gy = torch.randn(x[2].shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad(ops.gated_delta_rule(*x, cu, L, P), x, gy)
    (args,) = seen
    assert all(torch.equal(a, b) for a, b in zip(args[:7], x)) and torch.equal(args[7], cu)
    assert args[8] == L == 150 and torch.equal(args[9], gy)
    assert [g.unique().tolist() for g in grads] == [[1.0], [2.0], [3.0], [4.0], [5.0], [6.0],
                                                    [7.0]]
    assert bib.TORCH_BACKWARDS["gated_delta_rule"] is bib.gated_delta_rule_backward
    assert bib.TRITON_BACKWARDS["gated_delta_rule"] is bib.gated_delta_rule_backward_fla


def test_the_convs_and_the_qk_preps_backward_are_the_references_autograd():
    """CausalConv1dFn (recomputed through the fp32 reference) and GatedQKNormRopeFn (the
    rotation's transpose, then the Gemma norm's backward; the gate passed through) against
    autograd through the reference forwards."""
    gen = torch.Generator().manual_seed(3)
    ops = bib.custom_backward_kernels(bib.reference_forwards())
    x = torch.randn(20, 12, generator=gen, requires_grad=True)
    w = torch.randn(12, 4, generator=gen, requires_grad=True)
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    gy = torch.randn(20, 12, generator=gen)
    ours = torch.autograd.grad(ops.causal_conv1d(x, w, cu, 12), (x, w), gy)
    theirs = torch.autograd.grad(bib.ref_causal_conv1d(x, w, cu, 12), (x, w), gy)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    T, Hq, Hk, D = 9, 4, 2, 16
    q_gate = torch.randn(T, Hq * 2 * D, generator=gen, requires_grad=True)
    k = torch.randn(T, Hk * D, generator=gen, requires_grad=True)
    wq, wk = (0.1 * torch.randn(D, generator=gen).requires_grad_() for _ in range(2))
    positions = torch.arange(T)
    cos_sin = bib.rope_cos_sin_cache(4, 1e7, 64, "cpu", torch.float32)  # a quarter of each head
    outs = [f(q_gate, k, wq, wk, 1e-6, positions, cos_sin)
            for f in (ops.gated_qk_norm_rope, bib.ref_gated_qk_norm_rope)]
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    gs = [torch.randn(o.shape, generator=gen) for o in outs[0]]
    ours, theirs = (torch.autograd.grad(o, (q_gate, k, wq, wk), gs) for o in outs)
    for a, b in zip(ours, theirs):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_engine_and_the_trainer_run_a_layer_on_the_same_gemm(monkeypatch):
    """route_vllm_linear_through_cublaslt (the engine, on a Hopper) sends a layer of at least
    bib.NARROW_LINEAR output rows to F.linear (cuBLASLt) and leaves a narrower one, judged by
    its whole width (a TP rank holds a shard), on vLLM's own path (its Triton matmul);
    bib.vllm_linear (the trainer) chooses alike at the same widths."""
    class Method:
        def apply(self, layer, x, bias=None):
            return "vllm"

    linear = types.SimpleNamespace(UnquantizedLinearMethod=Method)
    vocab = types.SimpleNamespace(UnquantizedEmbeddingMethod=type("Vocab", (Method,), {}))
    platform = types.SimpleNamespace(is_cuda=lambda: True)
    triton_matmul = types.SimpleNamespace(linear_batch_invariant=lambda x, w: "vllm")
    for name, module in {
            "vllm.model_executor.layers": types.SimpleNamespace(
                linear=linear, vocab_parallel_embedding=vocab),
            "vllm.platforms": types.SimpleNamespace(current_platform=platform),
            "vllm.model_executor.determinism.batch_invariant": triton_matmul}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w: "cublaslt")
    rl.route_vllm_linear_through_cublaslt()
    x = types.SimpleNamespace(is_cuda=True)
    n = bib.NARROW_LINEAR
    for rows, whole, want in ((n, n, "cublaslt"), (n - 1, n - 1, "vllm"), (1, 1, "vllm"),
                              (n // 2, n, "cublaslt")):  # the last: a TP rank's half
        layer = types.SimpleNamespace(weight=torch.empty(rows, 4), output_size=whole)
        assert Method().apply(layer, x) == want, (rows, whole)
        assert bib.vllm_linear(x, torch.empty(whole, 4)) == want, whole
