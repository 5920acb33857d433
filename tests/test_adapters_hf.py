"""Adapters to and from the ecosystem: ``export-hf --adapters-only`` writes a folder that
``peft.PeftModel.from_pretrained`` loads onto the ``transformers`` export of the base with the same
logits (fp32, within 1e-5), ``import-hf`` reads it back to the same logits, ``--merge`` folds the
adapters into a plain folder ``transformers`` loads alone; a model with adapters names the two
choices. Fused Hugging Face modules (GPT-2's ``c_attn``) hold our separate projections' adapters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from yamlformer.blocks.linear import adapter_parameters
from yamlformer.builder import build_model, load_spec
from yamlformer.builder.cli import main
from yamlformer.builder.hf import load_weights, save_weights

REPO = Path(__file__).resolve().parents[1]
ATOL = 1e-5  # fp32: the same products in another order


def _trained(tmp_path: Path, name: str, adapters: dict):
    """A tiny model with trained-looking adapters, written as an import-hf folder would be (the spec
    with its adapters, model.safetensors), and its base alone beside it."""
    spec = load_spec(REPO / "specs" / "tiny" / f"{name}.yaml", overrides={"adapters": adapters})
    model = build_model(spec, init_seed=0).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in adapter_parameters(model).values():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    adapted, base = tmp_path / "adapted", tmp_path / "base-spec"
    for folder, data, state in (
        (adapted, spec.model_dump(mode="json"), model.state_dict()),
        (
            base,
            {**spec.model_dump(mode="json"), "adapters": None},
            {k: v for k, v in model.state_dict().items() if ".adapter." not in k},
        ),
    ):
        folder.mkdir()
        (folder / "spec.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        save_weights(state, folder / "model.safetensors")
    return spec, model, adapted / "spec.yaml", base / "spec.yaml"


def _cli(*args) -> int:
    return main([str(a) for a in args])


@pytest.mark.parametrize(
    "name, adapters",
    [
        ("llama", {"type": "lora", "rank": 4, "alpha": 8, "targets": "all-linear"}),
        ("llama", {"type": "dora", "rank": 4, "alpha": 4, "targets": ["q_proj", "v_proj", "down_proj"]}),
        ("gpt2", {"type": "lora", "rank": 2, "alpha": 4, "rank_scaled": True, "targets": ["attention"]}),
    ],
    ids=["llama-lora", "llama-dora", "gpt2-fused-rslora"],
)
def test_peft_loads_the_adapters_with_our_logits_and_they_come_back(name, adapters, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    spec, model, adapted, base = _trained(tmp_path, name, adapters)
    assert _cli("export-hf", base, "-o", tmp_path / "hf-base") == 0
    assert _cli("export-hf", adapted, "--adapters-only", "-o", tmp_path / "peft") == 0
    assert "PEFT LoRA" in capsys.readouterr().out
    ids = torch.randint(0, spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-base", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
    with torch.no_grad():
        ours = model(ids)
        torch.testing.assert_close(peft_model(ids).logits, ours, rtol=0, atol=ATOL)

    # back: the PEFT folder over its base, as a spec with adapters and one weights file
    assert _cli("import-hf", tmp_path / "peft", "--base", tmp_path / "hf-base", "-o", tmp_path / "back") == 0
    back_spec = load_spec(tmp_path / "back" / "spec.yaml")
    assert back_spec.adapters.type == adapters["type"] and back_spec.adapters.rank == adapters["rank"]
    back = load_weights(build_model(back_spec), tmp_path / "back" / "model.safetensors").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids), ours, rtol=0, atol=ATOL)

    # merged: a plain folder transformers loads alone, the adapted model's logits
    assert _cli("export-hf", adapted, "--merge", "-o", tmp_path / "merged") == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, ours, rtol=0, atol=ATOL)


def test_a_model_with_adapters_names_merge_and_adapters_only(tmp_path, capsys):
    _, _, adapted, base = _trained(tmp_path, "llama", {"type": "lora", "rank": 2, "targets": ["q_proj"]})
    assert _cli("export-hf", adapted, "-o", tmp_path / "out") == 1
    err = capsys.readouterr().err.strip()
    assert (
        err.count("\n") == 0
        and "has adapters (lora r2 on 2 linear layers): --merge" in err
        and "--adapters-only" in err
    )
    assert _cli("export-hf", base, "--merge", "-o", tmp_path / "out") == 1
    assert "--merge: the model has no adapters" in capsys.readouterr().err
    assert _cli("import-hf", tmp_path / "base-spec", "--base", tmp_path, "-o", tmp_path / "x") == 1
    assert "is not a PEFT adapter folder" in capsys.readouterr().err


def test_an_adapter_on_a_tied_head_has_no_peft_or_merged_form(tmp_path, capsys):
    spec = load_spec(
        REPO / "specs" / "tiny" / "llama.yaml",
        overrides={"tie_embeddings": True, "adapters": {"type": "lora", "targets": ["head.proj"]}},
    )
    model = build_model(spec, init_seed=0)
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    save_weights(model, tmp_path / "model.safetensors")
    for option in ("--merge", "--adapters-only"):
        assert _cli("export-hf", tmp_path / "spec.yaml", option, "-o", tmp_path / "out") == 1
        assert "tie_embeddings" in capsys.readouterr().err


def test_adapter_outputs_are_claimed_as_every_import_and_export(tmp_path, capsys):
    """A PEFT folder is an output like any other: a second export there needs --overwrite, and an
    import never writes into the base folder or the adapter folder it reads, even with it."""
    _, _, adapted, base = _trained(tmp_path, "llama", {"type": "lora", "rank": 2, "targets": ["q_proj"]})
    assert _cli("export-hf", base, "-o", tmp_path / "hf-base") == 0
    assert _cli("export-hf", adapted, "--adapters-only", "-o", tmp_path / "peft") == 0
    capsys.readouterr()
    assert _cli("export-hf", adapted, "--adapters-only", "-o", tmp_path / "peft") == 1
    err = capsys.readouterr().err
    assert "already holds adapter_config.json and adapter_model.safetensors" in err and "--overwrite" in err
    assert _cli("export-hf", adapted, "--adapters-only", "-o", tmp_path / "peft", "--overwrite") == 0
    for folder in ("hf-base", "peft"):
        before = sorted((tmp_path / folder).iterdir())
        assert _cli("import-hf", tmp_path / "peft", "--base", tmp_path / "hf-base", "-o", tmp_path / folder) == 1
        assert "is the folder this command reads" in capsys.readouterr().err
        assert sorted((tmp_path / folder).iterdir()) == before
    assert _cli("import-hf", tmp_path / "peft", "--base", tmp_path / "hf-base", "-o", tmp_path / "back") == 0
    assert _cli("import-hf", tmp_path / "peft", "--base", tmp_path / "hf-base", "-o", tmp_path / "back") == 1
    assert "add --overwrite" in capsys.readouterr().err


def _q_proj_peft(tmp_path: Path) -> dict:
    """``tmp_path/peft``: a PEFT LoRA folder of q_proj over ``tmp_path/hf-base``; returns its config."""
    _, _, adapted, base = _trained(tmp_path, "llama", {"type": "lora", "rank": 2, "targets": ["q_proj"]})
    assert _cli("export-hf", base, "-o", tmp_path / "hf-base") == 0
    assert _cli("export-hf", adapted, "--adapters-only", "-o", tmp_path / "peft") == 0
    return json.loads((tmp_path / "peft" / "adapter_config.json").read_text())


TARGETS = [  # target_modules -> what import-hf says (None: imported), on adapters of q_proj only
    (["q_proj"], None),
    (r".*\.q_proj", None),
    (r"model\.layers\.\d+\.self_attn\.q_proj", None),
    (".*", "selects the model itself, which is no linear layer"),
    (r".*\.(q|v)_proj", "selects model.layers.0.self_attn.v_proj and 1 more, which has no adapter in"),
    ("all-linear", "which has no adapter in adapter_model.safetensors"),
    (["no_such_proj"], "selects no module of the base llama model"),
    (["q_proj", "k_proj"], "selects model.layers.0.self_attn.k_proj and 1 more"),
    (["self_attn"], "selects model.layers.0.self_attn, which is no linear layer"),
    ("([", "is not a regular expression"),
    (42, "must be a list of module names or one regular expression"),
]


def test_target_modules_select_exactly_the_modules_the_weights_adapt_as_peft_matches(tmp_path, capsys):
    """PEFT matches ``target_modules`` (a list: names or their last dotted parts; a string: a regex
    the whole module name matches) and refuses one matching nothing: import-hf agrees with it, and
    refuses a selection other than the modules the weights adapt, naming the field."""
    import warnings

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = _q_proj_peft(tmp_path)
    capsys.readouterr()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-base", dtype=torch.float32)
    for i, (target, said) in enumerate(TARGETS):
        (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps({**config, "target_modules": target}))
        code = _cli("import-hf", tmp_path / "peft", "--base", tmp_path / "hf-base", "-o", tmp_path / f"out{i}")
        err = capsys.readouterr().err.strip()
        if said is None:
            assert code == 0, (target, err)
            assert load_spec(tmp_path / f"out{i}" / "spec.yaml").adapters.targets == [
                f"decoder.layers.{n}.attention.q_proj" for n in range(2)
            ]
        else:
            assert code == 1 and err.count("\n") == 0 and "adapter_config.json: target_modules: " in err, err
            assert said in err, (target, err)
            assert not (tmp_path / f"out{i}").exists()
        if said is None or "no module" in said or "no linear layer" in said:  # PEFT's own verdict
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    PeftModel.from_pretrained(hf, tmp_path / "peft").unload()
                    peft_loads = True
                except (ValueError, RuntimeError, TypeError):
                    peft_loads = False
            assert peft_loads == (said is None), target
    excluded = {**config, "target_modules": r".*_proj", "exclude_modules": r".*\.(k|v|o|gate|up|down)_proj"}
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps(excluded))  # PEFT's exclusion, then the match
    assert _cli("import-hf", tmp_path / "peft", "--base", tmp_path / "hf-base", "-o", tmp_path / "excluded") == 0
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps({**config, "target_modules": None}))
    assert _cli("import-hf", tmp_path / "peft", "--base", tmp_path / "hf-base", "-o", tmp_path / "none") == 1
    assert "target_modules: is not set" in capsys.readouterr().err


def test_use_dora_and_fan_in_fan_out_must_agree_with_the_tensors_and_layers(tmp_path, capsys):
    """``use_dora`` without magnitude vectors would invent them, magnitude vectors without it
    would be dropped, and ``fan_in_fan_out`` on a Linear (PEFT resets it with a warning) says the
    folder was written for another layout: each is one line naming the field, nothing written."""
    from safetensors.torch import load_file, save_file

    config = _q_proj_peft(tmp_path)
    peft = tmp_path / "peft"
    capsys.readouterr()

    def refused(out: str, *said: str) -> None:
        assert _cli("import-hf", peft, "--base", tmp_path / "hf-base", "-o", tmp_path / out) == 1
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "adapter_config.json: " in err and all(s in err for s in said), err
        assert not (tmp_path / out).exists()

    for key, value, said in (
        ("use_dora", True, "use_dora is true, but model.layers.0.self_attn.q_proj has no lora_magnitude_vector"),
        ("fan_in_fan_out", True, "fan_in_fan_out is true, but model.layers.0.self_attn.q_proj is a Linear"),
        ("fan_in_fan_out", "yes", "fan_in_fan_out must be true or false"),
        ("rank_pattern", {"q_proj": 8}, "peft/adapter_config.json: rank_pattern gives model.layers.0.self_attn.q_proj"),
    ):
        (peft / "adapter_config.json").write_text(json.dumps({**config, key: value}))
        refused(key, said)
    (peft / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(str(peft / "adapter_model.safetensors"))
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors[f"{name}.lora_magnitude_vector"] = torch.ones(tensors[f"{name}.lora_B.weight"].shape[0])
    save_file(tensors, str(peft / "adapter_model.safetensors"))
    refused("magnitude", "use_dora is false, but model.layers.0.self_attn.q_proj has a lora_magnitude_vector")
