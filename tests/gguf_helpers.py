"""What the GGUF tests (and benchmarks/gguf_llamacpp.py) compare llama.cpp with: our model's
greedy tokens as ``builder generate --temperature 0`` decodes them, and its first-step logits."""

from __future__ import annotations

import io

import torch

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


def ours_greedy(model, tokenizer, prompt: str, new: int) -> list[int]:
    """The ids ``builder generate --temperature 0 --max-new-tokens new`` decodes (its own loop)."""
    from yamlformer.recipes.tasks.lm.streaming import stream

    return stream(model, tokenizer, prompt, io.StringIO(), new, temperature=0.0)


@torch.no_grad()
def ours_logits(model, ids: list[int]) -> torch.Tensor:
    """Our model's logits after the last of ``ids`` (float32)."""
    return model(torch.tensor([ids]))[0, -1].float()
