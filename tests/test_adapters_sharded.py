"""Adapters under the sharded strategies, on CPU processes over gloo: FSDP2 (started on the meta
device, adapters initialised shard by shard, a DCP checkpoint) and tensor parallelism (each adapted
layer's factors split with it) train LoRA and DoRA as one process does, step for step; a compiled
run too. Slow: several training processes each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from sharded_helpers import EVEN_VOCAB, assert_same_losses, losses, recipe, train
from test_sharded import TINY_TP  # GQA, biases and a GLU: every projection of a layer split under TP


def _adapted(folder: Path, adapters: dict, **options) -> Path:
    path = recipe(folder, spec=TINY_TP, tokenizer=EVEN_VOCAB, steps=10, **options)
    data = yaml.safe_load(path.read_text())
    data["model"]["adapters"] = adapters
    data["optimizer"] = {"lr": 1e-2, "weight_decay": 0.0}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_fsdp_trains_adapters_like_one_process_from_a_meta_start(kind, tmp_path):
    from yamlformer.blocks.linear import adapter_parameters
    from yamlformer.builder.checkpoints import is_sharded, load_model

    adapters = {"type": kind, "rank": 4, "alpha": 8, "targets": "all-linear"}
    train(_adapted(tmp_path / "one", adapters, batch=4))
    out = train(_adapted(tmp_path / "fsdp", adapters, batch=2, devices=2, strategy="fsdp"))
    assert "trainable" in out  # the start-of-run line counts them
    assert_same_losses(losses(tmp_path / "fsdp" / "run"), losses(tmp_path / "one" / "run"))
    last = tmp_path / "fsdp" / "run" / "checkpoints" / "last.ckpt"
    assert is_sharded(last)
    model, _ = load_model(last)  # the DCP checkpoint read whole, adapters and all
    reference, _ = load_model(tmp_path / "one" / "run" / "checkpoints" / "last.ckpt")
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5, msg=name)
    assert all(bool(p.abs().sum()) for n, p in adapter_parameters(model).items() if n.endswith("lora_B"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_tensor_parallel_splits_adapters_with_their_layers(kind, tmp_path):
    adapters = {"type": kind, "rank": 4, "alpha": 8, "targets": ["attention", "ffn"]}
    train(_adapted(tmp_path / "one", adapters, batch=4))
    train(_adapted(tmp_path / "tp", adapters, batch=4, devices=2, strategy="fsdp", tensor_parallel=2))
    assert_same_losses(losses(tmp_path / "tp" / "run"), losses(tmp_path / "one" / "run"))


@pytest.mark.slow
def test_a_compiled_run_trains_adapters_as_an_eager_one(tmp_path):
    adapters = {"type": "dora", "rank": 4, "targets": "all-linear"}
    train(_adapted(tmp_path / "eager", adapters, batch=4))
    train(_adapted(tmp_path / "compiled", adapters, batch=4, compile="layers"))
    assert_same_losses(losses(tmp_path / "compiled" / "run"), losses(tmp_path / "eager" / "run"), atol=1e-4)
