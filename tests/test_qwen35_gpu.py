"""Qwen3.5's Gated DeltaNet kernels on the GPU: the properties simple_rl's design for them rests
on (pytest -m gpu; skip without CUDA or vLLM). Run it first in a GPU session:

    VLLM_BATCH_INVARIANT=1 python -m pytest -m gpu tests/test_qwen35_gpu.py -q -rA -s

Every kernel is called as vLLM 0.34's CUDA Qwen3.5 model calls it (`forward_cuda` and
`_forward_core` in model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py, the norms in
models/qwen3_5/nvidia/model.py, the attention's q/k prep in model_executor/models/qwen3_next.py):
strided views into the qkvz and ba projections, one-token varlen launches for decode steps, int32
index tensors, slot 0 left to the null block, a slot's conv and recurrent states in one page,
a bf16 conv state and an fp32 recurrent state. Data are random bf16 at the layer shapes of
Qwen3.5-0.8B and 9B.

  P2  conv: one causal_conv1d_fn over prompt + completion gives the engine's bits (its prefill,
      then per decode step causal_conv1d_update, or the fn kernel in a step shared with another
      prompt), outputs and final conv state; several sequences in one call give each one's bits
      alone. So the trainer can run a batch's conv in one launch.
  P3  recurrent: fused_sigmoid_gating_delta_rule_update over a sequence's T tokens in one launch
      (a 1-D index of T copies of its slot; or N sequences with a 2-D [N, T] index) gives the
      bits of the engine's decode steps (one token of each of 4 sequences per launch), outputs
      and final state; so do single-token launches alone, and (P10) a compact state buffer. So
      the trainer can replay all generated tokens of a batch in one launch.
  P4  report only: the packed decode kernel (vLLM's default for steps without a prefill) against
      the one above; the design sets VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=0 either way.
  P5  prefill: fused_post_conv_prep + chunk_gated_delta_rule over 300 tokens equals two calls
      split at 128 with the fp32 state carried (64-token chunks); a split at 100 is reported.
  P5b one prefill call over 5 sequences of different lengths gives each one's bits alone.
  P15 the prefill's kernels that Triton autotunes, pinned to one config (bib.pin_vllm_prefill),
      give a fresh process with an empty Triton cache the same bits, timing nothing (some of
      their candidate configs give other bits: counted and printed).
  P6  fused_gdn_gated_rms_norm: rows alone equal the same rows inside 600 (its rows per program
      grow with the token count).
  P7  FlashInfer gemma_rmsnorm and gemma_fused_add_rmsnorm: rows alone, and in batches of 1 to
      4097 rows, equal the same rows in one call of 8192.
  P12 the trainer's replay (bib.vllm_gated_delta_rule) over a packed batch equals the engine's
      schedule: prompts prefilled in one call, then one decode launch a step.
  P13 the rule's backward on fla's chunked kernels: near float64 autograd, repeatable; (P13d)
      each of fla's kernels kept on one config; (P13b) the same bits in two fresh processes,
      each with an empty Triton cache; (P13c) its peak memory within the estimate.
  P11 fused_qk_rmsnorm_rope_gate: M-RoPE positions of three equal rows equal 1-D positions;
      rows alone or in small calls equal the rows of one call.
  prefill vs decode: the prefill's output for the last prompt token is NOT the recurrent
      kernel's over the same tokens (the prefill rounds the normalised q and k to bf16, sums the
      gates per chunk and multiplies by a bf16 state). That is why the trainer replays the
      engine's schedule: prompt tokens through the chunk kernels, generated ones through the
      recurrent kernel.

None of these kernels reads VLLM_BATCH_INVARIANT (set here as simple_rl runs). The FLA knobs
read when vLLM's FLA ops are imported (FLA_USE_FAST_OPS, FLA_TRIL_PRECISION, FLA_USE_TMA,
GDN_RECOMPUTE_SUPPRESS_LEVEL, USE_DEFAULT_FLA_NORM) and FLASHINFER_USE_CUDA_NORM must be unset,
as the design leaves them.
"""

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")
os.environ.setdefault("VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE", "0")

pytestmark = pytest.mark.gpu

# name: (hidden, GDN key heads H, GDN value heads HV, attention heads, KV heads)
MODELS = {"0.8b": (1024, 16, 16, 8, 2), "9b": (4096, 16, 32, 16, 4)}
K = V = 128  # GDN key and value head dims
HEAD, ROTARY, MAX_POS = 256, 64, 32768  # attention head dim, its rotary dims (0.25), positions
EPS = 1e-6  # rms_norm_eps
TOKENS = 1024  # rows of random projections per GDN layer
UNSET = ("FLA_USE_FAST_OPS", "FLA_TRIL_PRECISION", "FLA_USE_TMA", "GDN_RECOMPUTE_SUPPRESS_LEVEL",
         "USE_DEFAULT_FLA_NORM", "FLASHINFER_USE_CUDA_NORM")
CONV_SEQS = [(300, 200), (77, 64), (40, 1), (129, 100)]  # P2: (tokens, of which prompt)
DECODE_LENS = [64, 17, 1, 40]  # P3: generated tokens fed per sequence
PREFILL_LENS = [300, 64, 1, 129, 500]  # P5b


def _need_vllm():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm")
    assert os.environ.get("VLLM_BATCH_INVARIANT") == "1", "run with VLLM_BATCH_INVARIANT=1"
    import batch_invariant_backward as bib

    # unset, or as pin_fla sets it (its FLA_USE_FAST_OPS=0 stays in this process once set)
    changed = [k for k in UNSET if os.environ.get(k, bib.FLA_ENV.get(k)) != bib.FLA_ENV.get(k)]
    assert not changed, f"unset {changed}, as the design does"


def _diff(name, got, want):
    """'' when bit-equal, else a line with the count, the max abs diff and the first index."""
    assert got.shape == want.shape, (name, got.shape, want.shape)
    if torch.equal(got, want):
        return ""
    bad = (got != want).nonzero()
    return (f"{name}: {len(bad)} of {got.numel()} differ, max abs diff "
            f"{(got.double() - want.double()).abs().max().item():.3g}, "
            f"first at {tuple(bad[0].tolist())}")


def _report(title, lines):
    """Print the differing lines (or that all were bit-equal) and return them."""
    lines = [s for s in lines if s]
    print("\n".join(f"{title}: {s}" for s in lines) or f"{title}: all bit-equal")
    return lines


def _rel(got, want):
    """Relative error ||got - want|| / ||want||, in float64."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _i32(values):
    return torch.tensor(list(values), dtype=torch.int32, device="cuda")


def _bool(values):
    return torch.tensor(list(values), dtype=torch.bool, device="cuda")


def _cu(lens):
    """query_start_loc / cu_seqlens: [0, l0, l0 + l1, ...], int32."""
    return _i32(itertools.accumulate(lens, initial=0))


def _rows(lens, start=0):
    """Row indices into the projections of consecutive sequences of these lengths."""
    ends = list(itertools.accumulate(lens, initial=start))
    return [torch.arange(a, b, device="cuda") for a, b in zip(ends, ends[1:])]


@pytest.fixture(scope="module", params=list(MODELS))
def gdn(request):
    """One GDN layer (random weights in the engine's dtypes) and TOKENS rows of its input
    projections."""
    _need_vllm()
    _, h, hv, _, _ = MODELS[request.param]
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    conv_dim = 2 * h * K + hv * V
    decay_rate = torch.rand(hv, device="cuda", generator=g) * 0.5 + 1e-3  # exp(A_log): slow decay
    return SimpleNamespace(
        name=request.param, h=h, hv=hv, conv_dim=conv_dim,
        qkvz=randn(TOKENS, conv_dim + hv * V).bfloat16(),  # in_proj_qkvz: [q | k | v | z]
        ba=randn(TOKENS, 2 * hv).bfloat16(),  # in_proj_ba: [b | a]
        conv_w=(randn(conv_dim, 4) * 0.5).bfloat16(),  # conv1d.weight [conv_dim, 1, 4], viewed
        A_log=decay_rate.log(),  # fp32, as vLLM creates it
        dt_bias=(randn(hv) * 0.5).bfloat16(),  # the default dtype: bf16
        norm_w=(1 + 0.1 * randn(V)).bfloat16())  # RMSNormGated weight [V]


def _views(gdn, rows):
    """What forward_cuda hands _forward_core for these token rows: mixed_qkv and z, strided
    views into the qkvz projection, and b, a, strided views into the ba projection."""
    qkvz, ba = gdn.qkvz[rows], gdn.ba[rows]  # (T, 2Kd + 2Vd), (T, 2HV): as fresh GEMM outputs
    mixed_qkv, z = qkvz.split([gdn.conv_dim, gdn.hv * V], dim=-1)
    b, a = ba.chunk(2, dim=-1)
    return mixed_qkv, z, b, a


def _cache(gdn, slots=8):
    """A GDN layer's states as the engine pages them: per slot, the bf16 conv state (3,
    conv_dim) (the default "SD" layout) then the fp32 recurrent state (HV, V, K), so stride(0)
    is a page. Returns the conv state as the kernels take it, (slots, conv_dim, 3), and the
    recurrent state (slots, HV, V, K), zeros. Slot 0 is the null block: never used."""
    conv_bytes, ssm_bytes = 3 * gdn.conv_dim * 2, gdn.hv * V * K * 4
    page = conv_bytes + ssm_bytes
    raw = torch.zeros(slots * page, dtype=torch.uint8, device="cuda")
    conv = raw.view(torch.bfloat16).as_strided((slots, 3, gdn.conv_dim),
                                               (page // 2, gdn.conv_dim, 1))
    ssm = raw.view(torch.float32).as_strided((slots, gdn.hv, V, K), (page // 4, V * K, K, 1),
                                             conv_bytes // 4)
    return conv.transpose(-1, -2), ssm


def _conv_fn(gdn, mixed_qkv, conv_state, lens, slots, has_state):
    """The conv of a step with a prefill, as _forward_core calls it (the metadata as the GDN
    backend builds it); (T, conv_dim) bf16."""
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn
    from vllm.v1.attention.backends.utils import compute_causal_conv1d_metadata

    cu = _cu(lens)
    nums, batch_ptr, offsets = compute_causal_conv1d_metadata(cu.cpu(), device=cu.device)
    meta = SimpleNamespace(nums_dict=nums, batch_ptr=batch_ptr, token_chunk_offset_ptr=offsets)
    return causal_conv1d_fn(mixed_qkv.transpose(0, 1), gdn.conv_w, None, activation="silu",
                            conv_states=conv_state, has_initial_state=_bool(has_state),
                            cache_indices=_i32(slots), query_start_loc=cu,
                            metadata=meta).transpose(0, 1)


def _conv_update(gdn, mixed_qkv, conv_state, slots):
    """The conv of a pure-decode step, one token per sequence, written over mixed_qkv."""
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update

    return causal_conv1d_update(mixed_qkv, conv_state, gdn.conv_w, None, "silu",
                                conv_state_indices=_i32(slots), validate_data=True)


def _qkv(gdn, mixed_qkv):
    """rearrange_mixed_qkv: q, k, v as contiguous (1, T, heads, 128) tensors."""
    q, k, v = mixed_qkv.split([gdn.h * K, gdn.h * K, gdn.hv * V], dim=-1)
    return [x.contiguous().view(1, len(x), -1, K) for x in (q, k, v)]


def _recurrent(gdn, mixed_qkv, b, a, ssm, lens, index):
    """fused_sigmoid_gating_delta_rule_update as _forward_core runs decode rows (gating, l2norm
    and scale inside the kernel); the states at `index` are updated in place; (T, HV, V)."""
    from vllm.third_party.flash_linear_attention.ops import (
        fused_sigmoid_gating_delta_rule_update,
    )

    q, k, v = _qkv(gdn, mixed_qkv)
    o, _ = fused_sigmoid_gating_delta_rule_update(
        A_log=gdn.A_log, a=a, b=b, dt_bias=gdn.dt_bias, q=q, k=k, v=v, initial_state=ssm,
        inplace_final_state=True, cu_seqlens=_cu(lens), ssm_state_indices=index,
        use_qk_l2norm_in_kernel=True)
    return o[0]


def _prefill(gdn, conv_out, b, a, ssm, lens, slots, has_state):
    """A prefill as _forward_core runs it on the Triton/FLA backend: fused_post_conv_prep, the
    initial states gathered, chunk_gated_delta_rule (chunk metadata built on the CPU, as the GDN
    backend does), the final states scattered into their slots; (T, HV, V) bf16."""
    from vllm.model_executor.layers.mamba.ops.gather_initial_states import (
        gather_initial_states,
    )
    from vllm.model_executor.layers.mamba.ops.scatter_states import scatter_states
    from vllm.third_party.flash_linear_attention.ops import (
        chunk_gated_delta_rule,
        fused_post_conv_prep,
    )
    from vllm.third_party.flash_linear_attention.ops.index import (
        prepare_chunk_indices,
        prepare_chunk_offsets,
    )
    from vllm.third_party.flash_linear_attention.ops.utils import FLA_CHUNK_SIZE

    q, k, v, g, beta = fused_post_conv_prep(
        conv_output=conv_out, a=a, b=b, A_log=gdn.A_log, dt_bias=gdn.dt_bias,
        num_k_heads=gdn.h, head_k_dim=K, head_v_dim=V, apply_l2norm=True, output_g_exp=False)
    cu, index = _cu(lens), _i32(slots)
    cu_cpu = cu.cpu()
    h0 = gather_initial_states(ssm, index, _bool(has_state))
    o, ht = chunk_gated_delta_rule(
        q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None], initial_state=h0,
        output_final_state=True, cu_seqlens=cu,
        chunk_indices=prepare_chunk_indices(cu_cpu, FLA_CHUNK_SIZE).cuda(),
        chunk_offsets=prepare_chunk_offsets(cu_cpu, FLA_CHUNK_SIZE).cuda(),
        use_qk_l2norm_in_kernel=False)
    scatter_states(ssm, ht, index)
    return o[0]


def _ref_recurrent(gdn, mixed_qkv, b, a, h=None):
    """The gated delta rule in float64, token by token, from a zero (or the given) state:
    h <- h exp(g); h <- h + k (beta (v - h k))^T; o = h q, with q, k l2-normalised (eps 1e-6),
    q scaled by K^-1/2, g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b); (T, HV, V)."""
    q, k, v = [x[0].double() for x in _qkv(gdn, mixed_qkv)]
    q = q / (q.square().sum(-1, keepdim=True) + 1e-6).sqrt() * K**-0.5
    k = k / (k.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    rep = gdn.hv // gdn.h  # value head j reads key head j // rep
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)  # (T, HV, K)
    decay = torch.exp(-gdn.A_log.double().exp() * F.softplus(a.double() + gdn.dt_bias.double()))
    beta = b.double().sigmoid()  # (T, HV)
    h = torch.zeros(gdn.hv, V, K, dtype=torch.float64, device="cuda") if h is None else h.double()
    out = []
    for t in range(len(v)):
        h = h * decay[t, :, None, None]
        delta = (v[t] - (h @ k[t, :, :, None])[..., 0]) * beta[t, :, None]  # (HV, V)
        h = h + delta[:, :, None] * k[t, :, None, :]
        out.append((h @ q[t, :, :, None])[..., 0])
    return torch.stack(out)


# ------------------------------------------------------------- the trainer's replay (P12)

REPLAY = [(300, 40), (64, 17), (1, 1), (129, 64), (70, 0)]  # (prompt, generated) per sample


def test_p12_the_trainers_replay_gives_the_engines_bits(gdn):
    """bib.vllm_gated_delta_rule, the trainer's replay, over a packed batch of 5 samples against
    the engine's schedule: the prompts prefilled in one call from zero states, then a decode
    step per generated token (one launch a step, one token of each sample still going), the
    states in their slots between steps. The conv's output is the input here (P2 covers the
    conv); every output row bit-equal."""
    import batch_invariant_backward as bib

    lens = [p + g for p, g in REPLAY]
    cu = list(itertools.accumulate(lens, initial=0))
    mixed, _, b, a = _views(gdn, torch.arange(sum(lens), device="cuda"))
    slots = list(range(1, len(REPLAY) + 1))
    _, ssm = _cache(gdn)
    want = torch.empty(sum(lens), gdn.hv, V, dtype=torch.bfloat16, device="cuda")
    prompt = torch.cat([torch.arange(c, c + p, device="cuda") for c, (p, _) in zip(cu, REPLAY)])
    want[prompt] = _prefill(gdn, mixed[prompt].contiguous(), b[prompt], a[prompt], ssm,
                            [p for p, _ in REPLAY], slots, [False] * len(REPLAY))
    for j in range(max(g for _, g in REPLAY)):
        live = [n for n, (_, g) in enumerate(REPLAY) if j < g]
        at = torch.tensor([cu[n] + REPLAY[n][0] + j for n in live], device="cuda")
        want[at] = _recurrent(gdn, mixed[at], b[at], a[at], ssm, [1] * len(live),
                              _i32(slots[n] for n in live))
    q, k, v = mixed.split([gdn.h * K, gdn.h * K, gdn.hv * V], dim=-1)
    T = sum(lens)
    got = bib.vllm_gated_delta_rule(q.view(T, gdn.h, K), k.view(T, gdn.h, K),
                                    v.view(T, gdn.hv, V), a, b, gdn.A_log, gdn.dt_bias,
                                    _i32(cu), max(lens), torch.tensor([p for p, _ in REPLAY]))
    assert not _report(f"P12 {gdn.name} the trainer's replay vs the engine's schedule",
                       [_diff("outputs", got, want)])


# One fresh process: simple_rl's pin first, then fla's dispatch switch as fla read it, each
# pinned kernel's candidates before and after, and the kernels Triton autotuned in one backward
# of the rule, as JSON.
PIN_FLA = """
import ctypes, json, torch, triton, batch_invariant_backward as bib
from triton.compiler.compiler import CompiledKernel
pinned = bib.pin_fla()
import fla.backends
tuned, local = [], {}
triton.knobs.autotuning.listener = lambda fn, **kw: tuned.append(fn.__name__)
load = CompiledKernel._init_handles
def init_handles(self):  # each loaded kernel's local memory a thread (Triton: n_spills = bytes/4)
    load(self)
    local[self.name] = max(local.get(self.name, 0), 4 * self.n_spills)
CompiledKernel._init_handles = init_handles
def stack_limit():  # CU_LIMIT_STACK_SIZE: the local memory a thread; it grows, never shrinks
    size = ctypes.c_size_t()
    error = ctypes.CDLL("libcuda.so.1").cuCtxGetLimit(ctypes.byref(size), 0)
    return size.value if error == 0 else f"CUresult {error}"
g = torch.Generator(device="cuda").manual_seed(0)
lens, H, HV, D = [70, 3, 130], 16, 32, 128
T = sum(lens)
r = lambda *shape: torch.randn(*shape, device="cuda", generator=g).bfloat16()
x = [r(T, H, D), r(T, H, D), r(T, HV, D), r(T, HV), r(T, HV),
     torch.rand(HV, device="cuda", generator=g).add(1e-3).log(), r(HV)]
cu = torch.tensor([0, 70, 73, 203], dtype=torch.int32, device="cuda")
go = r(T, HV, D)
torch.cuda.synchronize()
free, reserved, stack = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved(), stack_limit()
bib.gated_delta_rule_backward_fla(*x, cu, max(lens), go)
torch.cuda.synchronize()
outside = free - torch.cuda.mem_get_info()[0] - (torch.cuda.memory_reserved() - reserved)
print("P13d stack limit", stack, "->", stack_limit(), "bytes a thread; local memory a thread:",
      sorted(local.items(), key=lambda kv: -kv[1])[:6])
pin = lambda c: [c.kwargs, c.num_warps, c.num_stages]
print("P13d json", json.dumps([fla.backends._DISPATCH_DISABLED, sorted(set(tuned)),
                  {n: [[str(c) for c in cs], [str(c) for c in t.configs],
                       [pin(c) for c in t.configs] == [list(bib.FLA_PINS[n])]]
                   for n, (t, cs) in pinned.items()}, outside]))
"""


def test_p13d_the_fla_kernels_of_the_rules_backward_each_keep_one_config(tmp_path):
    """In a fresh process with an empty Triton cache, pin_fla (before any fla import) finds
    every kernel FLA_KERNELS names in the fla installed and leaves each on FLA_PINS's config,
    one of fla's candidates here; one backward of the rule then has Triton time no kernel but
    fla's output kernel (whose config the gradient never sees), and takes under 1 GiB outside
    PyTorch's allocator; fla's hand-off to other packages' kernels is off as fla read it."""
    _need_vllm()
    pytest.importorskip("fla")
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    out = subprocess.run([sys.executable, "-c", PIN_FLA], check=True, env=env, timeout=600,
                         stdout=subprocess.PIPE, text=True).stdout  # its errors: shown
    lines = [line for line in out.splitlines() if line.startswith("P13d")]
    print(*lines[:-1], sep="\n")
    dispatch_off, tuned, configs, outside = json.loads(lines[-1].removeprefix("P13d json "))
    print("P13d autotuned:", tuned, "pinned:", {n: c[1] for n, c in configs.items()})
    # GPU memory the first backward took outside PyTorch's allocator: the local memory the
    # driver holds for the kernel that needs the most a thread (on fla's first configs, 21,552
    # bytes for dqkwg: 5,294 MiB on an H100, for the rest of the process)
    print(f"P13d outside PyTorch's allocator: {outside / 2**20:.0f} MiB")
    assert dispatch_off and set(tuned) <= {"chunk_fwd_kernel_o"} and len(configs) == 10
    assert all(before and len(after) == 1 and hit for before, after, hit in configs.values())
    assert outside < 2**30, f"{outside / 2**20:.0f} MiB outside PyTorch's allocator"


def test_p13_the_rules_backward_on_fla_is_its_gradient(gdn):
    """The GPU kernel set's backward of the rule (bib.gated_delta_rule_backward_fla: fla's
    chunked kernels, the gates through autograd) over the packed batch of P12, for a random
    output gradient: every input's gradient near float64 autograd through the reference (bf16
    kernels: 0.6% measured at 4B's heads; the fp32 reference's own distance printed beside it),
    and bit-equal when run again in this process (P13b: in fresh processes too)."""
    import batch_invariant_backward as bib

    pytest.importorskip("fla")

    lens = [p + g for p, g in REPLAY]
    cu, L = _i32(itertools.accumulate(lens, initial=0)), max(lens)
    rows = torch.arange(sum(lens), device="cuda")
    mixed, _, b, a = _views(gdn, rows)
    q, k, v = mixed.split([gdn.h * K, gdn.h * K, gdn.hv * V], dim=-1)
    x = [q.reshape(-1, gdn.h, K), k.reshape(-1, gdn.h, K), v.reshape(-1, gdn.hv, V), a, b,
         gdn.A_log, gdn.dt_bias]
    go = torch.randn(len(rows), gdn.hv, V, device="cuda",
                     generator=torch.Generator(device="cuda").manual_seed(7)).bfloat16()
    got = bib.gated_delta_rule_backward_fla(*x, cu, L, go)
    again = bib.gated_delta_rule_backward_fla(*x, cu, L, go)
    fp32 = bib.gated_delta_rule_backward(*x, cu, L, go)
    exact = bib.gated_delta_rule_backward(*(t.double() for t in x), cu, L, go.double())
    names = ("q", "k", "v", "a", "b", "A_log", "dt_bias")
    errors = {n: (_rel(g, w), _rel(f, w)) for n, g, f, w in zip(names, got, fp32, exact)}
    print(f"P13 {gdn.name} (fla's, the fp32 reference's) relative error:", errors)
    assert not _report(f"P13 {gdn.name} fla's backward run twice",
                       [_diff(n, g, h) for n, g, h in zip(names, got, again)])
    # q, k, v, a, b measured within 0.6% (bench_gdn); A_log's and dt_bias' gradients sum over
    # every token (cancelling terms): looser until a GPU run has measured them
    bound = dict(q=2e-2, k=2e-2, v=2e-2, a=2e-2, b=2e-2, A_log=1e-1, dt_bias=1e-1)
    assert all(errors[n][0] < bound[n] for n in names), errors


def test_p13c_the_rules_backward_on_fla_takes_what_the_estimate_says(gdn):
    """The peak memory of the GPU kernel set's backward of the rule, above its inputs, as the
    trainer calls it (q, k, v strided views of the conv's output), over samples of whole
    64-token chunks, after a warm-up call (fla autotunes in its first: Triton's benchmark
    takes a 256 MiB buffer): 85 to 100% of simple_rl's estimate (gdn_rule_bytes a row)."""
    import batch_invariant_backward as bib
    import simple_rl as rl

    pytest.importorskip("fla")
    g = torch.Generator(device="cuda").manual_seed(3)
    lens = [320, 192, 64]
    T, cu = sum(lens), _i32(itertools.accumulate(lens, initial=0))
    mixed = torch.randn(T, 2 * gdn.h * K + gdn.hv * V, device="cuda", generator=g).bfloat16()
    q, k, v = mixed.split([gdn.h * K, gdn.h * K, gdn.hv * V], dim=-1)
    a, b, go = (torch.randn(*s, device="cuda", generator=g).bfloat16()
                for s in ((T, gdn.hv), (T, gdn.hv), (T, gdn.hv, V)))
    x = [q.view(T, gdn.h, K), k.view(T, gdn.h, K), v.view(T, gdn.hv, V), a, b, gdn.A_log,
         gdn.dt_bias]
    bib.gated_delta_rule_backward_fla(*x, cu, max(lens), go)  # autotunes
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = bib.gated_delta_rule_backward_fla(*x, cu, max(lens), go)
    peak = torch.cuda.max_memory_allocated() - base
    shape = rl.Qwen35Args(layer_types=("linear_attention",), k_heads=gdn.h, v_heads=gdn.hv,
                          k_dim=K, v_dim=V, conv_kernel=4, rotary_dim=0)
    bound = T * rl.gdn_rule_bytes(shape, fla=True)
    print(f"P13c {gdn.name}: {peak / T / 1024:.2f} KiB a row, estimated {bound / T / 1024:.2f}")
    assert len(grads) == 7 and 0.85 * bound < peak <= bound, (peak, bound)


# One process: the rule's gradients at 9B's GDN heads for P12's lengths, saved to argv[1].
FRESH_BACKWARD = """
import sys, torch, batch_invariant_backward as bib
g = torch.Generator(device="cuda").manual_seed(0)
lens, H, HV, D = [340, 81, 2, 193, 70], 16, 32, 128
T = sum(lens)
r = lambda *shape: torch.randn(*shape, device="cuda", generator=g).bfloat16()
x = [r(T, H, D), r(T, H, D), r(T, HV, D), r(T, HV), r(T, HV),
     torch.rand(HV, device="cuda", generator=g).add(1e-3).log(), r(HV)]
cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
grads = bib.gated_delta_rule_backward_fla(*x, cu, max(lens), r(T, HV, D))
torch.save([t.cpu() for t in grads], sys.argv[1])
"""


def test_p13b_the_rules_backward_on_fla_gives_the_same_bits_in_fresh_processes(tmp_path):
    """fla autotunes its kernels, and some of its candidates sum in another order: two fresh
    processes, each with an empty Triton cache (as on a new machine), must give the rule's
    gradients bit for bit with fla's kernels pinned (P13d), or a Qwen3.5 run's sha256 would
    depend on the machine's timings."""
    _need_vllm()
    pytest.importorskip("fla")
    root = Path(__file__).resolve().parents[1]
    got = []
    for n in range(2):
        env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / f"triton{n}"),
                   PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
        subprocess.run([sys.executable, "-c", FRESH_BACKWARD, str(tmp_path / f"{n}.pt")],
                       check=True, env=env, timeout=900)
        got.append(torch.load(tmp_path / f"{n}.pt"))
    names = ("q", "k", "v", "a", "b", "A_log", "dt_bias")
    assert not _report("P13b fla's backward in two fresh processes",
                       [_diff(n, a, b) for n, a, b in zip(names, *got)])


# ----------------------------------------------------------------------------- conv (P2)

def test_p2_one_conv_launch_gives_the_engines_conv_bits(gdn):
    """The engine: the prompts in one prefill, then one decode step per token, either pure
    (causal_conv1d_update) or shared with another request's 37-token prompt (the fn kernel, the
    decode rows first, their state from the cache). The trainer: one causal_conv1d_fn over all
    tokens of the 4 sequences; and each sequence alone."""
    lens, prompts = [t for t, _ in CONV_SEQS], [p for _, p in CONV_SEQS]
    n, rows = len(CONV_SEQS), _rows(lens)
    slots = list(range(1, n + 1))
    other = torch.arange(TOKENS - 37, TOKENS, device="cuda")  # the prompt sharing mixed steps
    engine = {}
    for mode in ("pure decode steps", "mixed steps"):
        conv, _ = _cache(gdn)
        first = _views(gdn, torch.cat([r[:p] for r, p in zip(rows, prompts)]))[0]
        outs = [[y] for y in _conv_fn(gdn, first, conv, prompts, slots, [False] * n)
                .split(prompts)]
        for j in range(max(t - p for t, p in CONV_SEQS)):
            live = [i for i in range(n) if prompts[i] + j < lens[i]]
            step = torch.stack([rows[i][prompts[i] + j] for i in live])
            live_slots = [slots[i] for i in live]
            if mode == "pure decode steps":
                y = _conv_update(gdn, _views(gdn, step)[0], conv, live_slots)
            else:
                x = _views(gdn, torch.cat([step, other]))[0]
                y = _conv_fn(gdn, x, conv, [1] * len(live) + [len(other)], live_slots + [n + 1],
                             [True] * len(live) + [False])[:len(live)]
            for i, yi in zip(live, y):
                outs[i].append(yi[None])
        engine[mode] = ([torch.cat(o) for o in outs], conv[1:n + 1].clone())

    conv, _ = _cache(gdn)
    one = _conv_fn(gdn, _views(gdn, torch.cat(rows))[0], conv, lens, slots, [False] * n)
    one, one_state = one.split(lens), conv[1:n + 1].clone()
    problems = []
    for mode, (outs, state) in engine.items():
        problems += _report(f"P2 {gdn.name} one launch vs the engine's {mode}", [
            *[_diff(f"sequence {i} outputs", one[i], outs[i]) for i in range(n)],
            _diff("final conv states", one_state, state)])
    alone = []
    for i, r in enumerate(rows):
        conv, _ = _cache(gdn)
        out = _conv_fn(gdn, _views(gdn, r)[0], conv, [lens[i]], [1], [False])
        alone += [_diff(f"sequence {i} outputs", one[i], out),
                  _diff(f"sequence {i} final conv state", one_state[i], conv[1])]
    problems += _report(f"P2 {gdn.name} 4 sequences in one launch vs each alone", alone)
    # real values: silu(causal conv of width 4) and the last 3 raw inputs as the state
    x = _views(gdn, rows[0])[0]
    ref = F.silu(F.conv1d(F.pad(x.T.float(), (3, 0))[None], gdn.conv_w.float()[:, None],
                          groups=gdn.conv_dim))[0].T
    assert _rel(one[0], ref) < 1e-2, _rel(one[0], ref)
    assert torch.equal(one_state[0], x[-3:].T)
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------ recurrent (P3, P4)

def test_p3_one_recurrent_launch_gives_the_engines_decode_bits(gdn):
    """The engine's decode steps over 4 sequences (one launch per step, one token each) against
    single-token launches of each sequence alone, one launch per sequence (1-D index of T copies
    of its slot), one launch over the 4 (2-D [4, T] index) and (P10) one launch per sequence on
    a compact state buffer."""
    n, rows = len(DECODE_LENS), _rows(DECODE_LENS, start=100)
    slots = list(range(1, n + 1))
    g = torch.Generator(device="cuda").manual_seed(1)
    h0 = torch.randn(n, gdn.hv, V, K, device="cuda", generator=g) * 0.1  # the prompts' states

    def fresh(compact=False):
        _, ssm = _cache(gdn)
        if compact:
            ssm = torch.zeros(ssm.shape, device="cuda")
        ssm[1:n + 1] = h0
        return ssm

    def steps(ids):
        ssm, outs = fresh(), {i: [] for i in ids}
        for j in range(max(DECODE_LENS[i] for i in ids)):
            live = [i for i in ids if j < DECODE_LENS[i]]
            mixed, _, b, a = _views(gdn, torch.stack([rows[i][j] for i in live]))
            o = _recurrent(gdn, mixed, b, a, ssm, [1] * len(live), _i32(slots[i] for i in live))
            for i, oi in zip(live, o):
                outs[i].append(oi[None])
        return {i: (torch.cat(outs[i]), ssm[slots[i]].clone()) for i in ids}

    def per_sequence(compact):
        got = {}
        for i, r in enumerate(rows):
            ssm = fresh(compact)
            mixed, _, b, a = _views(gdn, r)
            o = _recurrent(gdn, mixed, b, a, ssm, [len(r)], _i32([slots[i]] * len(r)))
            got[i] = (o, ssm[slots[i]].clone())
        return got

    def batch_2d():
        ssm = fresh()
        index = _i32(slots)[:, None].expand(n, max(DECODE_LENS)).contiguous()
        mixed, _, b, a = _views(gdn, torch.cat(rows))
        o = _recurrent(gdn, mixed, b, a, ssm, DECODE_LENS, index).split(DECODE_LENS)
        return {i: (o[i], ssm[slots[i]].clone()) for i in range(n)}

    engine = steps(range(n))
    forms = {"single-token launches alone": {i: steps([i])[i] for i in range(n)},
             "one launch per sequence (1-D index)": per_sequence(compact=False),
             "one launch over 4 (2-D index)": batch_2d(),
             "P10: one launch per sequence, compact state": per_sequence(compact=True)}
    problems = []
    for form, got in forms.items():
        problems += _report(f"P3 {gdn.name} {form} vs the engine's decode steps", [
            line for i in range(n) for line in (
                _diff(f"sequence {i} outputs", got[i][0], engine[i][0]),
                _diff(f"sequence {i} final state", got[i][1], engine[i][1]))])
    mixed, _, b, a = _views(gdn, rows[0])
    err = _rel(engine[0][0], _ref_recurrent(gdn, mixed, b, a, h0[0]))
    print(f"P3 {gdn.name} engine vs float64 recurrence: relative error {err:.2e}")
    assert err < 2e-2
    assert not problems, "\n".join(problems)


def test_p4_packed_decode_kernel_against_the_sigmoid_gating_kernel(gdn):
    """Report only: 16 pure-decode steps of 4 sequences through the packed kernel (vLLM's
    default without a prefill in the step) and through fused_sigmoid_gating_delta_rule_update
    (what the engine runs with VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=0, the design's setting
    whatever this prints). Both must compute the same math; their bits are printed."""
    from vllm.third_party.flash_linear_attention.ops import (
        fused_recurrent_gated_delta_rule_packed_decode,
    )

    n, steps = 4, 16
    index = _i32(range(1, n + 1))
    g = torch.Generator(device="cuda").manual_seed(2)
    h0 = torch.randn(n, gdn.hv, V, K, device="cuda", generator=g) * 0.1
    sigmoid_ssm, packed_ssm = _cache(gdn)[1], _cache(gdn)[1]
    sigmoid_ssm[1:n + 1] = h0
    packed_ssm[1:n + 1] = h0
    lines, errs = [], []
    for j in range(steps):
        mixed, _, b, a = _views(gdn, torch.arange(200 + n * j, 200 + n * (j + 1), device="cuda"))
        want = _recurrent(gdn, mixed, b, a, sigmoid_ssm, [1] * n, index)
        out = torch.empty(n, 1, gdn.hv, V, dtype=torch.bfloat16, device="cuda")
        fused_recurrent_gated_delta_rule_packed_decode(
            mixed_qkv=mixed, a=a, b=b, A_log=gdn.A_log, dt_bias=gdn.dt_bias, scale=K**-0.5,
            initial_state=packed_ssm, out=out, ssm_state_indices=index,
            use_qk_l2norm_in_kernel=True)
        lines.append(_diff(f"step {j} outputs", out[:, 0], want))
        errs.append(_rel(out[:, 0], want))
    lines.append(_diff("final states", packed_ssm[1:n + 1], sigmoid_ssm[1:n + 1]))
    differ = _report(f"P4 {gdn.name} packed vs sigmoid-gating decode kernel", lines)
    print(f"P4 {gdn.name}: the packed decode kernel {'DIFFERS from' if differ else 'equals'} "
          f"fused_sigmoid_gating_delta_rule_update (max relative error {max(errs):.2e}); "
          "VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=0 keeps every decode token on the latter")
    assert max(errs) < 1e-2, "the two decode kernels should compute the same math"


# -------------------------------------------------------------------------- prefill (P5, P5b)

def test_p5_prefill_split_at_a_chunk_boundary_gives_one_calls_bits(gdn):
    """300 prompt tokens in one prefill against two with the fp32 state carried through the
    cache: split at 128 (a multiple of the 64-token chunk) must give the same bits; at 100 the
    chunk grid moves, reported (the design turns chunked prefill off)."""
    rows = torch.arange(300, device="cuda")

    def run(split):
        _, ssm = _cache(gdn)
        outs = []
        for i, part in enumerate(rows.split(split)):
            mixed, _, b, a = _views(gdn, part)
            outs.append(_prefill(gdn, mixed.contiguous(), b, a, ssm, [len(part)], [1], [i > 0]))
        return torch.cat(outs), ssm[1].clone()

    out, state = run([300])
    at_128, at_100 = run([128, 172]), run([100, 200])
    _report(f"P5 {gdn.name} split at 100 (reported)", [
        _diff("outputs", at_100[0], out), _diff("final state", at_100[1], state)])
    problems = _report(f"P5 {gdn.name} split at 128", [
        _diff("outputs", at_128[0], out), _diff("final state", at_128[1], state)])
    mixed, _, b, a = _views(gdn, rows)
    err = _rel(out, _ref_recurrent(gdn, mixed, b, a))
    print(f"P5 {gdn.name} prefill vs float64 recurrence: relative error {err:.2e}")
    assert err < 5e-2
    assert _rel(at_100[0], out) < 2e-2
    assert not problems, "\n".join(problems)


def test_p5b_prefill_of_a_batch_gives_each_sequences_bits_alone(gdn):
    rows = _rows(PREFILL_LENS)
    n = len(rows)
    _, ssm = _cache(gdn)
    mixed, _, b, a = _views(gdn, torch.cat(rows))
    batch = _prefill(gdn, mixed.contiguous(), b, a, ssm, PREFILL_LENS, range(1, n + 1),
                     [False] * n).split(PREFILL_LENS)
    lines = []
    for i, r in enumerate(rows):
        _, alone = _cache(gdn)
        mixed, _, b, a = _views(gdn, r)
        out = _prefill(gdn, mixed.contiguous(), b, a, alone, [len(r)], [1], [False])
        lines += [_diff(f"sequence {i} ({len(r)} tokens) outputs", batch[i], out),
                  _diff(f"sequence {i} final state", ssm[i + 1], alone[1])]
    problems = _report(f"P5b {gdn.name} 5 sequences in one prefill vs each alone", lines)
    assert batch[2].abs().sum() > 0  # the 1-token prompt was computed
    assert not problems, "\n".join(problems)


# One fresh process with an empty Triton cache (another machine of this GPU kind), pinning
# before it has touched CUDA: vLLM's prefill over the inputs saved beside it; its output, final
# state, the kernels Triton timed, each kernel's pinned config and chunk_o's tile list, saved.
PINNED_PREFILL = """
import sys, torch, triton, batch_invariant_backward as bib
bib.pin_vllm_prefill()
from vllm.third_party.flash_linear_attention.ops import chunk_o
tuned = []
triton.knobs.autotuning.listener = lambda fn, **kw: tuned.append(fn.__name__)
out = bib.gdn_prefill_vllm(*torch.load(sys.argv[1]))
pins = {n: [str(c) for c in t.configs] for n, t in bib.vllm_prefill_autotuners().items()}
torch.save([*out, tuned, pins, chunk_o.BKV_LIST], sys.argv[2])
"""


def test_p15_the_pinned_prefill_computes_alike_on_an_empty_triton_cache(gdn, tmp_path):
    """vLLM's prefill over P5b's 5 prompts with each autotuned kernel on each of its candidate
    configs in turn (the others as Triton picks them): the configs that give another output or
    final state than the kernel's pinned one are counted and printed (why the pin exists; a
    kernel this prefill does not launch is named so), and the pinned one must run. Then
    bib.pin_vllm_prefill: each kernel keeps that config alone, and a fresh process with an
    empty Triton cache that pins before it has touched CUDA pins the same configs (of the
    kernels this prefill launches), times no kernel and gets this process's bits. Printed:
    chunk_o's tile list here and there (why the pin chooses by value). At 9B's heads only (each
    config compiles once: seconds)."""
    if gdn.name != "9b":
        pytest.skip("run at 9B's heads")
    import subprocess
    import sys
    from pathlib import Path

    import batch_invariant_backward as bib

    tuners = bib.vllm_prefill_autotuners()
    mixed, _, b, a = _views(gdn, torch.cat(_rows(PREFILL_LENS)))
    q, k, v = mixed.split([gdn.h * K, gdn.h * K, gdn.hv * V], dim=-1)
    x = (q.unflatten(1, (gdn.h, K)), k.unflatten(1, (gdn.h, K)), v.unflatten(1, (gdn.hv, V)), a,
         b, gdn.A_log, gdn.dt_bias, _i32(itertools.accumulate(PREFILL_LENS, initial=0)))
    counts = {}
    for name, tuner in tuners.items():
        configs, outs = tuner.configs, {}
        pin = configs.index(min(configs, key=bib.prefill_pin_order))
        tuner.best_config = None  # set by each launch: still None, this prefill never runs it
        try:
            for i, config in enumerate(configs):
                tuner.configs, tuner.cache = [config], {}
                try:
                    outs[i] = bib.gdn_prefill_vllm(*x)
                except Exception as e:  # too much shared memory here: Triton would time it inf
                    print(f"P15 {name} {config}: {type(e).__name__}")
                if tuner.best_config is None:
                    break
        finally:
            tuner.configs, tuner.cache = configs, {}
        if tuner.best_config is None:
            counts[name] = "not launched by this prefill"
            continue
        assert pin in outs, f"{name}'s pinned config {configs[pin]} failed here"
        differ = sum(any(not torch.equal(g, w) for g, w in zip(out, outs[pin]))
                     for out in outs.values())
        counts[name] = f"{differ} of {len(outs)} configs differ from the pinned one"
    print(f"P15 {gdn.name}:", counts)
    saved = {name: tuner.configs for name, tuner in tuners.items()}
    try:
        bib.pin_vllm_prefill()
        assert all(bib.autotuners(bib.VLLM_FLA + m) for m in bib.VLLM_PREFILL_AUTOTUNED)
        assert all(t.configs == [min(saved[n], key=bib.prefill_pin_order)]
                   for n, t in tuners.items())
        pins = {n: [str(c) for c in t.configs] for n, t in tuners.items()}
        want = bib.gdn_prefill_vllm(*x)
        torch.save([t.contiguous() for t in x], tmp_path / "x.pt")
        root = Path(__file__).resolve().parents[1]
        env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"),
                   PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
        subprocess.run([sys.executable, "-c", PINNED_PREFILL, tmp_path / "x.pt",
                        tmp_path / "out.pt"], check=True, env=env, timeout=600)
        *got, tuned, fresh_pins, fresh_tiles = torch.load(tmp_path / "out.pt")
        from vllm.third_party.flash_linear_attention.ops import chunk_o
    finally:
        for name, tuner in tuners.items():  # the other tests' prefill as vLLM's defaults run it
            tuner.configs, tuner.cache = saved[name], {}
    print(f"P15 chunk_o's tile list: {chunk_o.BKV_LIST} here, {fresh_tiles} in the fresh "
          f"process (imported before CUDA started)")
    assert tuned == [], f"Triton timed {tuned} in a pinned prefill"
    launched = [n for n, c in counts.items() if c != "not launched by this prefill"]
    assert len(launched) >= 5, counts  # 6 of 11 at 9B's heads
    assert {n: fresh_pins[n] for n in launched} == {n: pins[n] for n in launched}
    problems = _report(f"P15 {gdn.name} the pinned prefill, a fresh process vs this one",
                       [_diff(part, g, w) for part, g, w in zip(("output", "final state"),
                                                                 got, want)])
    assert not problems, "\n".join(problems)


def test_prefill_and_decode_kernels_give_different_bits(gdn):
    """The chunked prefill over 300 tokens against the recurrent kernel over the same tokens
    from the same zero state: both the same math (checked against float64), not the same bits
    (expected). This is why the trainer replays the engine's schedule instead of one kernel."""
    mixed, _, b, a = _views(gdn, torch.arange(300, device="cuda"))
    _, ssm = _cache(gdn)
    chunk = _prefill(gdn, mixed.contiguous(), b, a, ssm, [300], [1], [False])
    _, ssm = _cache(gdn)
    recurrent = _recurrent(gdn, mixed, b, a, ssm, [300], _i32([1] * 300))
    ref = _ref_recurrent(gdn, mixed, b, a)
    differ = int((chunk != recurrent).flatten(1).any(1).sum())
    print(f"prefill vs decode {gdn.name}: {differ} of 300 token outputs differ; relative error "
          f"vs float64: chunk {_rel(chunk, ref):.2e}, recurrent {_rel(recurrent, ref):.2e}")
    assert _rel(chunk, ref) < 5e-2 and _rel(recurrent, ref) < 2e-2
    assert not torch.equal(chunk[-1], recurrent[-1]), (
        "the prefill's output for the last prompt token has the recurrent kernel's bits: if that "
        "holds for every token, the trainer need not replay the engine's prefill/decode split "
        "and the design simplifies; check it at both shapes and other lengths first")


# ------------------------------------------------------------------------------ norms (P6, P7)

def test_p6_gated_rms_norm_rows_alone_equal_rows_in_600(gdn):
    """fused_gdn_gated_rms_norm as forward_cuda calls it (in place on core_attn_out flattened,
    z a strided view into qkvz): rows in calls of 1, 8, 300 and 529 rows against 600."""
    from vllm.models.qwen3_5.nvidia.ops.fused_gdn_gated_norm import fused_gdn_gated_rms_norm
    from vllm.third_party.flash_linear_attention.ops.layernorm_guard import calc_rows_per_block

    g = torch.Generator(device="cuda").manual_seed(3)
    core = torch.randn(600, gdn.hv * V, device="cuda", generator=g).bfloat16()  # core_attn_out

    def norm(start, m):
        rows = torch.arange(start, start + m, device="cuda")
        x, z = core[rows], _views(gdn, rows)[1]
        fused_gdn_gated_rms_norm(x=x, z=z, weight=gdn.norm_w, out=x, eps=EPS,
                                 num_v_heads=gdn.hv, head_v_dim=V, norm_before_gate=True,
                                 activation="silu")
        return x

    full = norm(0, 600)
    per_program = {m: calc_rows_per_block(m, full.device) for m in (1, 8, 300, 529, 600)}
    print(f"P6 rows per program by token count: {per_program}")
    assert per_program[600] > per_program[8], "this GPU runs 600 rows one per program too"
    problems = _report(f"P6 {gdn.name} rows alone vs in 600", [
        _diff(f"rows {a}..{a + m - 1} in a call of {m}", norm(a, m), full[a:a + m])
        for a, m in [(0, 1), (317, 1), (599, 1), (0, 8), (301, 8), (592, 8), (0, 300),
                     (0, 529)]])
    x = core.float().view(600, gdn.hv, V)
    z = _views(gdn, torch.arange(600, device="cuda"))[1].float().view(600, gdn.hv, V)
    ref = x * (x.square().mean(-1, keepdim=True) + EPS).rsqrt() * gdn.norm_w.float() * F.silu(z)
    assert _rel(full.view(600, gdn.hv, V), ref) < 1e-2
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("hidden", sorted({h for h, *_ in MODELS.values()}))
def test_p7_flashinfer_gemma_norms_are_row_invariant(hidden):
    """The decoder's norms (Qwen3_5RMSNorm: gemma_rmsnorm for the first layer's input norm,
    gemma_fused_add_rmsnorm, in place, for the others), contiguous bf16 rows."""
    _need_vllm()
    norm = pytest.importorskip("flashinfer.norm")
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(8192, hidden, device="cuda", generator=g).bfloat16()
    res = torch.randn(8192, hidden, device="cuda", generator=g).bfloat16()
    w = (0.1 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()

    def fused(start, m):
        xa, ra = x[start:start + m].clone(), res[start:start + m].clone()
        norm.gemma_fused_add_rmsnorm(xa, ra, w, EPS)
        return xa, ra

    want, (want_x, want_r) = norm.gemma_rmsnorm(x, w, EPS), fused(0, 8192)
    calls = [(0, m) for m in (1, 2, 3, 7, 8, 16, 31, 33, 64, 100, 127, 128, 129, 255, 256, 257,
                              511, 513, 600, 1000, 1023, 1024, 2048, 4097)]
    calls += [(i, 1) for i in (1, 517, 4000, 8191)]  # rows alone
    lines = []
    for a, m in calls:
        got_x, got_r = fused(a, m)
        lines += [_diff(f"gemma_rmsnorm rows {a}..{a + m - 1}", norm.gemma_rmsnorm(
                      x[a:a + m], w, EPS), want[a:a + m]),
                  _diff(f"gemma_fused_add_rmsnorm rows {a}..{a + m - 1}: out", got_x,
                        want_x[a:a + m]),
                  _diff(f"gemma_fused_add_rmsnorm rows {a}..{a + m - 1}: residual", got_r,
                        want_r[a:a + m])]
    problems = _report(f"P7 hidden {hidden} rows in calls of 1..4097 vs 8192", lines)

    def gemma(t):
        return t * (t.square().mean(-1, keepdim=True) + EPS).rsqrt() * (1 + w.float())

    s = x.float() + res.float()
    assert _rel(want, gemma(x.float())) < 1e-2 and _rel(want_r, s) < 1e-2
    assert _rel(want_x, gemma(s)) < 1e-2
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------ attention (P11)

def _cos_sin_cache():
    """The rotary cache as vLLM builds it (rotary_embedding/base.py): fp32 on the GPU from
    inv_freq = 1 / theta^(2i / 64), theta = 1e7, [cos | sin], cast to bf16; (MAX_POS, 64)."""
    i = torch.arange(0, ROTARY, 2, dtype=torch.float, device="cuda")
    freqs = torch.outer(torch.arange(MAX_POS, dtype=torch.float, device="cuda"),
                        1.0 / (1e7 ** (i / ROTARY)))
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).bfloat16()


@pytest.mark.parametrize("model", list(MODELS))
def test_p11_qk_norm_rope_gate_mrope_and_row_invariance(model):
    """fused_qk_rmsnorm_rope_gate as Qwen3NextAttention._project_qkv_gate calls it (q_gate and k
    strided views into qkv_proj's output, norm_beta 1.0, 64 of 256 dims rotated): (3, T) M-RoPE
    positions of three equal rows (text under Qwen3_5ForConditionalGeneration) against 1-D
    positions (Qwen3_5ForCausalLM), and rows in calls of 1, 7 and 256 against one of 600."""
    _need_vllm()
    from vllm.model_executor.layers.fused_qk_norm_rope import fused_qk_rmsnorm_rope_gate

    _, _, _, nh, nkv = MODELS[model]
    T = 600
    g = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn(T, (2 * nh + 2 * nkv) * HEAD, device="cuda", generator=g).bfloat16()
    q_gate, k, _ = qkv.split([2 * nh * HEAD, nkv * HEAD, nkv * HEAD], dim=-1)
    qw, kw = (0.1 * torch.randn(2, HEAD, device="cuda", generator=g)).bfloat16()  # q/k_norm
    cache = _cos_sin_cache()
    pos = torch.randint(0, MAX_POS, (T,), device="cuda", generator=g)  # int64, as vLLM's
    mrope = torch.zeros(3, 2 * T, dtype=torch.int64, device="cuda")  # the runner's buffer
    mrope[:, :T] = pos

    def run(a, b, positions, section=None):
        return fused_qk_rmsnorm_rope_gate(q_gate[a:b], k[a:b], qw, kw, cache, positions, EPS,
                                          nh, nkv, HEAD, ROTARY, norm_beta=1.0,
                                          mrope_section=section)

    names = ("q", "k", "gate")
    want = run(0, T, pos)
    lines = [_diff(f"M-RoPE [11, 11, 10] vs 1-D: {name}", got, w)
             for name, got, w in zip(names, run(0, T, mrope[:, :T], [11, 11, 10]), want)]
    for n in (1, 7, 256):
        stop = 40 if n == 1 else T  # 40 single-row calls are enough
        parts = [run(a, min(a + n, stop), pos[a:min(a + n, stop)]) for a in range(0, stop, n)]
        lines += [_diff(f"calls of {n}: {name}", torch.cat([p[j] for p in parts]), want[j][:stop])
                  for j, name in enumerate(names)]
    problems = _report(f"P11 {model}", lines)
    q, _, gate = want
    per_head = q_gate.view(T, nh, 2, HEAD)
    assert torch.equal(gate.view(T, nh, HEAD), per_head[:, :, 1])  # the gate, copied verbatim
    x = per_head[:, :, 0].float()
    ref = x * (x.square().mean(-1, keepdim=True) + EPS).rsqrt() * (1 + qw.float())
    assert _rel(q.view(T, nh, HEAD)[..., ROTARY:], ref[..., ROTARY:]) < 1e-2  # not rotated
    assert not problems, "\n".join(problems)
