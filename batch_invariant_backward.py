"""Autograd for the vLLM kernels that the simple_rl trainer calls.

vLLM ships forward-only kernels. To train with *exactly* the numbers vLLM computes at
inference, the trainer calls those same kernels in its forward and supplies the backward
here. Every op below has

  * a reference forward in plain PyTorch (`ref_*`), used on CPU, in tests, and as the source
    of reference gradients;
  * a hand-written backward, with its derivative in the docstring, twice: in PyTorch, fp32
    (`*_backward`: the CPU path and the tests' reference), and as a one-pass Triton kernel
    (`*_backward_triton`, `attention_backward_tiled`: the GPU path). Neither uses atomics,
    so two backward passes over the same batch are bitwise equal;
  * an autograd Function that runs a *given* forward and a given backward. With vLLM's
    forwards and the Triton backwards it is the GPU training path; with the reference
    forwards it lets CPU tests check every backward against autograd.

The MoE experts' backward sorts the (token, slot) pairs by expert once; in PyTorch it then loops
over the experts (the CPU path and the reference), in Triton it runs each of its GEMMs as one
grouped launch over every expert (the GPU path).

Qwen3.5's Gated DeltaNet conv and rule have no hand-written backward yet: their autograd
Functions run vLLM's kernels forward (the rule on vLLM's schedule: each prompt chunked as its
prefill, each generated token recurrent as its decode step) and, backward, recompute the fp32
reference and differentiate it with autograd: the gradient of the same math.

One forward is our own: the logprob head's. vLLM's sampler computes the sampled token's
logprob only; the loss also needs the entropy and, for the backward, each row's max and log
sum, so `_logprobs_entropy_kernel` computes all of them with vLLM's reduction, in vLLM's order
(the same bits), from the logits / T that vLLM's sampler divides with its own kernel.

Two kernel sets are built from these, chosen once at start-up: `reference_kernels()` (plain
PyTorch, autograd everywhere) and `vllm_kernels()` (vLLM's batch-invariant kernels + the
Triton backwards).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

Tensor = torch.Tensor


def _wide(t: Tensor) -> Tensor:
    """At least fp32: the precision every backward (and the reference attention) computes in."""
    return t if t.dtype == torch.float64 else t.float()


@dataclass(frozen=True)
class Kernels:
    """The ops a Qwen3 forward needs, as vLLM 0.34 runs them in batch-invariant mode.

    A set the model runs (`reference_kernels`, `vllm_kernels`) has the signatures in the
    comments below. A *forward set* (`reference_forwards`, `vllm_forwards`) is the input of
    `custom_backward_kernels`: its attention also returns the log-sum-exp, its
    logprobs_entropy also the row statistics (max, log sum) that its backward needs.
    """

    name: str
    rms_norm: Callable  # (x (..., D), w (D,), eps) -> y
    add_rms_norm: Callable  # (x, residual, w, eps) -> (y, x + residual)
    rotary: Callable  # (q (T, Hq, D), k (T, Hk, D), positions (T,), cos_sin (P, D)) -> (q, k)
    silu_and_mul: Callable  # (x (T, 2I)) -> (T, I)
    linear: Callable  # (x (T, K), w (N, K)) -> (T, N), computed in x's dtype
    # (a kernel set's linear also takes w_compute: w already cast to x's dtype, or None)
    # (q, k, v, cu_seqlens (B+1,), max_seqlen, scale) -> o (T, Hq, D);
    # a forward set's returns (o, lse (Hq, T))
    attention: Callable
    # (logits (N, V), targets (N,), T) -> (log softmax(logits / T)[target], entropy), fp32 (N,);
    # a forward set's returns (lp[target], entropy, max, log sum)
    logprobs_entropy: Callable
    # (router_logits (T, E), top_k, renormalize) -> (weights (T, k) fp32, ids (T, k) int32)
    moe_topk: Callable
    # (x (T, D), w13 (E, 2I, D), w2 (E, D, I), weights (T, k) fp32, ids (T, k) int32) -> (T, D),
    # computed in x's dtype (w13 rows: gate, then up); w13 and w2 get gradients in their dtypes;
    # casts=(w13, w2) already in x's dtype, if made once for many calls
    moe_experts: Callable
    # (x (T, K), y (T, N), casts (A's, B''s), scale, *masters (A's, then B's)) -> y + LoRA(x),
    # computed with the casts (see LoRAFn); a forward set's: (x, y, A's, B''s) -> u (S, T, r)
    # fp32, adding to y in place
    lora: Callable
    # Qwen3.5's ops (the banners "Qwen3.5: ..." below). Its norms scale by 1 + w:
    gemma_rms_norm: Callable  # (x (..., D), w (D,), eps) -> y
    gemma_add_rms_norm: Callable  # (x, residual, w, eps) -> (y, x + residual)
    sigmoid_gate_mul: Callable  # (o, gate) -> o * sigmoid(gate), gate broadcast to o's shape
    rms_norm_gated: Callable  # (x (..., D), z (..., D), w (D,), eps) -> rms_norm(x) w silu(z)
    causal_conv1d: Callable  # (x (T, C), w (C, K), cu_seqlens, max_seqlen) -> (T, C)
    # (q, k (T, Hk, Dk), v (T, Hv, Dv), a, b (T, Hv), A_log, dt_bias (Hv,), cu_seqlens,
    # max_seqlen, prefill (B,)) -> o (T, Hv, Dv): the gated delta rule over each sequence from
    # a zero state (vLLM's: each sequence's first prefill[n] tokens chunked, the rest recurrent)
    gated_delta_rule: Callable
    # (q_gate (T, Hq 2D), k (T, Hk D), wq, wk (D,), eps, positions (T,), cos_sin (P, R)) ->
    # (q (T, Hq, D), k (T, Hk, D), gate (T, Hq, D)): Gemma-normed, the first R dims turned
    gated_qk_norm_rope: Callable


# ---------------------------------------------------------------------------
# RMSNorm (vLLM: Triton `rms_norm_batch_invariant`; with residual, `fused_add_rms_norm`)
# ---------------------------------------------------------------------------


def ref_rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """y = x / sqrt(mean(x^2) + eps) * w, in fp32, rounded once (as the Triton kernel)."""
    xf = _wide(x)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * r * _wide(w)).to(x.dtype)


def ref_add_rms_norm(x: Tensor, residual: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """s = x + residual (rounded to x.dtype); y = round(s / rms(s)) * w, as vLLM's CUDA kernel."""
    s = x + residual
    sf = _wide(s)
    r = torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    return (sf * r).to(x.dtype) * w, s


def rms_norm_backward(x: Tensor, w: Tensor, gy: Tensor, eps: float,
                      gs: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Gradients of y = x_hat * w with x_hat = x * r, r = (mean(x^2) + eps)^-1/2.

    dx = r * (gy*w - x_hat * mean(gy*w*x_hat))  (+ gs, the gradient reaching x by another path)
    dw = sum_rows(gy * x_hat)                     (per row, over the last dim D)
    """
    d = x.shape[-1]
    xf, gf, wf = _wide(x), _wide(gy), _wide(w)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = xf * r
    gw = gf * wf
    dx = r * (gw - x_hat * (gw * x_hat).mean(-1, keepdim=True))
    dw = (gf * x_hat).reshape(-1, d).sum(0)
    dx = dx.to(x.dtype) if gs is None else dx.to(x.dtype) + gs
    return dx, dw.to(w.dtype)


class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps, fwd, bwd):
        ctx.save_for_backward(x, w)
        ctx.eps, ctx.bwd = eps, bwd
        return fwd(x, w, eps)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        dx, dw = ctx.bwd(x, w, gy, ctx.eps)
        return dx, dw, None, None, None


class AddRMSNormFn(torch.autograd.Function):
    """(y, s) = (rms_norm(x + residual) * w, x + residual); ds collects both paths (dy, ds)."""

    @staticmethod
    def forward(ctx, x, residual, w, eps, fwd, bwd):
        y, s = fwd(x, residual, w, eps)
        ctx.save_for_backward(s, w)
        ctx.eps, ctx.bwd = eps, bwd
        return y, s

    @staticmethod
    def backward(ctx, gy, gs):
        s, w = ctx.saved_tensors
        ds, dw = ctx.bwd(s, w, gy, ctx.eps, gs)
        return ds, ds, dw, None, None, None


# ---------------------------------------------------------------------------
# Rotary embedding (vLLM: CUDA `rotary_embedding`, NeoX layout, bf16 cos/sin cache)
# ---------------------------------------------------------------------------


def rope_cos_sin_cache(head_dim: int, theta: float, max_positions: int, device, dtype) -> Tensor:
    """cache[p] = [cos(p * f), sin(p * f)], f_i = theta^(-2i/D): fp32 on `device`, then cast.

    vLLM builds its cache the same way on the GPU at model load; building ours on the
    same device with the same fp32 ops gives the same bits.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    t = torch.arange(max_positions, dtype=torch.float, device=device)
    freqs = torch.outer(t, inv_freq)  # (P, D/2)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)  # (P, D)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """NeoX rotation of x = [x1, x2, rest]: [x1*cos - x2*sin, x2*cos + x1*sin, rest] (each op
    rounds), x1 and x2 as wide as cos; `rest` is empty but for partial rotary (Qwen3.5 rotates
    the first quarter of each head and passes the rest through)."""
    rot = 2 * cos.shape[-1]
    x1, x2 = x[..., :rot].chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rot:]), dim=-1)


def ref_rotary(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor) -> tuple[Tensor, Tensor]:
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # (T, 1, R/2), R rotated
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def rotary_backward(gq: Tensor, gk: Tensor, positions: Tensor,
                    cos_sin: Tensor) -> tuple[Tensor, Tensor]:
    """The rotation R(p) is orthogonal, so dx = R(p)^T g = R(-p) g: rotate by -sin, in fp32."""
    cos, sin = _wide(cos_sin[positions]).unsqueeze(1).chunk(2, dim=-1)
    return tuple(_rotate(_wide(g), cos, -sin).to(g.dtype) for g in (gq, gk))


class RotaryFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, positions, cos_sin, fwd, bwd):
        ctx.save_for_backward(positions, cos_sin)
        ctx.bwd = bwd
        return fwd(q, k, positions, cos_sin)

    @staticmethod
    def backward(ctx, gq, gk):
        positions, cos_sin = ctx.saved_tensors
        dq, dk = ctx.bwd(gq, gk, positions, cos_sin)
        return dq, dk, None, None, None, None


# ---------------------------------------------------------------------------
# SiluAndMul (vLLM: CUDA `silu_and_mul`)
# ---------------------------------------------------------------------------


def ref_silu_and_mul(x: Tensor) -> Tensor:
    """y = silu(a) * b for x = [a, b] (each op rounds to x.dtype, as the kernel)."""
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


def silu_and_mul_backward(x: Tensor, gy: Tensor) -> Tensor:
    """With s = sigmoid(a): da = gy * b * s * (1 + a * (1 - s)),  db = gy * a * s."""
    a, b = _wide(x).chunk(2, dim=-1)
    g = _wide(gy)
    s = torch.sigmoid(a)
    da = g * b * s * (1 + a * (1 - s))
    db = g * a * s
    return torch.cat((da, db), dim=-1).to(x.dtype)


class SiluAndMulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd, bwd):
        ctx.save_for_backward(x)
        ctx.bwd = bwd
        return fwd(x)

    @staticmethod
    def backward(ctx, gy):
        (x,) = ctx.saved_tensors
        return ctx.bwd(x, gy), None, None


# ---------------------------------------------------------------------------
# Linear (vLLM: Triton persistent matmul `linear_batch_invariant`)
# ---------------------------------------------------------------------------


def _mm(a: Tensor, b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a @ b with the sum (and result) in out_dtype: one GEMM on CUDA; on CPU, which has no
    mixed-dtype GEMM, on widened operands (exact)."""
    if out_dtype == a.dtype:
        return a @ b
    if not a.is_cuda:
        return a.to(out_dtype) @ b.to(out_dtype)
    return torch.mm(a, b, out_dtype=out_dtype)


def linear_backward(x: Tensor, w: Tensor, gy: Tensor,
                    w_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """y = x w^T  =>  dx = gy w,  dw = gy^T x. Plain GEMMs: deterministic for fixed shapes.

    dw is returned in w_dtype, the master's: for an fp32 master of bf16 compute the GEMM sums
    straight into fp32 (CUDA), with no bf16 rounding and no separate cast.
    """
    return gy @ w, _mm(gy.t(), x, w_dtype)


class LinearFn(torch.autograd.Function):
    """y = x W^T with W = w cast to x's dtype (or the given cast of w, w_compute); w's gradient
    comes back in w's own dtype."""

    @staticmethod
    def forward(ctx, x, w, fwd, w_compute=None):
        if w_compute is None:
            w_compute = w.to(x.dtype)  # the bf16 weight the engine holds (a no-op under FSDP)
        ctx.save_for_backward(x, w_compute)
        ctx.w_dtype = w.dtype
        return fwd(x, w_compute)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:  # a frozen base (LoRA): no weight gradient, no GEMM
            return gy @ w, None, None, None
        dx, dw = linear_backward(x, w, gy, ctx.w_dtype)
        return dx, dw, None, None


# ---------------------------------------------------------------------------
# LoRA (vLLM: `lora_shrink` then `lora_expand`, its punica Triton kernels, split-K off)
# ---------------------------------------------------------------------------
# A layer whose output is the concatenation of S slices (vLLM's packed qkv_proj: q, k, v;
# gate_up_proj: gate, up; one slice elsewhere) has one A_s (r, K) and B_s (n_s, r) per slice.
# The engine holds them as `lora_a_stacked[s]` (1, 1, r, K) and `lora_b_stacked[s]`
# (1, 1, n_s, r) in the compute dtype, the scale folded into B (B' = scale * B), and computes
#     u_s = x A_s^T                       (T, r) summed in fp32 (shrink)
#     y_s <- y_s + rnd(rnd(u_s) B'_s^T)   (T, n_s) summed in fp32, rounded, added (expand)
# with rnd the rounding to the compute dtype. The trainer calls the same two kernels on the
# same tensors.


def ref_lora(x: Tensor, y: Tensor, a: Sequence[Tensor], b: Sequence[Tensor]) -> Tensor:
    """The two kernels in PyTorch: y gets every slice's update in place; returns u (S, T, r)
    fp32."""
    u = torch.stack([x.float() @ a_s.flatten(0, -2).float().t() for a_s in a])  # (S, T, r)
    start = 0
    for u_s, b_s in zip(u, b):
        b_s = b_s.flatten(0, -2)  # (n_s, r)
        y[:, start:start + len(b_s)] += (u_s.to(x.dtype).float() @ b_s.float().t()).to(y.dtype)
        start += len(b_s)
    return u


def lora_backward(x: Tensor, u: Tensor, a: Sequence[Tensor], b: Sequence[Tensor], gy: Tensor,
                  scale: float) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """y_s = base_s + (u_s B'_s^T), u_s = x A_s^T, B'_s = scale B_s (roundings passed through)
    =>  g_s = gy_s B'_s,  dA_s = g_s^T x,  dB_s = scale gy_s^T u_s,  dx = [g_s]_s [A_s]_s.

    dA and dB in fp32 (the masters' dtype), from compute-dtype operands, summed over the tokens
    by `token_sum_mm`; dx is one GEMM over every slice's r columns."""
    starts = [0]
    for b_s in b:
        starts.append(starts[-1] + b_s.shape[-2])
    gys = [gy[:, lo:hi] for lo, hi in zip(starts, starts[1:])]  # (T, n_s) views
    g = torch.cat([gy_s @ b_s.flatten(0, -2) for gy_s, b_s in zip(gys, b)], 1)  # (T, S r)
    r = u.shape[-1]
    da = token_sum_mm(g, x).split(r)  # S x (r, K)
    db = [scale * token_sum_mm(gy_s, u_s.to(x.dtype)) for gy_s, u_s in zip(gys, u)]  # (n_s, r)
    dx = g @ torch.cat([a_s.flatten(0, -2) for a_s in a])  # (T, S r) @ (S r, K)
    return dx, list(da), db


# A weight gradient sums over every token: (M, T) @ (T, N) with M or N the rank (8-64). With
# split-K off (vLLM's batch-invariant cuBLAS), such a GEMM has a handful of output tiles, each
# looping over all T tokens: a few SMs of 132 busy. The tokens are cut into chunks instead,
# each chunk's product on its own tiles (one grouped launch), and the chunks summed in order:
# every SM busy, the bits fixed by the shapes alone.
TOKEN_SUM_TILES = 512  # about 4 waves of 128 x 128 tiles on an H200


def token_sum_mm(left: Tensor, right: Tensor) -> Tensor:
    """left^T right = sum_t left[t]^T right[t]: (T, M), (T, N) -> (M, N) in fp32.

    CUDA: C chunks of the T rows (C = TOKEN_SUM_TILES / the tiles of one product, at most one
    chunk per 256 rows), each summed in fp32 by `grouped_wgrad`, then summed over C in order.
    CPU: one GEMM on widened operands."""
    if not left.is_cuda:
        return _mm(left.t(), right, torch.float32)
    T, M, N = left.shape[0], left.shape[1], right.shape[1]
    blk = GROUPED_BLOCK
    tiles = triton.cdiv(M, blk["BM"]) * triton.cdiv(N, blk["BN"])
    chunks = max(1, min(triton.cdiv(TOKEN_SUM_TILES, tiles), T // 256))
    bounds = torch.arange(chunks + 1, device=left.device) * T // chunks  # (C + 1,) int64
    return grouped_wgrad(left, right, bounds, torch.float32).sum(0)


class LoRAFn(torch.autograd.Function):
    """y + LoRA(x), in place on y (the base layer's output), computed with the compute-dtype
    weights `casts` = (A's, B''s) by `fwd`; the gradients go to the fp32 masters (A's, B's)."""

    @staticmethod
    def forward(ctx, x, y, casts, scale, fwd, *masters):
        a, b = casts
        u = fwd(x, y, a, b)  # (S, T, r) fp32
        ctx.mark_dirty(y)
        ctx.save_for_backward(x, u, *a, *b)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, gy):
        x, u, *ab = ctx.saved_tensors
        S = len(u)
        dx, da, db = lora_backward(x, u, ab[:S], ab[S:], gy, ctx.scale)
        return dx, gy, None, None, None, *da, *db


# ---------------------------------------------------------------------------
# Tensor parallelism (vLLM: RowParallelLinear's partial GEMMs, summed by NCCL; see
# docs/tensor_parallel.md)
# ---------------------------------------------------------------------------
# What a trainer must compute to match a TP = n engine, proved on gloo ranks
# (tests/test_tensor_parallel.py). No run uses it yet: rollouts with tensor parallelism need
# two GPUs to be measured first.


def tensor_parallel_sum(parts: Tensor, order: Sequence[int] | None = None) -> Tensor:
    """s = (((p[o_0] + p[o_1]) + p[o_2]) + ... ) + p[o_{n-1}], each + rounded to parts' dtype.

    What the all-reduce of a batch-invariant vLLM engine computes from its n ranks' partials
    parts (n, ...): vLLM turns its custom and symmetric-memory all-reduces off, so NCCL sums,
    with NCCL_ALGO=allreduce:tree: inside one host a chain in which each rank adds the sum it
    receives to its own partial in the partials' dtype (bf16: one rounded add per hop) and
    passes it on. For n = 2 every order gives fl(p0 + p1), the same bits; for n > 2 `order`
    (the ranks from the chain's tail to its root) must be given: it is NCCL's topology's, to be
    measured on the GPUs, not assumed.
    """
    n = parts.shape[0]
    assert order is not None or n <= 2, "n > 2 partials: pass the chain order measured on GPUs"
    order = list(range(n)) if order is None else list(order)
    assert sorted(order) == list(range(n)), f"order {order} is not a permutation of {n} ranks"
    s = parts[order[0]]
    for r in order[1:]:
        s = s + parts[r]  # in parts' dtype: rounded at every hop, as NCCL's bf16 __hadd
    return s


def row_parallel_linear(x: Tensor, w: Tensor, n: int, linear: Callable = F.linear,
                        order: Sequence[int] | None = None) -> Tensor:
    """y = x W^T as a TP = n engine computes o_proj and down_proj (RowParallelLinear).

    Rank r holds the K columns K_r = [r K/n, (r+1) K/n) (its heads' attention output, its
    slice of the MLP's intermediate), and its GEMM writes p_r = x[:, K_r] W[:, K_r]^T, summed
    over K_r in fp32 and rounded to x's dtype; then y = tensor_parallel_sum(p, order). One GEMM
    over all of K rounds once; this rounds every partial and every add, so the bits differ.
    x (T, K), w (D, K) in x's dtype, `linear` the GEMM each rank calls. Its gradient is a plain
    linear layer's (dx = gy W, dW = gy^T x): LinearFn.apply(x, w, partial(row_parallel_linear,
    n=n), ...) trains it.
    """
    K = x.shape[-1]
    assert K % n == 0, f"K = {K} does not split over {n} ranks"
    parts = [linear(xr.contiguous(), wr.contiguous())  # each (T, D): what rank r holds
             for xr, wr in zip(x.split(K // n, dim=-1), w.split(K // n, dim=-1))]
    return tensor_parallel_sum(torch.stack(parts), order)  # (T, D)


# ---------------------------------------------------------------------------
# Attention (vLLM: FlashAttention 3 varlen, causal, num_splits=1)
# ---------------------------------------------------------------------------


def _pad(packed: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> tuple[Tensor, Tensor]:
    """(T, H, D) packed -> (B, H, L, D) zero-padded, at least fp32, plus the valid mask (B, L)."""
    starts, lens = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    pos = torch.arange(max_seqlen, device=packed.device)
    valid = pos[None, :] < lens[:, None]  # (B, L)
    index = torch.where(valid, starts[:, None] + pos[None, :], 0)  # (B, L)
    return _wide(packed)[index].masked_fill(~valid[..., None, None], 0).transpose(1, 2), valid


def _unpad(padded: Tensor, valid: Tensor) -> Tensor:
    """(B, H, L, D) -> (T, H, D): valid rows in row-major order are exactly the packed order."""
    return padded.transpose(1, 2)[valid]


def _masked_scores(q: Tensor, k: Tensor, valid: Tensor, scale: float) -> Tensor:
    """S = q k^T * scale, masked: q (B, Hq, L, D), k (B, Hk, L, D) -> (B, Hq, L, L)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # GQA: (B, Hq, L, D)
    s = q @ k.transpose(-1, -2) * scale
    L = q.shape[2]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    return s.masked_fill(~(causal & valid[:, None, None, :]), float("-inf"))


def ref_attention(q, k, v, cu_seqlens, max_seqlen: int, scale: float) -> tuple[Tensor, Tensor]:
    """Causal varlen attention o = softmax(q k^T * scale) v per sequence, in fp32 (padded)."""
    qp, valid = _pad(q, cu_seqlens, max_seqlen)
    kp, _ = _pad(k, cu_seqlens, max_seqlen)
    vp, _ = _pad(v, cu_seqlens, max_seqlen)
    s = _masked_scores(qp, kp, valid, scale)  # (B, Hq, L, L)
    lse = torch.logsumexp(s, dim=-1)  # (B, Hq, L)
    vp = vp.repeat_interleave(qp.shape[1] // vp.shape[1], dim=1)
    o = torch.exp(s - lse[..., None]) @ vp  # (B, Hq, L, D)
    return _unpad(o, valid).to(q.dtype), _unpad(lse[..., None], valid)[..., 0].t()


def attention_backward(q, k, v, o, lse, go, cu_seqlens, max_seqlen: int, scale: float):
    """Flash-attention backward, recomputing P from the saved log-sum-exp:

    P = exp(S - lse),  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dO * O)),
    dQ = dS K * scale,  dK = dS^T Q * scale;  GQA heads sum their group's dK, dV.
    """
    qp, valid = _pad(q, cu_seqlens, max_seqlen)
    kp, _ = _pad(k, cu_seqlens, max_seqlen)
    vp, _ = _pad(v, cu_seqlens, max_seqlen)
    op, _ = _pad(o, cu_seqlens, max_seqlen)
    gop, _ = _pad(go, cu_seqlens, max_seqlen)
    lsep = _pad(lse.t()[..., None], cu_seqlens, max_seqlen)[0][..., 0]  # (B, Hq, L)
    group = qp.shape[1] // kp.shape[1]
    p = torch.exp(_masked_scores(qp, kp, valid, scale) - lsep[..., None])  # (B, Hq, L, L)
    p = p.masked_fill(~valid[:, None, :, None], 0)  # padded query rows carry no gradient
    dv = p.transpose(-1, -2) @ gop  # (B, Hq, L, D)
    dp = gop @ vp.repeat_interleave(group, dim=1).transpose(-1, -2)
    ds = p * (dp - (gop * op).sum(-1, keepdim=True))
    dq = ds @ kp.repeat_interleave(group, dim=1) * scale
    dk = ds.transpose(-1, -2) @ qp * scale

    def fold(t):  # (B, Hq, L, D) -> (B, Hk, L, D): sum each GQA group, in a fixed order
        return t.unflatten(1, (kp.shape[1], group)).sum(2)

    return (
        _unpad(dq, valid).to(q.dtype),
        _unpad(fold(dk), valid).to(k.dtype),
        _unpad(fold(dv), valid).to(v.dtype),
    )


class AttentionFn(torch.autograd.Function):
    """Runs a given forward and a given backward (the padded PyTorch one, or the Triton one)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, scale, fwd, bwd):
        o, lse = fwd(q, k, v, cu_seqlens, max_seqlen, scale)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
        ctx.max_seqlen, ctx.scale, ctx.bwd = max_seqlen, scale, bwd
        return o

    @staticmethod
    def backward(ctx, go):
        q, k, v, o, lse, cu = ctx.saved_tensors
        dq, dk, dv = ctx.bwd(q, k, v, o, lse, go, cu, ctx.max_seqlen, ctx.scale)
        return dq, dk, dv, None, None, None, None, None


# The padded backward above materialises (B, Hq, L, L) fp32 scores: fine for tests, ~1 s per step
# at 1.7B with 256 sequences of 384 tokens. On the GPU the same math runs tile by tile in two
# Triton kernels: one program per (key block, sequence, kv head) accumulates dK, dV over its
# query blocks and GQA heads; one program per (query block, sequence, q head) accumulates dQ.
# Each program owns its output tile and loops in a fixed order (no atomics), so the gradients
# are bitwise reproducible. P and dS are rounded to the input dtype before their matmuls, as
# FlashAttention's own backward does; accumulation is fp32.
def attention_block(head_dim: int) -> int:
    """Rows and keys of a tile: 64, or 32 past head_dim 128 (Qwen3.5's 256), where 64-row
    tiles need 265 KiB of shared memory and an H200 has 227."""
    return 64 if head_dim <= 128 else 32


@triton.jit
def _tile_grads(q, k, v, do, lse, delta, offs_m, offs_n, length, scale):
    """P and dS of one (query block, key block) tile, with the causal and length mask."""
    keep = (offs_m[:, None] < length) & (offs_n[None, :] <= offs_m[:, None])
    p = tl.where(keep, tl.exp(tl.dot(q, tl.trans(k)) * scale - lse[:, None]), 0.0)  # (BM, BN)
    ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
    return p, ds


@triton.jit
def _query_block(Q, DO, LSE, DELTA, start, offs_m, offs_d, length, h, q_t, q_h, n_tok):
    """q, dO (BM, D), lse and delta (BM,) of query rows offs_m of head h (0 past the sequence)."""
    m_ok = offs_m < length
    qo = (start + offs_m)[:, None] * q_t + h * q_h + offs_d[None, :]
    q = tl.load(Q + qo, mask=m_ok[:, None], other=0.0)
    do = tl.load(DO + qo, mask=m_ok[:, None], other=0.0)
    lse = tl.load(LSE + h * n_tok + start + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + h * n_tok + start + offs_m, mask=m_ok, other=0.0)
    return q, do, lse, delta, qo


@triton.jit
def dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU, scale, q_t, q_h, k_t, k_h, n_tok,
                GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    b, hk = tl.program_id(1), tl.program_id(2)
    start = tl.load(CU + b)
    length = tl.load(CU + b + 1) - start
    n0 = tl.program_id(0) * BN
    if n0 < length:
        offs_n, offs_d = n0 + tl.arange(0, BN), tl.arange(0, D)
        kv = (start + offs_n)[:, None] * k_t + hk * k_h + offs_d[None, :]
        n_ok = (offs_n < length)[:, None]
        k = tl.load(K + kv, mask=n_ok, other=0.0)
        v = tl.load(V + kv, mask=n_ok, other=0.0)
        dk = tl.zeros([BN, D], dtype=tl.float32)
        dv = tl.zeros([BN, D], dtype=tl.float32)
        for g in range(GROUP):  # the q heads that share this kv head, in order
            h = hk * GROUP + g
            for m0 in range((n0 // BM) * BM, length, BM):  # causal: queries at or after the keys
                offs_m = m0 + tl.arange(0, BM)
                q, do, lse, delta, _ = _query_block(Q, DO, LSE, DELTA, start, offs_m, offs_d,
                                                    length, h, q_t, q_h, n_tok)
                p, ds = _tile_grads(q, k, v, do, lse, delta, offs_m, offs_n, length, scale)
                dv += tl.dot(tl.trans(p.to(do.dtype)), do)
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
        tl.store(DK + kv, (dk * scale).to(DK.dtype.element_ty), mask=n_ok)
        tl.store(DV + kv, dv.to(DV.dtype.element_ty), mask=n_ok)


@triton.jit
def dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU, scale, q_t, q_h, k_t, k_h, n_tok,
              GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    b, h = tl.program_id(1), tl.program_id(2)
    start = tl.load(CU + b)
    length = tl.load(CU + b + 1) - start
    m0 = tl.program_id(0) * BM
    if m0 < length:
        offs_m, offs_d = m0 + tl.arange(0, BM), tl.arange(0, D)
        q, do, lse, delta, qo = _query_block(Q, DO, LSE, DELTA, start, offs_m, offs_d, length, h,
                                             q_t, q_h, n_tok)
        dq = tl.zeros([BM, D], dtype=tl.float32)
        for n0 in range(0, tl.minimum(m0 + BM, length), BN):  # causal: keys up to the last query
            offs_n = n0 + tl.arange(0, BN)
            kv = (start + offs_n)[:, None] * k_t + (h // GROUP) * k_h + offs_d[None, :]
            k = tl.load(K + kv, mask=(offs_n < length)[:, None], other=0.0)
            v = tl.load(V + kv, mask=(offs_n < length)[:, None], other=0.0)
            _, ds = _tile_grads(q, k, v, do, lse, delta, offs_m, offs_n, length, scale)
            dq += tl.dot(ds.to(k.dtype), k)
        tl.store(DQ + qo, (dq * scale).to(DQ.dtype.element_ty), mask=(offs_m < length)[:, None])


@triton.jit
def _attention_delta_kernel(O, DO, DELTA, n_rows, H, T, D: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # over T * H, token-major
    ok = (rows < n_rows)[:, None]
    at = rows.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    o = tl.load(O + at, mask=ok, other=0.0).to(tl.float32)
    do = tl.load(DO + at, mask=ok, other=0.0).to(tl.float32)
    tl.store(DELTA + (rows % H) * T + rows // H, tl.sum(o * do, axis=1), mask=rows < n_rows)


def attention_backward_tiled(q, k, v, o, lse, go, cu_seqlens, max_seqlen: int, scale: float):
    """The math of `attention_backward`, tile by tile in Triton.

    q, o, go (T, Hq, D); k, v (T, Hk, D); lse (Hq, T).

    delta = rowsum(dO * O) (Hq, T) is computed once up front, in fp32, in one pass.
    """
    q, k, v, o, go = (t.contiguous() for t in (q, k, v, o, go))
    T, Hq, D = q.shape
    Hk, B = k.shape[1], cu_seqlens.numel() - 1
    lse = lse.float().contiguous()  # (Hq, T)
    delta = torch.empty(Hq, T, dtype=torch.float32, device=q.device)
    _attention_delta_kernel[(-(-T * Hq // 32),)](o, go, delta, T * Hq, Hq, T, D=D, BLOCK_R=32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    block = attention_block(D)
    blocks = -(-max_seqlen // block)
    common = dict(GROUP=Hq // Hk, D=D, BM=block, BN=block)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), T)
    dkdv_kernel[(blocks, B, Hk)](q, k, v, go, lse, delta, dk, dv, cu_seqlens, scale, *strides,
                                 **common)
    dq_kernel[(blocks, B, Hq)](q, k, v, go, lse, delta, dq, cu_seqlens, scale, *strides, **common)
    return dq, dk, dv


# ---------------------------------------------------------------------------
# Logprobs and entropy (vLLM: its sampler's logits / T, then its Triton logprob kernel)
# ---------------------------------------------------------------------------


def tempered(logits: Tensor, temperature: float) -> Tensor:
    """z = float(logits) / T, (N, V) fp32, in PyTorch: the reference, and what the backward
    recomputes (within an ulp of `sampler_logits`, whose division is Triton's).

    T is divided as a fp32 *device tensor* (a Python scalar would make CUDA multiply by 1/T).
    Dividing the bf16 logits by it promotes each to fp32 exactly first.
    """
    t = torch.full((1, 1), temperature, dtype=_wide(logits).dtype, device=logits.device)
    return logits / t


def sampler_logits(logits: Tensor, temperature: float) -> Tensor:
    """z = logits / T exactly as vLLM's (V2) sampler hands it to its logprob kernel, (N, V).

    At T = 1 the sampler changes nothing and keeps the logits in their own dtype (bf16); else
    it copies them to fp32 and divides them in place with its Triton temperature kernel, whose
    fp32 division rounds as Triton's does, not always as PyTorch's. So: the same two cases, the
    second through vLLM's own kernel. On the CPU (Triton's interpreter, in the tests): `tempered`.
    """
    if not logits.is_cuda:
        return tempered(logits, temperature)
    if temperature == 1.0:
        return logits.contiguous()
    from vllm.v1.worker.gpu.sample.gumbel import apply_temperature

    z = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).copy_(logits)
    request = torch.zeros(z.shape[0], dtype=torch.int32, device=z.device)  # every row: T[0]
    apply_temperature(z, request, torch.full((1,), temperature, device=z.device))
    return z


def ref_logprobs_entropy(logits: Tensor, targets: Tensor,
                         temperature: float) -> tuple[Tensor, Tensor]:
    """(lp[target], -sum exp(lp) * lp), both fp32 (N,), with lp = log_softmax(logits / T)."""
    lp = torch.log_softmax(tempered(logits, temperature), dim=-1)
    return lp.gather(-1, targets[:, None])[:, 0], -(lp.exp() * lp).sum(-1)


def ref_logprobs_entropy_stats(logits: Tensor, targets: Tensor, temperature: float):
    """`ref_logprobs_entropy` as a forward set's op: also the row statistics (max, log sum),
    fp32 (N,) each, from which the backward recomputes every lp without a log_softmax:

        z = logits / T,  m = max_j z_j,  s = sum_j exp(z_j - m),  lp_j = (z_j - m) - log s.
    """
    z = tempered(logits, temperature)
    m = z.amax(-1)
    log_s = (z - m[:, None]).exp().sum(-1).log()
    lp_t, entropy = ref_logprobs_entropy(logits, targets, temperature)
    return lp_t, entropy, m, log_s


def logprobs_entropy_backward(logits: Tensor, targets: Tensor, m: Tensor, log_s: Tensor,
                              entropy: Tensor, g_lp: Tensor, g_ent: Tensor,
                              temperature: float) -> Tensor:
    """Gradient w.r.t. the logits of (lp[t], H), with lp_j = (z_j - m) - log s, p = exp(lp):

    d lp[t] / dz_j = [j = t] - p_j,   dH / dz_j = -p_j (lp_j + H),   d/dlogits = d/dz / T.
    In LOGPROB_ROWS rows at a time (no (N, V) fp32 tensor alive); returns the logits' dtype.
    """
    out = torch.empty_like(logits)
    t = torch.full((1, 1), temperature, dtype=_wide(logits).dtype, device=logits.device)
    for start in range(0, logits.shape[0], LOGPROB_ROWS):
        s = slice(start, start + LOGPROB_ROWS)
        lp = tempered(logits[s], temperature) - m[s, None] - log_s[s, None]  # (rows, V)
        dz = -lp.exp() * (g_lp[s, None] + g_ent[s, None] * (lp + entropy[s, None]))
        dz.scatter_add_(-1, targets[s, None], g_lp[s, None])
        out[s] = dz / t
    return out


# vLLM's sampler computes a token's logprob with `_topk_log_softmax_kernel`: one program per
# row, over blocks of this many columns; pass 1 takes the max, pass 2 adds up each block's
# tl.sum of exp(z - max), then z[token] - max - log(sum). The order of that sum is fixed by the
# block size and by the layout Triton gives a block of loads of z's dtype (bf16 at T = 1, fp32
# else), so the kernel below, which reads the same z in the same blocks, adds the same numbers
# in the same order: its lp of the target is vLLM's, bit for bit (a GPU test compares them on
# every row of a 2048 x 151,936 batch). It also writes the entropy and the row statistics.
LOG_SOFTMAX_BLOCK = 1024


@triton.jit
def _logprobs_entropy_kernel(Z, TGT, LP_T, ENT, M, LOG_S, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * V
    m = -float("inf")  # pass 1: the max, as vLLM's pass 1
    for c0 in range(0, V, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        m = tl.max(tl.maximum(tl.load(z_row + cols, mask=cols < V, other=-float("inf")), m))
    s = 0.0  # pass 2: vLLM's sum of exp(z - m), block by block; alongside, a = sum e (z - m)
    a = 0.0
    for c0 in range(0, V, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ok = cols < V
        z = tl.load(z_row + cols, mask=ok, other=0.0)
        e = tl.exp(z - m)
        s += tl.sum(tl.where(ok, e, 0.0))
        a += tl.sum(tl.where(ok, e * (z - m), 0.0))
    log_s = tl.log(s)
    tl.store(LP_T + row, tl.load(z_row + tl.load(TGT + row)) - m - log_s)  # vLLM's pass 3, once
    tl.store(ENT + row, log_s - a / s)  # H = -sum p lp = log s - a / s
    tl.store(M + row, m)
    tl.store(LOG_S + row, log_s)


def logprobs_entropy_triton(logits: Tensor, targets: Tensor, temperature: float):
    """`ref_logprobs_entropy_stats` on the GPU: lp[target] with vLLM's bits, the entropy, and
    the row statistics (max, log sum), fp32 (N,) each, from one read of z = logits / T for the
    max and one for the sums."""
    z = sampler_logits(logits, temperature)  # (N, V), contiguous
    n, v = z.shape
    lp_t, entropy, m, log_s = torch.empty(4, n, dtype=torch.float32, device=z.device)
    _logprobs_entropy_kernel[(n,)](z, targets.contiguous(), lp_t, entropy, m, log_s, v,
                                   BLOCK=LOG_SOFTMAX_BLOCK)
    return lp_t, entropy, m, log_s


# Rows of z (N, V) fp32 alive at once in the forward: the whole (N, V) fp32 tensor is never
# materialised (the bf16 logits are what is kept). Every op is row-wise, so a row's values
# do not depend on the chunk it is computed in.
LOGPROB_ROWS = 1024


class LogprobsEntropyFn(torch.autograd.Function):
    """Runs a given forward (vLLM's numbers, with the row statistics) LOGPROB_ROWS rows at a
    time, and a given backward; keeps the bf16 logits and two floats a row."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, fwd, bwd):
        lp_t, entropy, m, log_s = torch.empty(4, logits.shape[0], dtype=_wide(logits).dtype,
                                              device=logits.device)
        for start in range(0, logits.shape[0], LOGPROB_ROWS):
            s = slice(start, start + LOGPROB_ROWS)
            lp_t[s], entropy[s], m[s], log_s[s] = fwd(logits[s], targets[s], temperature)
        ctx.save_for_backward(logits, targets, m, log_s, entropy)
        ctx.temperature, ctx.bwd = temperature, bwd
        return lp_t, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, targets, m, log_s, entropy = ctx.saved_tensors
        g_lp = torch.zeros_like(entropy) if g_lp is None else g_lp.to(entropy.dtype)
        g_ent = torch.zeros_like(entropy) if g_ent is None else g_ent.to(entropy.dtype)
        d_logits = ctx.bwd(logits, targets, m, log_s, entropy, g_lp.contiguous(),
                           g_ent.contiguous(), ctx.temperature)
        return d_logits, None, None, None, None


# ---------------------------------------------------------------------------
# The other backwards on the GPU: one fused Triton pass each
# ---------------------------------------------------------------------------
# The PyTorch backwards above make a dozen fp32 passes over their tensors; at 1.7B these
# elementwise passes took more GPU time than the GEMMs. Each kernel below computes the same
# formula as its PyTorch twin in one pass, in fp32, rounding once. None uses atomics; the
# RMSNorm weight gradient is summed per program and then over programs in a fixed order.


@triton.jit
def _rms_norm_bwd_kernel(X, W, GY, GS, DX, DW_PART, n_rows, D, eps, rows_per_prog,
                         HAS_GS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    c_ok = cols < D
    w = tl.load(W + cols, mask=c_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for r0 in range(pid * rows_per_prog, (pid + 1) * rows_per_prog, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        ok = (rows < n_rows)[:, None] & c_ok[None, :]
        at = rows.to(tl.int64)[:, None] * D + cols[None, :]
        x = tl.load(X + at, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(GY + at, mask=ok, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)  # (BLOCK_R,)
        x_hat = x * r[:, None]
        gw = g * w[None, :]
        dx = r[:, None] * (gw - x_hat * (tl.sum(gw * x_hat, axis=1) / D)[:, None])
        if HAS_GS:
            dx += tl.load(GS + at, mask=ok, other=0.0).to(tl.float32)
        tl.store(DX + at, dx.to(DX.dtype.element_ty), mask=ok)
        dw += tl.sum(g * x_hat, axis=0)
    tl.store(DW_PART + pid * D + cols, dw, mask=c_ok)


def rms_norm_backward_triton(x: Tensor, w: Tensor, gy: Tensor, eps: float,
                             gs: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`rms_norm_backward` in one pass over the rows (x, gy (..., D)); dw from per-program sums."""
    d = x.shape[-1]
    x2, g2 = x.reshape(-1, d).contiguous(), gy.reshape(-1, d).contiguous()
    n = x2.shape[0]
    block_d = triton.next_power_of_2(d)
    block_r = max(1, 4096 // block_d)
    rows_per_prog = -(-n // min(1024, max(1, n)))  # at most 1024 programs...
    rows_per_prog = -(-rows_per_prog // block_r) * block_r  # ...each a whole number of row blocks
    programs = -(-n // rows_per_prog)
    dx = torch.empty_like(x2)
    part = torch.empty(programs, d, dtype=torch.float32, device=x.device)
    gs2 = gs.reshape(-1, d).contiguous() if gs is not None else x2
    _rms_norm_bwd_kernel[(programs,)](x2, w, g2, gs2, dx, part, n, d, eps, rows_per_prog,
                                      HAS_GS=gs is not None, BLOCK_R=block_r, BLOCK_D=block_d)
    return dx.view(x.shape), part.sum(0).to(w.dtype)


@triton.jit
def _rotary_bwd_kernel(G, POS, CS, OUT, n_rows, H, HALF: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # over T * H
    ok = (rows < n_rows)[:, None]
    c = tl.arange(0, HALF)[None, :]
    pos = tl.load(POS + rows // H, mask=rows < n_rows, other=0).to(tl.int64)[:, None]
    cos = tl.load(CS + pos * (2 * HALF) + c, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(CS + pos * (2 * HALF) + HALF + c, mask=ok, other=0.0).to(tl.float32)
    at = rows.to(tl.int64)[:, None] * (2 * HALF) + c
    g1 = tl.load(G + at, mask=ok, other=0.0).to(tl.float32)
    g2 = tl.load(G + at + HALF, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + at, (g1 * cos + g2 * sin).to(OUT.dtype.element_ty), mask=ok)
    tl.store(OUT + at + HALF, (g2 * cos - g1 * sin).to(OUT.dtype.element_ty), mask=ok)


def rotary_backward_triton(gq: Tensor, gk: Tensor, positions: Tensor,
                           cos_sin: Tensor) -> tuple[Tensor, Tensor]:
    """`rotary_backward` (rotate by -sin), one pass per tensor; g (T, H, D) -> (T, H, D)."""
    assert cos_sin.shape[-1] == gq.shape[-1], "the Triton rotary backward turns whole heads; " \
        "partial rotary (Qwen3.5) is the GPU path's to add"
    out = []
    for g in (gq, gk):
        g = g.contiguous()
        rows, block_r = g.shape[0] * g.shape[1], 32
        dg = torch.empty_like(g)
        _rotary_bwd_kernel[(-(-rows // block_r),)](g, positions, cos_sin, dg, rows, g.shape[1],
                                                   HALF=g.shape[2] // 2, BLOCK_R=block_r)
        out.append(dg)
    return out[0], out[1]


@triton.jit
def _silu_and_mul_bwd_kernel(X, GY, DX, n, inter, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # over T * I
    ok = i < n
    at = (i // inter) * (2 * inter) + i % inter
    a = tl.load(X + at, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(X + at + inter, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(GY + i, mask=ok, other=0.0).to(tl.float32)
    sg = tl.sigmoid(a)
    tl.store(DX + at, (g * b * sg * (1 + a * (1 - sg))).to(DX.dtype.element_ty), mask=ok)
    tl.store(DX + at + inter, (g * a * sg).to(DX.dtype.element_ty), mask=ok)


def silu_and_mul_backward_triton(x: Tensor, gy: Tensor) -> Tensor:
    """`silu_and_mul_backward` in one pass; x (T, 2I), gy (T, I) -> (T, 2I)."""
    x, gy = x.contiguous(), gy.contiguous()
    dx = torch.empty_like(x)
    n, block = gy.numel(), 1024
    _silu_and_mul_bwd_kernel[(-(-n // block),)](x, gy, dx, n, gy.shape[-1], BLOCK=block)
    return dx


@triton.jit
def _logprobs_entropy_bwd_kernel(X, TGT, M, LOG_S, ENT, GLP, GENT, DX, V, TEMP,
                                 BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = j < V
    t = tl.load(TEMP)
    z = tl.math.div_rn(tl.load(X + row * V + j, mask=ok, other=0.0).to(tl.float32), t)
    lp = z - tl.load(M + row) - tl.load(LOG_S + row)  # the forward's lp, bit for bit
    g_lp, g_ent = tl.load(GLP + row), tl.load(GENT + row)
    dz = -tl.exp(lp) * (g_lp + g_ent * (lp + tl.load(ENT + row)))
    dz = tl.where(j == tl.load(TGT + row), dz + g_lp, dz)
    tl.store(DX + row * V + j, (dz / t).to(DX.dtype.element_ty), mask=ok)


def logprobs_entropy_backward_triton(logits, targets, m, log_s, entropy, g_lp, g_ent,
                                     temperature: float) -> Tensor:
    """`logprobs_entropy_backward` in one pass: reads the bf16 logits, writes their gradient;
    lp is recomputed from the row statistics (z / T by IEEE division, as CUDA's div)."""
    n, v = logits.shape
    dx = torch.empty_like(logits)
    block = 4096
    t = torch.full((1,), temperature, dtype=torch.float32, device=logits.device)
    _logprobs_entropy_bwd_kernel[(n, -(-v // block))](logits, targets, m, log_s, entropy, g_lp,
                                                      g_ent, dx, v, t, BLOCK=block)
    return dx


# ---------------------------------------------------------------------------
# Mixture of experts (vLLM: the router's `fused_topk` -> CUDA `topk_softmax`; the experts'
# `TritonExperts`: Triton `fused_moe_kernel` twice around silu_and_mul, then CUDA `moe_sum`)
# ---------------------------------------------------------------------------


def ref_moe_topk(logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """p = softmax(z) over the E experts, in fp32 (fp64 for fp64 z); the k largest p in
    descending order, w_j = p_{i_j}, renormalised to w_j / sum_l w_l if asked.

    logits (T, E) -> (weights (T, k) fp32, ids (T, k) int32).
    """
    p = torch.softmax(_wide(logits), dim=-1)
    w, ids = torch.topk(p, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids.to(torch.int32)


def moe_topk_backward(logits: Tensor, weights: Tensor, ids: Tensor, gw: Tensor,
                      renormalize: bool) -> Tensor:
    """Gradient of the routing weights w.r.t. the logits z (the choice S of experts is fixed).

    Without renormalisation w_j = p_{i_j} with p = softmax(z) over all E, so for every m
        dz_m = [m in S] g_m p_m - p_m sum_j g_j w_j.
    With it, w_j = exp(z_{i_j}) / sum_{l in S} exp(z_l) is the softmax of the chosen logits
    alone, so dz_{i_j} = w_j (g_j - sum_l g_l w_l) and dz_m = 0 off S.
    logits (T, E), weights/ids/gw (T, k) -> dz (T, E) in the logits' dtype. ids are distinct
    within a row, so the scatter writes each place once (deterministic).
    """
    w, g = _wide(weights), _wide(gw)
    gw_sum = (g * w).sum(dim=-1, keepdim=True)  # (T, 1)
    idx = ids.long()
    if renormalize:
        dz = logits.new_zeros(logits.shape, dtype=w.dtype).scatter(-1, idx, w * (g - gw_sum))
    else:
        p = torch.softmax(_wide(logits), dim=-1)
        dz = torch.zeros_like(p).scatter(-1, idx, g * w) - p * gw_sum
    return dz.to(logits.dtype)


class MoETopkFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, top_k, renormalize, fwd):
        w, ids = fwd(logits, top_k, renormalize)
        ctx.save_for_backward(logits, w, ids)
        ctx.renormalize = renormalize
        ctx.mark_non_differentiable(ids)
        return w, ids

    @staticmethod
    def backward(ctx, gw, _gids):
        logits, w, ids = ctx.saved_tensors
        return moe_topk_backward(logits, w, ids, gw, ctx.renormalize), None, None, None


def ref_moe_experts(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor,
                    ids: Tensor) -> Tensor:
    """out_t = sum_j w_tj * W2[e] silu_and_mul(W13[e] x_t),  e = ids[t, j].

    Shapes: x (T, D), w13 (E, 2I, D) (rows: gate, then up), w2 (E, D, I), weights/ids (T, k)
    -> (T, D) in x's dtype. Rounded where vLLM rounds: the first GEMM's output to x's dtype;
    the second GEMM sums in fp32 and is scaled by the routing weight before its one rounding
    to x's dtype; the k expert outputs are summed in fp32 and rounded once. Loops over the
    experts that have tokens (autograd-friendly; the CPU path and the tests' ground truth).
    """
    dt = x.dtype
    w13, w2 = w13.to(dt), w2.to(dt)  # the engine's compute copies (autograd casts back)
    T, k = ids.shape
    flat = ids.reshape(-1).long()  # slot s = t * k + j
    tok = torch.arange(T * k, device=x.device) // k
    w_flat = weights.reshape(-1)
    y = x.new_zeros(T * k, x.shape[1])  # (T k, D): every slot is written exactly once
    for e in flat.unique().tolist():
        s = (flat == e).nonzero()[:, 0]
        a = ref_silu_and_mul(F.linear(x[tok[s]], w13[e]))  # (n, I)
        u = F.linear(_wide(a), _wide(w2[e]))  # (n, D), summed in fp32
        y = y.index_put((s,), (u * w_flat[s, None]).to(dt))
    return _wide(y.view(T, k, -1)).sum(dim=1).to(dt)


def slots_by_expert(ids: Tensor, weights: Tensor, E: int) -> tuple[Tensor, Tensor, Tensor]:
    """The T k (token, slot) pairs sorted by expert, token order within: the flat slot index of
    each (S,), expert e's run [bounds[e], bounds[e+1]) (E+1,) on the device, and each sorted
    slot's routing weight, widened (S,)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    bounds = torch.searchsorted(flat[order].long(), torch.arange(E + 1, device=ids.device))
    return order, bounds, _wide(weights).reshape(-1)[order]


def moe_experts_backward(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, ids: Tensor,
                         gy: Tensor, w13_dtype: torch.dtype, w2_dtype: torch.dtype):
    """Gradients of out_t = sum_j w_tj W2[e] silu_and_mul(h_tj), h_tj = W13[e] x_t, e = ids[t, j].

    Per slot (t, j) with the unweighted expert output's gradient g = gy_t (a (T, D) row):
        da = w_tj W2[e]^T g,  dw_tj = <a_tj, W2[e]^T g>,  dW2[e] += w_tj g a_tj^T,
        dh = silu_and_mul'(h_tj) da,  dW13[e] += dh x_t^T,  dx_t += W13[e]^T dh.
    The slots are sorted by expert (stable: token order within an expert) and each expert's
    slots go through plain GEMMs, so every sum has a fixed order: the weight gradients sum the
    expert's tokens inside one GEMM (in fp32 when the master is fp32, as `linear_backward`),
    and dx_t sums its k slot rows in fp32, each written straight to its slot. No atomics,
    no scatter-add: two calls give the same bits. h and a are recomputed, rounded as the
    forward rounds them.

    x (T, D), w13 (E, 2I, D), w2 (E, D, I) already in x's dtype; weights/ids (T, k); gy (T, D).
    Returns (dx (T, D) in x's dtype, dw13 in w13_dtype, dw2 in w2_dtype, dweights (T, k) in
    the weights' dtype). One host sync (the per-expert slot counts).
    """
    T, k = ids.shape
    E, D = w13.shape[0], x.shape[1]
    wide = _wide(x).dtype  # fp32 for bf16 compute, fp64 in the fp64 tests
    order, bounds, ws = slots_by_expert(ids, weights, E)
    bounds = bounds.tolist()
    ws = ws[:, None]  # (T k, 1), sorted slot order
    dx_slots = torch.empty(T * k, D, dtype=x.dtype, device=x.device)  # slot order
    dw_slots = torch.empty(T * k, dtype=wide, device=x.device)
    dw13 = torch.zeros(w13.shape, dtype=w13_dtype, device=x.device)
    dw2 = torch.zeros(w2.shape, dtype=w2_dtype, device=x.device)
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue  # no tokens: zero gradients
        slots = order[lo:hi]  # this expert's slots, in token order
        xe, ge, we = x[slots // k], gy[slots // k], ws[lo:hi]
        h = xe @ w13[e].t()  # (n, 2I)
        a = ref_silu_and_mul(h)  # (n, I): the forward's values, rounded where it rounds
        g_a = _mm(ge, w2[e], wide)  # (n, I) = W2[e]^T g per slot, summed in fp32
        dw_slots[slots] = (g_a * _wide(a)).sum(dim=-1)
        dw2[e] = _mm((_wide(ge) * we).to(x.dtype).t(), a, w2_dtype)  # (D, I)
        dh = silu_and_mul_backward(h, (g_a * we).to(x.dtype))  # (n, 2I)
        dx_slots[slots] = dh @ w13[e]  # (n, D); each slot's row is written exactly once
        dw13[e] = _mm(dh.t(), xe, w13_dtype)  # (2I, D)
    dx = _wide(dx_slots.view(T, k, D)).sum(dim=1).to(x.dtype)
    return dx, dw13, dw2, dw_slots.view(T, k).to(weights.dtype)


# The experts' backward as grouped GEMMs: the (token, slot) pairs sorted by expert once, then
# one Triton launch per GEMM over every expert. A program owns one output tile and sums its K
# in a fixed order, with no atomics: the bits do not depend on the run or on the other experts.
GROUPED_BLOCK = dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3)


@triton.jit
def _grouped_rows_mm_kernel(A, A_ROWS, B, OUT, OUT_ROWS, TILE_E, TILE_START, BOUNDS, E, K, N,
                            s_am, s_ak, s_be, s_bk, s_bn, s_om, s_on,
                            GATHER: tl.constexpr, SCATTER: tl.constexpr, BM: tl.constexpr,
                            BN: tl.constexpr, BK: tl.constexpr):
    """OUT[r] = A[A_ROWS[r]] @ B[e] for the BM sorted rows r of tile program_id(0), all of expert
    e; B[e] (K, N) by strides. A tile past the last expert's (the grid is an upper bound) has
    no rows."""
    t = tl.program_id(0)
    e = tl.load(TILE_E + t)
    live = e < E
    e = tl.minimum(e, E - 1).to(tl.int64)
    start = tl.load(TILE_START + t)
    end = tl.where(live, tl.load(BOUNDS + e + 1), start)
    rows = (start + tl.arange(0, BM)).to(tl.int64)  # row * stride passes 2^31 at large shapes
    r_ok = rows < end
    src = tl.load(A_ROWS + rows, mask=r_ok, other=0).to(tl.int64) if GATHER else rows
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    c_ok = cols < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        a = tl.load(A + src[:, None] * s_am + ks[None, :] * s_ak,
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(B + e * s_be + ks[:, None] * s_bk + cols[None, :] * s_bn,
                    mask=k_ok[:, None] & c_ok[None, :], other=0.0)
        acc += tl.dot(a, b)
    dst = tl.load(OUT_ROWS + rows, mask=r_ok, other=0).to(tl.int64) if SCATTER else rows
    tl.store(OUT + dst[:, None] * s_om + cols[None, :] * s_on, acc.to(OUT.dtype.element_ty),
             mask=r_ok[:, None] & c_ok[None, :])


@triton.jit
def _grouped_wgrad_kernel(L, L_ROWS, L_SCALE, R, R_ROWS, OUT, BOUNDS, M, N,
                          s_lr, s_lm, s_rr, s_rn, s_oe, s_om, s_on,
                          GATHER_L: tl.constexpr, SCALE_L: tl.constexpr, GATHER_R: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """OUT[e] = sum over expert e's sorted rows r of L[r]^T R[r] (M, N), the rows in order, BK
    at a time; L's row scaled by L_SCALE[r] and rounded to L's dtype first if SCALE_L. An
    expert without rows gets zeros."""
    e = tl.program_id(0).to(tl.int64)
    lo, hi = tl.load(BOUNDS + e), tl.load(BOUNDS + e + 1)
    ms = tl.program_id(1) * BM + tl.arange(0, BM)
    ns = tl.program_id(2) * BN + tl.arange(0, BN)
    m_ok, n_ok = ms < M, ns < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for r0 in range(lo, hi, BK):
        rows = (r0 + tl.arange(0, BK)).to(tl.int64)
        r_ok = rows < hi
        lr = tl.load(L_ROWS + rows, mask=r_ok, other=0).to(tl.int64) if GATHER_L else rows
        rr = tl.load(R_ROWS + rows, mask=r_ok, other=0).to(tl.int64) if GATHER_R else rows
        lt = tl.load(L + lr[:, None] * s_lr + ms[None, :] * s_lm,
                     mask=r_ok[:, None] & m_ok[None, :], other=0.0)  # (BK, BM)
        if SCALE_L:
            scale = tl.load(L_SCALE + rows, mask=r_ok, other=0.0)
            lt = (lt.to(tl.float32) * scale[:, None]).to(L.dtype.element_ty)
        rt = tl.load(R + rr[:, None] * s_rr + ns[None, :] * s_rn,
                     mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # (BK, BN)
        acc += tl.dot(tl.trans(lt), rt)
    tl.store(OUT + e * s_oe + ms[:, None] * s_om + ns[None, :] * s_on,
             acc.to(OUT.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def grouped_rows_mm(a: Tensor, b: Tensor, tiles: tuple[Tensor, Tensor, Tensor], out_dtype,
                    a_rows: Tensor | None = None, out_rows: Tensor | None = None) -> Tensor:
    """out[out_rows[r]] = a[a_rows[r]] @ b[e_r] for the S sorted rows r (expert e_r's).

    a (., K); b (E, K, N), any strides; tiles from `expert_tiles`; a_rows/out_rows None: r.
    -> (S, N) in out_dtype, fp32 sums.
    """
    tile_e, tile_start, bounds = tiles
    E, K, N = b.shape
    S = int(a_rows.numel() if a_rows is not None else a.shape[0])
    out = torch.empty(S, N, dtype=out_dtype, device=a.device)
    blk = GROUPED_BLOCK
    grid = (tile_e.numel(), triton.cdiv(N, blk["BN"]))
    _grouped_rows_mm_kernel[grid](
        a, a_rows if a_rows is not None else bounds, b, out,
        out_rows if out_rows is not None else bounds, tile_e, tile_start, bounds, E, K, N,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
        out.stride(1), GATHER=a_rows is not None, SCATTER=out_rows is not None, **blk)
    return out


def grouped_wgrad(left: Tensor, right: Tensor, bounds: Tensor, out_dtype,
                  left_rows: Tensor | None = None, left_scale: Tensor | None = None,
                  right_rows: Tensor | None = None) -> Tensor:
    """out[e] = sum over expert e's sorted rows r of (s_r left[left_rows[r]])^T right[right_rows
    [r]]: (E, M, N) in out_dtype, each expert's rows summed in order in fp32."""
    E = bounds.numel() - 1
    M, N = left.shape[1], right.shape[1]
    out = torch.empty(E, M, N, dtype=out_dtype, device=left.device)
    blk = GROUPED_BLOCK
    grid = (E, triton.cdiv(M, blk["BM"]), triton.cdiv(N, blk["BN"]))
    _grouped_wgrad_kernel[grid](
        left, left_rows if left_rows is not None else bounds,
        left_scale if left_scale is not None else bounds, right,
        right_rows if right_rows is not None else bounds, out, bounds, M, N,
        left.stride(0), left.stride(1), right.stride(0), right.stride(1), out.stride(0),
        out.stride(1), out.stride(2), GATHER_L=left_rows is not None,
        SCALE_L=left_scale is not None, GATHER_R=right_rows is not None, **blk)
    return out


def expert_tiles(bounds: Tensor, n_rows: int, block: int) -> tuple[Tensor, Tensor, Tensor]:
    """The row tiles of a grouped GEMM, made on the device (no host sync): expert e's sorted
    rows [bounds[e], bounds[e+1]) in tiles of `block`. Returns (expert, first row) per tile and
    the bounds; the grid is the upper bound n_rows / block + E tiles, and the ones past the
    last expert's get expert E (no rows)."""
    E = bounds.numel() - 1
    n_tiles = (bounds[1:] - bounds[:-1] + block - 1) // block  # (E,)
    ends = torch.cumsum(n_tiles, 0)  # (E,) one past each expert's last tile
    t = torch.arange(triton.cdiv(n_rows, block) + E, device=bounds.device)
    tile_e = torch.searchsorted(ends, t, right=True)  # (tiles,) in 0..E
    e = tile_e.clamp(max=E - 1)
    tile_start = bounds[e] + (t - (ends - n_tiles)[e]) * block
    return tile_e.int(), tile_start.int(), bounds.int()


def moe_experts_backward_grouped(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor,
                                 ids: Tensor, gy: Tensor, w13_dtype: torch.dtype,
                                 w2_dtype: torch.dtype):
    """`moe_experts_backward`'s gradients, rounded where it rounds, in five grouped GEMMs
    over the S = T k slots sorted by expert (r: a sorted slot, t_r its token, e_r its expert):
        h_r = W13[e_r] x_t,  a_r = silu_and_mul(h_r),  g_r = W2[e_r]^T gy_t (fp32),
        dw_r = <g_r, a_r>,  dh_r = silu_and_mul'(h_r) (w_r g_r),
        dx_slot = W13[e_r]^T dh_r,  dW2[e] = sum_r (w_r gy_t) a_r^T,  dW13[e] = sum_r dh_r x_t^T.
    Every sum has one order (a program per output tile; the weight gradients sum an expert's
    rows in token order), so two calls give the same bits. Same arguments and results as
    `moe_experts_backward`; no host sync.
    """
    T, k = ids.shape
    S = T * k
    order, bounds, ws = slots_by_expert(ids, weights, w13.shape[0])
    tiles = expert_tiles(bounds, S, GROUPED_BLOCK["BM"])
    bounds = tiles[2]
    tok = (order // k).int()  # (S,) each sorted slot's token
    wide = ws.dtype
    h = grouped_rows_mm(x, w13.transpose(1, 2), tiles, x.dtype, a_rows=tok)  # (S, 2I)
    a = ref_silu_and_mul(h)  # (S, I): the forward's values, rounded where it rounds
    g = grouped_rows_mm(gy, w2, tiles, wide, a_rows=tok)  # (S, I) W2^T gy, fp32
    dw = torch.empty(S, dtype=wide, device=x.device).index_put_(
        (order,), (g * _wide(a)).sum(dim=-1))  # (S,) in slot order; each written once
    dh = silu_and_mul_backward_triton(h, (g * ws[:, None]).to(x.dtype))  # (S, 2I)
    dx_slots = grouped_rows_mm(dh, w13, tiles, x.dtype, out_rows=order.int())  # (S, D) by slot
    dx = dx_slots.view(T, k, -1).sum(dim=1, dtype=wide).to(x.dtype)
    dw2 = grouped_wgrad(gy, a, bounds, w2_dtype, left_rows=tok, left_scale=ws)  # (E, D, I)
    dw13 = grouped_wgrad(dh, x, bounds, w13_dtype, right_rows=tok)  # (E, 2I, D)
    return dx, dw13, dw2, dw.view(T, k).to(weights.dtype)


class MoEExpertsFn(torch.autograd.Function):
    """The experts with the weights cast to x's dtype (a no-op for bf16 weights), or the given
    casts; w13's and w2's gradients come back in their own dtypes."""

    @staticmethod
    def forward(ctx, x, w13, w2, weights, ids, fwd, bwd, casts=None):
        w13c, w2c = casts or (w13.to(x.dtype), w2.to(x.dtype))
        ctx.save_for_backward(x, w13c, w2c, weights, ids)
        ctx.w_dtypes = (w13.dtype, w2.dtype)
        ctx.bwd = bwd
        return fwd(x, w13c, w2c, weights, ids)

    @staticmethod
    def backward(ctx, gy):
        x, w13, w2, weights, ids = ctx.saved_tensors
        dx, dw13, dw2, dw = ctx.bwd(x, w13, w2, weights, ids, gy, *ctx.w_dtypes)
        return dx, dw13, dw2, dw, None, None, None, None


# ---------------------------------------------------------------------------
# Qwen3.5: RMSNorm with zero-centred weights (vLLM: GemmaRMSNorm, on CUDA FlashInfer's
# gemma_rmsnorm and gemma_fused_add_rmsnorm)
# ---------------------------------------------------------------------------


def ref_gemma_rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """y = x / sqrt(mean(x^2) + eps) * (1 + w), in fp32, rounded once: the weight is stored
    zero-centred, the scale is 1 + w."""
    return ref_rms_norm(x, 1 + _wide(w), eps)


def ref_gemma_add_rms_norm(x: Tensor, residual: Tensor, w: Tensor,
                           eps: float) -> tuple[Tensor, Tensor]:
    """s = x + residual (rounded to x.dtype); y = round(s / rms(s) * (1 + w)), one rounding."""
    s = x + residual
    return ref_gemma_rms_norm(s, w, eps), s


def gemma_backward(bwd: Callable) -> Callable:
    """The backward of y = x_hat (1 + w) from a backward of y = x_hat w: the same with the
    scale 1 + w (fp32), since d(1 + w)/dw = 1; dw comes back in w's dtype."""

    def backward(x: Tensor, w: Tensor, gy: Tensor, eps: float, gs: Tensor | None = None):
        dx, dw = bwd(x, 1 + _wide(w), gy, eps, gs)
        return dx, dw.to(w.dtype)

    return backward


# ---------------------------------------------------------------------------
# Qwen3.5: the sigmoid gate on full attention's output and on the shared expert (vLLM:
# o * torch.sigmoid(gate); on CUDA its Triton fused_sigmoid_gate_mul)
# ---------------------------------------------------------------------------


def ref_sigmoid_gate_mul(o: Tensor, gate: Tensor) -> Tensor:
    """y = o * sigmoid(gate), in fp32, rounded once; gate broadcasts to o's shape."""
    return (_wide(o) * torch.sigmoid(_wide(gate))).to(o.dtype)


def sigmoid_gate_mul_backward(o: Tensor, gate: Tensor, gy: Tensor) -> tuple[Tensor, Tensor]:
    """With s = sigmoid(gate): do = gy s,  dgate = gy o s (1 - s), summed over the dims the
    gate was broadcast along."""
    s = torch.sigmoid(_wide(gate))
    g = _wide(gy)
    dgate = (g * _wide(o) * s * (1 - s)).sum_to_size(gate.shape)
    return (g * s).to(o.dtype), dgate.to(gate.dtype)


class SigmoidGateMulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, gate, fwd, bwd):
        ctx.save_for_backward(o, gate)
        ctx.bwd = bwd
        return fwd(o, gate)

    @staticmethod
    def backward(ctx, gy):
        o, gate = ctx.saved_tensors
        do, dgate = ctx.bwd(o, gate, gy)
        return do, dgate, None, None


# ---------------------------------------------------------------------------
# Qwen3.5: the gated RMSNorm on the linear attention's output (vLLM: RMSNormGated, norm before
# gate, silu; on CUDA a Triton kernel that reads z from the packed projection)
# ---------------------------------------------------------------------------


def ref_rms_norm_gated(x: Tensor, z: Tensor, w: Tensor, eps: float) -> Tensor:
    """y = x / sqrt(mean(x^2) + eps) * w * silu(z) over the last dim, in fp32, rounded once."""
    xf = _wide(x)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * r * _wide(w) * F.silu(_wide(z))).to(x.dtype)


def rms_norm_gated_backward(x: Tensor, z: Tensor, w: Tensor, gy: Tensor,
                            eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """y = n * silu(z), n = x_hat w: (dx, dw) are rms_norm_backward's for the gradient
    gy silu(z) reaching n, and with s = sigmoid(z), dz = gy n s (1 + z (1 - s))."""
    zf = _wide(z)
    s = torch.sigmoid(zf)
    dx, dw = rms_norm_backward(x, w, _wide(gy) * zf * s, eps)
    xf = _wide(x)
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * _wide(w)
    dz = _wide(gy) * n * s * (1 + zf * (1 - s))
    return dx, dw, dz.to(z.dtype)


class RMSNormGatedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, z, w, eps, fwd, bwd):
        ctx.save_for_backward(x, z, w)
        ctx.eps, ctx.bwd = eps, bwd
        return fwd(x, z, w, eps)

    @staticmethod
    def backward(ctx, gy):
        x, z, w = ctx.saved_tensors
        dx, dw, dz = ctx.bwd(x, z, w, gy, ctx.eps)
        return dx, dz, dw, None, None, None


# ---------------------------------------------------------------------------
# Qwen3.5: Gated DeltaNet, its linear attention (vLLM: `causal_conv1d_fn`, then fla's
# `fused_post_conv_prep` (L2 norms, gates) and `chunk_gated_delta_rule` for a prefill; a decode
# step runs `causal_conv1d_update` and `fused_sigmoid_gating_delta_rule_update` instead)
# ---------------------------------------------------------------------------
# Reference forwards in plain PyTorch; the reference kernels differentiate them with autograd.
# vLLM's kernels, and a backward of their own, are the GPU path's part (see vllm_forwards).
GDN_CHUNK = 64  # tokens a chunk, as fla's chunked kernels (its FLA_CHUNK_SIZE)
L2NORM_EPS = 1e-6  # q and k are normalised as x / sqrt(sum x^2 + eps)


def ref_causal_conv1d(x: Tensor, w: Tensor, cu_seqlens: Tensor, max_seqlen: int = 0) -> Tensor:
    """y_t = silu(sum_j w[:, j] * x_{t-K+1+j}), channel by channel, over each sequence of the
    packed batch (x_s = 0 before a sequence's first token: no state comes in), in fp32.
    x (T, C), w (C, K) -> (T, C) in x's dtype. Not padded to the longest sequence: each gets
    its own K - 1 zero rows before it, and one grouped conv runs over all T + B (K - 1) rows
    (a window never reaches past its own zeros). max_seqlen: unused (the ops' signature)."""
    K, B = w.shape[1], len(cu_seqlens) - 1
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(B, device=x.device), lens)  # (T,)
    rows = torch.arange(x.shape[0], device=x.device) + (seq + 1) * (K - 1)  # after its zeros
    xp = _wide(x).new_zeros(x.shape[0] + B * (K - 1), x.shape[1]).index_copy(0, rows, _wide(x))
    y = F.conv1d(xp.T[None], _wide(w)[:, None], groups=w.shape[0])[0]  # (C, T + (B - 1)(K - 1))
    return F.silu(y[:, rows - (K - 1)]).T.to(x.dtype)  # (T, C)


def l2_normalize(x: Tensor, eps: float = L2NORM_EPS) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """The log decay g = -exp(A_log) softplus(a + dt_bias) (<= 0) and the write strength
    beta = sigmoid(b), at least fp32: a, b (..., Hv), A_log, dt_bias (Hv,)."""
    g = -torch.exp(_wide(A_log)) * F.softplus(_wide(a) + _wide(dt_bias))
    return g, torch.sigmoid(_wide(b))


def gated_delta_rule_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               state: Tensor | None = None,
                               scale: float | None = None) -> tuple[Tensor, Tensor]:
    """The gated delta rule token by token, as a decode step runs it. Per head, the state
    S (Dk, Dv) decays, then the error of its prediction of v_t from k_t is written back:
        S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T
        o_t = scale S_t^T q_t                                   (scale = Dk^-1/2)
    q, k (B, H, L, Dk), v (B, H, L, Dv), g, beta (B, H, L); state (B, H, Dk, Dv), None: 0.
    Returns (o (B, H, L, Dv), the final state), in q's dtype (fp32 or fp64)."""
    B, H, L, Dk = k.shape
    scale = Dk**-0.5 if scale is None else scale
    S = q.new_zeros(B, H, Dk, v.shape[-1]) if state is None else state.to(q.dtype)
    out = []
    for t in range(L):
        S = S * g[..., t, None, None].exp()  # (B, H, Dk, Dv)
        kt = k[..., t, :, None]  # (B, H, Dk, 1)
        err = beta[..., t, None, None] * (v[..., t, None, :] - kt.transpose(-1, -2) @ S)
        S = S + kt @ err  # (B, H, Dk, Dv)
        out.append(scale * (q[..., t, None, :] @ S)[..., 0, :])  # (B, H, Dv)
    return torch.stack(out, dim=2), S


def gated_delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                             state: Tensor | None = None, scale: float | None = None,
                             chunk: int = GDN_CHUNK) -> tuple[Tensor, Tensor]:
    """The same rule `chunk` tokens at a time, as a prefill runs it (fla's chunked form).

    In a chunk entered with state S_0, let c_i = g_1 + ... + g_i (the log decay since the
    chunk began) and e_i = beta_i (v_i - exp(g_i) S_{i-1}^T k_i) the value written at token i,
    so that S_i = exp(c_i) S_0 + sum_{j<=i} exp(c_i - c_j) k_j e_j^T. Then the e_i solve the
    unit lower-triangular system (I + A) E = beta V - (beta exp(c) K) S_0 with
    A_ij = beta_i exp(c_i - c_j) k_i . k_j (j < i), so E = U - W S_0 for U = (I + A)^-1 beta V
    and W = (I + A)^-1 beta exp(c) K, and
        O   = scale ((exp(c) Q) S_0 + ((Q K^T) * M) E),   M_ij = exp(c_i - c_j) (j <= i), else 0
        S_C = exp(c_C) S_0 + (exp(c_C - c) K)^T E.
    Same arguments and results as gated_delta_rule_recurrent. L is padded to whole chunks with
    tokens of g = beta = 0 and k = 0, which leave the state as it is."""
    B, H, L, Dk = k.shape
    scale = Dk**-0.5 if scale is None else scale
    pad = -L % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)).unflatten(2, (-1, chunk)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)).unflatten(2, (-1, chunk)) for x in (g, beta))  # (B, H, N, C)
    c, U, W, QK = chunk_terms(q, k, v, g, beta)  # (B, H, N, C, ...)
    S = q.new_zeros(B, H, Dk, v.shape[-1]) if state is None else state.to(q.dtype)
    out = []
    for n in range(q.shape[2]):
        o, S = carry_chunk(S, q[:, :, n], k[:, :, n], c[:, :, n], U[:, :, n], W[:, :, n],
                           QK[:, :, n], scale)
        out.append(o)
    return torch.cat(out, dim=2)[:, :, :L], S


def chunk_terms(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor):
    """The chunked rule's in-chunk terms (gated_delta_rule_chunked's c, U, W and (Q K^T) * M),
    every chunk at once: q, k (..., C, Dk), v (..., C, Dv), g, beta (..., C)."""
    C = g.shape[-1]
    c = g.cumsum(-1)  # (..., C)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    A = beta[..., None] * (k @ k.transpose(-1, -2)) * decay  # (..., C, C), j <= i
    solve = functools.partial(torch.linalg.solve_triangular, A, upper=False,
                              unitriangular=True)  # reads A below the diagonal only: I + A
    U = solve(beta[..., None] * v)  # (..., C, Dv)
    W = solve((beta * c.exp())[..., None] * k)  # (..., C, Dk)
    return c, U, W, (q @ k.transpose(-1, -2)) * decay


def carry_chunk(S: Tensor, q: Tensor, k: Tensor, c: Tensor, U: Tensor, W: Tensor, QK: Tensor,
                scale: float) -> tuple[Tensor, Tensor]:
    """One chunk entered with state S (..., Dk, Dv): its output (..., C, Dv) and the state it
    leaves, O and S_C of gated_delta_rule_chunked's docstring."""
    c = c[..., None]  # (..., C, 1)
    E = U - W @ S  # (..., C, Dv)
    o = scale * ((q * c.exp()) @ S + QK @ E)
    return o, c[..., -1:, :].exp() * S + ((c[..., -1:, :] - c).exp() * k).transpose(-1, -2) @ E


def chunk_rows(cu_seqlens: Tensor, chunk: int = GDN_CHUNK,
               total: int | None = None) -> tuple[Tensor, list[int]]:
    """Every sequence of a packed batch cut into its own chunks of `chunk` rows, the chunks in
    the order the rule carries its states: every sequence's first chunk, then every second one,
    ..., sequences with more chunks first (so those still going are always a leading run).
    Returns (rows (N, C) int64: each chunk's packed row, T past its sequence's end; counts: the
    chunks at each position, non-increasing). N = sum_b ceil(L_b / C): no sequence is padded
    beyond its last chunk. E.g. lengths (130, 10), C = 64: rows [0..63], [130..139, T...],
    [64..127], [128, 129, T...]; counts [2, 1, 1]. total: the packed rows, which the sequences
    must end at (row T stands for padding)."""
    cu = cu_seqlens.long().cpu()  # one host sync
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    n = -(-lengths // chunk)  # (B,) chunks of each sequence
    order = torch.argsort(n, descending=True, stable=True)
    counts = (n[None, :] > torch.arange(int(n.max()) if len(n) else 0)[:, None]).sum(1)  # (J,)
    j = torch.repeat_interleave(torch.arange(len(counts)), counts)  # (N,) each chunk's position
    r = torch.arange(len(j)) - torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])[j]
    b = order[r]  # (N,) each chunk's sequence
    offset = j[:, None] * chunk + torch.arange(chunk)[None]  # (N, C) within the sequence
    T = int(cu[-1])
    assert total is None or total == T, "the sequences must cover every row"
    rows = torch.where(offset < lengths[b][:, None], starts[b][:, None] + offset, T)
    return rows.to(cu_seqlens.device), counts.tolist()


def gated_delta_rule_varlen(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                            cu_seqlens: Tensor, scale: float | None = None,
                            chunk: int = GDN_CHUNK) -> Tensor:
    """gated_delta_rule_chunked over a packed batch, every sequence from a zero state, without
    padding the sequences to the longest: each is cut into its own chunks (`chunk_rows`; its
    last one padded with tokens of g = beta = 0 and k = 0, which leave the state as it is),
    every chunk's in-chunk terms are computed at once, and the states are carried position by
    position over the sequences still going. The same math as the chunked form, chunk for
    chunk. q, k (T, H, Dk), v (T, H, Dv), g, beta (T, H) -> o (T, H, Dv) in q's dtype."""
    T, H, Dk = k.shape
    scale = Dk**-0.5 if scale is None else scale
    rows, counts = chunk_rows(cu_seqlens, chunk, T)  # (N, C); row T: the zero row added below

    def chunked(x):  # (T, H, ...) -> (N, H, C, ...), zeros past each sequence's end
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])[rows]  # (N, C, H, ...)
        return x.transpose(1, 2)

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
    c, U, W, QK = chunk_terms(q, k, v, g, beta)  # (N, H, C, ...)
    S = q.new_zeros(counts[0] if counts else 0, H, Dk, v.shape[-1])  # the going sequences'
    out, at = [], 0
    for n in counts:  # chunks at this position: the first n sequences' (they are going)
        now = slice(at, at + n)
        o, S = carry_chunk(S[:n], q[now], k[now], c[now], U[now], W[now], QK[now], scale)
        out.append(o)
        at += n
    o = torch.cat(out).transpose(1, 2).flatten(0, 1)  # (N C, H, Dv) in rows' order
    keep = rows.flatten() < T
    return o.new_zeros(T, H, o.shape[-1]).index_copy(0, rows.flatten()[keep], o[keep])


def ref_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                         dt_bias: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                         prefill: Tensor | None = None) -> Tensor:
    """Qwen3.5's linear attention over a packed batch, every sequence from a zero state: q and
    k L2-normalised, g and beta from gdn_gates, each k head serving Hv / Hk v heads (v head h
    reads k head h // (Hv / Hk)), the chunked rule in each sequence's own chunks
    (gated_delta_rule_varlen), in fp32. `prefill` (vLLM's schedule) is not needed: each form
    computes the same rule, so each sequence runs in one; nor is max_seqlen (nothing is padded
    to it). q, k (T, Hk, Dk), v (T, Hv, Dv), a, b (T, Hv) -> o (T, Hv, Dv) in v's dtype."""
    group = v.shape[1] // k.shape[1]
    q, k = (l2_normalize(_wide(x)).repeat_interleave(group, dim=1) for x in (q, k))  # (T, Hv, Dk)
    g, beta = gdn_gates(a, b, A_log, dt_bias)  # (T, Hv) each
    return gated_delta_rule_varlen(q, k, _wide(v), g, beta, cu_seqlens).to(v.dtype)


def ref_prefill_form(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                     dt_bias: Tensor, cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
    """A prefill of whole prompts in the chunked form, in fp32, each from a zero state: the
    reference's stand-in for vLLM's (gdn_prefill_vllm). Packed as ref_gated_delta_rule's
    arguments -> (o (T, Hv, Dv) in v's dtype, final states (B, Hv, Dk, Dv) fp32)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    L = int(lengths.max())
    group = v.shape[1] // k.shape[1]
    qp, valid = _pad(l2_normalize(_wide(q)), cu_seqlens, L)  # (B, Hk, L, Dk)
    kp, _ = _pad(l2_normalize(_wide(k)), cu_seqlens, L)
    vp, _ = _pad(_wide(v), cu_seqlens, L)  # (B, Hv, L, Dv)
    g, beta = (_pad(x[..., None], cu_seqlens, L)[0][..., 0]
               for x in gdn_gates(a, b, A_log, dt_bias))  # (B, Hv, L), 0 past each end
    o, S = gated_delta_rule_chunked(qp.repeat_interleave(group, dim=1),
                                    kp.repeat_interleave(group, dim=1), vp, g, beta)
    return _unpad(o, valid).to(v.dtype), S


def ref_decode_form(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                    dt_bias: Tensor, states: Tensor, lens: list[int]) -> Tensor:
    """N sequences' decode steps in the recurrent form, in fp32, each from the state its prefill
    left: the reference's stand-in for vLLM's (gdn_decode_vllm). The sequences' rows are back to
    back, lens[n] of sequence n; they run as one batch padded to the longest (a padded step
    comes after a sequence's last and changes none of its outputs).
    q, k (L, Hk, Dk), v (L, Hv, Dv), a, b (L, Hv), states (N, Hv, Dk, Dv), L = sum(lens)
    -> o (L, Hv, Dv) in v's dtype."""
    n = torch.tensor(lens, device=q.device)
    steps = torch.arange(int(n.max()), device=q.device)
    real = steps < n[:, None]  # (N, Lmax)
    rows = torch.where(real, (n.cumsum(0) - n)[:, None] + steps, 0)  # (N, Lmax) into the L
    group = v.shape[1] // k.shape[1]
    q, k = (l2_normalize(_wide(x))[rows].transpose(1, 2).repeat_interleave(group, dim=1)
            for x in (q, k))  # (N, Hv, Lmax, Dk)
    g, beta = (x[rows].transpose(1, 2) for x in gdn_gates(a, b, A_log, dt_bias))  # (N, Hv, Lmax)
    o, _ = gated_delta_rule_recurrent(q, k, _wide(v)[rows].transpose(1, 2), g, beta,
                                      _wide(states))
    return o.transpose(1, 2)[real].to(v.dtype)  # (L, Hv, Dv)


def prefill_schedule(cu_seqlens: Tensor, prefill: Tensor) -> tuple[Tensor, Tensor, Tensor,
                                                                   Tensor]:
    """The rows vLLM prefilled and those it decoded, in a packed batch of B sequences whose first
    prefill[n] tokens (its prompt) were prefilled in one pass and the rest decoded one a step:
    (prompt rows (Tp,) of the packed batch, their cu_seqlens (B+1,) int32 (on CPU), decoded
    rows (Td,), each sequence's decoded count (B,)), rows on cu_seqlens' device."""
    starts = cu_seqlens[:-1].long().cpu()
    L = cu_seqlens[1:].long().cpu() - starts
    P = prefill.long().cpu()
    assert starts[0] == 0 and bool(((P >= 1) & (P <= L)).all()), "from row 0; prefills of 1 to L"
    offset = torch.arange(int(L.sum())) - torch.repeat_interleave(starts, L)  # within its sequence
    prompt = offset < torch.repeat_interleave(P, L)  # (T,)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), P.cumsum(0)]).int()
    on = cu_seqlens.device
    return prompt.nonzero()[:, 0].to(on), cu, (~prompt).nonzero()[:, 0].to(on), L - P


def replay_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor,
                            A_log: Tensor, dt_bias: Tensor, cu_seqlens: Tensor, prefill: Tensor,
                            prefill_form: Callable, decode_form: Callable) -> Tensor:
    """The gated delta rule over a packed batch as vLLM's engine scheduled it: every sequence's
    prompt rows through `prefill_form` (one call over all prompts, each from a zero state),
    then every sequence's generated rows through `decode_form` (one call over them all), each
    from the state its prompt left. The forms are vLLM's kernels (gdn_prefill_vllm,
    gdn_decode_vllm) or the reference's (ref_prefill_form, ref_decode_form); exact arithmetic
    gives ref_gated_delta_rule.
    q, k (T, Hk, Dk), v (T, Hv, Dv), a, b (T, Hv), prefill (B,) -> o (T, Hv, Dv)."""
    rows, cu_prompt, decoded, counts = prefill_schedule(cu_seqlens, prefill)
    o = v.new_empty(v.shape)  # (T, Hv, Dv)
    o_prompt, states = prefill_form(q[rows], k[rows], v[rows], a[rows], b[rows], A_log, dt_bias,
                                    cu_prompt.to(q.device))
    o[rows] = o_prompt
    going = counts > 0  # sequences that generated a token
    if going.any():
        o[decoded] = decode_form(*(x[decoded] for x in (q, k, v, a, b)), A_log, dt_bias,
                                 states[going.to(states.device)], counts[going].tolist())
    return o


class CausalConv1dFn(torch.autograd.Function):
    """A given forward of the causal conv1d (vLLM's kernel); the backward differentiates the
    fp32 reference, ref_causal_conv1d, with autograd. With u = sum_j w_j x_{t-K+1+j} per channel
    and y = silu(u): du = dy silu'(u), dx_s = sum_j w_j du_{s+K-1-j}, dw_j = sum_t du_t
    x_{t-K+1+j} (within each sequence): the gradient of the same math, taken at the fp32
    forward (which differs from the kernel's bf16 output by its rounding only)."""

    @staticmethod
    def forward(ctx, x, w, cu_seqlens, max_seqlen, fwd):
        ctx.save_for_backward(x, w, cu_seqlens)
        ctx.max_seqlen = max_seqlen
        return fwd(x, w, cu_seqlens, max_seqlen)

    @staticmethod
    def backward(ctx, gy):
        x, w, cu_seqlens = ctx.saved_tensors
        with torch.enable_grad():
            xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
            y = ref_causal_conv1d(xr, wr, cu_seqlens, ctx.max_seqlen)
            dx, dw = torch.autograd.grad(y, (xr, wr), gy)
        return dx, dw, None, None, None


def gated_delta_rule_backward(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor,
                              A_log: Tensor, dt_bias: Tensor, cu_seqlens: Tensor,
                              max_seqlen: int, go: Tensor) -> tuple[Tensor, ...]:
    """The rule's input gradients (q, k, v, a, b, A_log, dt_bias) for the output's gradient go:
    autograd through the reference (ref_gated_delta_rule: the L2 norms, the gates and the
    chunked rule over each whole sequence, in fp32 or wider). Backpropagating through the
    chunked form is the derivative of
        S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,  o_t = scale S_t^T q_t
    in the adjoint states dS_t, run backward in time. It holds fp32 tensors of every sequence's
    rows in whole chunks, not padded to the longest sequence (simple_rl's gdn_backward_bytes)."""
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in (q, k, v, a, b, A_log, dt_bias)]
        o = ref_gated_delta_rule(*leaves, cu_seqlens, max_seqlen)
        return torch.autograd.grad(o, leaves, go)


# The fla kernels whose config can change the bits of gated_delta_rule_backward_fla's gradient
# (its forward's and its backward's, by module; the output's kernel, chunk_fwd_kernel_o, only
# makes o, which the gradient never reads). fla picks each kernel's launch config by timing its
# candidates (Triton's autotuner), and some candidates sum in another order (the L2 norm's over
# a head; dqkwg's for the gates' gradient): a process with an empty Triton cache could get other
# gradient bits. Read in fla 0.6.0's source; checked on the GPU (tests/test_qwen35_gpu.py, P13d).
FLA_KERNELS = {
    "fla.modules.norm.l2norm": ("l2norm_fwd_kernel", "l2norm_bwd_kernel"),
    "fla.ops.utils.cumsum": ("chunk_local_cumsum_scalar_kernel",),
    "fla.ops.gated_delta_rule.chunk_fwd": ("chunk_gated_delta_rule_fwd_kkt_solve_kernel",),
    "fla.ops.gated_delta_rule.wy_fast": ("recompute_w_u_fwd_kernel", "prepare_wy_repr_bwd_kernel"),
    "fla.ops.common.chunk_delta_h": ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
                                     "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64"),
    "fla.ops.common.chunk_o": ("chunk_bwd_kernel_dv_local", "chunk_bwd_kernel_dqkwg"),
}
# The config each keeps: Triton's pick on an H100 at Qwen3.5-4B's heads, (tiles, warps,
# stages). Not the first of fla's candidates (1 or 2 warps): there chunk_bwd_kernel_dqkwg took
# 21,552 bytes of local memory a thread, for which the driver held 5.3 GiB of the GPU for the
# rest of the process, and the backward ran 7x slower (bench_gdn, 128 samples: 77 ms, 11 ms).
FLA_PINS = {"l2norm_fwd_kernel": ({"BT": 64}, 4, 3), "l2norm_bwd_kernel": ({"BT": 8}, 2, 3),
            "chunk_local_cumsum_scalar_kernel": ({}, 2, 3),
            "chunk_gated_delta_rule_fwd_kkt_solve_kernel": ({"BK": 64}, 1, 3),
            "recompute_w_u_fwd_kernel": ({}, 4, 3), "prepare_wy_repr_bwd_kernel": ({}, 4, 3),
            "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": ({"BV": 64}, 4, 2),
            "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64": ({"BV": 32}, 4, 2),
            "chunk_bwd_kernel_dv_local": ({}, 4, 3), "chunk_bwd_kernel_dqkwg": ({}, 4, 3)}
# fla's switches: its hand-off of these calls to other packages' kernels where they are
# installed (off at its import, or each package's switch at each call: FlashQLA, TileLang,
# Gluon, intra-card context parallelism), and its opt-in fast exp and log (read at its import).
# Each gives other bits.
FLA_ENV = dict(FLA_DISABLE_BACKEND_DISPATCH="1", FLA_FLASH_QLA="0", FLA_TILELANG="0",
               FLA_GLUON="0", FLA_INTRACARD_CP="0", FLA_USE_FAST_OPS="0")


@functools.cache
def pin_fla() -> dict[str, tuple[object, list]]:
    """fla's switches off (FLA_ENV), then each of FLA_KERNELS on one launch config, FLA_PINS's
    (on a GPU other than a Hopper, whose candidates may lack it, fla's first), so Triton times
    nothing and every process gets the same bits. Returns each kernel's autotuner and its
    candidates as they were. Refuses an fla whose exp and log are its fast ones (chosen at its
    import by FLA_USE_FAST_OPS), and on a Hopper an fla whose candidates lack a pin (another fla
    than 0.6.0)."""
    import sys

    exp = getattr(getattr(sys.modules.get("fla.ops.utils.op"), "exp", None), "fn", None)
    if exp is not None and "fast_expf" in exp.__code__.co_names:  # what fla read at import
        raise RuntimeError("fla was imported with FLA_USE_FAST_OPS=1 (its approximate exp and "
                           "log: other gradient bits); unset it.")
    os.environ.update(FLA_ENV)
    pinned = {}
    for module, names in FLA_KERNELS.items():
        for name in names:
            tuner = autotuners(module)[name]
            pinned[name] = tuner, tuner.configs
            pin = [c for c in tuner.configs
                   if (c.kwargs, c.num_warps, c.num_stages) == FLA_PINS[name]]
            if not pin and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
                raise RuntimeError(f"fla's {name} has no candidate {FLA_PINS[name]} (tiles, "
                                   f"warps, stages): not fla 0.6.0's kernels; install that.")
            tuner.configs = (pin or tuner.configs)[:1]
    return pinned


def gated_delta_rule_backward_fla(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor,
                                  A_log: Tensor, dt_bias: Tensor, cu_seqlens: Tensor,
                                  max_seqlen: int, go: Tensor) -> tuple[Tensor, ...]:
    """gated_delta_rule_backward on flash-linear-attention's chunked kernels (what transformers'
    Qwen3.5 trains with): its forward over every sequence in 64-token chunks, the L2 norms in its
    kernel, then its fused backward; the gates (gdn_gates, fp32) through autograd. This is the
    gradient of fla's bf16 chunked forward at the same inputs, not of the fp32 reference: at
    Qwen3.5-4B's heads within 0.6% of it for q, k, v, a, b, about 9x faster (fla's forward runs
    again inside) and in 0.3x the memory (results/h100_q35_lora_sha_gdn/)."""
    pin_fla()  # before fla's first import: its environment
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    with torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in (q, k, v, a, b, A_log, dt_bias)]
        q_, k_, v_, a_, b_, A_log_, dt_bias_ = leaves
        g, beta = gdn_gates(a_, b_, A_log_, dt_bias_)  # (T, Hv) fp32 each
        o, _ = chunk_gated_delta_rule(q_[None], k_[None], v_[None], g[None],
                                      beta.to(q.dtype)[None], cu_seqlens=cu_seqlens.long(),
                                      use_qk_l2norm_in_kernel=True)  # (1, T, Hv, Dv)
        return torch.autograd.grad(o[0], leaves, go.to(o.dtype))


class GatedDeltaRuleFn(torch.autograd.Function):
    """A given forward of Qwen3.5's gated delta rule (vLLM's kernels, replayed on vLLM's
    schedule: replay_gated_delta_rule) and a given backward (gated_delta_rule_backward, or on the
    GPU its fla form). The chunked and recurrent forms are one function of the inputs, so the
    gradient of either form is the gradient of the rule vLLM computes, up to rounding."""

    @staticmethod
    def forward(ctx, q, k, v, a, b, A_log, dt_bias, cu_seqlens, max_seqlen, prefill, fwd, bwd):
        ctx.save_for_backward(q, k, v, a, b, A_log, dt_bias, cu_seqlens)
        ctx.max_seqlen, ctx.bwd = max_seqlen, bwd
        return fwd(q, k, v, a, b, A_log, dt_bias, cu_seqlens, max_seqlen, prefill)

    @staticmethod
    def backward(ctx, go):
        *inputs, cu_seqlens = ctx.saved_tensors
        return *ctx.bwd(*inputs, cu_seqlens, ctx.max_seqlen, go), None, None, None, None, None


# ---------------------------------------------------------------------------
# Qwen3.5: full attention's q/k preparation (vLLM on CUDA: `fused_qk_rmsnorm_rope_gate`, one
# kernel: the gate split off each q head, Gemma RMSNorm of q and k heads, partial NeoX rotary)
# ---------------------------------------------------------------------------


def ref_gated_qk_norm_rope(q_gate: Tensor, k: Tensor, wq: Tensor, wk: Tensor, eps: float,
                           positions: Tensor, cos_sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q_gate (T, Hq 2D) holds each head's q, then its gate; k (T, Hk D). q and k are normed
    per head (ref_gemma_rms_norm, weights wq, wk (D,)), then their first R dims turned
    (ref_rotary, cos_sin (P, R)); the gate is copied. -> q (T, Hq, D), k (T, Hk, D), gate."""
    T, D = q_gate.shape[0], wq.shape[0]
    q, gate = q_gate.reshape(T, -1, 2 * D).chunk(2, dim=-1)  # (T, Hq, D) each
    q = ref_gemma_rms_norm(q, wq, eps)
    k = ref_gemma_rms_norm(k.reshape(T, -1, D), wk, eps)
    q, k = ref_rotary(q, k, positions, cos_sin)
    return q, k, gate


def gated_qk_norm_rope_backward(q_gate: Tensor, k: Tensor, wq: Tensor, wk: Tensor, eps: float,
                                positions: Tensor, cos_sin: Tensor, gq: Tensor, gk: Tensor,
                                ggate: Tensor, norm_bwd: Callable, rotary_bwd: Callable):
    """y = R(p) n(x) per head (n: the Gemma norm, R(p) the rotation) and gate = its copy:
    the norm's backward of R(p)^T dy (rotary_bwd), dgate = its output's gradient, laid back
    into q_gate's rows. -> (dq_gate, dk, dwq, dwk)."""
    T, D = q_gate.shape[0], wq.shape[0]
    q, _ = q_gate.reshape(T, -1, 2 * D).chunk(2, dim=-1)  # (T, Hq, D): the normed input
    gq, gk = rotary_bwd(gq, gk, positions, cos_sin)
    dq, dwq = norm_bwd(q, wq, gq, eps)
    dk, dwk = norm_bwd(k.reshape(T, -1, D), wk, gk, eps)
    dq_gate = torch.cat([dq, ggate.to(dq.dtype)], dim=-1).reshape(q_gate.shape)
    return dq_gate, dk.reshape(k.shape), dwq, dwk


class GatedQKNormRopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_gate, k, wq, wk, eps, positions, cos_sin, fwd, bwd):
        ctx.save_for_backward(q_gate, k, wq, wk, positions, cos_sin)
        ctx.eps, ctx.bwd = eps, bwd
        return fwd(q_gate, k, wq, wk, eps, positions, cos_sin)

    @staticmethod
    def backward(ctx, gq, gk, ggate):
        q_gate, k, wq, wk, positions, cos_sin = ctx.saved_tensors
        dq_gate, dk, dwq, dwk = ctx.bwd(q_gate, k, wq, wk, ctx.eps, positions, cos_sin, gq, gk,
                                        ggate)
        return dq_gate, dk, dwq, dwk, None, None, None, None, None


# ---------------------------------------------------------------------------
# Kernel sets
# ---------------------------------------------------------------------------

# The backward of each op, by name: the PyTorch ones (CPU, tests) and the Triton ones (GPU).
TORCH_BACKWARDS = dict(rms_norm=rms_norm_backward, rotary=rotary_backward,
                       silu_and_mul=silu_and_mul_backward, attention=attention_backward,
                       logprobs_entropy=logprobs_entropy_backward,
                       moe_experts=moe_experts_backward,
                       gemma_rms_norm=gemma_backward(rms_norm_backward),
                       sigmoid_gate_mul=sigmoid_gate_mul_backward,
                       rms_norm_gated=rms_norm_gated_backward,
                       gated_delta_rule=gated_delta_rule_backward,
                       gated_qk_norm_rope=functools.partial(
                           gated_qk_norm_rope_backward, norm_bwd=gemma_backward(rms_norm_backward),
                           rotary_bwd=rotary_backward))
# Qwen3.5's gated norm and partial rotary keep their PyTorch backward on the GPU for now; its
# rule takes fla's chunked backward (fla is imported at the first backward of a Qwen3.5).
TRITON_BACKWARDS = dict(rms_norm=rms_norm_backward_triton, rotary=rotary_backward_triton,
                        silu_and_mul=silu_and_mul_backward_triton,
                        attention=attention_backward_tiled,
                        logprobs_entropy=logprobs_entropy_backward_triton,
                        moe_experts=moe_experts_backward_grouped,
                        gemma_rms_norm=gemma_backward(rms_norm_backward_triton),
                        sigmoid_gate_mul=sigmoid_gate_mul_backward,
                        rms_norm_gated=rms_norm_gated_backward,
                        gated_delta_rule=gated_delta_rule_backward_fla,
                        gated_qk_norm_rope=functools.partial(
                            gated_qk_norm_rope_backward,
                            norm_bwd=gemma_backward(rms_norm_backward_triton),
                            rotary_bwd=rotary_backward))


def reference_kernels() -> Kernels:
    """Plain PyTorch ops with autograd's own backward: the CPU path and the tests' ground truth."""
    return Kernels(
        name="reference",
        rms_norm=ref_rms_norm,
        add_rms_norm=ref_add_rms_norm,
        rotary=ref_rotary,
        silu_and_mul=ref_silu_and_mul,
        linear=lambda x, w, w_compute=None: F.linear(x, w.to(x.dtype)),  # autograd casts
        attention=lambda *a: ref_attention(*a)[0],
        logprobs_entropy=ref_logprobs_entropy,
        moe_topk=ref_moe_topk,
        moe_experts=lambda x, w13, w2, w, ids, casts=None: ref_moe_experts(x, w13, w2, w, ids),
        lora=ref_lora_autograd,
        gemma_rms_norm=ref_gemma_rms_norm,
        gemma_add_rms_norm=ref_gemma_add_rms_norm,
        sigmoid_gate_mul=ref_sigmoid_gate_mul,
        rms_norm_gated=ref_rms_norm_gated,
        causal_conv1d=ref_causal_conv1d,
        gated_delta_rule=ref_gated_delta_rule,
        gated_qk_norm_rope=ref_gated_qk_norm_rope,
    )


def ref_lora_autograd(x: Tensor, y: Tensor, casts, scale: float, *masters: Tensor) -> Tensor:
    """y + [x A_s^T (scale B_s)^T]_s on the masters, with autograd (the reference kernels')."""
    S = len(masters) // 2
    parts = [(x @ a.to(x.dtype).t()) @ (scale * b).to(x.dtype).t()
             for a, b in zip(masters[:S], masters[S:])]
    return y + torch.cat(parts, dim=-1)


def custom_backward_kernels(fwd: Kernels, bwd: dict = TORCH_BACKWARDS) -> Kernels:
    """Wrap the forwards of `fwd` in the autograd Functions above, with the backwards `bwd`."""
    return Kernels(
        name=fwd.name,
        rms_norm=lambda x, w, eps: RMSNormFn.apply(x, w, eps, fwd.rms_norm, bwd["rms_norm"]),
        add_rms_norm=lambda x, r, w, eps: AddRMSNormFn.apply(x, r, w, eps, fwd.add_rms_norm,
                                                             bwd["rms_norm"]),
        rotary=lambda q, k, pos, cs: RotaryFn.apply(q, k, pos, cs, fwd.rotary, bwd["rotary"]),
        silu_and_mul=lambda x: SiluAndMulFn.apply(x, fwd.silu_and_mul, bwd["silu_and_mul"]),
        linear=lambda x, w, w_compute=None: LinearFn.apply(x, w, fwd.linear, w_compute),
        attention=lambda q, k, v, cu, L, sc: AttentionFn.apply(q, k, v, cu, L, sc, fwd.attention,
                                                               bwd["attention"]),
        logprobs_entropy=lambda z, t, temp: LogprobsEntropyFn.apply(z, t, temp,
                                                                    fwd.logprobs_entropy,
                                                                    bwd["logprobs_entropy"]),
        moe_topk=lambda z, top_k, renorm: MoETopkFn.apply(z, top_k, renorm, fwd.moe_topk),
        moe_experts=lambda x, w13, w2, w, ids, casts=None: MoEExpertsFn.apply(
            x, w13, w2, w, ids, fwd.moe_experts, bwd["moe_experts"], casts),
        lora=lambda x, y, casts, scale, *m: LoRAFn.apply(x, y, casts, scale, fwd.lora, *m),
        gemma_rms_norm=lambda x, w, eps: RMSNormFn.apply(x, w, eps, fwd.gemma_rms_norm,
                                                         bwd["gemma_rms_norm"]),
        gemma_add_rms_norm=lambda x, r, w, eps: AddRMSNormFn.apply(
            x, r, w, eps, fwd.gemma_add_rms_norm, bwd["gemma_rms_norm"]),
        sigmoid_gate_mul=lambda o, gate: SigmoidGateMulFn.apply(o, gate, fwd.sigmoid_gate_mul,
                                                                bwd["sigmoid_gate_mul"]),
        rms_norm_gated=lambda x, z, w, eps: RMSNormGatedFn.apply(x, z, w, eps,
                                                                 fwd.rms_norm_gated,
                                                                 bwd["rms_norm_gated"]),
        causal_conv1d=lambda x, w, cu, L: CausalConv1dFn.apply(x, w, cu, L, fwd.causal_conv1d),
        gated_delta_rule=lambda *x: GatedDeltaRuleFn.apply(*x, fwd.gated_delta_rule,
                                                            bwd["gated_delta_rule"]),
        gated_qk_norm_rope=lambda q_gate, k, wq, wk, eps, pos, cs: GatedQKNormRopeFn.apply(
            q_gate, k, wq, wk, eps, pos, cs, fwd.gated_qk_norm_rope, bwd["gated_qk_norm_rope"]),
    )


def reference_forwards() -> Kernels:
    """The reference forwards as a forward set (attention also returns lse, logprobs_entropy
    the row statistics)."""
    ref = reference_kernels()
    return Kernels(**{**ref.__dict__, "name": "reference+custom-backward",
                      "attention": ref_attention, "logprobs_entropy": ref_logprobs_entropy_stats,
                      "lora": ref_lora})


# vLLM's CUDA fused_add_rms_norm, which its batch-invariant RMSNorm still calls when there is a
# residual, is not invariant to the number of rows in one call (vLLM #48271): its thread block
# (capped at the hidden size) is 1024 threads below 256 rows and 256 threads from 256 rows on,
# and with it changes the order of the sum of squares; about 2% of rows then differ by an ulp. So
# every call goes through `fused_add_rms_norm_rows`, which gives the kernel at least this many
# rows, padding a smaller call: every row is normalised by the 256-thread configuration, the
# trainer's and the engine's alike (simple_rl routes vLLM's calls through it too), and a whole
# micro-batch is one launch. A decode step of fewer than 256 sequences pays four small copies per
# norm for it.
ADD_RMS_NORM_MIN_ROWS = 256


def fused_add_rms_norm_rows(x: Tensor, residual: Tensor, w: Tensor, eps: float) -> None:
    """vLLM's in-place fused_add_rms_norm (residual <- x + residual, x <- rms_norm(residual) * w),
    on at least ADD_RMS_NORM_MIN_ROWS rows: each row's result is batch-independent."""
    from vllm import _custom_ops as ops

    d = x.shape[-1]
    x2, r2 = x.view(-1, d), residual.view(-1, d)  # (n, d)
    n = x2.shape[0]
    if n >= ADD_RMS_NORM_MIN_ROWS:
        ops.fused_add_rms_norm(x2, r2, w, eps)
        return
    pad = (0, 0, 0, ADD_RMS_NORM_MIN_ROWS - n)  # zero rows below: each row is its own block
    xp, rp = F.pad(x2, pad), F.pad(r2, pad)  # (256, d)
    ops.fused_add_rms_norm(xp, rp, w, eps)
    x2.copy_(xp[:n])
    r2.copy_(rp[:n])


# Output columns below which a linear layer keeps vLLM's batch-invariant Triton matmul, in the
# engine (route_vllm_linear_through_cublaslt) and the trainer: cuBLASLt may run a GEMM of one
# column as a GEMV, whose sums need not keep one order at every row count, and bf16 rounding
# hides all but a rare flip (on an H100 Qwen3.5-35B-A3B's one-column shared-expert gate gave
# other rows than the Triton kernel from M = 239: tests/test_gemm_gpu.py). A Triton tile is at
# least 128 columns wide, so such a layer costs what it did.
NARROW_LINEAR = 128


def vllm_linear(x: Tensor, w: Tensor) -> Tensor:
    """x W^T as the engine's linear layers compute it: cuBLASLt (F.linear), or below
    NARROW_LINEAR output columns vLLM's Triton matmul (CUDA; F.linear elsewhere)."""
    if w.shape[0] >= NARROW_LINEAR or not x.is_cuda:
        return F.linear(x, w)
    from vllm.model_executor.determinism.batch_invariant import linear_batch_invariant

    return linear_batch_invariant(x, w)


def vllm_moe_topk(logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """vLLM's Qwen3-MoE router: `FusedTopKRouter` -> `fused_topk` -> the CUDA `topk_softmax`
    (softmax in fp32 of the bf16 logits, top k, renormalised if asked), ids int32. CUDA only."""
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk

    w, ids, _ = fused_topk(logits, logits, top_k, renormalize)  # 1st arg: only its row count
    return w, ids


def vllm_moe_experts(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor,
                     ids: Tensor) -> Tensor:
    """vLLM's unquantized MoE experts on CUDA (`TritonExperts.apply`, TP = EP = 1, no LoRA),
    call for call: the batch-invariant config, the expert assignment (the naive one for few
    tokens, else `moe_align_block_size`), `fused_moe_kernel` for x W13^T, silu_and_mul,
    `fused_moe_kernel` for a W2^T scaled by the routing weight in fp32 before its rounding,
    and `moe_sum` over the k slots. x (T, D), w13 (E, 2I, D), w2 (E, D, I) in x's dtype."""
    from vllm import _custom_ops as ops
    from vllm import envs
    from vllm.model_executor.layers.fused_moe.activation import (
        MoEActivation, apply_moe_activation)
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.fused_moe import (
        _prepare_expert_assignment, invoke_fused_moe_triton_kernel, try_get_optimal_moe_config)

    # Without it the tile config follows T (tuned tables): not batch-invariant.
    assert envs.VLLM_BATCH_INVARIANT, "the MoE kernels need VLLM_BATCH_INVARIANT=1"
    x, weights, ids = x.contiguous(), weights.contiguous(), ids.contiguous()
    T, D = x.shape
    E, N, _ = w13.shape  # N = 2I
    k = ids.shape[1]
    config = try_get_optimal_moe_config(
        w13.size(), w2.size(), k, FUSED_MOE_UNQUANTIZED_CONFIG.config_name(x.dtype), T)
    compute_type = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                    torch.float32: tl.float32}[x.dtype]
    sorted_ids, expert_ids, n_post_pad = _prepare_expert_assignment(ids, config, T, k, E, None)
    gemm = dict(compute_type=compute_type, use_fp8_w8a8=False, use_int8_w8a8=False,
                use_int8_w8a16=False, use_int4_w4a16=False, per_channel_quant=False,
                block_shape=None, B_bias=None)
    h = torch.empty(T, k, N, dtype=x.dtype, device=x.device)
    invoke_fused_moe_triton_kernel(x, w13, h, None, None, None, sorted_ids, expert_ids,
                                   n_post_pad, False, k, config, **gemm)
    a = torch.empty(T * k, N // 2, dtype=x.dtype, device=x.device)
    apply_moe_activation(MoEActivation.SILU, a, h.view(-1, N))
    y = torch.empty(T, k, D, dtype=x.dtype, device=x.device)
    invoke_fused_moe_triton_kernel(a, w2, y, None, None, weights, sorted_ids, expert_ids,
                                   n_post_pad, True, 1, config, **gemm)
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    ops.moe_sum(y, out)
    return out


@functools.lru_cache(maxsize=16)
def lora_meta(T: int, device: torch.device) -> tuple:
    """The punica kernels' token metadata for T tokens that all use the adapter in slot 0 (the
    one slot of an engine with max_loras = 1): the arguments vLLM's LoRAKernelMeta.meta_args
    gives when every token of a batch has that adapter."""
    i32 = dict(dtype=torch.int32, device=device)
    return (torch.zeros(T, **i32), torch.arange(T, **i32), torch.tensor([T], **i32),
            torch.tensor([0, T], **i32), torch.tensor([0], **i32),
            torch.tensor([False]), torch.tensor([1], dtype=torch.int32))


def vllm_lora(x: Tensor, y: Tensor, a: Sequence[Tensor], b: Sequence[Tensor]) -> Tensor:
    """vLLM's LoRA linear update (`PunicaWrapperGPU.add_lora_linear`): lora_shrink into an fp32
    buffer u (S, T, r) with scale 1, then lora_expand adding rnd(rnd(u) B'^T) to y in place.
    a, b: the stacked (1, 1, rows, cols) tensors of slot 0. Returns u. CUDA only."""
    from vllm.lora.ops.triton_ops import lora_expand, lora_shrink

    x = x.contiguous()
    T = x.shape[0]
    u = torch.empty(len(a), T, a[0].shape[-2], dtype=torch.float32, device=x.device)
    meta = lora_meta(T, x.device)
    lora_shrink(x, list(a), u, *meta, 1.0)
    lora_expand(u, list(b), y, *meta, offset_start=0, add_inputs=True)
    return u


# vLLM's Qwen3.5 kernels on CUDA (its vllm/models/qwen3_5/nvidia model), each called as the
# engine's layer calls it: the same arguments, dtypes and memory layouts (CUDA only).


def vllm_gemma_rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """Qwen3_5RMSNorm without a residual (the first layer's input norm): FlashInfer's
    gemma_rmsnorm, x (T, D) -> x / rms(x) * (1 + w)."""
    from flashinfer.norm import gemma_rmsnorm

    return gemma_rmsnorm(x, w, eps)


def vllm_gemma_add_rms_norm(x: Tensor, residual: Tensor, w: Tensor,
                            eps: float) -> tuple[Tensor, Tensor]:
    """Qwen3_5RMSNorm with a residual: FlashInfer's gemma_fused_add_rmsnorm, which works in
    place (residual <- x + residual, x <- its norm), on copies. -> (y, x + residual)."""
    from flashinfer.norm import gemma_fused_add_rmsnorm

    x, residual = x.clone(), residual.clone()
    gemma_fused_add_rmsnorm(x, residual, w, eps)
    return x, residual


def vllm_sigmoid_gate_mul(o: Tensor, gate: Tensor) -> Tensor:
    """Gated attention's output gate: vLLM's fused_sigmoid_gate_mul on (T, Hq D) rows, one
    rounding of o sigmoid(gate). A gate of another shape (Qwen3.5-MoE's shared expert, (T, 1))
    takes the kernel's own eager fallback, o * torch.sigmoid(gate)."""
    from vllm.kernels.triton.fused_sigmoid_gate_mul import fused_sigmoid_gate_mul

    if o.shape != gate.shape:
        return fused_sigmoid_gate_mul(o, gate)
    T = o.shape[0]
    return fused_sigmoid_gate_mul(o.reshape(T, -1), gate.reshape(T, -1)).view(o.shape)


def vllm_rms_norm_gated(x: Tensor, z: Tensor, w: Tensor, eps: float) -> Tensor:
    """Gated DeltaNet's output norm: vLLM's fused_gdn_gated_rms_norm (norm before the gate,
    silu), on x (T, Hv, Dv) flattened to rows and z read strided from the qkvz projection."""
    from vllm.models.qwen3_5.nvidia.ops.fused_gdn_gated_norm import fused_gdn_gated_rms_norm

    T, Hv, Dv = x.shape
    x2 = x.reshape(T, Hv * Dv)
    out = torch.empty_like(x2)  # the engine writes over x; a copy keeps x for the backward
    fused_gdn_gated_rms_norm(x=x2, z=z.reshape(T, Hv * Dv), weight=w, out=out, eps=eps,
                             num_v_heads=Hv, head_v_dim=Dv, norm_before_gate=True,
                             activation="silu")
    return out.view(T, Hv, Dv)


def vllm_causal_conv1d(x: Tensor, w: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
    """Gated DeltaNet's conv1d + silu: vLLM's causal_conv1d_fn over every token of each sequence,
    as a prefill with no state runs it (a decode step's causal_conv1d_update computes each
    token alike). x (T, C) is the column slice of the qkvz projection the engine passes (its
    transpose: channel-last); conv states bf16, slot n + 1 sequence n's (slot 0: the null block).
    w (C, K) -> (T, C)."""
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn

    B = cu_seqlens.numel() - 1
    C, K = w.shape
    states = x.new_zeros(B + 1, C, K - 1)
    y = causal_conv1d_fn(x.transpose(0, 1), w, None, conv_states=states,
                         query_start_loc=cu_seqlens.int(),
                         cache_indices=torch.arange(1, B + 1, dtype=torch.int32, device=x.device),
                         has_initial_state=torch.zeros(B, dtype=torch.bool, device=x.device),
                         activation="silu")  # (C, T)
    return y.transpose(0, 1)


def gdn_prefill_vllm(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                     dt_bias: Tensor, cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
    """A prefill of whole prompts as vLLM's Triton/fla backend runs it: fused_post_conv_prep
    (the L2 norms of q and k rounded to bf16, the gates g and beta in fp32) on the conv output
    rows (T, 2 Hk Dk + Hv Dv), contiguous, then chunk_gated_delta_rule from zero fp32 states
    with the chunk metadata the engine's builder makes. -> (o (T, Hv, Dv), final states
    (B, Hv, Dv, Dk) fp32, vLLM's layout)."""
    from vllm.third_party.flash_linear_attention.ops import (chunk_gated_delta_rule,
                                                             fused_post_conv_prep)
    from vllm.third_party.flash_linear_attention.ops.index import (prepare_chunk_indices,
                                                                   prepare_chunk_offsets)
    from vllm.third_party.flash_linear_attention.ops.utils import FLA_CHUNK_SIZE
    from vllm.utils.torch_utils import async_tensor_h2d

    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    conv_out = torch.cat([x.reshape(T, -1) for x in (q, k, v)], dim=-1)  # (T, C) contiguous
    b, a = torch.cat([b, a], dim=-1).chunk(2, dim=-1)  # strided views of one [b | a], as vLLM's
    q, k, v, g, beta = fused_post_conv_prep(conv_output=conv_out, a=a, b=b, A_log=A_log,
                                            dt_bias=dt_bias, num_k_heads=Hk, head_k_dim=Dk,
                                            head_v_dim=Dv, apply_l2norm=True, output_g_exp=False)
    cu_cpu = cu_seqlens.cpu().int()
    device = q.device
    h0 = torch.zeros(cu_cpu.numel() - 1, Hv, Dv, Dk, dtype=torch.float32, device=device)
    o, final = chunk_gated_delta_rule(
        q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None], initial_state=h0,
        output_final_state=True, cu_seqlens=cu_cpu.to(device),
        chunk_indices=async_tensor_h2d(prepare_chunk_indices(cu_cpu, FLA_CHUNK_SIZE), device),
        chunk_offsets=async_tensor_h2d(prepare_chunk_offsets(cu_cpu, FLA_CHUNK_SIZE), device),
        use_qk_l2norm_in_kernel=False)
    return o[0], final  # (T, Hv, Dv), (B, Hv, Dv, Dk)


# The modules of vLLM's prefill whose kernels Triton autotunes: a machine's first run of a head
# shape times each candidate launch config and keeps the fastest in its Triton cache, and some
# candidates sum in another order (on an H100 at Qwen3.5-9B's heads, the kkt kernel at BK 32
# and 4 warps: 304 of 4.07M outputs differ). Engine and trainer share the winner (one process),
# so parity holds; but a machine with an empty cache could pick another and end a run of one
# seed at another sha256. pin_vllm_prefill leaves each kernel one config: Triton times nothing.
VLLM_FLA = "vllm.third_party.flash_linear_attention.ops."
VLLM_PREFILL_AUTOTUNED = ("cumsum", "chunk_scaled_dot_kkt", "solve_tril", "wy_fast",
                          "chunk_delta_h", "chunk_o", "l2norm")


def autotuners(module: str) -> dict[str, triton.runtime.Autotuner]:
    """The Triton autotuners of a module's kernels, by kernel name (under heuristics too)."""
    import importlib

    found = {}
    for name, fn in vars(importlib.import_module(module)).items():
        while isinstance(fn, triton.runtime.Heuristics):  # a triton.heuristics around it
            fn = fn.fn
        if isinstance(fn, triton.runtime.Autotuner):
            found[name] = fn
    return found


def vllm_prefill_autotuners() -> dict[str, triton.runtime.Autotuner]:
    """The autotuners of vLLM's prefill (VLLM_PREFILL_AUTOTUNED's modules), by "module.kernel"."""
    return {f"{module}.{name}": tuner for module in VLLM_PREFILL_AUTOTUNED
            for name, tuner in autotuners(VLLM_FLA + module).items()}


def pin_vllm_prefill() -> None:
    """Each autotuned kernel of vLLM's prefill on one of its candidate configs, in this process
    (`prefill_pin_order`'s first): with one candidate Triton neither times nor reads its cache,
    so every machine of a GPU kind computes alike."""
    for tuner in vllm_prefill_autotuners().values():
        tuner.configs = [min(tuner.configs, key=prefill_pin_order)]


def prefill_pin_order(config: triton.Config) -> tuple[int, int, int]:
    """The pin's preference: 64-wide tiles (BK, BV, ... where a kernel has them), then the
    fewest warps and stages. Not merely a list's first: chunk_o sizes its tiles at import by a
    shared-memory probe that fails where CUDA has not started yet (vLLM asks NVML whether there
    is a GPU, and Triton's probe does not start CUDA), listing [32, 64], not [64, 128] (a fresh
    process pinning first computed 29 of 4.07M outputs otherwise on an H100); 64 is on both.
    (cumsum's vector kernel, [16, 32] or [32, 64], is not in the Gated DeltaNet's prefill.)"""
    off = sum(v != 64 for k, v in config.kwargs.items() if k.startswith("B"))
    return off, config.num_warps, config.num_stages


def gdn_decode_vllm(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                    dt_bias: Tensor, states: Tensor, lens: list[int]) -> Tensor:
    """N sequences' decode steps as vLLM runs decode tokens (packed decode off), in one launch of
    fused_sigmoid_gating_delta_rule_update over all their rows, back to back (lens[n] of sequence
    n): gates, L2 norms and scale inside the kernel, each from the state its prefill left, in
    slot n + 1 (slot 0: the null block), through a 2-D slot index, row n all n + 1 (each token's
    state is written back there). Its arithmetic per token does not depend on how many tokens
    or sequences a launch covers (the state stays fp32 in registers): the engine's decode steps'
    bits (tests/test_qwen35_gpu.py, P3 and P12). states (N, Hv, Dv, Dk) fp32 -> o (L, Hv, Dv)."""
    from vllm.third_party.flash_linear_attention.ops import (
        fused_sigmoid_gating_delta_rule_update)

    slots = torch.cat([torch.zeros_like(states[:1]), states])  # (N + 1, Hv, Dv, Dk)
    cu = torch.tensor([0, *lens], dtype=torch.int32, device=q.device).cumsum(0, dtype=torch.int32)
    o, _ = fused_sigmoid_gating_delta_rule_update(
        A_log=A_log, a=a, b=b, dt_bias=dt_bias, q=q[None], k=k[None], v=v[None],
        initial_state=slots, inplace_final_state=True, cu_seqlens=cu,
        ssm_state_indices=decode_slot_index(lens, q.device), use_qk_l2norm_in_kernel=True)
    return o[0]  # (L, Hv, Dv)


def decode_slot_index(lens: list[int], device) -> Tensor:
    """gdn_decode_vllm's slot index: row n all n + 1, at least max(lens) wide, rounded up to a
    power of two (the kernel's row stride is a compile-time constant: a few compiles per run,
    not one per longest decode), contiguous (the kernel ignores the column stride: an expanded
    index would read other sequences' slots) -> (N, W) int32."""
    width = 1 << (max(lens) - 1).bit_length()
    n = torch.arange(1, len(lens) + 1, dtype=torch.int32, device=device)
    return n[:, None].expand(len(lens), width).contiguous()


def vllm_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, cu_seqlens, max_seqlen,
                          prefill) -> Tensor:
    """Gated DeltaNet's rule on vLLM's kernels, on the engine's schedule (prompts prefilled
    whole, generated tokens decoded): replay_gated_delta_rule with vLLM's two forms."""
    return replay_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, cu_seqlens, prefill,
                                   gdn_prefill_vllm, gdn_decode_vllm)


def vllm_gated_qk_norm_rope(q_gate: Tensor, k: Tensor, wq: Tensor, wk: Tensor, eps: float,
                            positions: Tensor, cos_sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gated attention's q/k preparation as vLLM's Qwen3NextAttention runs it on CUDA (text
    positions: 1-D, no M-RoPE sections): fused_qk_rmsnorm_rope_gate on the q_gate and k
    column slices of the qkv projection, norm_beta 1 (the Gemma scale 1 + w), rotary_dim the
    cache's width. -> q (T, Hq, D), k (T, Hk, D), gate (T, Hq, D)."""
    from vllm.model_executor.layers.fused_qk_norm_rope import fused_qk_rmsnorm_rope_gate

    T, D = q_gate.shape[0], wq.shape[0]
    Hq, Hk = q_gate.shape[1] // (2 * D), k.shape[1] // D
    q, k, gate = fused_qk_rmsnorm_rope_gate(q_gate, k, wq, wk, cos_sin, positions, eps, Hq, Hk,
                                            D, cos_sin.shape[-1], mrope_section=None,
                                            norm_beta=1.0)
    return q.view(T, Hq, D), k.view(T, Hk, D), gate.view(T, Hq, D)


def vllm_forwards() -> Kernels:
    """The kernels vLLM 0.34's Qwen3 (and, on CUDA, Qwen3.5) forward calls with
    VLLM_BATCH_INVARIANT=1 (CUDA only)."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.determinism import batch_invariant as bi
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    def add_rms_norm(x, residual, w, eps):
        x, residual = x.clone(), residual.clone()  # the kernel works in place
        fused_add_rms_norm_rows(x, residual, w, eps)
        return x, residual

    def rotary(q, k, positions, cos_sin):
        q = q.contiguous().clone()  # the kernel works in place, on heads flattened as vLLM
        k = k.contiguous().clone()  # passes them
        ops.rotary_embedding(positions, q.view(q.shape[0], -1), k.view(k.shape[0], -1),
                             q.shape[-1], cos_sin, True)
        return q, k

    def silu_and_mul(x):
        out = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=x.dtype, device=x.device)
        torch.ops._C.silu_and_mul(out, x)
        return out

    def attention(q, k, v, cu_seqlens, max_seqlen, scale):
        return flash_attn_varlen_func(
            q, k, v, max_seqlen, cu_seqlens, max_seqlen, cu_seqlens_k=cu_seqlens,
            softmax_scale=scale, causal=True, return_softmax_lse=True, fa_version=3,
            num_splits=1,
        )

    # vLLM 0.34's linear layers and LM head call its Triton persistent matmul in batch-invariant
    # mode; simple_rl routes them on Hopper to F.linear, which the trainer calls too: cuBLASLt
    # with split-K off, bit-equal to the Triton kernel at every row count checked
    # (tests/test_gemm_gpu.py) and faster; narrow layers stay on the Triton kernel
    # (vllm_linear). On Ampere vLLM routes aten::linear to the Triton kernel itself.
    return Kernels(
        name="vllm",
        rms_norm=bi.rms_norm_batch_invariant,
        add_rms_norm=add_rms_norm,
        rotary=rotary,
        silu_and_mul=silu_and_mul,
        linear=vllm_linear,
        attention=attention,
        logprobs_entropy=logprobs_entropy_triton,  # ours, with the bits of vLLM's sampler
        moe_topk=vllm_moe_topk,
        moe_experts=vllm_moe_experts,
        lora=vllm_lora,
        gemma_rms_norm=vllm_gemma_rms_norm,
        gemma_add_rms_norm=vllm_gemma_add_rms_norm,
        sigmoid_gate_mul=vllm_sigmoid_gate_mul,
        rms_norm_gated=vllm_rms_norm_gated,
        causal_conv1d=vllm_causal_conv1d,
        gated_delta_rule=vllm_gated_delta_rule,
        gated_qk_norm_rope=vllm_gated_qk_norm_rope,
    )


def vllm_kernels() -> Kernels:
    return custom_backward_kernels(vllm_forwards(), TRITON_BACKWARDS)
