"""What the GGUF tests (and benchmarks/gguf_llamacpp.py) compare llama.cpp with: our model's
greedy tokens as ``builder generate --temperature 0`` decodes them, and its first-step logits."""

from __future__ import annotations

import copy
import io
from pathlib import Path

import torch
from recipe_helpers import TINY_SPEC, tiny_recipe

#: code prompts (the models are trained on Python's source): words after spaces and at the start,
#: indentation, digits, quotes, a non-ASCII character (byte fallback)
PROMPTS = [
    "def parse(",
    "class Stack:\n    def push(self, item):\n        ",
    "import os\nfor i in range(10):\n",
    "    return x  # the result",
    "print('héllo wörld')\n",
    'if __name__ == "__main__":\n    main()',
    "x = {1: 'a', 2: [3, 4]}",
]


#: greedy tokens compared after each prompt
NEW = 24


def ours_greedy(model, tokenizer, prompt: str, new: int) -> list[int]:
    """The ids ``builder generate --temperature 0 --max-new-tokens new`` decodes (its own loop)."""
    from yamlformer.recipes.tasks.lm.streaming import stream

    return stream(model, tokenizer, prompt, io.StringIO(), new, temperature=0.0)


@torch.no_grad()
def ours_logits(model, ids: list[int]) -> torch.Tensor:
    """Our model's logits after the last of ``ids`` (float32)."""
    return model(torch.tensor([ids]))[0, -1].float()


def same_as_ours(
    model,
    tokenizer,
    gguf: Path,
    tolerance: float,
    special: bool = False,
    lora: Path | None = None,
    overrides: dict | None = None,
    add_special: bool = False,
) -> float:
    """llama.cpp's tokens for each prompt (text in), its greedy tokens and its first-step logits
    against our model's (``lora``: with that adapter applied over ``gguf``; ``overrides``: llama.cpp's
    ``--override-kv``; ``add_special``: tokenized as llama.cpp's tools do a prompt, with whatever
    BOS the file says to add); returns the largest logit difference, asserted under ``tolerance``."""
    from yamlformer.builder.gguf.llamacpp import LlamaCpp

    worst = 0.0
    with LlamaCpp(gguf, n_ctx=model.spec.max_seq_len, lora=lora, overrides=overrides) as runtime:
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt)
            assert runtime.tokenize(prompt, special, add_special) == ids, prompt
            theirs = torch.from_numpy(runtime.logits(ids)[-1])
            ours = ours_logits(model, ids)[: runtime.n_vocab]
            worst = max(worst, (theirs - ours).abs().max().item())
            assert runtime.greedy(ids, NEW) == ours_greedy(model, tokenizer, prompt, NEW), prompt
    assert worst < tolerance, worst
    return worst


def prove(source: Path, gguf: Path, capsys, tolerance: float, special: bool = False, **runtime_options) -> float:
    """:func:`same_as_ours` for a checkpoint (or model folder), and ``builder generate --temperature 0``'s
    text against what llama.cpp decodes; ``runtime_options``: ``same_as_ours``' ``overrides``,
    ``add_special``. Returns the largest logit difference."""
    from yamlformer.builder.cli import main
    from yamlformer.builder.gguf.llamacpp import LlamaCpp
    from yamlformer.recipes.trained import load_trained

    model, tokenizer, _ = load_trained(source, "cpu", folders=True)
    worst = same_as_ours(model, tokenizer, gguf, tolerance, special, **runtime_options)
    # the command's own text: `builder generate --temperature 0` prints what llama.cpp decodes
    prompt = PROMPTS[0]
    assert main(["generate", str(source), "--prompt", prompt, "--max-new-tokens", str(NEW), "--temperature", "0"]) == 0
    ids = tokenizer.encode(prompt)
    overrides = runtime_options.get("overrides")
    with LlamaCpp(gguf, n_ctx=model.spec.max_seq_len, overrides=overrides) as runtime:
        new = runtime.greedy(ids, NEW)
    expected = prompt + tokenizer.decode(ids + new)[len(tokenizer.decode(ids)) :]
    assert capsys.readouterr().out == expected + "\n"
    return worst


#: the trained model: a Llama layout with grouped-query attention and a byte-fallback BPE
LLAMA = {
    **copy.deepcopy(TINY_SPEC),
    "name": "tiny-llama-gqa",
    "d_model": 64,
    "max_seq_len": 96,
    "decoder": {
        "n_layers": 2,
        "attention": {"n_heads": 4, "n_kv_heads": 2},
        "ffn": {"type": "glu", "activation": "silu", "hidden_dim": 128},
        "norm": {"type": "rmsnorm", "eps": 1e-5},
    },
}


#: each family llama.cpp runs, as a zoo spec (and overrides) the LM recipe trains a few dozen steps
FAMILIES = {
    "qwen2": ("tiny/llama", {"decoder": {"attention": {"qkv_bias": True}}}),
    "qwen3": ("tiny/qwen3", {}),
    "qwen3_moe": ("tiny/qwen3-moe", {}),
    "mixtral": ("tiny/mixtral", {}),
    "olmo2": ("tiny/olmo2", {}),
    "gpt_neox": ("tiny/neox", {}),
    "gpt2": ("tiny/gpt2", {"position": {"max_positions": 128}}),
    "gemma2": ("tiny/gemma2", {}),  # sliding windows of 16 on alternate layers, softcaps, sandwich norms
    "gemma3_text": ("tiny/gemma3", {}),  # windows 5 of 6 layers, a local RoPE base, q/k norms
    # fused qkv and gate/up; a window as long as the context (128), which masks nothing
    "phi3": ("tiny/phi3", {"decoder": {"attention": {"sliding_window": 128}}}),
    # ALiBi over 6 heads (not a power of two: 4 slopes of ALiBi's series, 2 of twice its count)
    "mpt": ("tiny/alibi", {"d_model": 96, "decoder": {"attention": {"n_heads": 6}, "ffn": {"hidden_dim": 384}}}),
    # latent attention (kv_lora_rank 32, RoPE on 8 of 24 key dims), a dense layer, then routed and
    # shared experts; ungrouped routing and plain RoPE (V2's group maxima and YaRN are refused)
    "deepseek_v2": (
        "tiny/deepseek-v2",
        {"position": {"scaling": None}, "decoder": {"ffn": {"n_groups": 1, "topk_groups": 1}}},
    ),
    # sinks, biased attention, a window of 8 on even layers, biased experts with the clamped SwiGLU
    "gpt_oss": ("tiny/gpt-oss", {"position": {"scaling": None}}),
    # chunked RoPE layers with an L2 QK-norm, a NoPE layer with temperature tuning, two of four
    # sigmoid experts weighting their input plus a shared one on odd layers, dense even layers,
    # Llama 3's RoPE scaling; chunk and temperature as llama.cpp fixes them (8192), which over
    # this context mask and scale nothing (both are proven past 8192 in test_gguf_llamacpp.py)
    "llama4_text": (
        "tiny/llama4",
        {
            "decoder": {
                "attention": {"chunk_size": 128},
                "ffn": {"top_k": 2},
                "overrides": [
                    {"layers": "0::2", "ffn": {"type": "glu", "activation": "silu", "hidden_dim": 96}},
                    {
                        "layers": "3::4",
                        "attention": {
                            "rope": False,
                            "chunk_size": None,
                            "qk_norm": None,
                            "temperature_tuning": {"floor_scale": 8192, "scale": 0.1},
                        },
                    },
                ],
            }
        },
    ),
}
#: export-gguf's arguments for a family that is not export-hf's first choice for its spec
EXPORT_ARGS = {"phi3": ["--family", "phi3"]}


#: every model the GGUF tests and benchmarks/gguf_llamacpp.py export (export-gguf, or export-hf for
#: llama.cpp's own converter): the spec, its overrides and the export's arguments. Mistral without
#: a window (llama.cpp's llama architecture has none, and the converter writes none for mistral)
MODELS = {
    "llama": (LLAMA, {}, []),
    "mistral": ("tiny/llama", {}, ["--family", "mistral"]),
    **{name: (spec, overrides, EXPORT_ARGS.get(name, [])) for name, (spec, overrides) in FAMILIES.items()},
}
#: what the converter says for a family whose converter class reads only a byte-level BPE
#: tokenizer.json (``_set_vocab_gpt2``), which it identifies by a hash of its ids on a fixed text
#: looked up in a table of published models' tokenizers: ours (SentencePiece) is in none
NOT_RECOGNIZED = "BPE pre-tokenizer was not recognized"
#: the families the converter refuses, and what it says (a regex): gpt_neox stops before the
#: tokenizer under transformers 5 (its AutoConfig moves ``rotary_pct`` into ``rope_parameters``);
#: mpt's class is registered under MosaicML's ``MPTForCausalLM``, not transformers' ``MptForCausalLM``
NOT_CONVERTED = {
    "gpt2": NOT_RECOGNIZED,
    "olmo2": NOT_RECOGNIZED,
    "qwen3_moe": NOT_RECOGNIZED,
    "deepseek_v2": NOT_RECOGNIZED,
    "gpt_oss": NOT_RECOGNIZED,
    "llama4_text": NOT_RECOGNIZED,
    "gpt_neox": f"KeyError: 'rotary_pct'|{NOT_RECOGNIZED}",
    "mpt": "Model MptForCausalLM is not supported",
}


def stdlib_text(limit: int) -> str:
    from yamlformer.recipes.data.corpus import read_corpus
    from yamlformer.recipes.recipe.sections import DataSection

    return read_corpus(DataSection(sources=["python-stdlib"], max_bytes=limit), None).text


def train(tmp: Path, cache: Path, spec, overrides: dict | None = None, tokenizer: dict | None = None) -> Path:
    """A checkpoint of the LM recipe trained a few dozen steps with a sentencepiece BPE tokenizer
    (trained once: ``cache`` keeps it for every family)."""
    from yamlformer.recipes.training.run import run

    path = tiny_recipe(
        tmp,
        model={"spec": spec, "overrides": {"max_seq_len": 128, **(overrides or {})}},
        data={"cache_dir": str(cache)},
        tokenizer=tokenizer or {"type": "sentencepiece", "model_type": "bpe", "vocab_size": 400},
        trainer={"max_steps": 40, "val_check_interval": 40, "checkpoint_every_n_steps": 40},
    )
    return Path(run(path, samples=False)["last"])
