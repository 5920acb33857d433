"""What ``benchmarks/hostile_run.py`` found in the wave-4 commands, each kept fixed: every case
here was a hang, a traceback or a silent wrong result before, and is one located refusal now."""

from __future__ import annotations

import time

from hostile_helpers import cli, refused
from recipe_helpers import tiny_recipe


def test_an_adapter_range_past_the_layers_is_refused_at_once(capsys, tmp_path):
    """``decoder.layers.0-999999999999`` built the set of its 10**12 indices to compare it with the
    model's (the dry run hung, then took 19 GB)."""
    adapters = {"type": "lora", "rank": 4, "targets": ["decoder.layers.0-999999999999.attention"]}
    recipe = tiny_recipe(tmp_path, model={"adapters": adapters})
    started = time.perf_counter()
    result = cli(capsys, "validate", recipe)
    assert time.perf_counter() - started < 10
    assert result.status == 1 and "decoder.layers has 0-1, not 0-999999999999" in result.out, result.text
    err = refused(cli(capsys, "train", recipe, "--dry-run"), 1, "model.adapters.targets.0")
    assert "0-999999999999" in err


def test_a_tensor_of_one_element_and_any_stride_is_checksummed():
    """torchao's NF4 weight of one scaler block holds a ``quantization_factor`` of shape (1,) and
    stride (64,): sealing a QLoRA checkpoint of a small model raised RuntimeError at the first
    save (``quantize: nf4`` on a 64 x 64 layer, found by the hostile run)."""
    import torch

    from yamlformer.builder.checkpoints.integrity import _tensor_crc

    odd = torch.empty_strided((1,), (64,)).fill_(0.5)
    assert _tensor_crc(odd) == _tensor_crc(torch.tensor([0.5]))


def test_instruction_records_nested_too_deep_or_of_huge_numbers_are_one_line(tmp_path):
    """A record nested 100,000 deep raised RecursionError, a number of 10**6 digits ValueError
    (Python's int conversion limit): the CLI's last resort caught both."""
    import pytest

    from yamlformer.recipes.data.instructions import read_records
    from yamlformer.recipes.errors import RecipeError

    deep, digits = tmp_path / "deep.jsonl", tmp_path / "digits.jsonl"
    deep.write_text('{"prompt": "a", "response": "b"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    digits.write_text('{"prompt": ' + "9" * 100_000 + "}\n")
    with pytest.raises(RecipeError, match=r"deep.jsonl:2: not a record: JSON nested deeper"):
        list(read_records(deep))
    with pytest.raises(RecipeError, match=r"digits.jsonl:1: not a record the reader takes \(Exceeds the limit") as got:
        list(read_records(digits))
    assert "999" not in str(got.value)


def test_a_chat_template_that_renders_without_end_is_refused_before_tokenizing():
    """``{{ 'a' * 10**9 }}`` rendered a gigabyte that the tokenizer then took 8 GB to encode before
    it aborted the process."""
    import pytest

    from yamlformer.recipes.data.chat import MAX_RENDERED, ChatError, ChatFormat
    from yamlformer.recipes.data.tokenizers import CharTokenizer

    chat = ChatFormat(CharTokenizer.fit("ab", eos=True), template="{{ 'a' * " + str(MAX_RENDERED + 1) + " }}")
    with pytest.raises(ChatError, match="renders 67,108,865 characters, more than the 67,108,864"):
        chat.encode([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])


def test_sgd_nesterov_without_momentum_is_refused_by_validate_as_by_the_run(capsys, tmp_path):
    """validate and the dry run accepted it; the run refused it once the model was built."""
    recipe = tiny_recipe(tmp_path, optimizer={"type": "sgd", "momentum": 0, "nesterov": True})
    result = cli(capsys, "validate", recipe)
    assert result.status == 1 and "optimizer.nesterov: Nesterov momentum needs momentum > 0" in result.out
    refused(cli(capsys, "train", recipe, "--dry-run"), 1, "optimizer.nesterov: Nesterov momentum needs momentum > 0")


def test_a_chat_template_that_is_no_string_is_refused():
    """A tokenizer_config.json's ``"chat_template": 42`` trained on what str(42) rendered."""
    import pytest

    from yamlformer.recipes.data.chat import ChatFormat
    from yamlformer.recipes.data.tokenizers import CharTokenizer
    from yamlformer.recipes.errors import RecipeError

    tokenizer = CharTokenizer.fit("ab", eos=True)
    tokenizer.chat_template = 42
    with pytest.raises(RecipeError, match="chat_template is a int, not a Jinja template"):
        ChatFormat(tokenizer)


def test_a_tokenizer_folder_whose_chat_template_is_no_string_is_refused(tmp_path):
    """tokenizer_config.json's ``"chat_template": 42`` was dropped, and the default template trained."""
    import json

    import pytest

    from yamlformer.builder.hf.checks import HFError
    from yamlformer.builder.hf.tokenizer import chat_template

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 42}))
    with pytest.raises(HFError, match="chat_template is a int, not a Jinja template"):
        chat_template(tmp_path)


def _peft_folder(tmp_path):
    """The harness's PEFT folder over its base's Hugging Face export (benchmarks/hostile_run.py)."""
    import sys

    from hostile_helpers import REPO

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from hostile_run import _base_models
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return _base_models(tmp_path)


def test_a_peft_folder_of_wrong_types_or_shapes_is_one_line(capsys, tmp_path):
    """``lora_alpha: "eight"`` raised ValueError and adapter tensors of the wrong shape IndexError;
    ``r: -1`` was taken (the rank read from the tensors)."""
    import json

    from safetensors.numpy import load_file, save_file

    models = _peft_folder(tmp_path)
    peft, config = models["peft"], json.loads((models["peft"] / "adapter_config.json").read_text())
    for key, value, said in [
        ("lora_alpha", "eight", "lora_alpha must be a number, got str"),
        ("r", -1, "r must be a whole number from 1, got int"),
        ("use_dora", "yes", "use_dora must be true or false, got str"),
        ("r", 10**9, "r is 1000000000, its tensors' rank 4"),
    ]:
        (peft / "adapter_config.json").write_text(json.dumps({**config, key: value}))
        refused(cli(capsys, "import-hf", peft, "-o", tmp_path / key), 1, said)
        assert not (tmp_path / key).exists()
    (peft / "adapter_config.json").write_text(json.dumps(config))
    state = load_file(str(peft / "adapter_model.safetensors"))
    save_file({k: v[:1] for k, v in state.items()}, str(peft / "adapter_model.safetensors"))
    refused(cli(capsys, "import-hf", peft, "-o", tmp_path / "shapes"), 1, "are no adapter of its")
