"""LoRA and DoRA fine-tuning against ``peft`` on ``transformers``, side by side in one script run.

The same base (a seeded Llama-style model: built here, exported to a ``transformers`` folder), the
same adapters at the start (ours exported as a PEFT folder and loaded by ``PeftModel`` as
trainable: every factor equal), the same data in the same order, the same plain training loop
(AdamW, fp32, no weight decay, no dropout) for ``--steps`` steps. Each side runs in a fresh process
of its own (its peak RSS is its own). Printed per adapter type: the largest difference of the
per-step losses (they must agree to ``--tolerance``), tokens/s (median over the steps after
``--warmup``) and the training peak memory above what the process held before its first step (on
the CPU its RSS; with ``--device cuda`` ``torch.cuda.max_memory_allocated``), each as a ratio ours /
peft, the median over ``--seeds`` runs.

``--data instructions`` (the default: what fine-tuning trains on) draws seeded instruction records,
a prompt of 32-160 tokens and an answer of 16-96 (uniform), the loss on the answers only. Ours
trains as ``task: sft`` does: records packed whole into rows of ``--seq-len`` with document
masking (``yamlformer.recipes.data.instructions.Rows``), the head projecting the answers' positions
only (``scored``, ``yamlformer.blocks.heads``). The plain loop gets the records of each of our
steps, in order, padded to the longest (``attention_mask``, ``labels`` -100 on prompts and padding:
a ``transformers`` model's own loss), so both sides see the same tokens and the same targets in
each step; tokens/s counts the records' tokens (no padding) on both sides. ``--data random`` is the
control: windows of random tokens, every position scored, the same work on both sides.

    nice python benchmarks/lora_vs_peft.py                       # LoRA and DoRA, r16 on q,k,v,o
    nice python benchmarks/lora_vs_peft.py --targets all-linear --seeds 3
    nice python benchmarks/lora_vs_peft.py --data random         # equal work: whole windows
    python benchmarks/lora_vs_peft.py --quick                    # a few steps of a smaller model
    python benchmarks/lora_vs_peft.py --device cuda --seeds 3    # on a GPU (fp32 both sides)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "benchmarks"))

#: the base: a small Llama (GQA, SwiGLU, RMSNorm, RoPE), untied so it exports as LlamaForCausalLM
SPEC = {
    "name": "bench-llama",
    "architecture": "decoder-only",
    "vocab_size": 4096,
    "d_model": 256,
    "max_seq_len": 256,
    "position": {"type": "rope"},
    "decoder": {
        "n_layers": 4,
        "attention": {"n_heads": 8, "n_kv_heads": 4},
        "ffn": {"type": "glu", "activation": "silu", "hidden_dim": 688},
        "norm": {"type": "rmsnorm", "eps": 1e-5},
    },
    "head": {"type": "lm"},
}
QUICK = {"d_model": 64, "hidden_dim": 172, "n_layers": 2, "vocab_size": 512}


def spec_for(args, kind: str) -> dict:
    spec = {**SPEC, "decoder": {**SPEC["decoder"], "ffn": dict(SPEC["decoder"]["ffn"])}}
    if args.quick:
        spec.update(d_model=QUICK["d_model"], vocab_size=QUICK["vocab_size"])
        spec["decoder"]["n_layers"] = QUICK["n_layers"]
        spec["decoder"]["ffn"]["hidden_dim"] = QUICK["hidden_dim"]
    targets = "all-linear" if args.targets == "all-linear" else args.targets.split(",")
    spec["adapters"] = {"type": kind, "rank": args.rank, "alpha": 2.0 * args.rank, "targets": targets}
    return spec


def prepare(args, kind: str, folder: Path, seed: int) -> None:
    """The base as a transformers folder, our initial adapters as a PEFT folder, our model's
    starting state: what both sides start from."""
    import torch

    from yamlformer.builder import build_model
    from yamlformer.builder.hf import to_hf
    from yamlformer.builder.hf.peft import to_peft
    from yamlformer.builder.hf.writer import choose_family
    from yamlformer.builder.spec.schema import ModelSpec

    spec = ModelSpec.model_validate(spec_for(args, kind))
    model = build_model(spec, init_seed=seed)
    with torch.no_grad():  # adapters as training leaves them, so the first steps already differ from the base
        generator = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0.0, 0.01, generator=generator)
    state = model.state_dict()
    to_hf(
        spec.model_copy(update={"adapters": None}),
        {k: v for k, v in state.items() if ".adapter." not in k},
        folder / "base",
    )
    to_peft(spec, state, folder / "peft", choose_family(spec)[0])
    torch.save({"spec": spec.model_dump(mode="json"), "state": state}, folder / "ours.pt")


def seq_len(args) -> int:
    return 64 if args.quick else args.seq_len


def batches(args, vocab: int, seed: int) -> list[dict]:
    """Each step's data for both sides: ``ours`` (our model's arguments) and ``targets`` (of its
    logits), ``peft`` (the ``transformers`` model's: ``input_ids``, ``attention_mask``) and
    ``peft_targets`` (``IGNORE`` on prompts and padding), ``tokens`` (the records' tokens, the same
    on both sides)."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    seq = seq_len(args)
    if args.data == "random":
        steps = []
        for _ in range(args.steps):
            ids = torch.randint(0, vocab, (args.batch, seq + 1), generator=generator)
            inputs, targets = ids[:, :-1], ids[:, 1:]
            steps.append(
                {
                    "ours": {"input_ids": inputs},
                    "targets": targets,
                    "peft": {"input_ids": inputs},
                    "peft_targets": targets,
                    "tokens": inputs.numel(),
                }
            )
        return steps
    return instruction_batches(args, vocab, seq, generator)


def instruction_batches(args, vocab: int, seq: int, generator) -> list[dict]:
    """``--data instructions`` (module doc): our packed rows, and the same records padded."""
    import numpy as np
    import torch

    from yamlformer.blocks.heads import IGNORE
    from yamlformer.recipes.data.chat import Encoded
    from yamlformer.recipes.data.instructions import Rows

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=generator))

    pad = vocab - 1  # no record's token
    scale = seq / 256  # the lengths of a 256-token row, scaled to --quick's shorter one
    records = []
    for _ in range(args.steps * args.batch * 3):  # rows hold 1-3 records: more than enough
        prompt, answer = draw(round(32 * scale), round(160 * scale)), draw(round(16 * scale), round(96 * scale))
        ids = torch.randint(0, pad, (prompt + answer,), generator=generator).numpy()
        records.append(Encoded(ids, np.arange(prompt + answer) >= prompt, [prompt]))
    rows = Rows(records, seq, pad=pad, packing=True)
    steps = []
    for step in range(args.steps):
        index = np.arange(step * args.batch, (step + 1) * args.batch)
        inputs, targets, documents = rows.batch(index)
        mine = [records[i] for r in index for i in rows.records[r]]  # the step's records, row by row
        longest = max(len(r) for r in mine) - 1
        ids = torch.zeros(len(mine), longest, dtype=torch.long)
        labels = torch.full((len(mine), longest), IGNORE, dtype=torch.long)
        mask = torch.zeros(len(mine), longest, dtype=torch.long)
        for i, record in enumerate(mine):
            n = len(record) - 1
            ids[i, :n] = torch.from_numpy(record.ids[:-1])
            mask[i, :n] = 1
            labels[i, :n] = torch.from_numpy(np.where(record.trained[1:], record.ids[1:], IGNORE))
        assert int((labels != IGNORE).sum()) == int((targets != IGNORE).sum()), "different targets"
        steps.append(
            {
                "ours": {"input_ids": inputs, "document_ids": documents, "scored": targets != IGNORE},
                "targets": targets[targets != IGNORE],
                "peft": {"input_ids": ids, "attention_mask": mask},
                "peft_targets": labels,
                "tokens": sum(len(r) for r in mine),
            }
        )
    return steps


def side(name: str, args, folder: Path, seed: int, queue) -> None:
    """One side's training run in this process: per-step losses, seconds and the peak memory above
    what the process held before the first step (RSS on the CPU, allocated memory on a GPU)."""
    import psutil
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    torch.set_num_threads(args.threads)
    if name == "ours":
        from yamlformer.builder import build_model
        from yamlformer.builder.spec.schema import ModelSpec

        saved = torch.load(folder / "ours.pt", weights_only=True)
        spec = ModelSpec.model_validate(saved["spec"])
        model = build_model(spec, device="meta").to_empty(device="cpu")
        model.load_state_dict(saved["state"])
        for p_name, p in model.named_parameters():
            p.requires_grad_(".adapter." in p_name)
        forward = lambda step: (model(**step["ours"]), step["targets"])
        vocab = spec.vocab_size
    else:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(folder / "base", dtype=torch.float32)
        model = PeftModel.from_pretrained(base, folder / "peft", is_trainable=True)
        forward = lambda step: (model(**step["peft"]).logits, step["peft_targets"])
        vocab = base.config.vocab_size
    cuda = args.device == "cuda"
    model.to(args.device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, foreach=True)
    data = [_to(step, args.device) for step in batches(args, vocab, seed)]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = psutil.Process().memory_info().rss
    losses, seconds = [], []
    for step in data:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        logits, targets = forward(step)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.flatten(), ignore_index=-100)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())  # a host sync: the step has ended on a GPU too
        seconds.append(time.perf_counter() - start)
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    kept = range(args.warmup, len(data))
    queue.put(
        {
            "losses": losses,
            "tokens_per_s": statistics.median(data[i]["tokens"] / seconds[i] for i in kept),
            "peak_above_start": max(peak - before, 0),
            "trainable": sum(p.numel() for p in params),
        }
    )


def _to(step: dict, device: str) -> dict:
    return {
        key: _to(value, device) if isinstance(value, dict) else value.to(device) if hasattr(value, "to") else value
        for key, value in step.items()
    }


def run_side(name: str, args, folder: Path, seed: int) -> dict:
    context = mp.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=side, args=(name, args, folder, seed, queue))
    process.start()
    result = queue.get(timeout=3600)
    process.join()
    return result


def _gpu() -> str:
    import torch

    return torch.cuda.get_device_name()


def parsed(parser: argparse.ArgumentParser, argv: list[str] | None):
    """``argv`` parsed with the options every side-by-side benchmark here takes added to ``parser``
    (``preference_vs_trl`` too); None, said on stderr, for ``--device cuda`` without a CUDA GPU."""
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seeds", type=int, default=1, help="runs per side; ratios are their median")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per side (they run in turn)")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="the largest per-step loss difference allowed")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where every side trains (default cpu)"
    )
    parser.add_argument("--quick", action="store_true", help="a smaller model and sequence (the tests' run)")
    parser.add_argument("--json", metavar="FILE", help="also write the result here")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("--device cuda: no CUDA GPU is available here", file=sys.stderr)
            return None
    return args


def main(argv: list[str] | None = None) -> int:
    from machine import emit, machine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="lora,dora", help="adapter types, comma-separated (default lora,dora)")
    parser.add_argument("--targets", default="q_proj,k_proj,v_proj,out_proj", help="our paths, or all-linear")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the tokens/s median")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument(
        "--data", choices=("instructions", "random"), default="instructions", help="what trains (module doc)"
    )
    args = parsed(parser, argv)
    if args is None:
        return 2
    if args.quick:
        args.steps, args.warmup = min(args.steps, 4), min(args.warmup, 1)
    where = f"device {args.device}" + (f" ({_gpu()})" if args.device == "cuda" else "")
    print(f"machine: {machine()}; {where}; torch threads {args.threads} per side, sides in turn", flush=True)
    result = {"machine": machine(), "settings": vars(args), "kinds": {}}
    failed = False
    for kind in args.kinds.split(","):
        runs = []
        for seed in range(args.seeds):
            with tempfile.TemporaryDirectory() as tmp:
                folder = Path(tmp)
                prepare(args, kind, folder, seed)
                order = ("ours", "peft") if seed % 2 == 0 else ("peft", "ours")  # neither always first
                sides = {name: run_side(name, args, folder, seed) for name in order}
            diff = max(abs(a - b) for a, b in zip(sides["ours"]["losses"], sides["peft"]["losses"]))
            runs.append(
                {
                    "max_loss_difference": diff,
                    "tokens_per_s_ratio": sides["ours"]["tokens_per_s"] / sides["peft"]["tokens_per_s"],
                    "peak_ratio": sides["ours"]["peak_above_start"] / max(sides["peft"]["peak_above_start"], 1),
                    "sides": sides,
                }
            )
        row = {
            "max_loss_difference": max(r["max_loss_difference"] for r in runs),
            "tokens_per_s_ratio": statistics.median(r["tokens_per_s_ratio"] for r in runs),
            "tokens_per_s_ratio_by_seed": [round(r["tokens_per_s_ratio"], 4) for r in runs],
            "peak_ratio": statistics.median(r["peak_ratio"] for r in runs),
            "ours_tokens_per_s": statistics.median(r["sides"]["ours"]["tokens_per_s"] for r in runs),
            "peft_tokens_per_s": statistics.median(r["sides"]["peft"]["tokens_per_s"] for r in runs),
            "ours_peak_MiB": statistics.median(r["sides"]["ours"]["peak_above_start"] for r in runs) / 2**20,
            "peft_peak_MiB": statistics.median(r["sides"]["peft"]["peak_above_start"] for r in runs) / 2**20,
            "trainable": runs[0]["sides"]["ours"]["trainable"],
            "first_losses": [round(x, 6) for x in runs[0]["sides"]["ours"]["losses"][:3]],
        }
        assert runs[0]["sides"]["ours"]["trainable"] == runs[0]["sides"]["peft"]["trainable"], "different adapters"
        failed |= row["max_loss_difference"] > args.tolerance
        result["kinds"][kind] = row
        speed = f"{row['ours_tokens_per_s']:,.0f} vs peft {row['peft_tokens_per_s']:,.0f}"
        peak = f"{row['ours_peak_MiB']:.1f} MiB vs peft {row['peft_peak_MiB']:.1f} MiB"
        memory = "GPU memory" if args.device == "cuda" else "RSS"
        print(
            f"{kind}: {row['trainable']:,} trainable; per-step losses differ by at most "
            f"{row['max_loss_difference']:.2e} (tolerance {args.tolerance:g}); tokens/s ours {speed} = "
            f"{row['tokens_per_s_ratio']:.2f}x; training peak {memory} ours {peak} = {row['peak_ratio']:.2f}x",
            flush=True,
        )
    for kind in result["kinds"].values():
        for key in ("tokens_per_s_ratio", "peak_ratio"):
            kind[key] = round(kind[key], 4)
    emit(result, args.json)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
