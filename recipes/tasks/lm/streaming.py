"""Decoding text from a model and a tokenizer, streamed as the tokens come."""

from __future__ import annotations

from typing import TextIO

import torch

from yamlformer.recipes.errors import RecipeError


class TextStreamer:
    """Writes each new token's text as it arrives: the decoded suffix of everything so far, held
    back while it ends in a partial UTF-8 character (byte-fallback pieces)."""

    def __init__(self, tokenizer, out: TextIO, prompt_ids: list[int]):
        self.tokenizer, self.out = tokenizer, out
        self.prompt_ids = list(prompt_ids)
        self.ids: list[int] = []
        self.written = 0
        self.prompt_chars = len(tokenizer.decode(self.prompt_ids))

    def __call__(self, tokens: torch.Tensor) -> None:
        self.ids.extend(int(t) for t in tokens.reshape(-1)[:1])
        text = self.tokenizer.decode(self.prompt_ids + self.ids)[self.prompt_chars :]
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.written :])
        self.out.flush()
        self.written = len(text)


@torch.no_grad()
def stream(
    model,
    tokenizer,
    prompt: str,
    out: TextIO,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    num_beams: int = 1,
    generator: torch.Generator | None = None,
    compile: bool = False,
) -> list[int]:
    """Continue ``prompt``, writing text to ``out`` as it is decoded; returns the new token ids.

    Past the model's ``max_seq_len`` the context slides: it is re-encoded from its last half.
    ``compile``: decode with ``generate(..., compile=True)`` (a compiled one-token step).
    """
    device = next(model.parameters()).device
    max_len = model.spec.max_seq_len if getattr(model, "spec", None) is not None else None
    ids = tokenizer.encode(prompt)
    if not ids:
        raise RecipeError("the prompt encodes to no tokens; give a non-empty --prompt")
    new: list[int] = []
    limit = tokenizer.vocab_size  # never an id past it (an embedding's padding rows): it would not decode
    sampling = {"temperature": temperature or None, "top_k": top_k, "top_p": top_p} if temperature else {}
    while len(new) < max_new_tokens:
        keep = max(1, max_len // 2) if max_len and len(ids) >= max_len else len(ids)
        context = ids[-keep:]
        room = (max_len - len(context)) if max_len else max_new_tokens
        count = min(max_new_tokens - len(new), room)
        input_ids = torch.tensor([context], device=device)  # (1, seq)
        if num_beams > 1:
            out_ids = model.generate(input_ids, count, num_beams=num_beams, compile=compile, vocab_size=limit)
            out_ids = out_ids[0, len(context) :].tolist()
            out.write(tokenizer.decode(ids + out_ids)[len(tokenizer.decode(ids)) :])
        else:
            streamer = TextStreamer(tokenizer, out, ids)
            out_ids = model.generate(
                input_ids, count, streamer=streamer, generator=generator, compile=compile, vocab_size=limit, **sampling
            )
            out_ids = out_ids[0, len(context) :].tolist()
            tail = tokenizer.decode(ids + out_ids)[len(tokenizer.decode(ids)) :]
            out.write(tail[streamer.written :])
        out.flush()
        ids += out_ids
        new += out_ids
    return new
