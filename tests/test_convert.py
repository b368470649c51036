"""HF checkpoint <-> trainer weights: one path each way, exact round trip."""

import json
from types import SimpleNamespace

import pytest
import torch

import batch_invariant_backward as bib
import simple_rl as rl
from helpers import vllm_name


def load(path):
    args = rl.model_args_from_hf(rl.read_qwen3_config(path))
    return args, rl.load_hf_state_dict(path)


@pytest.mark.parametrize(
    "tied,shard", [(True, None), (False, None), (True, "600KB"), (False, "600KB")]
)
def test_round_trip_is_exact(ckpt, tied, shard):
    """HF -> trainer -> HF gives every tensor back bit for bit. A sharded checkpoint's files are
    each listed once (the header check refuses a weight held twice) and pass that check."""
    path = ckpt(tied=tied, shard=shard)
    if shard:
        index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        files = rl.weight_files(path)
        assert files == sorted(set(index.values())) and len(files) > 1
    rl.check_weight_headers(path, rl.model_args_from_hf(rl.read_qwen3_config(path)))
    args, hf = load(path)
    assert args.enable_weight_tying == tied and ("lm_head.weight" in hf) != tied
    back = rl.trainer_to_hf(rl.hf_to_trainer(hf, args), args)
    assert sorted(back) == sorted(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, None), (torch.float16, None),
                                        (torch.float32, None), (torch.float64, "F64"),
                                        (torch.int8, "I8")])
def test_bf16_fp16_and_fp32_weights_pass_the_header_check_and_others_do_not(ckpt, tmp_path,
                                                                             dtype, name):
    """check_weight_headers reads bf16, fp16 (a half-precision fine-tune) and fp32 weights and
    refuses any other dtype in one sentence naming it."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "m"
    shutil.copytree(ckpt(), path)
    state = load_file(path / "model.safetensors")
    save_file({k: v.to(dtype) for k, v in state.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    args = rl.model_args_from_hf(rl.read_qwen3_config(path))
    if name is None:
        rl.check_weight_headers(path, args)  # no ConfigError
    else:
        with pytest.raises(rl.ConfigError, match=f"is {name}; simple_rl reads bf16, fp16 or "
                                                 "fp32 weights"):
            rl.check_weight_headers(path, args)


def test_trainer_layout_is_vllms_fused_layout(ckpt):
    args, hf = load(ckpt(tied=False))
    st = rl.hf_to_trainer(hf, args)
    p = "model.layers.1."
    qkv = torch.cat([hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(st["layers.1.attention.wqkv.weight"], qkv)  # vLLM's qkv_proj = [q; k; v]
    gate_up = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
    assert torch.equal(
        st["layers.1.feed_forward.w13.weight"], gate_up
    )  # vLLM's gate_up_proj = [gate; up]
    assert torch.equal(st["output.weight"], hf["lm_head.weight"])
    model = rl.build_model(args, st, bib.reference_kernels(), torch.float32, "cpu")
    assert {n for n, _ in model.named_parameters()} == set(st)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())


def test_tied_model_has_no_separate_head(ckpt):
    args, hf = load(ckpt(tied=True))
    st = rl.hf_to_trainer(hf, args)
    assert "output.weight" not in st
    model = rl.build_model(args, st, bib.reference_kernels(), torch.float32, "cpu")
    assert model.output is None


def test_saved_checkpoint_reloads_in_transformers_with_same_hash(ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    path = ckpt(tied=True)
    args, hf = load(path)
    model = rl.build_model(
        args, rl.hf_to_trainer(hf, args), bib.reference_kernels(), torch.float32, "cpu"
    )
    state = rl.gathered_hf_state(model)
    rl.save_hf_checkpoint(tmp_path / "out", state, path)
    assert (tmp_path / "out" / "tokenizer.json").is_file() and (
        tmp_path / "out" / "config.json"
    ).is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    again = {k: v for k, v in reloaded.state_dict().items() if k != "lm_head.weight"}
    assert rl.weights_sha256(again) == rl.weights_sha256(state) == rl.weights_sha256(hf)


def test_sha256_sees_every_bit():
    """The export's sha256 tells apart weights that differ in a bit, or only in a tensor's
    name (an export that writes a layer's weight under another layer's name: a server loads
    other weights, the same digest would say they are the run's)."""
    a = {"w": torch.zeros(4)}
    b = {"w": torch.tensor([0.0, 0.0, 0.0, -0.0])}  # equal as numbers, not as bits
    assert rl.weights_sha256(a) != rl.weights_sha256(b)
    assert rl.weights_sha256(a) == rl.weights_sha256({"w": torch.zeros(4)})
    w = torch.arange(4.0).reshape(2, 2)
    assert rl.weights_sha256({"model.layers.0.w": w}) != rl.weights_sha256({"model.layers.1.w": w})


def test_weights_that_do_not_fit_the_config_are_refused(ckpt):
    args, hf = load(ckpt(tied=False))
    missing = {k: v for k, v in hf.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(rl.ConfigError, match="weights do not match its config.json"):
        rl.hf_to_trainer(missing, args)
    wrong = dict(hf, **{"model.norm.weight": torch.ones(7)})
    with pytest.raises(rl.ConfigError, match="weights do not match its config.json: .*norm.weight"):
        rl.build_model(
            args, rl.hf_to_trainer(wrong, args), bib.reference_kernels(), torch.float32, "cpu"
        )


def test_saved_config_names_the_saved_dtype(ckpt, tmp_path):
    path = ckpt()
    args, hf = load(path)
    rl.save_hf_checkpoint(tmp_path / "o", {k: v.bfloat16() for k, v in hf.items()}, path)
    assert json.loads((tmp_path / "o" / "config.json").read_text())["dtype"] == "bfloat16"


def test_rotary_inv_freq_buffers_in_the_files_are_not_weights(ckpt, tmp_path):
    """A checkpoint that stores rotary_emb.inv_freq (older exports do) passes the header check
    and converts to the same trainer tensors as without it."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "m"
    shutil.copytree(ckpt(), path)
    st = load_file(path / "model.safetensors")
    st["model.layers.0.self_attn.rotary_emb.inv_freq"] = 1e6 ** -(torch.arange(64) / 64)
    save_file(st, path / "model.safetensors", metadata={"format": "pt"})
    args = rl.model_args_from_hf(rl.read_qwen3_config(path))
    rl.check_weight_headers(path, args)  # no ConfigError
    ours = rl.hf_to_trainer(rl.load_hf_state_dict(path), args)
    plain = rl.hf_to_trainer(rl.load_hf_state_dict(ckpt()), args)
    assert sorted(ours) == sorted(plain)


@pytest.mark.parametrize("tied", [True, False])
def test_engine_weights_drop_the_padded_vocab_rows_of_the_embedding_and_the_head(ckpt, tied):
    """vLLM pads its vocab rows (embedding and untied head) to a multiple of its own; the
    weights a LoRA trainer adopts from the engine are the checkpoint's shapes and values.
    Without the trim, an untied model of an unpadded vocab stops at start-up ("size mismatch
    for output.weight"). The engine's params here: the state's bf16 casts under vLLM's names,
    16 rows of 7.0 after each vocab."""
    path = ckpt(tied=tied)
    args = rl.model_args_from_hf(rl.read_qwen3_config(path))
    state = rl.hf_to_trainer(rl.load_hf_state_dict(path), args)
    params = {}
    for k, v in state.items():
        t = v.to(torch.bfloat16)
        if k in ("tok_embeddings.weight", "output.weight"):  # vLLM pads its vocab rows
            t = torch.cat([t, torch.full((16, t.shape[1]), 7.0, dtype=t.dtype)])
        params[vllm_name(k)] = t
    assert {rl.trainer_name(n) for n in params} == set(state)
    llm = SimpleNamespace(apply_model=lambda fn: [fn(SimpleNamespace(
        named_parameters=lambda: params.items()))])
    adopted = rl.engine_weights(llm, args, torch.bfloat16)
    assert {k: tuple(v.shape) for k, v in adopted.items()} == \
        {k: tuple(v.shape) for k, v in state.items()}
    for k, v in adopted.items():
        assert torch.equal(v, state[k].to(torch.bfloat16)), k


def test_the_exports_config_drops_the_hubs_stale_torch_dtype(tmp_path):
    """Hub configs name their dtype as torch_dtype: an fp32 export of a bf16 hub model must not
    keep torch_dtype bfloat16 beside its dtype float32."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3",
                                                 "torch_dtype": "bfloat16"}))
    rl.save_hf_checkpoint(tmp_path / "out", {"model.norm.weight": torch.ones(4)}, src)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == "float32" and "torch_dtype" not in config


def test_the_export_carries_every_tokenizer_file_of_the_model(tmp_path):
    """An export is served as it is: it must carry the model's tokenizer files, the chat
    template too (chat_template.jinja, where newer transformers keep Qwen3.5's). Without it a
    server of the trained model formats chats otherwise than the run that trained it."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
             "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")
    for name in names:
        (src / name).write_text(f"the model's {name}")
    rl.save_hf_checkpoint(tmp_path / "out", {"model.norm.weight": torch.ones(4)}, src)
    for name in names:
        assert (tmp_path / "out" / name).read_text() == f"the model's {name}", name
