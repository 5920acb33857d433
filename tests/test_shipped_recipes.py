"""Every shipped recipe runs outside the repository: copied alone into a temp folder, run there a
few steps on a tiny model with BUILDER_DATA pointing at a local copy of its data (the real files
when a local copy is here, generated stand-ins otherwise), with every download blocked, then
evaluated from its checkpoint."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from data_helpers import REPO, data_for_recipes

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))

TRAINER = {
    "trainer.max_steps": 3,
    "trainer.val_check_interval": 3,
    "trainer.limit_val_batches": 2,
    "trainer.checkpoint_every_n_steps": 3,
    "trainer.log_every_n_steps": 1,
    "trainer.max_time": None,
    "trainer.accelerator": "cpu",
    "trainer.devices": 1,
    "trainer.compile": False,
}  # a cold compile is ~25 s; compiled runs are tests/test_speed.py's
ENCODER = {
    "d_model": 32,
    "max_seq_len": 32,
    "position.max_positions": 32,
    "encoder.n_layers": 1,
    "encoder.attention.n_heads": 2,
    "encoder.ffn.hidden_dim": 64,
}
#: recipe -> (spec overrides, recipe overrides): a model and data small enough for seconds on a CPU
TINY = {
    "lm-stdlib": (
        {
            "d_model": 32,
            "max_seq_len": 32,
            "decoder.n_layers": 1,
            "decoder.attention.n_heads": 2,
            "decoder.attention.n_kv_heads": 1,
            "decoder.ffn.hidden_dim": 64,
        },
        {
            "data.seq_len": 32,
            "data.batch_size": 4,
            "data.max_bytes": 100_000,
            "tokenizer.vocab_size": 500,
            "sample.max_new_tokens": 4,
        },
    ),
    "shakespeare-char": (
        {"d_model": 32, "decoder.n_layers": 1, "decoder.attention.n_heads": 2, "decoder.ffn.hidden_dim": 64},
        {"data.seq_len": 32, "data.batch_size": 4, "sample.max_new_tokens": 4},
    ),
    "bert-mlm": (
        ENCODER,
        {"data.seq_len": 32, "data.batch_size": 4, "data.max_bytes": 200_000, "tokenizer.vocab_size": 500},
    ),
    "classify": (ENCODER, {"data.max_len": 32, "data.max_tokens": 256, "tokenizer.vocab_size": 500}),
    "translate-multi30k": (
        {
            "d_model": 32,
            "max_seq_len": 128,
            "encoder.n_layers": 1,
            "decoder.n_layers": 1,
            "encoder.attention.n_heads": 2,
            "decoder.attention.n_heads": 2,
            "encoder.ffn.hidden_dim": 64,
            "decoder.ffn.hidden_dim": 64,
        },
        {
            "data.limit_pairs": 1000,
            "data.max_len": 60,
            "data.max_tokens": 400,
            "tokenizer.vocab_size": 500,
            "eval.num_beams": 1,
            "eval.max_sentences": 8,
            "eval.average_last": 1,
            "eval.bleu_at_validation": False,
        },
    ),
}


#: recipe -> (the recipe whose run it starts from, that run's overrides): trained first, tiny, in the
#: same folder (``model.init_from: lm-stdlib`` is its run's last checkpoint)
BASES = {
    "lora-stdlib": (
        "lm-stdlib",
        {
            **{f"model.overrides.{k}": v for k, v in TINY["lm-stdlib"][0].items()},
            **TINY["lm-stdlib"][1],
            "model.overrides.max_seq_len": 128,  # the answers' rows are longer than its windows
            "data.max_bytes": 30_000,
            "tokenizer.vocab_size": 500,
            "trainer.max_steps": 1,
            "trainer.val_check_interval": 1,
            "trainer.checkpoint_every_n_steps": 1,
            "trainer.precision": "32",
        },
    ),
}
TINY["lora-stdlib"] = ({}, {"data.limit": 40, "data.batch_size": 2, "eval.prompts": 1, "eval.max_new_tokens": 2})
BASES["dpo-stdlib"] = ("lora-stdlib", {**TINY["lora-stdlib"][1], "trainer.precision": "32"})  # after lm-stdlib's
TINY["dpo-stdlib"] = ({}, {"data.limit": 40, "data.batch_size": 2})


def _train_bases(stem: str, run) -> str:
    """Train the runs ``stem`` starts from, first to last, as a user would have; returns the first
    (the base model's recipe, whose export the adapters load onto)."""
    base, settings = BASES[stem]
    first = _train_bases(base, run) if base in BASES else base
    run(REPO / "recipes" / f"{base}.yaml", {**TRAINER, **settings}, samples=False)
    return first


def test_every_shipped_recipe_is_covered():
    assert sorted(p.stem for p in RECIPES) == sorted(TINY)


def _cases():
    """Each recipe; one whose precision is ``auto`` twice, with the CPU's bf16 detection patched
    each way (so both behaviours run on every machine)."""
    for path in RECIPES:
        if path.stem in BASES:  # its precision is its base's recipe's, run both ways: once here (cost)
            yield pytest.param(path, None, id=f"{path.stem}-fp32-cpu")
        elif str(yaml.safe_load(path.read_text())["trainer"].get("precision", "auto")) == "auto":
            for native in ("AVX512-BF16", None):
                yield pytest.param(path, native, id=f"{path.stem}-{'bf16' if native else 'fp32'}-cpu")
        else:
            yield pytest.param(path, "as found", id=path.stem)


@pytest.mark.parametrize("shipped,native", list(_cases()))
def test_a_shipped_recipe_runs_outside_the_repository(shipped, native, tmp_path, monkeypatch, capsys):
    from yamlformer.builder.cli import main
    from yamlformer.recipes.training import precision
    from yamlformer.recipes.training.run import run

    if native != "as found":
        monkeypatch.setattr(precision, "cpu_bf16", lambda: native)
    kinds = data_for_recipes(tmp_path / "data", monkeypatch)
    recipe = yaml.safe_load(shipped.read_text())
    work = tmp_path / "elsewhere"
    work.mkdir()
    copy = work / shipped.name
    copy.write_text(shipped.read_text())  # as it is: a spec it names by its zoo name resolves anywhere
    monkeypatch.chdir(work)  # runs/ and .cache/ land here, as for a user running `builder train my.yaml`

    if shipped.stem in BASES:  # the runs it starts from, as a user would have trained them first
        first = _train_bases(shipped.stem, run)
    model, settings = TINY[shipped.stem]
    overrides = {**TRAINER, **settings, **{f"model.overrides.{k}": v for k, v in model.items()}}
    summary = run(copy, overrides, samples=False)
    dataset = recipe["data"].get("dataset")
    print(f"{shipped.stem}: dataset {dataset} ({kinds.get(dataset, 'local')}), summary {summary}")
    assert summary["steps"] == 3 and math.isfinite(summary["val_loss"])
    ran = torch.load(summary["last"], weights_only=True)["builder"]["recipe"]["trainer"]["precision"]
    assert ran == {"AVX512-BF16": "bf16-mixed", None: "32"}.get(native, str(recipe["trainer"].get("precision")))
    assert (work / summary["output_dir"] / "checkpoints" / "last.ckpt").is_file()
    assert "downloading" not in capsys.readouterr().err

    extra = {"translation": ["--max-sentences", "4"], "classification": []}.get(
        recipe.get("task"), ["--max-batches", "2"]
    )
    assert main(["eval", summary["last"], "--json", *extra]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["step"] == 3
    if recipe.get("task") == "translation":  # another split of the dataset: val is here, test2016 is not
        assert main(["eval", summary["last"], "--json", "--split", "val", *extra]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["src"].endswith("val.de")
        assert main(["eval", summary["last"], "--split", "test2016", *extra]) == 1
        *fetching, error = capsys.readouterr().err.strip().splitlines()  # (its terms,) the URL, the error
        assert error.startswith("builder eval: downloading") and "BUILDER_DATA" in error, error
        assert "multi30k/test2016.de" in error and fetching[-1].startswith("downloading")
    if shipped.stem in BASES:  # what the recipe's header shows: its adapters loaded by peft onto the base's export
        _peft_loads_the_run(work, summary["last"], first, main)


def _peft_loads_the_run(work, last: str, base: str, main) -> None:
    """The base run exported for transformers, the adapters for PEFT: the logits of our checkpoint."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from yamlformer.recipes.trained import load_trained

    base_ckpt = work / "runs" / base / "checkpoints" / "last.ckpt"
    assert main(["export-hf", str(base_ckpt), "-o", str(work / "hf-base")]) == 0
    assert main(["export-hf", last, "--adapters-only", "-o", str(work / "hf-adapters")]) == 0
    model, _, _ = load_trained(last, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(work / "hf-base", dtype=torch.float32)
    adapted = PeftModel.from_pretrained(hf, work / "hf-adapters").eval()
    ids = torch.randint(0, model.spec.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, model(ids), rtol=0, atol=1e-5)
