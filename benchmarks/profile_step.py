"""Where a training step of the shakespeare-char model goes, by ``torch.profiler``.

    python benchmarks/profile_step.py [--steps 30] [--rows 12] [--threads N] [--rounds 15]

The model ``recipes/shakespeare-char.yaml`` builds (nanoGPT's 4 x 128 GPT), its loss, backward and
fused AdamW step on one micro-batch of 12 x 64 tokens, profiled over ``--steps`` steps after a
warm-up, two ways in one process: eager, and ``torch.compile`` of the loss (what
``trainer.compile: model`` runs; Inductor's kernels named in the table). For each: the ops by self
CPU time (ms per step, share), the
matrix multiplies' share and their GFLOP/s, and the minor page faults and kernel (system) CPU
milliseconds per step from ``getrusage``.

Then, unprofiled, the wall time of one step four ways, alternating 10-step chunks for
``--rounds`` rounds in the same process (the median of each, and its ratio to the yardstick):
the yardstick's step (``benchmarks/yardstick.py``, eager, nanoGPT's AdamW), ours eager, ours
compiled, and the **floor**: only the step's matrix multiplies (the yardstick's fused-QKV shapes,
forward and both backward products) and its attention kernel forward and backward, nothing else.
The floor bounds what any tool can reach in this precision on this machine: yardstick / floor is
the largest possible speed-up over the yardstick with every other operation made free.

What it shows on a 2-core CPU: the step is bound by fp32 matrix multiplies (``aten::mm``),
so compilation can only remove the rest.
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


VOCAB = 65  # tiny Shakespeare's characters


def recipe_and_spec():
    from yamlformer.recipes.recipe.sections import model_spec
    from yamlformer.recipes.tasks import load_recipe

    recipe_file = REPO / "recipes" / "shakespeare-char.yaml"
    located = load_recipe(recipe_file)
    return located.recipe, model_spec(located, vocab_size=VOCAB)


def build():
    import torch
    import torch.nn.functional as F

    from yamlformer.builder import build_model

    recipe, spec = recipe_and_spec()
    torch.manual_seed(0)
    model = build_model(spec)
    batch, seq = recipe.data.batch_size, recipe.data.seq_len
    x, y = torch.randint(0, VOCAB, (batch, seq)), torch.randint(0, VOCAB, (batch, seq))

    def loss():
        logits = model(x)  # (batch, seq, vocab)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    return model, loss, batch * seq


def matmul_flops(model, tokens: int) -> float:
    """Forward + backward FLOPs of the step's matrix multiplies (2 * 3 per weight element per token)."""
    return 6.0 * tokens * sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "position" not in n)


def profile(name: str, model, loss, tokens: int, steps: int, rows: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step():
        loss().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(10):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps):
        step()
    after = resource.getrusage(resource.RUSAGE_SELF)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)  # microseconds over `steps` steps
    mm = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
    print(
        f"\n{name}: {total / steps / 1e3:.1f} ms/step of self CPU time under the profiler; matrix multiplies "
        f"{mm / total:.0%} ({matmul_flops(model, tokens) / (mm / steps / 1e6) / 1e9:.0f} GFLOP/s); "
        f"{(after.ru_minflt - before.ru_minflt) / steps:.0f} minor page faults and "
        f"{(after.ru_stime - before.ru_stime) / steps * 1e3:.1f} ms of kernel CPU time per step (unprofiled)"
    )
    print(f"  {'op':60s} {'ms/step':>8s} {'share':>6s} {'calls/step':>10s}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:rows]:
        print(
            f"  {e.key[:60]:60s} {e.self_cpu_time_total / steps / 1e3:8.2f} {e.self_cpu_time_total / total:6.1%} "
            f"{e.count / steps:10.1f}"
        )


def step_fns() -> tuple[dict, int]:
    """The four steps :func:`side_by_side` times (see the module doc), and the tokens of one."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(REPO / "benchmarks"))
    from yardstick import GPT, GPTConfig

    recipe, spec = recipe_and_spec()
    batch, seq, vocab = recipe.data.batch_size, recipe.data.seq_len, VOCAB
    d, layers, heads = spec.d_model, spec.decoder.n_layers, spec.decoder.attention.n_heads
    hidden, tokens = spec.decoder.ffn.hidden_dim, batch * seq

    def with_optimizer(model, loss_fn, optimizer=None):
        params = list(model.parameters())
        optimizer = optimizer or torch.optim.AdamW(params, lr=1e-3, fused=True)

        def step():
            loss_fn().backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    torch.manual_seed(0)
    yard = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=d))
    x, y = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))

    def yard_loss():
        return yard(x, y)[1]

    eager_model, eager_loss, _ = build()
    compiled_model, compiled_loss, _ = build()
    shapes = [(d, 3 * d), (d, d), (d, hidden), (hidden, d)] * layers + [(d, vocab)]
    gemms = [(torch.randn(tokens, k), torch.randn(n, k), torch.randn(tokens, n)) for k, n in shapes]
    qkv = [torch.randn(batch, heads, seq, d // heads, requires_grad=True) for _ in range(3)]
    grad_out = torch.randn(batch, heads, seq, d // heads)

    def floor():
        for a, w, g in gemms:  # forward, grad of the input, grad of the weight
            a @ w.t(), g @ w, g.t() @ a
        for _ in range(layers):
            out = F.scaled_dot_product_attention(*qkv, is_causal=True)
            torch.autograd.grad(out, qkv, grad_out)

    return {
        "yardstick (eager)": with_optimizer(yard, yard_loss, yard.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")),
        "ours eager": with_optimizer(eager_model, eager_loss),
        "ours compiled": with_optimizer(compiled_model, torch.compile(compiled_loss)),
        "floor (matmuls + attention only)": floor,
    }, tokens


def side_by_side(rounds: int) -> None:
    import statistics
    import time

    steps, tokens = step_fns()
    for step in steps.values():  # warm-up, the compile included
        for _ in range(5):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            started = time.perf_counter()
            for _ in range(10):
                step()
            times[name].append((time.perf_counter() - started) / 10 * 1e3)
    base = statistics.median(times["yardstick (eager)"])
    print(f"\nwall time per step, alternating 10-step chunks, median of {rounds} rounds:")
    for name, values in times.items():
        median = statistics.median(values)
        print(
            f"  {name:34s} {median:6.1f} ms  ({tokens / median * 1e3:8,.0f} tokens/s)  "
            f"{base / median:5.2f}x the yardstick"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--rounds", type=int, default=15, help="rounds of the side-by-side step timing")
    args = parser.parse_args(argv)
    import torch
    import torch._inductor.config as inductor

    if args.threads:
        torch.set_num_threads(args.threads)
    inductor.cpp.enable_kernel_profile = True  # each Inductor kernel its own row
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    model, loss, tokens = build()
    profile("eager", model, loss, tokens, args.steps, args.rows)
    model, loss, tokens = build()
    profile("compiled (trainer.compile: model)", model, torch.compile(loss), tokens, args.steps, args.rows)
    side_by_side(args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
