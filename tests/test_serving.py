"""Models that leave the project: each shipped recipe's model, trained a few seconds on the CPU by
the recipe itself (tiny, on generated stand-in data), written by ``builder export-hf`` and served
by the libraries people serve models with, as a user runs them:

- CTranslate2: the folder converted as ``ct2-transformers-converter --model DIR`` converts it
  (its ``TransformersConverter``), then ``Generator`` for the language models, ``Translator`` for
  the translation model and ``Encoder`` for the BERT ones;
- ONNX Runtime through Hugging Face ``optimum`` (its ``main_export``, what ``optimum-cli export
  onnx`` runs, then its ``ORTModel`` classes). optimum's exporter (``optimum-onnx``) needs
  ``transformers<4.58``; where it does not import these tests skip, saying so.

Each client's greedy tokens equal ``builder generate --temperature 0``'s (the LM's ``stream``, the
translation task's ``translate``); the encoders' states or logits are within 1e-4 of ours; the
translation client's beam-4 sacreBLEU on the validation set is within 0.5 of ours.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch
from data_helpers import REPO, data_for_recipes
from test_shipped_recipes import TINY, TRAINER

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

#: training steps per recipe: enough that greedy decoding has no near-ties (a few seconds each)
STEPS = {"lm-stdlib": 60, "shakespeare-char": 60, "translate-multi30k": 800, "bert-mlm": 20, "classify": 20}
#: recipe settings beside the tiny model's (tests/test_shipped_recipes.py): a warmup that fits the steps
SETTINGS = {
    "translate-multi30k": {
        "schedule.warmup_steps": 100,
        "data.limit_pairs": 3000,
        "model.overrides.d_model": 64,
        "model.overrides.encoder.ffn.hidden_dim": 128,
        "model.overrides.decoder.ffn.hidden_dim": 128,
    }
}
PROMPTS = {"lm-stdlib": ["def ", "import os\n", "class A:\n    "], "shakespeare-char": ["KING:\n", "The ", "\n"]}
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(name)``: ``(checkpoint, export folder)`` of shipped recipe ``name``, trained once."""
    from yamlformer.builder.cli import main
    from yamlformer.recipes.training.run import run

    root = tmp_path_factory.mktemp("serving")
    patch = pytest.MonkeyPatch()
    data_for_recipes(root / "data", patch, real=False)
    patch.chdir(root)  # runs/ and .cache/ land here
    done: dict[str, tuple[Path, Path]] = {}

    def train(name: str) -> tuple[Path, Path]:
        if name not in done:
            model, settings = TINY[name]
            steps = STEPS[name]
            overrides = {
                **TRAINER,
                **settings,
                "trainer.max_steps": steps,
                "trainer.val_check_interval": steps,
                "trainer.checkpoint_every_n_steps": steps,
                "trainer.precision": "32",
                "trainer.output_dir": str(root / name),
                **{f"model.overrides.{k}": v for k, v in model.items()},
                **SETTINGS.get(name, {}),
            }
            summary = run(REPO / "recipes" / f"{name}.yaml", overrides, samples=False)
            folder = root / f"{name}-hf"
            assert main(["export-hf", str(summary["last"]), "-o", str(folder)]) == 0
            done[name] = Path(summary["last"]), folder
        return done[name]

    yield train
    patch.undo()


def _ours_lm(checkpoint: Path, prompt: str) -> list[int]:
    """What ``builder generate CKPT --prompt P --temperature 0 --max-new-tokens N`` decodes."""
    from yamlformer.recipes.tasks.lm.streaming import stream
    from yamlformer.recipes.trained import load_trained

    model, tokenizer, _ = load_trained(checkpoint, "cpu")
    return stream(model, tokenizer, prompt, io.StringIO(), NEW_TOKENS, temperature=0.0)


def _validation(name: str = "val") -> tuple[list[str], list[str]]:
    root = Path(os.environ["BUILDER_DATA"]) / "multi30k"
    return tuple((root / f"{name}.{lang}").read_text(encoding="utf-8").splitlines() for lang in ("de", "en"))


def _ours_translations(checkpoint: Path, sources: list[str], beams: int, one_by_one: bool = False) -> list[str]:
    """What ``builder eval`` decodes: the translation task's ``translate`` (the recipe's length
    penalty); ``one_by_one``: each source alone, with its own length budget, as a client is called."""
    from yamlformer.recipes.tasks.translation.training import translate
    from yamlformer.recipes.trained import load_trained

    model, tokenizer, meta = load_trained(checkpoint, "cpu")
    penalty = meta["recipe"]["eval"]["length_penalty"]
    if one_by_one:
        return [translate(model, tokenizer, [s], num_beams=beams, length_penalty=penalty)[0] for s in sources]
    return translate(model, tokenizer, sources, num_beams=beams, length_penalty=penalty)


def _max_new(tokenizer, source: str) -> int:
    """The translation task's decoding budget for one source (1.5 x its length + 10, in the context)."""
    return min(int(1.5 * len(tokenizer(source)["input_ids"]) + 10), tokenizer.model_max_length - 1)


# -- CTranslate2 ------------------------------------------------------------------------------------


def _ct2(folder: Path, out: Path) -> Path:
    """``ct2-transformers-converter --model FOLDER --output_dir OUT``."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    ctranslate2.converters.TransformersConverter(str(folder)).convert(str(out), force=True)
    return out


@pytest.mark.parametrize("name", ["lm-stdlib", "shakespeare-char"])
def test_ctranslate2_generator_decodes_what_builder_generate_does(name, trained, tmp_path):
    import ctranslate2

    checkpoint, folder = trained(name)
    generator = ctranslate2.Generator(str(_ct2(folder, tmp_path / "ct2")), device="cpu", compute_type="float32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    for prompt in PROMPTS[name]:
        ours = _ours_lm(checkpoint, prompt)
        start = tokenizer.convert_ids_to_tokens(tokenizer(prompt)["input_ids"])
        (result,) = generator.generate_batch(
            [start], max_length=NEW_TOKENS, sampling_topk=1, include_prompt_in_result=False, return_end_token=True
        )
        theirs = result.sequences_ids[0]
        assert theirs == ours[: len(theirs)], (name, prompt)
        assert len(theirs) == NEW_TOKENS or theirs[-1] == tokenizer.eos_token_id  # stopped at eos, or ran out


@pytest.mark.slow  # trains a translation model first
def test_ctranslate2_translator_decodes_and_scores_what_builder_eval_does(trained, tmp_path):
    """Greedy: the same translations; beam 4 (the recipe's): sacreBLEU within 0.5 of ours."""
    import ctranslate2

    from yamlformer.recipes.tasks.translation.training import score

    checkpoint, folder = trained("translate-multi30k")
    translator = ctranslate2.Translator(str(_ct2(folder, tmp_path / "ct2")), device="cpu", compute_type="float32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    sources, references = _validation()

    def theirs(beams: int, texts: list[str]) -> list[str]:
        out = []
        for source in texts:  # each with its own budget
            tokens = tokenizer.convert_ids_to_tokens(tokenizer(source)["input_ids"])  # ends in </s>
            (result,) = translator.translate_batch(
                [tokens], beam_size=beams, length_penalty=1.0, max_decoding_length=_max_new(tokenizer, source)
            )
            out.append(tokenizer.convert_tokens_to_string(result.hypotheses[0]))
        return out

    assert theirs(1, sources[:20]) == _ours_translations(checkpoint, sources[:20], 1, one_by_one=True)
    ours_bleu = score(_ours_translations(checkpoint, sources, 4), references)["bleu"]
    their_bleu = score(theirs(4, sources), references)["bleu"]
    assert ours_bleu > 2, ("too little trained for the comparison to mean anything", ours_bleu, their_bleu)
    assert abs(their_bleu - ours_bleu) <= 0.5, (their_bleu, ours_bleu)


def _tokens(tokenizer, text: str) -> list[str]:
    """The text as the exported tokenizer encodes it, with the specials the recipe adds, cut to the context."""
    return tokenizer.convert_ids_to_tokens(tokenizer(text, truncation=True)["input_ids"])


TEXTS = ["Ein Hund rennt durch das Gras.", "Two men are playing chess in a park."]


@pytest.mark.parametrize("name", ["bert-mlm", "classify"])
def test_ctranslate2_encoder_computes_our_encoder_states(name, trained, tmp_path):
    """CTranslate2's BERT is BertModel: the encoder's last states (and the classifier's tanh pooler)."""
    import ctranslate2
    import numpy as np

    from yamlformer.recipes.trained import load_trained

    checkpoint, folder = trained(name)
    encoder = ctranslate2.Encoder(str(_ct2(folder, tmp_path / "ct2")), device="cpu", compute_type="float32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model, _, _ = load_trained(checkpoint, "cpu")
    for text in TEXTS:
        ids = tokenizer(text, truncation=True)["input_ids"]
        output = encoder.forward_batch([_tokens(tokenizer, text)], token_type_ids=[[0] * len(ids)])
        theirs = torch.from_numpy(np.array(output.last_hidden_state))[0]
        with torch.no_grad():
            ours = model.encoder(torch.tensor([ids]))[0]
            assert (theirs - ours).abs().max().item() < 1e-4, name
            if model.spec.head.type == "classification":
                pooled = torch.tanh(model.head.pooler(ours[0]))
                assert (torch.from_numpy(np.array(output.pooler_output))[0] - pooled).abs().max().item() < 1e-4


# -- ONNX Runtime through optimum ---------------------------------------------------------------------


def _onnx(folder: Path, out: Path, task: str) -> Path:
    """``optimum-cli export onnx --model FOLDER --task TASK OUT``."""
    exporters = pytest.importorskip(
        "optimum.exporters.onnx",
        reason="optimum's ONNX exporter (optimum-onnx) does not import here; it needs transformers<4.58",
        exc_type=ImportError,
    )
    exporters.main_export(str(folder), output=str(out), task=task, device="cpu")
    return out


@pytest.mark.parametrize("name", ["lm-stdlib", "shakespeare-char"])
def test_onnx_runtime_decodes_what_builder_generate_does(name, trained, tmp_path):
    checkpoint, folder = trained(name)
    onnx = _onnx(folder, tmp_path / "onnx", "text-generation-with-past")
    from optimum.onnxruntime import ORTModelForCausalLM

    model = ORTModelForCausalLM.from_pretrained(onnx)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    for prompt in PROMPTS[name]:
        ours = _ours_lm(checkpoint, prompt)
        inputs = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        theirs = out[0, inputs["input_ids"].shape[1] :].tolist()
        assert theirs == ours[: len(theirs)], (name, prompt)
        assert len(theirs) == NEW_TOKENS or theirs[-1] == tokenizer.eos_token_id


def test_onnx_runtime_translates_and_scores_what_builder_eval_does(trained, tmp_path):
    from yamlformer.recipes.tasks.translation.training import score

    checkpoint, folder = trained("translate-multi30k")
    onnx = _onnx(folder, tmp_path / "onnx", "text2text-generation-with-past")
    from optimum.onnxruntime import ORTModelForSeq2SeqLM

    model = ORTModelForSeq2SeqLM.from_pretrained(onnx)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    sources, references = _validation()

    def theirs(beams: int, texts: list[str]) -> list[str]:
        out = []
        for source in texts:
            inputs = tokenizer(source, return_tensors="pt")  # ends in </s>
            ids = model.generate(
                **inputs, num_beams=beams, length_penalty=1.0, max_new_tokens=_max_new(tokenizer, source)
            )
            out.append(tokenizer.decode(ids[0], skip_special_tokens=True))
        return out

    assert theirs(1, sources[:20]) == _ours_translations(checkpoint, sources[:20], 1, one_by_one=True)
    ours_bleu = score(_ours_translations(checkpoint, sources, 4), references)["bleu"]
    their_bleu = score(theirs(4, sources), references)["bleu"]
    assert abs(their_bleu - ours_bleu) <= 0.5, (their_bleu, ours_bleu)


@pytest.mark.parametrize("name,task", [("bert-mlm", "fill-mask"), ("classify", "text-classification")])
def test_onnx_runtime_computes_our_logits(name, task, trained, tmp_path):
    from yamlformer.recipes.trained import load_trained

    checkpoint, folder = trained(name)
    onnx = _onnx(folder, tmp_path / "onnx", task)
    from optimum.onnxruntime import ORTModelForMaskedLM, ORTModelForSequenceClassification

    auto = ORTModelForMaskedLM if task == "fill-mask" else ORTModelForSequenceClassification
    model = auto.from_pretrained(onnx)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ours_model, _, _ = load_trained(checkpoint, "cpu")
    inputs = tokenizer(TEXTS, return_tensors="pt", padding=True, truncation=True)
    theirs = model(**inputs).logits
    with torch.no_grad():
        ours = ours_model(inputs["input_ids"], inputs["attention_mask"])
    kept = inputs["attention_mask"] == 1 if task == "fill-mask" else slice(None)
    assert (theirs[kept] - ours[kept]).abs().max().item() < 1e-4
