"""``train --dry-run`` of a ``task: sft`` recipe reads its records as the run does
(``yamlformer.recipes.tasks.sft.records.check_records``): a file of no records, a record longer
than ``data.seq_len`` and a chat template that fails or trains no answer are refused by the dry
run in the run's own line, exit 1, nothing written, nothing of the file printed (the hostile
run's 11 "dry run disagrees" cases, issue 52)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hostile_helpers import cli, refused
from recipe_helpers import tiny_recipe

SECRET = "the users secret words"
GOOD = [json.dumps({"prompt": f"what is {i} plus one", "response": f"it is {i + 1}"}) for i in range(8)]


def _sft_recipe(folder: Path, lines: list[str], tokenizer: dict | None = None) -> Path:
    records = folder / "records.jsonl"
    records.write_text("".join(line + "\n" for line in lines))
    data = {"file": str(records), "seq_len": 64, "batch_size": 4, "cache_dir": str(folder / "cache")}
    recipe = tiny_recipe(folder, data=data)
    document = yaml.safe_load(recipe.read_text())
    document["task"], document["data"] = "sft", data
    document["tokenizer"] = tokenizer or {"type": "char"}
    document["trainer"]["max_steps"] = 2
    document["model"]["spec"]["max_seq_len"] = 64
    del document["sample"]
    recipe.write_text(yaml.safe_dump(document, sort_keys=False))
    return recipe


def _hf_folder(folder: Path, template: str) -> dict:
    """A Hugging Face tokenizer folder of single characters whose chat template is ``template``."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    chars = sorted(set("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789#:.?\n'{}"))
    model = tokenizers.models.WordLevel({"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}, unk_token="<unk>")
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tokenizer.add_special_tokens(["<s>", "</s>"])
    out = folder / "hf"
    out.mkdir()
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"eos_token": "</s>", "bos_token": "<s>", "chat_template": template}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return {"type": "hf", "model_file": str(out)}


def _agree(capsys, recipe: Path, needle: str) -> str:
    """The dry run and the run refuse ``recipe`` in the same one line, exit 1, nothing written."""
    dry = cli(capsys, "train", str(recipe), "--dry-run")
    run = cli(capsys, "train", str(recipe), "--no-samples")
    lines = [refused(result, 1, needle) for result in (dry, run)]
    assert lines[0] == lines[1], lines
    assert SECRET not in dry.text + run.text
    assert not (recipe.parent / "run").exists()
    return lines[0]


@pytest.mark.parametrize("lines", [[], ["", "  ", ""]], ids=["an empty file", "blank lines only"])
def test_a_file_of_no_records(capsys, tmp_path, lines):
    recipe = _sft_recipe(tmp_path, lines)
    assert _agree(capsys, recipe, "no records").endswith(f"{tmp_path / 'records.jsonl'}: no records")


def test_a_record_longer_than_seq_len(capsys, tmp_path):
    long = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 40}
    recipe = _sft_recipe(tmp_path, [*GOOD, json.dumps(long)])
    line = _agree(capsys, recipe, "more than data.seq_len 64")
    assert line.startswith(f"builder train: {tmp_path / 'records.jsonl'}:{len(GOOD) + 1}: the record is ")


def test_one_record_without_a_held_out_file(capsys, tmp_path):
    _agree(capsys, _sft_recipe(tmp_path, GOOD[:1]), "fewer than 2 records")


TEMPLATES = {
    "unsafe attribute": ("{{ cycler.__init__.__globals__.os }}", "the chat template fails: "),
    "subclasses": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "the chat template fails: "),
    "a range over MAX_RANGE": ("{% for i in range(10**9) %}x{% endfor %}", "the chat template fails: "),
    "raise_exception": (
        "{{ raise_exception('" + SECRET + "') }}",
        "the chat template fails: it calls raise_exception (its message is not shown)",
    ),
    "bad syntax": ("{% for m in messages %}{{ m['content'] ", "the chat template fails: "),
    "no answer": (
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}",
        "its answer encodes to no token: nothing to train on",
    ),
}


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_a_tokenizers_chat_template_that_fails(capsys, tmp_path, name):
    template, needle = TEMPLATES[name]
    recipe = _sft_recipe(tmp_path, GOOD, _hf_folder(tmp_path, template))
    assert _agree(capsys, recipe, needle).startswith(f"builder train: {tmp_path / 'records.jsonl'}:1: ")


def test_a_good_file_is_accepted_by_the_dry_run(capsys, tmp_path):
    result = cli(capsys, "train", str(_sft_recipe(tmp_path, GOOD)), "--dry-run")
    assert result.status == 0, result.text
    assert not (tmp_path / "run").exists()
