"""Write a random Qwen3 or Qwen3.5 checkpoint (+ tiny tokenizer) to a directory, e.g. the exact
Qwen3-1.7B shape, or Qwen3.5-27B's cut to its first 8 layers (6 linear attention, 2 full):

    python tests/make_checkpoint.py OUT --preset qwen3-1.7b --device cuda
    python tests/make_checkpoint.py OUT --preset qwen3.5-27b --layers 8 --device cuda

A Qwen3.5 preset is its text model (Qwen3_5ForCausalLM; 35B-A3B: Qwen3_5MoeForCausalLM); add
--vision to lay it out as the hub's checkpoints are (a text_config, model.language_model.*,
stand-ins for the vision tower and the multi-token-prediction head).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import make_checkpoint, make_qwen35_checkpoint  # noqa: E402

# Published Qwen/Qwen3-* config.json shapes (head_dim 128, GQA, vocab 151936, 40960 positions).
QWEN3 = dict(vocab=151936, head_dim=128, max_pos=40960)
PRESETS = {
    "qwen3-0.6b": dict(QWEN3, tied=True, layers=28, hidden=1024, heads=16, kv_heads=8, inter=3072),
    "qwen3-1.7b": dict(QWEN3, tied=True, layers=28, hidden=2048, heads=16, kv_heads=8, inter=6144),
    "qwen3-4b": dict(QWEN3, tied=True, layers=36, hidden=2560, heads=32, kv_heads=8, inter=9728),
    "qwen3-8b": dict(QWEN3, tied=False, layers=36, hidden=4096, heads=32, kv_heads=8, inter=12288),
    "qwen3-14b": dict(QWEN3, tied=False, layers=40, hidden=5120, heads=40, kv_heads=8,
                      inter=17408),
    "qwen3-32b": dict(QWEN3, tied=False, layers=64, hidden=5120, heads=64, kv_heads=8,
                      inter=25600),
    "tiny": dict(
        tied=True, layers=2, vocab=384, hidden=256, heads=4, kv_heads=2, head_dim=128, inter=512
    ),
}

# Qwen3.5's text models (every one: head_dim 256, a quarter of it rotated, rope theta 1e7; linear
# attention of 16 k heads and 128-dim k and v heads, conv kernel 4; three layers in four linear
# attention, the fourth full; vocab 248320, 262144 positions). Sources, none of them read from
# the hub here (this machine has no network): 0.8B, the hub's config.json as a public log
# copied it whole; 4B, the hub's config.json as a public design note quoted it field by field
# (tied embeddings: another note checked against the hub's file); 9B and 35B-A3B, the defaults
# of transformers' Qwen3_5TextConfig and Qwen3_5MoeTextConfig, documented as those models'
# shapes, and two third-party configuration tables agree; 27B, three third-party tables agree
# (tied embeddings off: one of them), the hub's file not seen.
QWEN35 = dict(vocab=248320, head_dim=256, k_heads=16, k_dim=128, v_dim=128, max_pos=262144,
              rope_theta=10_000_000.0)
QWEN35_PRESETS = {
    "qwen3.5-0.8b": dict(QWEN35, tied=True, layers=24, hidden=1024, heads=8, kv_heads=2,
                         inter=3584, v_heads=16),
    "qwen3.5-4b": dict(QWEN35, tied=True, layers=32, hidden=2560, heads=16, kv_heads=4,
                       inter=9216, v_heads=32),
    "qwen3.5-9b": dict(QWEN35, tied=False, layers=32, hidden=4096, heads=16, kv_heads=4,
                       inter=12288, v_heads=32),
    "qwen3.5-27b": dict(QWEN35, tied=False, layers=64, hidden=5120, heads=24, kv_heads=4,
                        inter=17408, v_heads=48),
    # 256 experts of 512 rows, 8 a token, and a shared expert of 512 rows, in every layer
    "qwen3.5-35b-a3b": dict(QWEN35, tied=False, layers=40, hidden=2048, heads=16, kv_heads=2,
                            v_heads=32, experts=256, top_k=8, moe_inter=512, shared_inter=512),
    "qwen3.5-tiny": dict(),  # make_qwen35_checkpoint's own: 4 layers, hidden 64, CPU seconds
    "qwen3.5-moe-tiny": dict(experts=8, top_k=2, moe_inter=32, shared_inter=48),
}

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--preset", choices=sorted(PRESETS) + sorted(QWEN35_PRESETS), default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, help="the preset's layers cut to this many")
    p.add_argument("--attention-every", type=int, help="Qwen3.5: one full-attention layer in "
                   "this many (the published models: 4)")
    p.add_argument("--vision", action="store_true", help="Qwen3.5: the hub's vision-language "
                   "layout")
    p.add_argument("--chat", action="store_true", help="a tokenizer with a chat template")
    p.add_argument("--stop-ids", type=int, default=0, help="Qwen3.5: this many eos ids, spread "
                   "over the vocabulary (a random model's samples then stop at random lengths)")
    a = p.parse_args()
    qwen35 = a.preset in QWEN35_PRESETS
    if not qwen35 and (a.vision or a.attention_every or a.stop_ids):
        p.error("--vision, --attention-every and --stop-ids are for the Qwen3.5 presets")
    if a.attention_every is not None and a.attention_every < 1:
        p.error(f"--attention-every {a.attention_every}: one full-attention layer in N, N >= 1")
    shape = {**(QWEN35_PRESETS if qwen35 else PRESETS)[a.preset],
             **({"layers": a.layers} if a.layers else {}), **({"vision": True} if a.vision else {}),
             **({"attention_every": a.attention_every} if a.attention_every else {}),
             **({"chat": True} if a.chat else {}),
             **({"stop_ids": a.stop_ids} if a.stop_ids else {})}
    from transformers.utils import logging

    logging.disable_progress_bar()  # its bars, off a terminal, are lines of carriage returns
    print(f"making a random {a.preset} ({shape.get('layers', 4)} layers, bf16) on {a.device} "
          f"and saving it to {a.out} with a tokenizer (a 1.7B on CPU: about 30 s)", flush=True)
    make = make_qwen35_checkpoint if qwen35 else make_checkpoint
    make(Path(a.out), **shape, dtype=torch.bfloat16, device=a.device, seed=a.seed)
    print(f"wrote {a.out}")
