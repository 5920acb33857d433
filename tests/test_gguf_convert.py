"""``builder export-hf`` folders converted by llama.cpp's own ``convert_hf_to_gguf.py`` (vendored in
llama-cpp-python's sdist, which .ci/llamacpp.sh downloads and builds), run in llama.cpp itself, as a
user does it: for each family the converter knows, llama.cpp's tokenizer gives our ids for the
prompts (text in, with whatever BOS the file says to add), its greedy tokens equal ``builder generate
--temperature 0``'s over 7 prompts x 24 tokens, and its first-step logits agree with ours within
:data:`F32_TOLERANCE` (``--outtype f32``). The families whose tokenizer the converter refuses are
refused for the reason the README gives.

    .ci/llamacpp.sh && python -m pytest -m llamacpp -n 0 tests/test_gguf_convert.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_helpers import MODELS, NOT_CONVERTED, prove, train

from yamlformer.builder.cli import main
from yamlformer.builder.gguf.llamacpp import NO_SDIST, NOT_BUILT, ConvertError, available, convert, load_overrides
from yamlformer.builder.gguf.llamacpp import sdist as llamacpp_sdist

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.skipif(not available(), reason=NOT_BUILT),
    pytest.mark.skipif(llamacpp_sdist() is None, reason=NO_SDIST),
]

#: the largest |logit difference| of a converted f32 file against our model (float32 both sides;
#: the orders of summation differ; measured up to 2.8e-4 on these models)
F32_TOLERANCE = 1e-3

#: the families the converter reads our SentencePiece tokenizer for (its classes try tokenizer.model first)
CONVERTED = {name: family for name, family in MODELS.items() if name not in NOT_CONVERTED}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("convert-cache")


def _export_hf(checkpoint: Path, tmp_path: Path, export_args: list[str]) -> Path:
    folder = tmp_path / "hf"
    assert main(["export-hf", str(checkpoint), "-o", str(folder), *export_args]) == 0
    return folder


@pytest.mark.parametrize("family", list(CONVERTED))
def test_an_export_converts_with_llama_cpps_converter_and_runs_as_ours(family, tmp_path, cache, capsys):
    from yamlformer.recipes.trained import load_trained

    spec, overrides, export_args = CONVERTED[family]
    checkpoint = train(tmp_path, cache, spec, overrides)
    folder = _export_hf(checkpoint, tmp_path, export_args)
    assert (folder / "tokenizer.model").is_file()  # the converter's classes read the SentencePiece model
    gguf = convert(folder, tmp_path / "converted.gguf")
    capsys.readouterr()
    state = load_trained(checkpoint, "cpu")[2].get("tokenizer")
    prove(checkpoint, gguf, capsys, F32_TOLERANCE, overrides=load_overrides(gguf, state), add_special=True)


@pytest.mark.parametrize("family", list(NOT_CONVERTED))
def test_a_family_the_converter_refuses_is_refused_for_the_reason_given(family, tmp_path, cache):
    spec, overrides, export_args = MODELS[family]
    folder = _export_hf(train(tmp_path, cache, spec, overrides), tmp_path, export_args)
    with pytest.raises(ConvertError, match=NOT_CONVERTED[family]):
        convert(folder, tmp_path / "converted.gguf")
