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
