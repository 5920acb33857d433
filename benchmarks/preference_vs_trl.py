"""DPO with LoRA against TRL's ``DPOTrainer`` (on ``transformers`` and ``peft``), side by side in one
script run.

The same base (a seeded Llama-style model: built here, exported to a ``transformers`` folder), the
same adapters at the start (ours exported as a PEFT folder and loaded by ``PeftModel`` as
trainable: LoRA's ``B`` zero, so on both sides the reference is the base with the adapters
switched off), the same pairs in the same order, ``--batch`` pairs a step, the same optimizer
(AdamW, fp32, constant rate, no weight decay, no clipping, no dropout, no activation
checkpointing: TRL's defaults of bf16 and gradient checkpointing are turned off) for ``--steps`` steps. The
pairs are seeded token ids (a prompt of 32-160 tokens, each answer 16-96, then EOS) written as
words of a word-level Hugging Face tokenizer, so TRL reads them as text through its own
tokenization and collator and produces the ids ours encodes directly. TRL runs its own
``DPOTrainer.train()`` (``train_sampling_strategy: sequential``, ``logging_steps: 1``); each
step's loss is read as its ``compute_loss`` returns it, unrounded, and the rewards from its logs.

Sides, each in a fresh process of its own (its peak RSS is its own):

* ``ours``: as ``task: preference`` trains, each step's pairs packed whole into rows of
  ``--seq-len`` (``yamlformer.recipes.data.pairs.PairRows``: a pair's two sequences two documents,
  attention masked between them), the head projecting the answers' positions only
  (``yamlformer.recipes.tasks.preference.training.pair_losses``);
* ``control``: our model and loss on TRL's own batch (chosen and rejected each a row, padded to the
  step's longest, every position projected): the same work as TRL, so its ratio is the framework's
  alone and the rest of ``ours``' gain is the packing and the projection of answers only;
* ``trl``: ``DPOTrainer``.

Printed: the largest per-step differences of loss and chosen/rejected rewards against TRL (the
loss must agree to ``--tolerance``, a reward, beta times a difference of sums of some hundred
log-probabilities, to ``--tolerance`` times beta times their largest magnitude: fp32 relative to
what it is computed from), tokens/s (the pairs' tokens, no padding; the median over the steps
after ``--warmup``) and the training peak memory above what the process held before its first
step (RSS on the CPU; ``torch.cuda.max_memory_allocated`` with ``--device cuda``), each a ratio
against TRL, the median over ``--seeds`` runs.

    nice python benchmarks/preference_vs_trl.py --seeds 3
    python benchmarks/preference_vs_trl.py --quick                     # a few steps of a smaller model
    python benchmarks/preference_vs_trl.py --device cuda --seeds 3     # on a GPU (fp32 on every side)
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

from lora_vs_peft import QUICK, SPEC, parsed  # noqa: E402 (the benchmarks' folder, appended above)

SIDES = ("ours", "control", "trl")


def spec_for(args) -> dict:
    spec = {**SPEC, "decoder": {**SPEC["decoder"], "ffn": dict(SPEC["decoder"]["ffn"])}}
    if args.quick:
        spec.update(d_model=QUICK["d_model"], vocab_size=QUICK["vocab_size"])
        spec["decoder"]["n_layers"] = QUICK["n_layers"]
        spec["decoder"]["ffn"]["hidden_dim"] = QUICK["hidden_dim"]
    spec["max_seq_len"] = 2 * seq_len(args)  # a row holds a pair's two sequences, positions restarted
    spec["adapters"] = {"type": "lora", "rank": args.rank, "alpha": 2.0 * args.rank, "targets": "all-linear"}
    return spec


def seq_len(args) -> int:
    return 128 if args.quick else args.seq_len


def prepare(args, folder: Path, seed: int) -> None:
    """The base as a transformers folder, our initial adapters as a PEFT folder, our model's
    starting state, and a word-level tokenizer (word ``i`` is token ``i``; the last is EOS)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from yamlformer.builder import build_model
    from yamlformer.builder.hf import to_hf
    from yamlformer.builder.hf.peft import to_peft
    from yamlformer.builder.hf.writer import choose_family
    from yamlformer.builder.spec.schema import ModelSpec

    spec = ModelSpec.model_validate(spec_for(args))
    model = build_model(spec, init_seed=seed)
    state = model.state_dict()
    to_hf(
        spec.model_copy(update={"adapters": None}),
        {k: v for k, v in state.items() if ".adapter." not in k},
        folder / "base",
    )
    to_peft(spec, state, folder / "peft", choose_family(spec)[0])
    torch.save({"spec": spec.model_dump(mode="json"), "state": state}, folder / "ours.pt")
    eos = spec.vocab_size - 1
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(eos)} | {"</s>": eos}, unk_token="</s>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="</s>", pad_token="</s>")
    tokenizer.save_pretrained(folder / "tokenizer")


def pairs(args, vocab: int, seed: int) -> list[tuple[list[int], list[int], list[int]]]:
    """``(prompt, chosen, rejected)`` token ids of every step's pairs, in order (module doc); the
    answers without their EOS."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    scale = seq_len(args) / 256

    def draw(low: int, high: int) -> list[int]:
        n = int(torch.randint(round(low * scale), round(high * scale) + 1, (1,), generator=generator))
        return torch.randint(0, vocab - 1, (n,), generator=generator).tolist()

    out = []
    for _ in range(args.steps * args.batch):
        prompt = draw(32, 160)
        out.append((prompt, draw(16, 96), draw(16, 96)))
    return out


def our_steps(args, drawn, eos: int) -> list[dict]:
    """Each step's pairs as ours trains them (packed rows) and as TRL batches them (the control)."""
    import numpy as np
    import torch

    from yamlformer.recipes.data.chat import Encoded
    from yamlformer.recipes.data.pairs import EncodedPair, PairRows
    from yamlformer.recipes.data.windows import IGNORE

    def encoded(prompt, answer) -> Encoded:
        ids = np.asarray([*prompt, *answer, eos])
        return Encoded(ids, np.arange(len(ids)) >= len(prompt), [len(prompt)])

    steps = []
    for step in range(args.steps):
        chunk = drawn[step * args.batch : (step + 1) * args.batch]
        encoded_pairs = [EncodedPair(encoded(p, c), encoded(p, r)) for p, c, r in chunk]
        rows = PairRows(encoded_pairs, 2 * seq_len(args) - 1, eos, packing=True)
        order = [i for row in rows.records for i in row]
        packed = rows.batch(np.arange(len(rows)))
        # TRL's layout: chosen rows then rejected rows, right-padded to the longest (causal: the
        # padding after a sequence changes nothing before it)
        sequences = [e.chosen for e in encoded_pairs] + [e.rejected for e in encoded_pairs]
        longest = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), longest), eos, dtype=torch.long)
        targets = torch.full((len(sequences), longest - 1), IGNORE, dtype=torch.long)
        segment = torch.full((len(sequences), longest - 1), -1, dtype=torch.long)
        for j, s in enumerate(sequences):
            ids[j, : len(s)] = torch.from_numpy(s.ids)
            keep = torch.from_numpy(s.trained[1:])
            targets[j, : len(s) - 1] = torch.from_numpy(s.ids[1:]).masked_fill(~keep, IGNORE)
            pair, side = j % len(chunk), j // len(chunk)
            segment[j, : len(s) - 1] = torch.where(keep, 2 * pair + side, -1)
        steps.append(
            {
                "packed": packed,
                "order": order,
                "padded": (ids[:, :-1].contiguous(), targets, None, segment, len(chunk)),
                "tokens": sum(len(s) for s in sequences),
            }
        )
    return steps


class Objective:
    """The recipe's ``preference`` section as the loss reads it: dpo, TRL's default beta."""

    loss, beta, label_smoothing = "dpo", 0.1, 0.0

    @staticmethod
    def needs_reference() -> bool:
        return True


def our_side(name: str, args, folder: Path, seed: int) -> dict:
    """``ours`` or ``control`` (module doc): per-step losses, rewards, seconds, peak memory."""
    import torch

    from yamlformer.builder import build_model
    from yamlformer.builder.spec.schema import ModelSpec
    from yamlformer.recipes.tasks.preference.training import Reference, pair_losses

    saved = torch.load(folder / "ours.pt", weights_only=True)
    spec = ModelSpec.model_validate(saved["spec"])
    model = build_model(spec, device="meta").to_empty(device="cpu")
    model.load_state_dict(saved["state"])
    for p_name, p in model.named_parameters():
        p.requires_grad_(".adapter." in p_name)
    reference = Reference(needed=True)
    reference.capture(model)  # adapters that start as the identity: switched off, no copy
    model.to(args.device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, foreach=True)
    steps = our_steps(args, pairs(args, spec.vocab_size, seed), spec.vocab_size - 1)
    batches = [_to(s["packed"] if name == "ours" else s["padded"], args.device) for s in steps]
    before = _memory_before(args)
    losses, chosen, rejected, seconds, scale = [], [], [], [], 0.0
    for batch in batches:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss, metrics = pair_losses(model, reference, Objective, batch, select=name == "ours")
        loss.backward()
        optimizer.step()
        losses.append(loss.item())  # a host sync: the step has ended on a GPU too
        seconds.append(time.perf_counter() - start)
        chosen.append(float(metrics["rewards/chosen"]))
        rejected.append(float(metrics["rewards/rejected"]))
        scale = max(scale, abs(float(metrics["logps/chosen"])), abs(float(metrics["logps/rejected"])))
    return _result(args, steps, losses, chosen, rejected, seconds, before, params) | {"logps_scale": scale}


def trl_side(args, folder: Path, seed: int) -> dict:
    """TRL's ``DPOTrainer.train()`` on the same pairs (module doc)."""
    import torch
    from datasets import Dataset
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    base = AutoModelForCausalLM.from_pretrained(folder / "base", dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folder / "peft", is_trainable=True)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder / "tokenizer")
    drawn = pairs(args, base.config.vocab_size, seed)
    text = lambda ids: " ".join(f"w{i}" for i in ids)
    dataset = Dataset.from_list(
        [{"prompt": text(p), "chosen": " " + text(c), "rejected": " " + text(r)} for p, c, r in drawn]
    )
    losses, chosen, rejected, seconds, clock = [], [], [], [], {}
    cuda = args.device == "cuda"

    class Timed(TrainerCallback):
        def on_step_begin(self, *_, **__):
            if cuda:
                torch.cuda.synchronize()
            clock["start"] = time.perf_counter()

        def on_step_end(self, *_, **__):
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - clock["start"])

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "rewards/chosen" in logs:
                chosen.append(logs["rewards/chosen"])
                rejected.append(logs["rewards/rejected"])

    class Recorded(DPOTrainer):
        def compute_loss(self, *a, **k):
            loss = super().compute_loss(*a, **k)
            if self.model.training:
                losses.append(float(loss.detach()))
            return loss

    config = DPOConfig(
        output_dir=str(folder / "trl"),
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=0.0,
        optim="adamw_torch",
        bf16=False,  # TRL's default where the machine has bf16: fp32 on every side
        gradient_checkpointing=False,  # TRL's default recomputes layers; neither other side does
        beta=Objective.beta,
        max_length=None,
        train_sampling_strategy="sequential",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=seed,
        use_cpu=not cuda,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Recorded(model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[Timed()])
    model.to(args.device)
    before = _memory_before(args)
    trainer.train()
    chunks = [drawn[i * args.batch : (i + 1) * args.batch] for i in range(args.steps)]
    steps = [{"tokens": sum(2 * len(p) + len(c) + len(r) + 2 for p, c, r in chunk)} for chunk in chunks]
    params = [p for p in model.parameters() if p.requires_grad]
    return _result(args, steps, losses, chosen, rejected, seconds, before, params)


def _memory_before(args) -> int:
    import psutil
    import torch

    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return psutil.Process().memory_info().rss


def _result(args, steps, losses, chosen, rejected, seconds, before, params) -> dict:
    import torch

    if args.device == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    kept = range(args.warmup, len(steps))
    return {
        "losses": losses,
        "rewards_chosen": chosen,
        "rewards_rejected": rejected,
        "tokens_per_s": statistics.median(steps[i]["tokens"] / seconds[i] for i in kept),
        "peak_above_start": max(peak - before, 0),
        "trainable": sum(p.numel() for p in params),
    }


def _to(batch, device: str):
    return tuple(t.to(device) if hasattr(t, "to") else t for t in batch)


def side(name: str, args, folder: Path, seed: int, queue) -> None:
    import torch

    torch.manual_seed(seed)
    torch.set_num_threads(args.threads)
    queue.put(trl_side(args, folder, seed) if name == "trl" else our_side(name, args, folder, seed))


def run_side(name: str, args, folder: Path, seed: int) -> dict:
    context = mp.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=side, args=(name, args, folder, seed, queue))
    process.start()
    result = queue.get(timeout=3600)
    process.join()
    return result


def main(argv: list[str] | None = None) -> int:
    from machine import emit, machine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the tokens/s median")
    parser.add_argument("--batch", type=int, default=8, help="pairs per step")
    parser.add_argument("--seq-len", type=int, default=256, help="the longest sequence: a packed row holds two")
    args = parsed(parser, argv)  # --lr, --seeds, --threads, --tolerance, --device, --quick, --json
    if args is None:
        return 2
    if args.quick:
        args.steps, args.warmup, args.batch = min(args.steps, 4), min(args.warmup, 1), min(args.batch, 4)
    print(
        f"machine: {machine()}; device {args.device}; torch threads {args.threads} per side, sides in turn", flush=True
    )
    runs = []
    for seed in range(args.seeds):
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            prepare(args, folder, seed)
            order = SIDES[seed % 3 :] + SIDES[: seed % 3]  # no side always first
            runs.append({name: run_side(name, args, folder, seed) for name in order})
        run = runs[-1]
        print(  # each seed as it ends: a run cut short still says what it measured
            f"seed {seed}: tokens/s ours / TRL {run['ours']['tokens_per_s'] / run['trl']['tokens_per_s']:.3f}x, "
            f"control / TRL {run['control']['tokens_per_s'] / run['trl']['tokens_per_s']:.3f}x; largest loss "
            f"difference ours {max(abs(a - b) for a, b in zip(run['ours']['losses'], run['trl']['losses'])):.2e}",
            flush=True,
        )
    result = {"machine": machine(), "settings": vars(args), "sides": {}}
    failed = False
    trl = [run["trl"] for run in runs]
    for name in ("ours", "control"):
        mine = [run[name] for run in runs]
        # a reward is beta times a difference of sums of log-probabilities: its fp32 error scales with them
        scale = max(1.0, Objective.beta * max(m["logps_scale"] for m in mine))
        row = {"trainable": mine[0]["trainable"], "reward_tolerance": args.tolerance * scale}
        for key in ("losses", "rewards_chosen", "rewards_rejected"):
            row[f"max_{key}_difference"] = max(
                abs(a - b) for m, t in zip(mine, trl) for a, b in zip(m[key], t[key], strict=True)
            )
            allowed = args.tolerance if key == "losses" else row["reward_tolerance"]
            failed |= row[f"max_{key}_difference"] > allowed
        ratios = [m["tokens_per_s"] / t["tokens_per_s"] for m, t in zip(mine, trl)]
        peaks = [m["peak_above_start"] / max(t["peak_above_start"], 1) for m, t in zip(mine, trl)]
        row.update(
            tokens_per_s_ratio=round(statistics.median(ratios), 4),
            tokens_per_s_ratio_by_seed=[round(r, 4) for r in ratios],
            peak_ratio=round(statistics.median(peaks), 4),
            tokens_per_s=statistics.median(m["tokens_per_s"] for m in mine),
            trl_tokens_per_s=statistics.median(t["tokens_per_s"] for t in trl),
            peak_MiB=statistics.median(m["peak_above_start"] for m in mine) / 2**20,
            trl_peak_MiB=statistics.median(t["peak_above_start"] for t in trl) / 2**20,
            first_losses=[round(x, 6) for x in mine[0]["losses"][:3]],
        )
        assert row["trainable"] == trl[0]["trainable"], "different adapters"
        result["sides"][name] = row
        memory = "GPU memory" if args.device == "cuda" else "RSS"
        print(
            f"{name}: per-step loss, chosen and rejected rewards differ from TRL's by at most "
            f"{row['max_losses_difference']:.2e}, {row['max_rewards_chosen_difference']:.2e}, "
            f"{row['max_rewards_rejected_difference']:.2e} (tolerance {args.tolerance:g}, the rewards' "
            f"{row['reward_tolerance']:.2g}: beta x their log-probabilities' scale); tokens/s "
            f"{row['tokens_per_s']:,.0f} vs TRL {row['trl_tokens_per_s']:,.0f} = {row['tokens_per_s_ratio']:.2f}x; "
            f"training peak {memory} {row['peak_MiB']:.1f} MiB vs TRL {row['trl_peak_MiB']:.1f} MiB = "
            f"{row['peak_ratio']:.2f}x",
            flush=True,
        )
    emit(result, args.json)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
