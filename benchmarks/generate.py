"""Decoding speed: ``builder generate``'s decode path against ``transformers``' ``generate``.

    python benchmarks/generate.py [--new-tokens 128] [--prompt 16] [--batches 1 8] [--repeats 7]
                                  [--threads N] [--json FILE]

For each family (a tiny Llama with grouped-query attention and RoPE, a tiny GPT-2 with learned
positions and a tied head), random weights are drawn with ``transformers``, saved with
``save_pretrained`` and imported with ``builder import-hf``; ours is loaded from the imported
folder the way ``builder generate FOLDER`` loads it (``build_model`` + ``load_weights``), and
``transformers`` loads the saved folder with ``from_pretrained``. Both decode greedily (fp32, CPU,
every token to ``--new-tokens``, no EOS) from the same random prompts. Ours runs twice: with
``generate(..., compile=True)`` (the one-token step over the static KV cache of ``yamlformer.blocks.cache``
compiled by ``torch.compile``, what ``builder generate --compile`` runs) and eagerly (the same
static cache, the step run op by op: ``generate``'s default); theirs with its default
``DynamicCache``.

In the same process, rotating the order every repeat, after one untimed warm-up call each (the
compiled one's warm-up compiles its step; those seconds, ``compile s``, are printed apart and
are in no rate): wall time of the whole ``generate`` call (prefill included), tokens/s =
``batch * new_tokens / seconds``, the median over ``--repeats`` calls and the ratio of the
medians to transformers'. Every run's tokens must be identical to transformers'; a difference
is printed with the logit margin of the token where they part (two near-equal logits can swap
under float rounding) and makes the exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's modules, also under python -P
from machine import machine  # benchmarks/machine.py

REPO = Path(__file__).resolve().parents[1]

#: the two families: transformers' config class and its fields (vocabulary as a small real model's)
FAMILIES = {
    "llama": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            vocab_size=8192,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=1024,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        ),
    ),
    "gpt2": (
        "GPT2LMHeadModel",
        "GPT2Config",
        dict(
            vocab_size=8192,
            n_embd=256,
            n_layer=4,
            n_head=8,
            n_positions=1024,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        ),
    ),
}


def make_models(family: str, folder: Path, seed: int = 0):
    """``(ours, theirs)`` on the same weights: drawn by transformers, saved, imported by us."""
    import torch
    import transformers

    from yamlformer.builder import build_model
    from yamlformer.builder.hf import import_hf, load_weights
    from yamlformer.builder.spec.loader import load_spec

    model_class, config_class, fields = FAMILIES[family]
    torch.manual_seed(seed)
    hf = getattr(transformers, model_class)(getattr(transformers, config_class)(**fields))
    hf.save_pretrained(folder / "hf")
    spec_path, weights_path = import_hf(folder / "hf", folder / "ours")
    ours = load_weights(build_model(load_spec(spec_path)), weights_path).eval()
    theirs = getattr(transformers, model_class).from_pretrained(folder / "hf").eval()
    return ours, theirs


def ours_generate(model, prompt, new_tokens: int):
    return model.generate(prompt, new_tokens)


def ours_compiled_generate(model, prompt, new_tokens: int):
    return model.generate(prompt, new_tokens, compile=True)


def theirs_generate(model, prompt, new_tokens: int):
    import torch

    return model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        num_beams=1,
        pad_token_id=0,
    )


def timed(fn, *args) -> tuple[float, object]:
    import torch

    with torch.inference_mode():
        start = time.perf_counter()
        out = fn(*args)
        return time.perf_counter() - start, out


def divergence(ours, theirs, prompt, a, b) -> str:
    """Where two greedy outputs part, with the logit margin there in our model."""
    import torch

    row, col = next((r, c) for r in range(a.shape[0]) for c in range(a.shape[1]) if a[r, c] != b[r, c])
    with torch.no_grad():
        logits = ours(a[row : row + 1, :col])[0, -1]
    top = logits.topk(2).values
    return (
        f"row {row} token {col - prompt.shape[1]}: ours {int(a[row, col])} theirs {int(b[row, col])}, "
        f"our top-2 logit margin {float(top[0] - top[1]):.2e}"
    )


def bench(family: str, batches: list[int], prompt_len: int, new_tokens: int, repeats: int) -> list[dict]:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = make_models(family, Path(tmp))
    vocab = FAMILIES[family][2]["vocab_size"]
    rows = []
    for batch in batches:
        prompt = torch.randint(0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(batch))
        runs = {
            "ours": (ours_compiled_generate, ours),
            "ours_eager": (ours_generate, ours),
            "transformers": (theirs_generate, theirs),
        }
        outputs = {"ours": timed(ours_compiled_generate, ours, prompt, new_tokens)[1]}  # warm-up: compiles
        compile_seconds = ours.last_compile_seconds
        outputs |= {who: timed(fn, model, prompt, new_tokens)[1] for who, (fn, model) in runs.items() if who != "ours"}
        same = {who: torch.equal(outputs[who], outputs["transformers"]) for who in ("ours", "ours_eager")}
        seconds = {who: [] for who in runs}
        names = list(runs)
        for r in range(repeats):
            for who in names[r % 3 :] + names[: r % 3]:
                fn, model = runs[who]
                seconds[who].append(timed(fn, model, prompt, new_tokens)[0])
        rate = {who: batch * new_tokens / statistics.median(s) for who, s in seconds.items()}
        row = {
            "family": family,
            "batch": batch,
            "prompt": prompt_len,
            "new_tokens": new_tokens,
            "ours_tokens_per_s": rate["ours"],
            "ours_eager_tokens_per_s": rate["ours_eager"],
            "transformers_tokens_per_s": rate["transformers"],
            "ratio": rate["ours"] / rate["transformers"],
            "eager_ratio": rate["ours_eager"] / rate["transformers"],
            "compile_seconds": compile_seconds,
            "identical": all(same.values()),
            "seconds": seconds,
        }
        differ = [
            f"{who}: " + divergence(ours, theirs, prompt, outputs[who], outputs["transformers"])
            for who in same
            if not same[who]
        ]
        if differ:
            row["first_difference"] = "; ".join(differ)
        rows.append(row)
        print(
            f"{family:6s} batch {batch:2d}: ours compiled {rate['ours']:8,.0f} tokens/s ({row['ratio']:.2f}x), "
            f"ours eager {rate['ours_eager']:8,.0f} ({row['eager_ratio']:.2f}x), transformers "
            f"{rate['transformers']:8,.0f} tokens/s; compile {compile_seconds:.1f} s; tokens "
            f"{'identical' if row['identical'] else 'DIFFER: ' + row['first_difference']}",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=["llama", "gpt2"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens (default 16)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row (default 128)")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls of each, rotating (default 7)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"machine: {machine()}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.1f}; started "
        f"{time.strftime('%Y-%m-%d %H:%M')}",
        flush=True,
    )
    rows = [
        row
        for family in args.families
        for row in bench(family, args.batches, args.prompt, args.new_tokens, args.repeats)
    ]
    print(
        "\n| model | batch | ours compiled tokens/s | ours eager tokens/s | transformers tokens/s | "
        "compiled ratio | eager ratio | compile s | tokens |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for row in rows:
        print(
            f"| {row['family']} | {row['batch']} | {row['ours_tokens_per_s']:,.0f} | "
            f"{row['ours_eager_tokens_per_s']:,.0f} | {row['transformers_tokens_per_s']:,.0f} | "
            f"{row['ratio']:.2f}x | {row['eager_ratio']:.2f}x | {row['compile_seconds']:.1f} | "
            f"{'identical' if row['identical'] else 'differ'} |"
        )
    result = {"machine": machine(), "threads": torch.get_num_threads(), "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(
        json.dumps(
            {k: v for k, v in result.items() if k != "rows"}
            | {
                "ratios": {f"{r['family']}-b{r['batch']}": round(r["ratio"], 3) for r in rows},
                "eager_ratios": {f"{r['family']}-b{r['batch']}": round(r["eager_ratio"], 3) for r in rows},
            }
        )
    )
    return 0 if all(row["identical"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
