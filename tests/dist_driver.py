"""Multi-process experiments for tests/test_distributed.py (gloo on CPU, or NCCL on GPUs):

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_driver.py rollout-grads \
        --model CKPT --log-dir DIR --out OUT.json
    python -m torch.distributed.run --nproc-per-node 2 tests/dist_driver.py main SIMPLE_RL_FLAGS

Writes, from rank 0, the step's samples in prompt order and the full gradient of the first
update (gathered from FSDP's shards), so the test can compare them with a single process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import simple_rl as rl  # noqa: E402
from helpers import TorchEngine, cpu_argv, first_turns  # noqa: E402


def rollout_grads(model: str, log_dir: str, out: str, lora_rank: int = 0,
                  dtype: str = "float32") -> None:
    """One step's rollout of every rank and the first pass's gradient (under LoRA the
    adapters'), in global order; the dtype each Qwen3.5 A_log had in the forward."""
    # no clipping: a gradient clipped to --grad-clip on both sides would hide a uniform scale
    # error (each rank's loss not scaled by the world size, which FSDP's average halves at 2)
    cfg, given = rl.parse_config(cpu_argv(model, log_dir, num_prompts=3, micro_batch_tokens=128,
                                          run_name="grads", kl_coef=0.0, grad_clip=0.0,
                                          lora_rank=lora_rank, dtype=dtype))
    trainer, _, _, _ = rl.setup(cfg, given, TorchEngine, "cpu")
    a_log_dtypes = []
    for m in trainer.model.modules():
        if isinstance(m, rl.GatedDeltaNet):
            m.register_forward_pre_hook(lambda m, _: a_log_dtypes.append(str(m.A_log.dtype)))
    ranks, G = trainer.ranks, cfg.group_size
    mine = rl.my_prompts(cfg.num_prompts, ranks)
    chosen = rl.step_problems(len(trainer.task.problems), cfg.num_prompts, 0, cfg.seed)
    ro = first_turns(trainer.engine, [trainer.task.prompt_ids[chosen[i]] for i in mine], mine, 0)
    packed = rl.pack(ro.prompts, ro.completions)
    # fixed advantages, a function of the sample's index in the whole step (the same for any N)
    adv = torch.tensor([((i * G + g) % 5 - 2) / 2 for i in mine for g in range(G)])
    n_micro, n_tokens = rl.batch_over_ranks(packed, cfg, ranks.device)
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.0)
    trainer.optimizer.zero_grad = lambda set_to_none=True: None  # keep the gradients
    lps = [ro.logprobs[packed.seq == s].tolist() for s in range(len(ro.completions))]
    per_prompt = [(ro.completions[j * G:(j + 1) * G], lps[j * G:(j + 1) * G])
                  for j in range(len(mine))]
    rl.update(trainer.model, None, trainer.optimizer, packed, ro.logprobs, adv, cfg, n_micro,
              n_tokens)
    samples = rl.in_prompt_order(rl.all_gather_objects(per_prompt))
    grads = {n: rl.full_tensor(p.grad) for n, p in trainer.model.named_parameters()
             if p.requires_grad}
    if ranks.main:
        torch.save(dict(world=ranks.world, samples=json.dumps(samples), grads=grads,
                        micro_batches=n_micro, a_log_dtypes=a_log_dtypes), out)


if __name__ == "__main__":
    if sys.argv[1] == "main":  # simple_rl's main with the stand-in engine, on CPU
        from helpers import main_cpu

        code = main_cpu(sys.argv[2:])
        sys.stdout.flush()
        sys.stderr.flush()
        # Past interpreter teardown: once in four full suites a gloo rank aborted there
        # ("terminate called without an active exception"), its run done and saved.
        os._exit(code)
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["rollout-grads"])
    p.add_argument("--model", required=True)
    p.add_argument("--log-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    a = p.parse_args()
    rollout_grads(a.model, a.log_dir, a.out, a.lora_rank, a.dtype)
    if rl.dist.is_initialized():
        rl.dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past teardown, as `main` above: a gloo rank aborted there once (CI)
