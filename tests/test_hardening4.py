"""Hardening, fourth pass (the LoRA, config and checkpoint half): a changed base never resumes
silently, a half-written export is cleaned by the same run's next start, crafted LoRA fields
are refused in one sentence naming the real cause, and the suite pins LoRA's scale, its
gradients and what DCP writes. One test (or more) per row of the issue, numbered as there."""

import json
import shutil

import pytest
import torch

import batch_invariant_backward as bib
import simple_rl as rl
from helpers import (LORA, ExactEngine, Killed, cpu_argv, edit_json, exits, latest, main_cpu,
                     refuse, run_cpu)

SEVEN = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


@pytest.fixture(scope="module")
def lora_saved(ckpt, tmp_path_factory):
    """A 2-step LoRA run (checkpoint at step 2) on its own copy of the tiny model."""
    tmp = tmp_path_factory.mktemp("lora_saved")
    model = tmp / "model"
    shutil.copytree(ckpt(), model)
    run_cpu(cpu_argv(model, tmp / "runs", steps=2, run_name="r", **LORA), ExactEngine)
    return tmp


def copy_lora_run(lora_saved, tmp_path):
    """A copy of `lora_saved` (model and run) to damage; returns its checkpoint."""
    for name in ("model", "runs"):
        shutil.copytree(lora_saved / name, tmp_path / name)
    return tmp_path / "runs" / "r" / "checkpoints" / "step_000002"


# ---------------------------------------------------------------- 1. a changed base


def test_1_an_unchanged_base_resumes_without_a_word(lora_saved, tmp_path, capsys):
    copy_lora_run(lora_saved, tmp_path)
    capsys.readouterr()
    assert main_cpu(latest(tmp_path), ExactEngine) == 0
    captured = capsys.readouterr()
    assert "differs" not in captured.out + captured.err


# ---------------------------------------------------------------- 3. all and a target


@pytest.mark.parametrize("check", [False, True])
def test_3_all_with_a_target_is_refused_at_validation(ckpt, tmp_path, capsys, check):
    argv = cpu_argv(ckpt(), tmp_path, lora_rank=8, lora_targets="all,q_proj")
    err = refuse(argv + ["--check"] * check, capsys)
    assert "--lora-targets all,q_proj: all already names every target; give it alone" in err


# ---------------------------------------------------------------- 4. a killed export


def kill_in_export(monkeypatch, save: str):
    """SIGKILL's stand-in in the middle of the final export (after its files are written)."""
    real = getattr(rl, save)

    def killed(out, *a, **k):
        real(out, *a, **k)
        if out.name.startswith(".tmp_"):
            raise Killed

    monkeypatch.setattr(rl, save, killed)
    return real


@pytest.mark.parametrize("where", ["final", "output dir"])
def test_4_the_next_start_removes_what_a_killed_export_left(lora_saved, tmp_path, monkeypatch,
                                                            capsys, where):
    ckpt_dir = copy_lora_run(lora_saved, tmp_path)
    run_dir = ckpt_dir.parent.parent
    out = tmp_path / "exports" / "mine"
    other = tmp_path / "exports" / ".tmp_mine.another-run"  # not this run's: left alone
    other.mkdir(parents=True)
    extra = ["--output-dir", out] if where == "output dir" else []
    real = kill_in_export(monkeypatch, "save_peft_adapter")
    with pytest.raises(Killed):
        main_cpu(latest(tmp_path, *extra), ExactEngine)
    place = out.parent if extra else run_dir
    left = [p for p in place.glob(".tmp_*") if p != other]
    assert len(left) == 1 and (left[0] / "adapter_model.safetensors").is_file()
    old_style = run_dir / ".tmp_final.k3j2l1x0"  # what an older version's mkdtemp left
    old_style.mkdir()
    (old_style / "model.safetensors").write_bytes(b"half")
    monkeypatch.setattr(rl, "save_peft_adapter", real)
    assert main_cpu(latest(tmp_path, *extra), ExactEngine) == 0
    assert not left[0].exists() and not old_style.exists() and other.is_dir()
    assert (out if extra else run_dir / "final").joinpath("adapter_config.json").is_file()


# ---------------------------------------------------------------- 6. crafted LoRA fields


@pytest.mark.parametrize("change, words", [
    (dict(lora_targets=["q_proj"]), "holds an invalid config: --lora-targets must be a str "
                                    "(got ['q_proj'])."),
    (dict(lora_alpha=1e30), "--lora-alpha 1e+30 with --lora-rank 8 scales the update by "
                            "1.25e+29; alpha / r may be at most 1024."),
    (dict(lora_rank=True), "--lora-rank must be a int (got True)."),
    (dict(lora_alpha="32"), "--lora-alpha must be a float (got '32')."),
])
def test_6_a_crafted_lora_field_is_one_sentence(lora_saved, tmp_path, capsys, change, words):
    ckpt_dir = copy_lora_run(lora_saved, tmp_path)
    edit_json(ckpt_dir / "run_config.json", **change)
    assert words in exits(capsys, latest(tmp_path), 2)


def test_6_an_alpha_far_too_large_is_refused_on_the_command_line(ckpt, tmp_path, capsys):
    err = refuse(cpu_argv(ckpt(), tmp_path, lora_rank=8, lora_alpha=1e30), capsys)
    assert "alpha / r may be at most 1024" in err


# ---------------------------------------------------------------- 8. messages that mislead


@pytest.mark.parametrize("change, name, said, trained", [
    (dict(lora_rank=16), "--lora-rank", "16", "8"),
    (dict(lora_targets="q_proj"), "--lora-targets", "q_proj", "'all'"),
    (dict(lora_alpha=64.0), "--lora-alpha", "64.0", "32.0"),
])
def test_8_a_crafted_lora_config_is_blamed_on_the_file_not_the_model(lora_saved, tmp_path,
                                                                     capsys, change, name, said,
                                                                     trained):
    ckpt_dir = copy_lora_run(lora_saved, tmp_path)
    state = json.loads((ckpt_dir / "state.json").read_text())
    assert state["lora"] == dict(lora_rank=8, lora_alpha=32.0, lora_targets="all")
    edit_json(ckpt_dir / "run_config.json", **change)
    err = exits(capsys, latest(tmp_path), 2)
    assert f"{ckpt_dir / 'run_config.json'} says {name} {said}, but the checkpoint's weights " \
           f"were trained with {trained} (state.json): restore the file." in err


def test_8_an_older_checkpoints_other_rank_names_the_weight_not_the_count(lora_saved, tmp_path,
                                                                          capsys):
    ckpt_dir = copy_lora_run(lora_saved, tmp_path)
    state = json.loads((ckpt_dir / "state.json").read_text())
    del state["lora"]  # as older versions saved it
    (ckpt_dir / "state.json").write_text(json.dumps(state))
    edit_json(ckpt_dir / "run_config.json", lora_rank=16)
    err = exits(capsys, latest(tmp_path), 2)
    assert "holds other weights than --model" in err and "has 28" not in err
    assert "saved [8, " in err and "here [16, " in err, err


def test_8_targets_with_spaces_and_repeats_are_the_set_they_name(ckpt, tmp_path, capsys):
    capsys.readouterr()
    argv = cpu_argv(ckpt(), tmp_path, steps=1, run_name="s", lora_rank=8,
                    lora_targets="v_proj, q_proj,q_proj ")
    assert main_cpu(argv, ExactEngine) == 0
    banner = next(line for line in capsys.readouterr().out.splitlines()
                  if line.startswith("simple_rl |"))
    assert "M params, LoRA rank 8 on q_proj,v_proj (0." in banner and "M trained) |" in banner
    config = json.loads((tmp_path / "s" / "final" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "v_proj"]


def test_8_the_seven_targets_spelled_out_resume_a_run_of_all(lora_saved, tmp_path, capsys):
    copy_lora_run(lora_saved, tmp_path)
    capsys.readouterr()
    assert main_cpu(latest(tmp_path, "--lora-targets", SEVEN), ExactEngine) == 0
    assert "--lora-targets" not in capsys.readouterr().out  # no warning either
    err = exits(capsys, latest(tmp_path, "--lora-targets", "q_proj,v_proj"), 2)
    assert "cannot change it to q_proj,v_proj" in err


@pytest.mark.parametrize("flags, named", [
    (dict(lora_alpha=16.0), "--lora-alpha"),
    (dict(export="merged"), "--export"),
    (dict(lora_targets="q_proj", lora_alpha=8.0), "--lora-alpha, --lora-targets"),
])
@pytest.mark.parametrize("check", [False, True])
def test_8_lora_flags_without_a_rank_are_refused(ckpt, tmp_path, capsys, flags, named, check):
    err = refuse(cpu_argv(ckpt(), tmp_path, **flags) + ["--check"] * check, capsys)
    assert f"{named} set a LoRA run's adapters and export, and full fine-tuning has none: add " \
           "--lora-rank r, or drop them." in err


def test_8_a_crafted_export_in_a_full_runs_config_is_refused(saved, tmp_path, capsys):
    from helpers import copy_checkpoint

    ckpt_dir = copy_checkpoint(saved, tmp_path)
    edit_json(ckpt_dir / "run_config.json", export="merged")
    err = exits(capsys, latest(tmp_path), 2)
    assert "holds an invalid config: --export set a LoRA run's adapters and export" in err


# ---------------------------------------------------------------- 11. a hub id's adapter


def test_11_the_adapter_names_the_hub_id_as_its_base(ckpt, tmp_path, monkeypatch):
    local = ckpt()
    monkeypatch.setattr(rl, "resolve_checkpoint", lambda name: local)  # the hub's cache
    argv = cpu_argv("Org/tiny-qwen3", tmp_path, steps=2, run_name="h", **LORA)
    run_cpu(argv, ExactEngine)
    for where in ("final", "checkpoints/step_000002/model"):
        config = json.loads((tmp_path / "h" / where / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == "Org/tiny-qwen3"


# ---------------------------------------------------------------- the one-line bugs


@pytest.mark.parametrize("rank, alpha", [(8, 32.0), (8, 4.0), (16, 8.0)])
def test_lora_adds_alpha_over_r_times_b_a_x(ckpt, rank, alpha):
    """A layer's output is W x + (alpha / r) B A x, computed here by hand."""
    files = rl.load_model_files(rl.Config(model=str(ckpt()), dtype="float32"))
    cfg = rl.Config(model=str(ckpt()), dtype="float32", lora_rank=rank, lora_alpha=alpha)
    ranks = rl.Ranks(0, 1, torch.device("cpu"))
    model, _ = rl.build_models(cfg, files.args, rl.load_hf_state_dict(files.path),
                               bib.reference_kernels(), ranks)
    layer = model.layers[1].attention.wo  # o_proj: one slice
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        a, b = layer.lora.a[0], layer.lora.b[0]
        a.copy_(torch.randn(a.shape, generator=g))
        b.copy_(torch.randn(b.shape, generator=g))
        layer.lora.refresh()
        x = torch.randn(3, a.shape[1], generator=g)
        want = x @ layer.weight.T + (alpha / rank) * (x @ a.T) @ b.T  # (3, dim)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
        assert (want - x @ layer.weight.T).abs().max() > 1.0  # the update is not negligible


@pytest.mark.parametrize("kernels", ["reference", "custom backward"])
def test_lora_passes_the_gradient_to_the_base_layers_output(kernels):
    """y = 1.5 z (a base output that depends on z), out = y + s B A x: d(out . w)/dz = 1.5 w."""
    ops = bib.reference_kernels() if kernels == "reference" else \
        bib.custom_backward_kernels(bib.reference_forwards())
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 16, generator=g)
    z = torch.randn(5, 12, generator=g, requires_grad=True)
    a = [torch.randn(4, 16, generator=g, requires_grad=True)]
    b = [torch.randn(12, 4, generator=g, requires_grad=True)]
    casts = ((a[0].detach()[None, None],), ((2.0 * b[0].detach())[None, None],))
    w = torch.randn(5, 12, generator=g)
    out = ops.lora(x, 1.5 * z, casts, 2.0, *a, *b)
    (out * w).sum().backward()
    assert z.grad is not None
    torch.testing.assert_close(z.grad, 1.5 * w, rtol=0, atol=1e-6)


def test_a_lora_checkpoint_writes_the_adapters_only(lora_saved):
    """What DCP wrote (its metadata and its shards), not what state.json says."""
    ckpt_dir = lora_saved / "runs" / "r" / "checkpoints" / "step_000002"
    meta = rl.read_dcp_metadata(ckpt_dir)
    model_keys = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all(".lora." in k for k in model_keys), model_keys[:5]
    written = sum(p.stat().st_size for p in (ckpt_dir / "trainer").glob("*.distcp"))
    base = (lora_saved / "model" / "model.safetensors").stat().st_size
    assert written < base / 4  # adapters and their Adam moments: a fraction of the base
