"""The Lightning recipe: recipe validation, a tiny run whose loss falls, NaN stops, eval, generate."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from recipe_helpers import history, tiny_recipe

from yamlformer.builder.spec.loader import SpecError
from yamlformer.recipes.recipe.sections import ScheduleSection
from yamlformer.recipes.tasks import load_recipe


def test_recipe_typo_fails_with_its_line(tmp_path):
    path = tiny_recipe(tmp_path)
    text = path.read_text().replace("max_steps:", "max_stepz:")
    path.write_text(text)
    line = next(i for i, row in enumerate(text.splitlines(), 1) if "max_stepz" in row)
    with pytest.raises(SpecError) as info:
        load_recipe(path)
    message = str(info.value)
    assert f"recipe.yaml:{line}:" in message
    assert "trainer.max_stepz" in message and "did you mean 'max_steps'" in message


def test_bad_inline_spec_points_at_the_recipe_line(tmp_path):
    from yamlformer.recipes.recipe.sections import model_spec

    path = tiny_recipe(tmp_path)
    text = path.read_text().replace("n_heads: 2", "n_heads: 3")
    path.write_text(text)
    line = next(i for i, row in enumerate(text.splitlines(), 1) if "n_heads: 3" in row)
    recipe = load_recipe(path)
    with pytest.raises(SpecError) as info:
        model_spec(recipe, vocab_size=100)
    message = str(info.value)
    assert f"recipe.yaml:{line}:" in message and "model.spec.decoder.attention.n_heads" in message


def test_set_reaches_recipe_fields_and_the_model(tmp_path):
    from yamlformer.recipes.recipe.sections import model_spec

    path = tiny_recipe(tmp_path)
    recipe = load_recipe(path, {"trainer.max_steps": 3, "model.overrides.decoder.n_layers": 1, "data.seq_len": 16})
    assert recipe.recipe.trainer.max_steps == 3 and recipe.recipe.data.seq_len == 16
    spec = model_spec(recipe, vocab_size=77)
    assert spec.decoder.n_layers == 1 and spec.vocab_size == 77 and spec.d_model == 32

    spec_file = Path(__file__).resolve().parents[1] / "specs" / "tiny" / "llama.yaml"
    path = tiny_recipe(tmp_path, model={"spec": str(spec_file), "overrides": {"decoder": {"n_layers": 1}}})
    spec = model_spec(load_recipe(path), vocab_size=90)
    assert spec.name == "tiny-llama" and spec.decoder.n_layers == 1 and spec.vocab_size == 90


def test_model_overrides_merge_over_the_spec_and_point_at_the_recipe(tmp_path):
    from yamlformer.recipes.recipe.sections import model_spec

    spec_file = Path(__file__).resolve().parents[1] / "specs" / "tiny" / "llama.yaml"
    moe = {"type": "moe", "n_experts": 2, "expert": {"type": "glu", "hidden_dim": 16}}
    path = tiny_recipe(tmp_path, model={"spec": str(spec_file), "overrides": {"decoder": {"ffn": moe}}})
    spec = model_spec(load_recipe(path), vocab_size=90)
    assert spec.decoder.ffn.type == "moe"  # another block type replaces the spec's glu and its fields
    path = tiny_recipe(tmp_path, model={"spec": str(spec_file), "overrides": {"decoder.n_layers": "two"}})
    line = next(i for i, row in enumerate(path.read_text().splitlines(), 1) if "decoder.n_layers" in row)
    with pytest.raises(SpecError) as info:
        model_spec(load_recipe(path), vocab_size=90)
    assert [(p.file, p.line, p.path) for p in info.value.problems] == [(str(path), line, "decoder.n_layers")]


def test_schedule_warms_up_then_decays_to_min_lr():
    from yamlformer.recipes.optim.schedule import lr_multiplier

    cosine = ScheduleSection(type="cosine", warmup_steps=10, min_lr=1e-4)
    values = [lr_multiplier(s, cosine, lr=1e-3, max_steps=100) for s in range(120)]
    assert values[0] == pytest.approx(1 / 11) and values[9] == pytest.approx(10 / 11)
    assert values[10] == pytest.approx(1.0) and values[99] > 0.1 and values[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[10:], values[11:]))
    inverse = ScheduleSection(type="inverse_sqrt", warmup_steps=4)
    assert lr_multiplier(16, inverse, lr=1.0, max_steps=100) == pytest.approx(0.5)


def test_no_weight_decay_on_norms_biases_and_embeddings():
    from yamlformer.builder import build_model
    from yamlformer.builder.optim.configs import AdamWConfig
    from yamlformer.builder.spec.schema import spec_model
    from yamlformer.recipes.optim import param_groups

    spec = spec_model().model_validate(
        {
            "architecture": "decoder-only",
            "vocab_size": 50,
            "d_model": 16,
            "max_seq_len": 8,
            "position": {"type": "learned"},
            "decoder": {"n_layers": 1, "attention": {"n_heads": 2, "qkv_bias": True}},
        }
    )
    model = build_model(spec)
    decay, no_decay = param_groups(AdamWConfig(weight_decay=0.1), model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    decayed = {names[id(p)] for p in decay["params"]}
    assert decayed and all(p.ndim == 2 for p in decay["params"])
    assert not any("embed" in n or "norm" in n or n.endswith("bias") for n in decayed)
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    decay_all, _ = param_groups(AdamWConfig(weight_decay=0.1, decay_embeddings=True), model)
    added = {names[id(p)] for p in decay_all["params"]} - decayed
    assert added and all("embed" in n or "position" in n for n in added)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One tiny run shared by the tests that need a checkpoint."""
    from yamlformer.recipes.training.run import run

    tmp = tmp_path_factory.mktemp("trained")
    path = tiny_recipe(tmp, trainer={"max_steps": 30, "val_check_interval": 15})
    summary = run(path, samples=False)
    return path, summary


def test_a_tiny_run_learns_and_checkpoints(trained):
    path, summary = trained
    assert summary["steps"] == 30
    train = history(Path(summary["last"]))["train"]  # read every log_every_n_steps (2) steps: no sync per step
    assert [step for step, _ in train] == list(range(2, 31, 2))
    losses = [loss for _, loss in train]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3
    assert Path(summary["best"]).is_file() and (Path(summary["output_dir"]) / "loss.png").is_file()
    assert list((Path(summary["output_dir"]) / "logs").rglob("metrics.csv"))
    val = history(Path(summary["last"]))["val"]
    assert [v[0] for v in val] == [15, 30] and val[1][1] < val[0][1] and 0 < val[0][2] < val[1][2]


def test_eval_and_generate_need_only_the_checkpoint(trained, capsys):
    from yamlformer.builder.cli import main

    _, summary = trained
    assert main(["eval", summary["last"], "--json", "--max-batches", "4"]) == 0
    result = __import__("json").loads(capsys.readouterr().out)
    assert result["step"] == 30 and result["tokens"] == 4 * 4 * 32
    assert math.isfinite(result["loss"]) and result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    assert main(["generate", summary["last"], "--prompt", "def ", "--max-new-tokens", "40", "--seed", "0"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def ") and len(text) == len("def ") + 40 + 1
    assert main(["generate", summary["last"], "--prompt", "import", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    assert (
        main(
            [
                "generate",
                summary["last"],
                "--prompt",
                "import",
                "--max-new-tokens",
                "5",
                "--num-beams",
                "1",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == greedy


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    from yamlformer.builder.cli import main

    path = tiny_recipe(
        tmp_path,
        optimizer={"lr": 1e30},
        schedule={"warmup_steps": 0, "type": "constant"},
        trainer={
            "max_steps": 20,
            "checkpoint_every_n_steps": 1,
            "gradient_clip_val": None,
            "output_dir": str(tmp_path / "run"),
        },
    )
    assert main(["train", str(path), "--no-samples"]) == 1
    err = capsys.readouterr().err
    assert "the training loss became" in err and "last good checkpoint" in err
    step = int(err.split(" at step ")[1].split(";")[0])  # checked at every checkpoint: here every step
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=True)
    assert 0 < saved["global_step"] <= step
    assert all(math.isfinite(loss) for _, loss in saved["builder"]["history"]["train"])


def test_nan_between_log_intervals_is_caught_before_a_checkpoint_keeps_it(tmp_path, capsys, monkeypatch):
    """Losses are read every 5 steps and before each checkpoint (every 3): the loss of step 8 is
    NaN, so the checkpoint of step 9 is not written; step 6's stays, with only finite losses."""
    from yamlformer.builder.cli import main
    from yamlformer.recipes.learning.module import LMModule

    original = LMModule.logits_and_targets

    def poisoned(self, *batch):
        logits, targets = original(self, *batch)
        return (logits * float("nan") if self.global_step >= 7 else logits), targets

    monkeypatch.setattr(LMModule, "logits_and_targets", poisoned)
    path = tiny_recipe(
        tmp_path,
        trainer={
            "max_steps": 40,
            "log_every_n_steps": 5,
            "checkpoint_every_n_steps": 3,
            "val_check_interval": 100,
            "output_dir": str(tmp_path / "run"),
        },
    )
    assert main(["train", str(path), "--no-samples"]) == 1
    err = capsys.readouterr().err
    assert "the training loss became nan between steps 6 and 9" in err
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == 6
    builder = saved["builder"]
    assert [step for step, _ in builder["history"]["train"]] == [5]
    assert builder["pending_loss"]["steps"] == 1 and math.isfinite(builder["pending_loss"]["sum"])
    assert all(torch.isfinite(t).all() for t in saved["state_dict"].values())


def test_atomic_checkpoint_survives_a_kill_during_the_write(tmp_path, monkeypatch):
    from yamlformer.recipes.training.checkpointing import AtomicCheckpointIO
    from yamlformer.recipes.training.run import resume_path
    from yamlformer.recipes.training.run_folder import claim

    target = tmp_path / "run" / "checkpoints" / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 4, "builder": {}}, target)  # a resume reads only builder train's own

    def killed_mid_write(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt  # interrupted here, before os.replace

    monkeypatch.setattr(torch, "save", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"global_step": 8}, target)
    monkeypatch.undo()
    assert [p.name for p in target.parent.iterdir()] == ["last.ckpt"]  # the temp file went with it
    assert torch.load(target, weights_only=True)["global_step"] == 4
    assert resume_path(tmp_path / "run", resume=None, fresh=False) == target
    # a process killed outright leaves its temp file: the next run's claim removes it
    (target.parent / ".last.ckpt.tmp-999999").write_bytes(b"PK\x03\x04 half")
    with claim(tmp_path / "run"):
        assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"]


def _tiny_model(spec_file: str, seed: int = 0):
    from yamlformer.builder import build_model, load_spec

    torch.manual_seed(seed)
    return build_model(load_spec(Path(__file__).resolve().parents[1] / "specs" / "tiny" / spec_file))


def test_activation_checkpointing_keeps_the_gradients():
    from yamlformer.recipes.parallel.activation_checkpointing import checkpoint_layers, layer_modules

    plain, checkpointed = _tiny_model("llama.yaml"), _tiny_model("llama.yaml")
    assert checkpoint_layers(checkpointed) == len(layer_modules(plain)) == 2
    ids = torch.randint(0, 256, (2, 16))
    for model in (plain, checkpointed):
        model(ids).float().square().mean().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    assert plain.state_dict().keys() == checkpointed.state_dict().keys()


def test_every_task_builds_its_model_with_the_recipes_checkpointing(tmp_path):
    """`trainer.activation_checkpointing` reaches encoder-decoder (translation) models too."""
    import dataclasses

    from yamlformer.builder import load_spec
    from yamlformer.recipes.training.resolved import resolve_run
    from yamlformer.recipes.training.run import training_model

    path = tiny_recipe(tmp_path)
    run = resolve_run(load_recipe(path, {"trainer.activation_checkpointing": True}))
    spec = load_spec(Path(__file__).resolve().parents[1] / "specs" / "tiny" / "transformer.yaml")
    model, est = training_model(dataclasses.replace(run, spec=spec), seq_len=16, batch=1)
    layers = [layer for stack in model.stacks().values() for layer in stack.layers]
    assert len(layers) == 4 and all("forward" in vars(layer) for layer in layers)  # wrapped
    assert est.flops.train_per_token > 0


def test_moe_balancing_loss_joins_the_training_loss(tmp_path):
    from yamlformer.recipes.learning.module import LMModule

    path = tiny_recipe(tmp_path, loss={"moe_aux_coef": 0.5})
    model = _tiny_model("mixtral.yaml")
    module = LMModule(model, load_recipe(path).recipe, meta={})
    ids = torch.randint(0, 256, (2, 16))
    loss, ce = module._losses(ids[:, :-1], ids[:, 1:])
    aux = model.aux_loss()
    assert module.adds_aux_losses and aux > 0
    torch.testing.assert_close(loss, ce + 0.5 * aux)
