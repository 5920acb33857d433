"""llama.cpp itself, through ``llama-cpp-python`` (built from its sdist by ``.ci/llamacpp.sh``):
a GGUF file's tokenization, first-step logits and greedy decoding as llama.cpp computes them, and
llama.cpp's own converter (``convert_hf_to_gguf.py``, vendored in the same sdist) run on a
``builder export-hf`` folder. The ``llamacpp`` tests and ``benchmarks/gguf_llamacpp.py`` prove an
export with these."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from collections.abc import Mapping
from pathlib import Path

#: why llama.cpp is missing, for a skip or an error
NOT_BUILT = "llama.cpp is not built: run .ci/llamacpp.sh (llama-cpp-python from its sdist, CPU)"
#: the llama-cpp-python release .ci/llamacpp.sh builds (LLAMACPP_VERSION there and here)
VERSION = "0.3.36"
#: why llama.cpp's converter is missing, for a skip or an error
NO_SDIST = (
    "llama-cpp-python's sdist (which vendors llama.cpp's convert_hf_to_gguf.py) is not in the cache: "
    "run .ci/llamacpp.sh, or set LLAMACPP_SDIST"
)
#: what the converter needs of the sdist's vendor/llama.cpp: the script, its modules, its gguf-py
_CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


class ConvertError(RuntimeError):
    """llama.cpp's converter refused a folder: its last line of output (the reason it gives)."""


def _version() -> str:
    return os.environ.get("LLAMACPP_VERSION", VERSION)


def cache_dir() -> Path:
    """Where .ci/llamacpp.sh keeps the sdist and its wheel (``LLAMACPP_CACHE``/<version>)."""
    root = os.environ.get("LLAMACPP_CACHE") or Path.home() / ".cache" / "yamlformer-llamacpp"
    return Path(root) / _version()


def sdist() -> Path | None:
    """llama-cpp-python's sdist as .ci/llamacpp.sh left it (``LLAMACPP_SDIST`` names another), or None."""
    path = Path(os.environ.get("LLAMACPP_SDIST") or cache_dir() / f"llama_cpp_python-{_version()}.tar.gz")
    return path if path.is_file() else None


def converter() -> Path | None:
    """llama.cpp's ``convert_hf_to_gguf.py`` (with its ``conversion`` modules and ``gguf-py``),
    unpacked once from the sdist beside it in the cache; None without the sdist."""
    source = sdist()
    if source is None:
        return None
    folder = cache_dir() / f"converter-{source.stem.removesuffix('.tar')}"
    script = folder / _CONVERTER_PARTS[0]
    if script.is_file():
        return script
    partial = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    with tarfile.open(source) as archive:
        prefix = f"{archive.getmembers()[0].name.split('/')[0]}/vendor/llama.cpp/"
        members = []
        for member in archive.getmembers():
            inner = member.name.removeprefix(prefix)
            if (
                member.name.startswith(prefix)
                and inner.startswith(_CONVERTER_PARTS)
                and (member.isfile() or member.isdir())
            ):
                member.name = inner
                members.append(member)
        archive.extractall(partial, members=members, filter="data")
    os.replace(partial, folder)  # whole or not at all: a second process finds a complete copy
    return script


def convert(folder: str | Path, out: str | Path, outtype: str = "f32", timeout: float = 600) -> Path:
    """``python convert_hf_to_gguf.py FOLDER --outfile OUT --outtype OUTTYPE``, as a user runs it
    (its own ``gguf-py``; this Python's torch, transformers and sentencepiece); returns ``out``, or
    :class:`ConvertError` with the converter's last line."""
    script = converter()
    if script is None:
        raise ConvertError(NO_SDIST)
    command = [sys.executable, str(script), str(folder), "--outfile", str(out), "--outtype", outtype]
    # its modules beside it, where Python puts them on the path (also under PYTHONSAFEPATH, which drops that)
    path = os.pathsep.join(filter(None, [str(script.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()] or [f"exit status {done.returncode}"]
        raise ConvertError(lines[-1].strip())
    return Path(out)


def load_overrides(path: str | Path, tokenizer: Mapping | None) -> dict[str, bool]:
    """What a converted file leaves to llama.cpp's defaults where ours differs, as llama.cpp's
    ``--override-kv`` (``kv_overrides`` here): a SentencePiece vocabulary without
    ``tokenizer.ggml.add_space_prefix`` (the converter's qwen2, qwen3 and phi3 classes write none)
    gets a space put first by llama.cpp; ours puts one only with ``add_dummy_prefix``."""
    import gguf  # optional: the gguf extra

    from yamlformer.builder.gguf.vocab import _proto

    fields = gguf.GGUFReader(str(path)).fields
    spm = "tokenizer.ggml.model" in fields and fields["tokenizer.ggml.model"].contents() == "llama"
    if not spm or "tokenizer.ggml.add_space_prefix" in fields or not tokenizer:
        return {}
    if tokenizer.get("type") != "sentencepiece":
        return {}
    return {"tokenizer.ggml.add_space_prefix": bool(_proto(tokenizer).normalizer_spec.add_dummy_prefix)}


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError):  # OSError: the shared library does not load
        return False
    return True


class LlamaCpp:
    """One GGUF file loaded by llama.cpp (CPU), with its whole context's logits kept."""

    def __init__(
        self,
        path: str | Path,
        n_ctx: int,
        threads: int | None = None,
        lora: str | Path | None = None,
        overrides: Mapping[str, bool | int | float | str] | None = None,
    ):
        """``lora``: a GGUF LoRA adapter llama.cpp applies over the model (scale 1); ``overrides``:
        metadata read in place of the file's (llama.cpp's ``--override-kv``)."""
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
            kv_overrides=dict(overrides) if overrides else None,
        )
        self.n_vocab = self.llm.n_vocab()

    def close(self) -> None:
        """Free the model now (not at interpreter exit, where llama-cpp-python's finalizer fails)."""
        self.llm.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def tokenize(self, text: str, special: bool = False, add_special: bool = False) -> list[int]:
        """llama.cpp's ids for ``text``; ``special``: read special tokens typed in the text as those
        tokens; ``add_special``: add the BOS/EOS the file says to add, as llama.cpp's tools do for a
        prompt (else none)."""
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=special)

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
