"""torch_dist checkpoints: save under one layout, load under another."""
import json

import pytest
import torch

from megatron_marsrl.megatron.launch import LaunchError, launch


def _save(tiny_hf, ckpt, world, layout):
    launch("tests.megatron.workers:save_trained", world, {"hf_dir": tiny_hf("qwen3_moe"), "layout": layout, "ckpt": str(ckpt)})


def _score(tiny_hf, ckpt, world, layout):
    out = launch("tests.megatron.workers:resume_and_score", world,
                 {"hf_dir": tiny_hf("qwen3_moe"), "layout": layout, "ckpt": str(ckpt)})
    return next(r["logits"] for r in out if r["logits"] is not None), out[0]["losses"]


def test_reshard_tp2_to_pp2_and_world1_with_optimizer(tiny_hf, tmp_path):
    ckpt = tmp_path / "ckpt"
    _save(tiny_hf, ckpt, 2, {"tp": 2})
    assert json.loads((ckpt / "marsrl_checkpoint.json").read_text())["optimizer"]["parts"] == 1
    logits_a, losses_a = _score(tiny_hf, ckpt, 2, {"pp": 2})
    logits_b, losses_b = _score(tiny_hf, ckpt, 1, {})
    assert float((torch.tensor(logits_a) - torch.tensor(logits_b)).abs().max()) < 1e-5
    # The step after loading equals an uninterrupted run's third step: Adam moments came back.
    uninterrupted = launch("tests.megatron.workers:continued_losses", 1, {"hf_dir": tiny_hf("qwen3_moe")})[0]
    assert losses_a == pytest.approx(losses_b, abs=1e-5)
    assert losses_b[0] == pytest.approx(uninterrupted, abs=1e-5)


@pytest.mark.slow
def test_reshard_ep2_to_tp2_ep2(tiny_hf, tmp_path):
    ckpt = tmp_path / "ckpt"
    _save(tiny_hf, ckpt, 2, {"ep": 2})
    logits_a, _ = _score(tiny_hf, ckpt, 2, {"ep": 2})
    logits_b, _ = _score(tiny_hf, ckpt, 2, {"tp": 2, "ep": 2})
    assert float((torch.tensor(logits_a) - torch.tensor(logits_b)).abs().max()) < 1e-5


def test_optimizer_of_another_kind_is_refused(tiny_hf, tmp_path):
    ckpt = tmp_path / "ckpt"
    _save(tiny_hf, ckpt, 1, {})
    with pytest.raises(LaunchError, match="optimizer state was saved as .* Load the model only"):
        _score(tiny_hf, ckpt, 2, {"ep": 2})


def test_partial_checkpoint_is_not_loaded(tmp_path):
    from megatron_marsrl.megatron.dist_checkpoint import CheckpointNotFoundError, read_meta

    (tmp_path / "half" / "dist").mkdir(parents=True)
    with pytest.raises(CheckpointNotFoundError, match="not a complete marsrl checkpoint"):
        read_meta(tmp_path / "half")
