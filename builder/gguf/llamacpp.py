"""llama.cpp itself, through ``llama-cpp-python`` (built from its sdist by ``.ci/llamacpp.sh``):
a GGUF file's tokenization, first-step logits and greedy decoding as llama.cpp computes them.
The ``llamacpp`` tests and ``benchmarks/gguf_llamacpp.py`` prove an export with these."""

from __future__ import annotations

import os
from pathlib import Path

#: why llama.cpp is missing, for a skip or an error
NOT_BUILT = "llama.cpp is not built: run .ci/llamacpp.sh (llama-cpp-python from its sdist, CPU)"


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError):  # OSError: the shared library does not load
        return False
    return True


class LlamaCpp:
    """One GGUF file loaded by llama.cpp (CPU), with its whole context's logits kept."""

    def __init__(self, path: str | Path, n_ctx: int, threads: int | None = None, lora: str | Path | None = None):
        """``lora``: a GGUF LoRA adapter llama.cpp applies over the model (scale 1)."""
        from llama_cpp import Llama  # optional: built by .ci/llamacpp.sh

        threads = threads or max(1, min(4, os.cpu_count() or 1))
        self.llm = Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=n_ctx,
            logits_all=True,
            n_threads=threads,
            verbose=False,
            lora_path=str(lora) if lora else None,
        )
        self.n_vocab = self.llm.n_vocab()

    def close(self) -> None:
        """Free the model now (not at interpreter exit, where llama-cpp-python's finalizer fails)."""
        self.llm.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        """llama.cpp's ids for ``text``: no BOS added (the file says whether one is: ours never);
        ``special``: read special tokens typed in the text as those tokens."""
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)

    def detokenize(self, ids: list[int]) -> str:
        return self.llm.detokenize(ids).decode("utf-8", errors="replace")

    def logits(self, ids: list[int]):
        """The logits after each of ``ids`` (numpy, ``(len(ids), n_vocab)``)."""
        self.llm.reset()
        self.llm.eval(ids)
        return self.llm.scores[: len(ids)].copy()

    def greedy(self, ids: list[int], new: int) -> list[int]:
        """``new`` tokens by argmax after ``ids`` (no stop token: as many as asked)."""
        self.llm.reset()
        self.llm.eval(ids)
        out: list[int] = []
        for _ in range(new):
            token = int(self.llm.scores[self.llm.n_tokens - 1].argmax())
            out.append(token)
            if len(out) < new:
                self.llm.eval([token])
        return out
