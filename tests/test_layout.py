"""Where parameters live under FSDP2 and tensor parallelism (yamlformer.builder.analysis.layout): every block's
``param_shapes`` against the module it builds, the whole model's tensors against
``named_parameters()``, each block's tensor-parallel view against its plan, torch.chunk's split,
exact per-rank figures, located refusals and the describe options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from yamlformer.blocks import registry
from yamlformer.blocks.build import Dims, build_block
from yamlformer.builder.analysis.estimates import estimate
from yamlformer.builder.analysis.layout import (
    Layout,
    LayoutError,
    chunk_rows,
    model_tensors,
    rank_states,
    tensor_parallel_problems,
    tensor_parallel_spec,
)
from yamlformer.builder.assemble import build_model
from yamlformer.builder.cli import main
from yamlformer.builder.spec.loader import load_spec
from yamlformer.builder.spec.schema import spec_model

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted((ROOT / "specs").rglob("*.yaml"))
D_MODEL, VOCAB, MAX_SEQ, N_HEADS = 32, 48, 16, 4
DIMS = Dims(d_model=D_MODEL, vocab_size=VOCAB, max_seq_len=MAX_SEQ, n_heads=N_HEADS, rotary_head_dim=8)


def _cases(kind: str):
    for name, cls in sorted(registry.configs(kind).items()):
        for i, example in enumerate(cls.__dict__.get("examples", [])):
            yield pytest.param(cls.model_validate(example), id=f"{name}-{i}")


def _shapes(module: nn.Module, skip=()) -> dict[str, tuple[int, ...]]:
    skip = {id(p) for p in skip}
    return {name: tuple(p.shape) for name, p in module.named_parameters() if id(p) not in skip}


def _numel(shape) -> int:
    return int(torch.Size(shape).numel())


@pytest.mark.parametrize("config", list(_cases("attention")) + list(_cases("ffn")) + list(_cases("norm")))
def test_param_shapes_are_what_the_block_builds(config):
    extra = {"cross": False, "backend": "eager"} if config.kind == "attention" else {}
    module = build_block(config, DIMS, **extra)
    assert config.param_shapes(D_MODEL) == _shapes(module)
    assert sum(map(_numel, config.param_shapes(D_MODEL).values())) == config.params(D_MODEL)


@pytest.mark.parametrize("config", list(_cases("head")))
@pytest.mark.parametrize("tied", [False, True])
def test_head_param_shapes(config, tied):
    embedding = nn.Embedding(VOCAB, D_MODEL) if tied and type(config).projects_to_vocab else None
    module = build_block(config, DIMS, tied_embedding=embedding)
    own = list(embedding.parameters()) if embedding is not None else []
    assert config.param_shapes(D_MODEL, VOCAB, embedding is not None) == _shapes(module, skip=own)


@pytest.mark.parametrize("config", list(_cases("position")))
def test_position_param_shapes(config):
    module = build_block(config, DIMS, causal=True)
    assert config.param_shapes(D_MODEL, N_HEADS, MAX_SEQ) == _shapes(module)


@pytest.mark.parametrize("path", SPECS, ids=lambda p: str(p.relative_to(ROOT / "specs")))
def test_model_tensors_are_named_parameters(path):
    spec = load_spec(path)
    built = {name: tuple(p.shape) for name, p in build_model(spec, device="meta").named_parameters()}
    assert {t.name: t.shape for t in model_tensors(spec)} == built


@pytest.mark.parametrize("config", list(_cases("attention")) + list(_cases("ffn")))
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_view_holds_what_the_plan_leaves_a_rank(config, tp):
    """The view's own count equals the tensors its plan leaves one rank: colwise rows / tp,
    rowwise columns / tp (bias whole), the rest whole."""
    problems = config.tensor_parallel_problems(tp, D_MODEL)
    if problems:
        assert all(loc[0] in type(config).model_fields for loc, _ in problems)
        return
    view = config.tensor_parallel(tp, D_MODEL)
    assert type(view) is type(config)
    plan = config.parallel_plan() or {}
    local = 0
    for name, shape in config.param_shapes(D_MODEL).items():
        style = next((plan[k] for k in plan if name.startswith(k + ".")), "replicate")
        shape = list(shape)
        if style == "colwise" or (style == "rowwise" and len(shape) == 2):
            dim = 0 if style == "colwise" else 1
            assert shape[dim] % tp == 0
            shape[dim] //= tp
        local += _numel(shape)
    assert view.params(D_MODEL) == local


def test_chunk_rows_is_torch_chunk():
    for rows in range(1, 23):
        for parts in range(1, 10):
            chunks = torch.arange(rows).chunk(parts)
            sizes = [len(c) for c in chunks] + [0] * (parts - len(chunks))
            assert [chunk_rows(rows, parts, i) for i in range(parts)] == sizes


def _odd_spec(**top):
    """Dims that do not divide by 3 or 4: ranks hold different shares."""
    return spec_model().model_validate(
        {
            "name": "odd",
            "architecture": "decoder-only",
            "vocab_size": 250,
            "d_model": 24,
            "max_seq_len": 32,
            "position": {"type": "learned"},
            "tie_embeddings": True,
            "decoder": {
                "n_layers": 3,
                "attention": {"n_heads": 4, "n_kv_heads": 2, "qkv_bias": True},
                "ffn": {"type": "glu", "hidden_dim": 70},
                "norm": {"type": "layernorm"},
            },
            **top,
        }
    )


@pytest.mark.parametrize(
    "devices, nodes, tp, mode", [(3, 1, 1, "shard"), (8, 2, 2, "hybrid"), (8, 1, 2, "shard"), (4, 1, 1, "replicate")]
)
def test_ranks_split_every_tensor_as_torch_chunk(devices, nodes, tp, mode):
    spec = _odd_spec(
        decoder={
            "n_layers": 3,
            "attention": {"n_heads": 4, "n_kv_heads": 2, "qkv_bias": True},
            "ffn": {"type": "glu", "hidden_dim": 72},
            "norm": {"type": "layernorm"},
        }
    )
    layout = Layout(devices=devices, nodes=nodes, tensor_parallel=tp, data_parallel=mode)
    ranks = [rank_states(spec, layout, r) for r in range(devices)]
    tensors = model_tensors(spec)
    local_total = sum(_numel(t.local_shape(tp)) for t in tensors)  # one TP rank's share of the model
    group = [r for r in ranks if layout.coordinates(r.rank)[0] == 0 and layout.coordinates(r.rank)[2] == 0]
    assert sum(r.elements for r in group) == local_total
    assert ranks[0].elements == max(r.elements for r in ranks) == ranks[0].padded_elements
    assert ranks[layout.smallest_rank()].elements == min(r.elements for r in ranks)
    for r in ranks:
        assert r.optimizer == 8 * r.elements + 4 * len(tensors) and r.weights == r.gradients == 4 * r.elements
    if mode == "shard" and tp == 1:
        assert ranks[-1].elements < ranks[0].elements  # 250 rows over 3: 84, 84, 82


def test_llama2_70b_on_64_ranks_exactly():
    spec = load_spec(ROOT / "specs" / "llama2-70b.yaml")
    n, tensors = 68_976_648_192, 80 * 9 + 3
    fsdp = rank_states(spec, Layout(devices=64, nodes=8))
    assert (fsdp.elements, fsdp.tensors) == (n // 64, tensors)  # every dim divides by 64
    est = estimate(spec, seq_len=4096, layout=Layout(devices=64, nodes=8, tensor_parallel=8)).memory
    # TP 8 splits all but the 161 norms (8192 each), FSDP shards that over 8
    norms = 161 * 8192
    assert est.weights == 4 * ((n - norms) // 8 + norms) // 8
    assert est.optimizer == 2 * est.weights + 4 * tensors and est.master_weights == 0
    assert est.layout["shard_size"] == 8 and est.layout["smallest"]["elements"] == est.weights // 4
    hsdp = estimate(spec, seq_len=4096, layout=Layout(devices=64, nodes=8, data_parallel="hybrid")).memory
    assert hsdp.weights == 4 * n // 8


def test_tensor_parallel_activations_and_kv_cache_are_one_ranks():
    spec = load_spec(ROOT / "specs" / "llama2-7b.yaml")
    one = estimate(spec, seq_len=2048, layout=Layout(devices=8)).memory
    two = estimate(spec, seq_len=2048, layout=Layout(devices=8, tensor_parallel=2)).memory
    ddp = estimate(spec, seq_len=2048).memory
    assert one.activations == ddp.activations and one.kv_cache == ddp.kv_cache
    assert two.kv_cache == ddp.kv_cache // 2  # KV heads split
    assert ddp.activations / 2 < two.activations < ddp.activations  # norms, layer inputs, logits whole
    local = tensor_parallel_spec(spec, 2)
    assert (local.decoder.attention.n_heads, local.decoder.attention.head_dim, local.vocab_size) == (16, 128, 32000)
    assert local.decoder.ffn.hidden_dim == 5504
    # served on 2 ranks: each holds half of every tensor but the 65 norms, in bf16
    assert two.inference_weights == 2 * ((6_738_415_616 - 65 * 4096) // 2 + 65 * 4096)


def test_tensor_parallel_problems_name_each_field():
    spec = load_spec(ROOT / "specs" / "llama2-70b.yaml")
    problems = dict(tensor_parallel_problems(spec, 3))
    assert set(problems) == {
        ("vocab_size",),
        ("decoder", "attention", "n_heads"),
        ("decoder", "attention", "n_kv_heads"),
        ("decoder", "ffn", "hidden_dim"),
    }
    assert "64 is not a multiple of the tensor-parallel degree 3" in problems[("decoder", "attention", "n_heads")]
    gemma = load_spec(ROOT / "specs" / "gemma2-2b.yaml")  # 8 heads, 4 KV heads, overrides per layer
    assert [loc for loc, _ in tensor_parallel_problems(gemma, 8)] == [
        ("decoder", "attention", "n_kv_heads"),
        ("decoder", "overrides", 0, "attention", "n_kv_heads"),
    ]
    assert tensor_parallel_problems(gemma, 4) == []
    with pytest.raises(LayoutError, match="tensor_parallel=3: .*decoder.ffn.hidden_dim"):
        rank_states(spec, Layout(devices=3, tensor_parallel=3))


def test_layout_refusals_name_the_setting():
    with pytest.raises(LayoutError, match="data_parallel='hybrid': .*at least 2 nodes"):
        Layout(devices=8, data_parallel="hybrid")
    with pytest.raises(LayoutError, match="tensor_parallel=3: must divide the 8 devices of a node"):
        Layout(devices=16, nodes=2, tensor_parallel=3)
    with pytest.raises(LayoutError, match="devices=10: must be a multiple of the 4 nodes"):
        Layout(devices=10, nodes=4)
    with pytest.raises(LayoutError, match="tensor_parallel=2: needs strategy fsdp"):
        Layout(tensor_parallel=2, strategy="ddp")
    with pytest.raises(TypeError, match="the devices are a Layout"):
        estimate(load_spec(ROOT / "specs" / "tiny" / "llama.yaml"), tensor_parallel=2)


def test_describe_layout_options(capsys):
    spec = str(ROOT / "specs" / "llama2-70b.yaml")
    assert (
        main(
            [
                "describe",
                spec,
                "--seq-len",
                "4096",
                "--devices",
                "64",
                "--nodes",
                "8",
                "--strategy",
                "fsdp",
                "--tensor-parallel",
                "8",
                "--data-parallel",
                "shard",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["memory"]["layout"]["tensor_parallel"] == 8 and out["settings"]["tensor_parallel"] == 8
    assert (
        main(["describe", spec, "--devices", "64", "--nodes", "8", "--strategy", "fsdp", "--tensor-parallel", "8"]) == 0
    )
    assert "rank 0 (holds the most): 64 devices on 8 nodes: tensor-parallel 8 x FSDP shard over 8" in " ".join(
        capsys.readouterr().out.split()
    )
    for argv, expected in (
        (["--strategy", "fsdp", "--devices", "8", "--tensor-parallel", "3"], "error: --tensor-parallel 3: must divide"),
        (
            ["--strategy", "fsdp", "--devices", "6", "--tensor-parallel", "3"],
            "error: --tensor-parallel 3: vocab_size: 32000 rows of the vocabulary-parallel embedding and head do not "
            "split over 3 tensor-parallel ranks; pad_vocab_to_multiple_of: 384 pads them to 32,256",
        ),
        (["--strategy", "fsdp", "--devices", "8", "--data-parallel", "hybrid"], "error: --data-parallel hybrid: "),
        (["--devices", "8", "--tensor-parallel", "2"], "error: --tensor-parallel needs --strategy fsdp"),
        (["--strategy", "fsdp", "--devices", "10", "--nodes", "4"], "error: --devices 10: must be a multiple"),
    ):
        assert main(["describe", spec, *argv]) == 1
        err = capsys.readouterr().err
        assert err.startswith(expected) and err.count("\n") == 1, err
