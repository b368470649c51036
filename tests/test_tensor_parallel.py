"""Tensor parallelism emulated in one process equals N ranks summing on gloo, bit for bit (CPU).

A TP = N vLLM engine computes o_proj and down_proj as N partial GEMMs over slices of K and sums
them with NCCL (docs/tensor_parallel.md). Four gloo processes, launched once, do that: ranks 0-1
with gloo's bf16 all_reduce (for two ranks every algorithm gives fl(p0 + p1)), all four as the
chain NCCL's tree runs inside one host (rank 3's partial passed down to rank 0, each rank adding
its own in bf16; gloo's own 4-rank all_reduce sums in its ring's order, which is not NCCL's),
and ranks 0-1 as the vocab-parallel embedding (masked lookups all-reduced). On 2-4 GPUs
(pytest -m gpu) vLLM's own NCCL communicator sums the partials.
"""

import itertools
import json
import os
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import batch_invariant_backward as bib
from helpers import free_port

WORLD = 4
SHAPES = [(37, 1536, 256), (5, 1200, 96)]  # (T, K, D): K not a power of two, K / 4 neither
CHAIN = [3, 2, 1, 0]  # the ranks from the chain's tail to its root, as _ranks sums them
VOCAB, DIM = 100, 24  # an embedding whose 100 rows split 50 / 50 over two ranks


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bf16 bit patterns: torch.equal on these tells -0.0 from 0.0."""
    return t.view(torch.int16)


def case(T: int, K: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, K), w (D, K) in bf16, the same in every process."""
    g = torch.Generator().manual_seed(T * K + D)
    x = torch.randn(T, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(D, K, generator=g) / K**0.5).to(torch.bfloat16)
    return x, w


def embedding_case() -> tuple[torch.Tensor, torch.Tensor]:
    """weight (VOCAB, DIM) bf16 with a few -0.0 entries, and tokens from both halves."""
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(VOCAB, DIM, generator=g).to(torch.bfloat16)
    weight[3, :5] = -0.0
    weight[71, 2] = -0.0
    tokens = torch.tensor([3, 71, 0, 99, 50, 49, 3])
    return weight, tokens


def partial_gemm(x: torch.Tensor, w: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Rank r's GEMM of a row-parallel layer over n ranks: x[:, K_r] W[:, K_r]^T in bf16."""
    k = x.shape[1] // n
    return F.linear(x[:, r * k:(r + 1) * k].contiguous(), w[:, r * k:(r + 1) * k].contiguous())


def _ranks(rank: int, port: int, threads: int, out: str) -> None:
    """One gloo rank: its partials summed three ways; rank 0 saves the sums."""
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    pair = dist.new_group([0, 1])  # every rank takes part in making a group
    sums = {}
    for T, K, D in SHAPES:
        x, w = case(T, K, D)
        if rank < 2:  # TP = 2: gloo's own bf16 all-reduce
            p = partial_gemm(x, w, 2, rank)  # (T, D)
            dist.all_reduce(p, group=pair)
            sums[("tp2", T)] = p
        s = partial_gemm(x, w, WORLD, rank)  # TP = 4 as a chain 3 -> 2 -> 1 -> 0
        if rank < WORLD - 1:
            upstream = torch.empty_like(s)
            dist.recv(upstream, src=rank + 1)
            s = upstream + s  # one bf16 add per hop
        if rank > 0:
            dist.send(s, dst=rank - 1)
        dist.broadcast(s, src=0)  # the root's sum, to every rank
        sums[("tp4", T)] = s
    if rank < 2:  # the vocab-parallel embedding: rank r looks up rows [50 r, 50 r + 50)
        weight, tokens = embedding_case()
        mine = (tokens >= 50 * rank) & (tokens < 50 * (rank + 1))
        e = weight[50 * rank:50 * (rank + 1)][(tokens - 50 * rank).clamp(0, 49)]
        e.masked_fill_(~mine[:, None], 0)  # (len(tokens), DIM); another rank's rows: +0.0
        dist.all_reduce(e, group=pair)
        sums["embedding"] = e
    if rank == 0:
        torch.save(sums, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_sums(tmp_path_factory):
    """The sums the four gloo ranks computed, from one launch."""
    out = tmp_path_factory.mktemp("tp") / "sums.pt"
    mp.spawn(_ranks, args=(free_port(), torch.get_num_threads(), str(out)), nprocs=WORLD,
             join=True)
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("T,K,D", SHAPES)
def test_row_parallel_emulation_equals_the_ranks_all_reduce_bit_for_bit(rank_sums, T, K, D):
    x, w = case(T, K, D)
    one_gemm = F.linear(x, w)  # (T, D): what the trainer computes without the emulation
    for n, order in ((2, None), (2, [1, 0]), (WORLD, CHAIN)):
        ranks = rank_sums[(f"tp{n}", T)]
        emulated = bib.row_parallel_linear(x, w, n, order=order)
        same = torch.equal(bits(emulated), bits(ranks))
        assert same, f"TP = {n}, order {order}: {(emulated != ranks).sum()} elements differ"
        # the emulation is no no-op: N roundings are not one GEMM's one rounding
        assert (emulated != one_gemm).sum() > 0, n
    # for n > 2 the order counts, and so does the precision (one fp32 sum, as vLLM's custom
    # all-reduce would add, is not NCCL's bf16 chain): both are measured, not assumed
    four = torch.stack([partial_gemm(x, w, WORLD, r) for r in range(WORLD)])  # (4, T, D)
    assert (bib.tensor_parallel_sum(four, [0, 1, 2, 3]) != rank_sums[("tp4", T)]).sum() > 0
    assert (four.float().sum(0).to(torch.bfloat16) != rank_sums[("tp4", T)]).sum() > 0


def test_vocab_parallel_embedding_changes_only_the_sign_of_zero(rank_sums):
    weight, tokens = embedding_case()
    ranks, lookup = rank_sums["embedding"], weight[tokens]  # (7, DIM)
    assert torch.equal(bits(ranks), bits(lookup + 0.0))  # -0.0 + 0.0 = +0.0; nothing else moves
    assert not torch.equal(bits(ranks), bits(lookup))  # rows 3 and 71 held -0.0


def test_row_parallel_gradient_is_a_gdn_layers():
    """d/dx and d/dW of sum_r x_r W_r^T (roundings as identity): gy W and gy^T x, through
    LinearFn with the emulated forward, as autograd computes them through the emulation."""
    x, w = case(6, 96, 40)
    x, w = x.double().requires_grad_(), w.double().requires_grad_()
    gy = torch.randn(6, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    fn = bib.LinearFn.apply(x, w, partial(bib.row_parallel_linear, n=4, order=CHAIN))
    ref = bib.row_parallel_linear(x, w, 4, order=CHAIN)
    assert torch.equal(fn, ref)
    dx, dw = torch.autograd.grad(fn, (x, w), gy)
    rx, rw = torch.autograd.grad(ref, (x, w), gy)
    torch.testing.assert_close(dx, rx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, rw, rtol=1e-12, atol=1e-12)


# o_proj and down_proj of Qwen3-1.7B and 8B: (hidden, K); and batch sizes from one decode row to a
# full prefill (the all-reduce's message from 4 KB to 64 MB)
GPU_SHAPES = {"1.7b/o": (2048, 2048), "1.7b/down": (2048, 6144), "8b/o": (4096, 4096),
              "8b/down": (4096, 12288)}
GPU_ROWS = [1, 7, 64, 255, 256, 1031, 4096, 8192]


def _nccl_ranks(rank: int, world: int, port: int, out: str) -> None:
    """One GPU as a TP engine's rank inside simple_rl: the trainer's NCCL group first, then
    vLLM's batch-invariant settings and its pynccl communicator, which sums each rank's partial
    GEMM. Rank 0 writes, for every shape and batch size, the chain orders that give its sum."""
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=device)
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.model_executor.determinism.batch_invariant import init_batch_invariance

    init_batch_invariance()  # NCCL's knobs, split-K off: after the trainer's communicator
    comm = PyNcclCommunicator(dist.new_group(backend="gloo"), device)
    report = {}
    for name, (hidden, K) in GPU_SHAPES.items():
        g = torch.Generator(device=device).manual_seed(K)  # the same x, w on every rank
        x = torch.randn(max(GPU_ROWS), K, device=device, generator=g).to(torch.bfloat16)
        w = (torch.randn(hidden, K, device=device, generator=g) * 0.02).to(torch.bfloat16)
        k = K // world
        for T in GPU_ROWS:
            parts = torch.stack([F.linear(x[:T, r * k:(r + 1) * k].contiguous(),
                                          w[:, r * k:(r + 1) * k].contiguous())
                                 for r in range(world)])  # (world, T, hidden)
            y = comm.all_reduce(parts[rank].contiguous())  # (T, hidden)
            report[f"{name}/{T}"] = dict(
                orders=[o for o in itertools.permutations(range(world))
                        if torch.equal(bits(bib.tensor_parallel_sum(parts, o)), bits(y))],
                one_gemm_differs=bool((F.linear(x[:T], w) != y).any()))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.gpu
def test_vllm_nccl_all_reduce_equals_the_emulation_at_every_batch_size(tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    pytest.importorskip("vllm")
    world = min(torch.cuda.device_count(), 4)
    out = tmp_path / "nccl.json"
    mp.spawn(_nccl_ranks, args=(world, free_port(), str(out)), nprocs=world, join=True)
    report = json.loads(out.read_text())
    assert len(report) == len(GPU_SHAPES) * len(GPU_ROWS)
    assert all(r["one_gemm_differs"] for r in report.values())
    fits = set.intersection(*(set(map(tuple, r["orders"])) for r in report.values()))
    # TP = 2: both orders, always; TP > 2: the chain order NCCL ran, if one fits every case
    print(f"TP = {world}: the chain orders that fit every shape and batch size: {sorted(fits)}")
    assert fits, {k: r["orders"] for k, r in report.items()}
