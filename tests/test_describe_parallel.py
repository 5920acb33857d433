"""``builder describe`` per rank under context and expert parallelism, against analytic figures on
tiny specs: context parallelism splits every activation by ``C`` and adds each layer's gathered
keys and values (the recipes' all-gather attention); its ranks join the FSDP shard group; expert
parallelism keeps ``n / E`` experts sharded over ``shard / E`` ranks, so a rank's states stay
``1 / shard`` of the experts while a gathered layer holds ``1 / E`` of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from yamlformer.builder.analysis.layout import Layout, model_tensors, rank_states
from yamlformer.builder.analysis.perf import Model, Run, memory
from yamlformer.builder.cli import main
from yamlformer.builder.spec.loader import load_spec

TINY = Path(__file__).resolve().parents[1] / "specs" / "tiny"
BF16 = 2


def _describe(capsys, spec, *argv) -> dict:
    assert main(["describe", str(spec), "--strategy", "fsdp", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_context_parallel_splits_activations_and_keeps_the_gathered_keys_and_values(capsys):
    spec = load_spec(TINY / "llama.yaml")  # 2 layers, 2 KV heads of 16, 123,712 parameters
    seq, cp = spec.max_seq_len, 2
    shown = _describe(capsys, TINY / "llama.yaml", "--devices", "2", "--context-parallel", str(cp))
    parts = shown["layout_memory"]["parts"]
    # fp32 weights, gradients and two AdamW states of every parameter, sharded over dp x cp = 2
    assert parts["states"] == 16 * 123_712 // 2
    whole = memory(Model(spec, seq), Layout(devices=2), Run(seq_len=seq, global_batch=2, context_gather=True))
    kv_per_token = 2 * spec.decoder.attention.n_kv_heads * 16 * BF16  # keys and values
    gathered = (cp - 1) / cp * seq * kv_per_token  # the other rank's keys and values, per layer
    expected = whole["activations"] / cp + spec.decoder.n_layers * gathered
    assert parts["activations"] == pytest.approx(expected, abs=2)
    # ring attention (the planner's default, torchtitan's) keeps only its own share
    ring = memory(Model(spec, seq), Layout(devices=2, context_parallel=cp), Run(seq_len=seq, global_batch=1))
    assert ring["activations"] == pytest.approx(whole["activations"] / cp, abs=2)


def test_expert_parallel_shards_the_experts_as_fsdp_would_and_gathers_a_layer_with_fewer(capsys):
    path = TINY / "deepseek-v2.yaml"
    spec = load_spec(path)
    flat, split = (_describe(capsys, path, "--devices", "4", "--expert-parallel", str(e)) for e in (1, 2))
    # 8 experts: 4 per expert-parallel rank, sharded over the 2 ranks holding them = 1/4 each, as plain FSDP
    assert split["memory"]["weights"] == flat["memory"]["weights"]
    # exactly: each stacked expert tensor (8 rows) keeps 4 rows per expert-parallel rank, 2 per shard rank
    stacked = [t for t in model_tensors(spec) if t.expert]
    assert stacked and all(t.shape[0] == 8 for t in stacked)
    plain = rank_states(spec, Layout(devices=4), tensors=[t for t in model_tensors(spec) if not t.expert])
    for rank in range(4):
        states = rank_states(spec, Layout(devices=4, expert_parallel=2), rank)
        rows = sum(2 * _numel(t.shape[1:]) for t in stacked)
        assert (
            states.elements - rows
            == rank_states(spec, Layout(devices=4), rank, [t for t in model_tensors(spec) if not t.expert]).elements
        )
    assert plain.elements > 0
    ffn = spec.decoder.ffn
    experts = ffn.n_experts * ffn.expert.params(spec.d_model)
    model = Model(spec, spec.max_seq_len)
    unit = max(layer["params"] + layer["expert_params"] / 2 for layer in model.layers)
    assert split["layout_memory"]["parts"]["buffers"] == int(unit * (3 * BF16 + 4))
    assert max(layer["expert_params"] for layer in model.layers) == experts


def _numel(shape) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def test_pipeline_stages_hold_exactly_their_layers_states(capsys):
    """Under pipeline parallelism describe's states are its heaviest stage's own, exactly: on two
    stages of one rank each (no FSDP, no TP to split them) 16 bytes per parameter of the layers,
    embedding or final norm and head a stage holds as the recipes cut the model, plus AdamW's
    fp32 step per tensor; the built model's parameters, grouped by the same cut, say which."""
    import torch

    from yamlformer.builder.analysis.shards import stage_layers
    from yamlformer.builder.assemble import build_model

    spec = load_spec(TINY / "llama.yaml")
    model = build_model(spec, device=torch.device("meta"))
    cut = stage_layers(spec.decoder.n_layers, 2)

    def stage_of(name: str) -> int:
        if name.startswith("decoder.layers."):
            layer = int(name.split(".")[2])
            return next(s for s, layers in enumerate(cut) if layer in layers)
        return 0 if name.startswith("decoder.embedding") else 1

    held = [[p for n, p in model.named_parameters() if stage_of(n) == s] for s in range(2)]
    exact = [16 * sum(p.numel() for p in ps) + 4 * len(ps) for ps in held]
    assert exact[0] != exact[1]  # so a part taken from the other stage would show
    out = _describe(capsys, TINY / "llama.yaml", "--devices", "2", "--pipeline-parallel", "2")
    # every part is the stage holding the most in all: under 1F1B the first, which keeps a
    # micro-batch in flight per stage (its states the smaller here)
    parts = out["layout_memory"]["parts"]
    assert parts["states"] == exact[0] and out["layout_memory"]["per_gpu_bytes"] == sum(parts.values())


def test_v_placed_stages_hold_the_first_and_the_last_and_the_dry_run_counts_them(tmp_path, capsys):
    """The runtime's zero-bubble schedules place two stages per rank in a V: on four layers over
    two ranks, rank 0 holds layers 0 and 3 with the embedding, the final norm and the head, rank 1
    layers 1 and 2; the count of the rank holding the most is 16 bytes per parameter (no FSDP or
    TP to split them) plus AdamW's fp32 step per tensor, and ``builder train --dry-run`` of a
    recipe on that layout prints it."""
    import torch
    from recipe_helpers import tiny_recipe

    from yamlformer.builder.analysis.layout_memory import layout_memory
    from yamlformer.builder.analysis.report import human_bytes
    from yamlformer.builder.assemble import build_model
    from yamlformer.recipes.training.dry_run import dry_run

    spec = load_spec(TINY / "llama.yaml", {"decoder": {"n_layers": 4}, "tie_embeddings": False})
    model = build_model(spec, device=torch.device("meta"))

    def rank_of(name: str) -> int:
        if name.startswith("decoder.layers."):
            return 0 if int(name.split(".")[2]) in (0, 3) else 1
        return 0  # the embedding, the final norm and the head

    held = [[p for n, p in model.named_parameters() if rank_of(n) == r] for r in range(2)]
    exact = max(16 * sum(p.numel() for p in ps) + 4 * len(ps) for ps in held)
    layout = Layout(devices=2, pipeline_parallel=2)

    def count(spec):  # data.batch_size 4 in 4 micro-batches of 32 tokens, fp32 (the recipe's precision 32)
        return layout_memory(
            spec, layout, seq_len=32, micro_batch=1, dtype="fp32", checkpointing=False, schedule="zbv", microbatches=4
        )

    assert count(spec)["parts"]["states"] == exact
    trainer = {"strategy": "fsdp", "devices": 2, "pipeline_parallel": 2, "pipeline_schedule": "zbv", "microbatches": 4}
    recipe = tiny_recipe(tmp_path, model={"spec": spec.model_dump(mode="json")}, trainer=trainer)
    result = dry_run(recipe)  # the spec with the tokenizer's vocabulary
    memory = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("memory"))
    expected = count(load_spec(result["spec"]))["per_gpu_bytes"]
    assert memory.split(maxsplit=1)[1].startswith(f"{human_bytes(expected)} per device on "), memory
    assert "pipeline-parallel 2" in memory, memory
