"""Training-memory estimate against ``torch.cuda.max_memory_allocated`` (goal: within 10%).

For a few specs and batch sizes this runs real training steps on one CUDA GPU under exactly the
convention ``yamlformer.builder.analysis.memory`` documents: weights and gradients in the compute dtype, an fp32
master copy of the weights and AdamW's two fp32 states (for bf16; fp32 trains its weights
directly), the attention backend the estimate assumes (``auto``: the fused Triton kernel;
``eager``: explicit matrix products), and, when asked, activation checkpointing on every layer.
The loss is the recipe's: cross-entropy on fp32 logits. Two cases fine-tune with adapters (LoRA
r16 on q and v; QLoRA on every linear layer, its base in NF4 through torchao): only the adapters
train, so the frozen base holds its weights alone. It prints one row per case with the estimate,
the measured peak and their ratio.

    python benchmarks/memory.py                 # the default cases
    python benchmarks/memory.py --quick         # two small cases
    python benchmarks/memory.py --adapters      # the two cases with adapters
    python benchmarks/memory.py --json out.json

Without CUDA it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LORA = {"type": "lora", "rank": 16, "alpha": 32, "targets": ["q_proj", "v_proj"]}
QLORA = {"type": "lora", "rank": 16, "alpha": 32, "targets": "all-linear", "quantize": "nf4"}

# (spec, overrides, batch, seq_len, dtype, backend, checkpointing)
CASES = [
    ("specs/gpt2-small.yaml", {}, 8, 1024, "bf16", "auto", False),
    ("specs/gpt2-small.yaml", {}, 4, 512, "bf16", "eager", False),
    ("specs/gpt2-small.yaml", {}, 16, 1024, "bf16", "auto", True),
    ("specs/llama2-7b.yaml", {"decoder.n_layers": 4}, 4, 2048, "bf16", "auto", False),
    ("specs/mistral-7b.yaml", {"decoder.n_layers": 2}, 2, 8192, "bf16", "auto", False),
    ("specs/mixtral-8x7b.yaml", {"decoder.n_layers": 2}, 4, 1024, "bf16", "auto", False),
    ("specs/t5-small.yaml", {}, 16, 512, "bf16", "auto", False),
    ("specs/bert-base.yaml", {}, 32, 512, "fp32", "auto", False),
    # adapters: a frozen base (no gradients, master copy or AdamW state), the NF4 base at torchao's bytes
    ("specs/llama2-7b.yaml", {"decoder.n_layers": 4, "adapters": LORA}, 4, 2048, "bf16", "auto", False),
    ("specs/llama2-7b.yaml", {"decoder.n_layers": 4, "adapters": QLORA}, 4, 2048, "bf16", "auto", False),
]
QUICK = [CASES[0], CASES[6]]


class MasterAdamW:
    """AdamW on fp32 master weights for a model held in a lower precision.

    States (master, exp_avg, exp_avg_sq: 12 bytes per parameter) are allocated up front; a step
    walks the parameters one at a time, so its scratch space is one parameter's worth.
    """

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
        import torch

        self.params = list(params)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.fp32 = all(p.dtype == torch.float32 for p in self.params)
        self.masters = [p if self.fp32 else p.detach().float() for p in self.params]
        self.states = [(torch.zeros_like(m), torch.zeros_like(m)) for m in self.masters]
        self.steps = 0

    def step(self) -> None:
        import torch

        self.steps += 1
        b1, b2 = self.betas
        correction1, correction2 = 1 - b1**self.steps, 1 - b2**self.steps
        with torch.no_grad():
            for p, master, (exp_avg, exp_avg_sq) in zip(self.params, self.masters, self.states):
                if p.grad is None:
                    continue
                grad = p.grad if self.fp32 else p.grad.float()
                p.grad = None
                master.mul_(1 - self.lr * self.weight_decay)
                exp_avg.lerp_(grad, 1 - b1)
                exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                denom = (exp_avg_sq / correction2).sqrt_().add_(self.eps)
                master.addcdiv_(exp_avg, denom, value=-self.lr / correction1)
                if not self.fp32:
                    p.copy_(master)


def checkpoint_layers(model) -> None:
    """Recompute every layer in backward (torch.utils.checkpoint, non-reentrant)."""
    from torch.utils.checkpoint import checkpoint

    for stack in model.stacks().values():
        for layer in stack.layers:
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)


def run_case(spec_path, overrides, batch, seq, dtype, backend, checkpointing, steps=2, device="cuda") -> dict:
    """One case's estimate and measured peak; ``device="cpu"`` trains the case there to prove the
    plumbing (``gpu_check.py --cpu``), measuring nothing (``measured_bytes`` and ``ratio`` None)."""
    import torch
    import torch.nn.functional as F

    from yamlformer.builder.analysis.estimates import estimate
    from yamlformer.builder.assemble import build_model
    from yamlformer.builder.spec.loader import load_spec

    spec = load_spec(ROOT / spec_path, overrides)
    enc_dec = spec.architecture == "encoder-decoder"
    est = estimate(
        spec,
        seq_len=seq,
        batch=batch,
        dtype=dtype,
        activation_checkpointing=checkpointing,
        fused_attention=backend != "eager",
    )
    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    torch.manual_seed(0)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    model = build_model(spec, device=device, dtype=torch_dtype, attention_backend=backend).train()
    if checkpointing:
        checkpoint_layers(model)
    optimizer = MasterAdamW(p for p in model.parameters() if p.requires_grad)  # with adapters, theirs alone
    ids = torch.randint(0, spec.vocab_size, (batch, seq + 1), device=device)
    src = torch.randint(0, spec.vocab_size, (batch, seq), device=device) if enc_dec else None
    inputs, targets = ids[:, :-1], ids[:, 1:]
    for _ in range(steps):
        logits = model(src, decoder_input_ids=inputs) if enc_dec else model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        del logits
        loss.backward()
        optimizer.step()
        del loss
    peak = None
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    predicted = est.memory.training_total
    del model, optimizer
    if cuda:
        torch.cuda.empty_cache()
    return {
        "spec": spec_path,
        "overrides": overrides,
        "batch": batch,
        "seq_len": seq,
        "dtype": dtype,
        "backend": backend,
        "checkpointing": checkpointing,
        "params": est.params.total,
        "estimate_bytes": predicted,
        "activations_bytes": est.memory.activations,
        "measured_bytes": peak,
        "ratio": None if peak is None else predicted / peak if peak else math.nan,  # None: not measured (CPU)
    }


def short_label(value) -> str:
    """An override as a label: an adapters mapping as its type and quantization."""
    if isinstance(value, dict):
        return "q" + value["type"] if value.get("quantize") else value["type"]
    return str(value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two small cases")
    parser.add_argument("--adapters", action="store_true", help="only the cases with adapters (LoRA, QLoRA)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("benchmarks/memory.py needs torch", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            "benchmarks/memory.py measures torch.cuda.max_memory_allocated and needs a CUDA GPU; "
            "none is available here. `builder describe SPEC` prints the estimate alone.",
            file=sys.stderr,
        )
        return 2
    from yamlformer.builder.analysis.report import human_bytes

    print(f"device: {torch.cuda.get_device_name()}")
    header = (
        f"{'spec':28} {'batch':>5} {'seq':>6} {'dtype':>5} {'attn':>6} {'ckpt':>5} "
        f"{'estimate':>12} {'measured':>12} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    cases = QUICK if args.quick else CASES
    for case in [c for c in cases if "adapters" in c[1]] if args.adapters else cases:
        spec_path, overrides, batch, seq, dtype, backend, ckpt = case
        label = Path(spec_path).stem + "".join(f" {k.split('.')[-1]}={short_label(v)}" for k, v in overrides.items())
        try:
            row = run_case(*case)
        except torch.cuda.OutOfMemoryError:
            print(f"{label:28} {batch:>5} {seq:>6} {dtype:>5} {backend:>6} {ckpt!s:>5}  out of memory")
            torch.cuda.empty_cache()
            continue
        rows.append(row)
        flag = "" if abs(row["ratio"] - 1) <= 0.10 else "  (off by more than 10%)"
        print(
            f"{label:28} {batch:>5} {seq:>6} {dtype:>5} {backend:>6} {ckpt!s:>5} "
            f"{human_bytes(row['estimate_bytes']):>12} {human_bytes(row['measured_bytes']):>12} "
            f"{row['ratio']:>6.3f}{flag}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
