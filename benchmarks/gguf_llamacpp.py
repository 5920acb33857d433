"""GGUF export against llama.cpp itself: per family, whether ``builder export-gguf`` converts, whether
llama.cpp's tokens and greedy decoding equal ours, the largest first-step logit difference, and
decode tokens/s of llama.cpp against ``builder generate`` on the same CPU in the same run.

    .ci/llamacpp.sh    # llama.cpp (llama-cpp-python from its sdist), once
    python benchmarks/gguf_llamacpp.py [--families llama gemma2 ...] [--outtypes f32 q8_0]
                                       [--new-tokens 64] [--repeats 5] [--threads N] [--json FILE]
    python benchmarks/gguf_llamacpp.py --converter [...]   # export-hf + llama.cpp's convert_hf_to_gguf.py

Each family is a tiny model the LM recipe trains 40 steps (sentencepiece BPE, 400 pieces: the
``llamacpp`` tests' models, ``tests/gguf_helpers.py``), exported with ``builder export-gguf``.
Tokens: llama.cpp's tokenizer on the text of 7 prompts against ours. Greedy: 24 tokens after
each prompt, llama.cpp's argmax loop against ``builder generate --temperature 0``'s decoding
(``yamlformer.recipes.tasks.lm.streaming.stream``). ``--converter``: each family exported with
``builder export-hf`` and converted by llama.cpp's own ``convert_hf_to_gguf.py`` from
llama-cpp-python's sdist (``yamlformer.builder.gguf.llamacpp.convert``), loaded with the
``--override-kv`` that ``load_overrides`` names, its prompts tokenized as llama.cpp's tools do
(the BOS the file says to add); a refusal is the converter's last line. Logits: the largest
|difference| after each prompt. Speed: ``--new-tokens`` greedy tokens after the first prompt, wall
time of the whole call (prefill included), both on ``--threads`` threads, alternating which runs first, median over
``--repeats`` after one untimed warm-up each; ours is eager (``builder generate``'s default).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's modules, also under python -P
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the llamacpp tests' models
from machine import emit, machine  # benchmarks/machine.py

#: families llama.cpp has that export-gguf refuses (the spec, export-gguf's arguments): their one line
REFUSED = {
    "mistral (sliding window)": ("tiny/llama", ["--set", "decoder.attention.sliding_window=16"]),
    "phi3 (a window below max_seq_len)": ("tiny/phi3", ["--family", "phi3"]),
    "deepseek_v2 (V2's group routing)": ("tiny/deepseek-v2", []),
    "gpt_oss (YaRN's fractional ramp ends)": ("tiny/gpt-oss", []),
    "llama4 (chunks of 8)": ("tiny/llama4", []),
}


def main(argv: list[str] | None = None) -> int:
    import torch
    from gguf_helpers import MODELS, PROMPTS, ours_greedy, ours_logits, train

    from yamlformer.builder.cli import main as builder
    from yamlformer.builder.gguf.llamacpp import NOT_BUILT, ConvertError, LlamaCpp, available, convert, load_overrides
    from yamlformer.recipes.tasks.lm.streaming import stream
    from yamlformer.recipes.trained import load_trained

    models = MODELS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--converter", action="store_true", help="export-hf, then llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--families", nargs="+", default=list(models), choices=list(models))
    parser.add_argument("--outtypes", nargs="+", default=["f32", "q8_0"], choices=["f32", "f16", "bf16", "q8_0"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not available():
        print(NOT_BUILT, file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    print(f"# {machine()}; {args.threads} threads; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family, (spec, extra) in ({} if args.converter else REFUSED).items():
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                code = builder(["export-gguf", spec, "--init", "-o", f"{tmp}/x.gguf", *extra])
            rows.append({"family": family, "outtype": "f32", "converts": code == 0, "why": err.getvalue().strip()})
            print(_line(rows[-1]), flush=True)
        cache = Path(tmp) / "cache"
        for family in args.families:
            spec, overrides, export_args = models[family]
            folder = Path(tmp) / family
            folder.mkdir()
            checkpoint = train(folder, cache, spec, overrides)
            model, tokenizer, meta = load_trained(checkpoint, "cpu")
            if args.converter:
                hf = folder / "hf"
                if builder(["export-hf", str(checkpoint), "-o", str(hf), *export_args]) != 0:
                    return 1
            for outtype in args.outtypes:
                out = folder / f"{outtype}.gguf"
                row = {"family": family, "outtype": outtype}
                rows.append(row)
                if args.converter:
                    try:
                        row["converts"] = convert(hf, out, outtype) == out
                    except ConvertError as exc:
                        row.update(converts=False, why=str(exc))
                else:
                    code = builder(["export-gguf", str(checkpoint), "-o", str(out), "--outtype", outtype, *export_args])
                    row["converts"] = code == 0
                if not row["converts"]:
                    print(_line(row), flush=True)
                    continue
                overrides = load_overrides(out, meta.get("tokenizer")) if args.converter else None
                if overrides:
                    row["overrides"] = overrides
                with LlamaCpp(out, n_ctx=model.spec.max_seq_len, threads=args.threads, overrides=overrides) as runtime:
                    tokens = greedy = 0
                    worst = 0.0
                    for prompt in PROMPTS:
                        ids = tokenizer.encode(prompt)
                        tokens += runtime.tokenize(prompt, add_special=args.converter) == ids
                        theirs = torch.from_numpy(runtime.logits(ids)[-1])
                        worst = max(worst, (theirs - ours_logits(model, ids)[: runtime.n_vocab]).abs().max().item())
                        greedy += runtime.greedy(ids, 24) == ours_greedy(model, tokenizer, prompt, 24)
                    ids = tokenizer.encode(PROMPTS[0])
                    runs = {
                        "llama.cpp": lambda: runtime.greedy(ids, args.new_tokens),
                        "ours": lambda: stream(model, tokenizer, PROMPTS[0], io.StringIO(), args.new_tokens),
                    }
                    seconds = _timed(runs, args.repeats)
                row.update(
                    tokens=f"{tokens}/{len(PROMPTS)}",
                    greedy=f"{greedy}/{len(PROMPTS)}",
                    max_logit_diff=worst,
                    llamacpp_tok_s=args.new_tokens / seconds["llama.cpp"],
                    ours_tok_s=args.new_tokens / seconds["ours"],
                )
                row["ratio"] = row["llamacpp_tok_s"] / row["ours_tok_s"]
                print(_line(row), flush=True)
    print()
    print(
        "| family | outtype | converts | tokens equal | greedy 24 equal | max logit diff "
        "| llama.cpp tok/s | builder generate tok/s | llama.cpp / ours |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(_line(row))
    return emit({"benchmark": "gguf_llamacpp", "threads": args.threads, "rows": rows}, args.json)


def _timed(runs: dict, repeats: int) -> dict[str, float]:
    """The median seconds of each call, after one untimed warm-up, alternating the order."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for i in range(repeats):
        for name in order if i % 2 == 0 else reversed(order):
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _line(row: dict) -> str:
    if not row["converts"]:
        why = row.get("why", "").removeprefix("error: ").split(";")[0]
        return f"| {row['family']} | {row['outtype']} | no: {why} | | | | | | |"
    return (
        f"| {row['family']} | {row['outtype']} | yes | {row['tokens']} | {row['greedy']} | {row['max_logit_diff']:.1e} "
        f"| {row['llamacpp_tok_s']:,.0f} | {row['ours_tok_s']:,.0f} | {row['ratio']:.1f}x |"
    )


if __name__ == "__main__":
    raise SystemExit(main())
