"""What each parallel dimension cannot split of a spec, each refusal naming its field (torch-free).

Tensor parallelism needs every head count, FFN width and the vocabulary to divide by its degree
(each block's ``tensor_parallel_problems``); pipeline parallelism one stack with at least as many
layers as stages; expert parallelism experts its degree divides (each block's
``expert_parallel_problems``, as the recipes run it); context parallelism one stack and a sequence
that splits into ``2 x C`` balanced chunks. :func:`tensor_parallel_spec` is the spec as one
tensor-parallel rank runs it.
"""

from __future__ import annotations

import math
from typing import Any

from yamlformer.builder.analysis.runtime import stage_placement
from yamlformer.builder.mesh import Layout, LayoutError

#: Megatron-LM's ``make_vocab_size_divisible_by``: it pads the vocabulary to a multiple of this x TP
MEGATRON_VOCAB_MULTIPLE = 128
#: the layer fields that hold blocks, as ``yamlformer.builder.spec.schema.LAYER_FIELDS``
_LAYER_BLOCKS = ("attention", "cross_attention", "ffn", "norm")


def experts_of(ffn) -> tuple[int, int] | None:
    """``(n_experts, top_k)`` of a feed-forward block that routes tokens to experts (its
    ``n_experts`` and ``top_k`` fields), None for a dense one."""
    n = getattr(ffn, "n_experts", None)
    return (n, ffn.top_k) if n else None


def layout_problems(spec, layout: Layout, seq_len: int | None = None) -> list[LayoutError]:
    """Every way ``layout`` cannot split ``spec`` (and ``seq_len``), each naming the argument at
    fault and the spec field: a tensor-parallel degree a head count does not divide, more
    pipeline stages than layers, an expert-parallel degree the experts do not divide (or a
    model without experts), a sequence the context-parallel ranks cannot split in balanced halves."""
    out = []
    problems = tensor_parallel_problems(spec, layout.tensor_parallel)
    if problems:
        out.append(
            LayoutError(
                "tensor_parallel",
                layout.tensor_parallel,
                "; ".join(f"{'.'.join(map(str, loc))}: {msg}" for loc, msg in problems),
            )
        )
    stacks = spec.stacks()
    if max(layout.pipeline_parallel, layout.context_parallel) > 1 and len(stacks) > 1:
        name = "pipeline_parallel" if layout.pipeline_parallel > 1 else "context_parallel"
        out.append(LayoutError(name, getattr(layout, name), f"splits one stack; {spec.name} has {', '.join(stacks)}"))
    layers = sum(stack.n_layers for stack in stacks.values())
    if layout.pipeline_parallel > layers:
        first = next(iter(stacks))
        out.append(
            LayoutError(
                "pipeline_parallel",
                layout.pipeline_parallel,
                f"{first}.n_layers ({layers}): more stages than layers",
            )
        )
    if layout.expert_parallel > 1:
        routed = [
            (f"{name}.{where}ffn.n_experts", experts_of(ffn))
            for name, stack in stacks.items()
            for where, ffn in [("", stack.ffn), *((f"overrides.{i}.", o.ffn) for i, o in enumerate(stack.overrides))]
            if ffn is not None and experts_of(ffn)
        ]
        if not routed:
            out.append(LayoutError("expert_parallel", layout.expert_parallel, f"{spec.name} has no experts to split"))
        for path, (n, _) in routed:
            if n % layout.expert_parallel:
                out.append(
                    LayoutError("expert_parallel", layout.expert_parallel, f"{path} ({n}) does not divide by it")
                )
    if layout.context_parallel > 1 and seq_len is not None and seq_len % (2 * layout.context_parallel):
        out.append(
            LayoutError(
                "context_parallel",
                layout.context_parallel,
                f"seq_len {seq_len} does not split into 2 x {layout.context_parallel} equal chunks "
                "(load-balanced causal ring attention)",
            )
        )
    return out


def check_layout(spec, layout: Layout, seq_len: int | None = None) -> None:
    """Raise the first of :func:`layout_problems`."""
    problems = layout_problems(spec, layout, seq_len)
    if problems:
        raise problems[0]


def _blocks(spec):
    """(location, config) of every block config in the spec, in the spec's field order."""
    if spec.embedding.norm is not None:
        yield ("embedding", "norm"), spec.embedding.norm
    yield ("position",), spec.position
    for name, stack in spec.stacks().items():
        for key in _LAYER_BLOCKS:
            if getattr(stack, key) is not None:
                yield (name, key), getattr(stack, key)
        for i, override in enumerate(stack.overrides):
            for key in _LAYER_BLOCKS:
                if getattr(override, key, None) is not None:
                    yield (name, "overrides", i, key), getattr(override, key)
    yield ("head",), spec.head


def padded_for(spec, tp: int):
    """``spec`` as it runs ``tp``-way tensor parallel: itself when its vocabulary (padded as it
    says) divides by ``tp``, else with the vocabulary padded as Megatron-LM pads it, to a multiple
    of :data:`MEGATRON_VOCAB_MULTIPLE` x ``tp`` (and of the spec's own multiple)."""
    if tp == 1 or spec.padded_vocab_size % tp == 0:
        return spec
    multiple = math.lcm(spec.pad_vocab_to_multiple_of, MEGATRON_VOCAB_MULTIPLE * tp)
    return spec.model_copy(update={"pad_vocab_to_multiple_of": multiple})


def vocabulary_problems(spec, tp: int) -> list[tuple[tuple, str]]:
    """The vocabulary's rows (``padded_vocab_size``) that ``tp`` vocab-parallel ranks cannot
    split evenly, with the padding that would (:func:`padded_for`)."""
    rows = spec.padded_vocab_size
    if rows % tp == 0:
        return []
    fix = padded_for(spec, tp)
    field = "vocab_size" if spec.pad_vocab_to_multiple_of == 1 else "pad_vocab_to_multiple_of"
    shown = f"{rows}" if rows == spec.vocab_size else f"{spec.vocab_size} padded to {rows}"
    return [
        (
            (field,),
            f"{shown} rows of the vocabulary-parallel embedding and head do not split over {tp} tensor-parallel "
            f"ranks; pad_vocab_to_multiple_of: {fix.pad_vocab_to_multiple_of} pads them to "
            f"{fix.padded_vocab_size:,} (Megatron-LM's {MEGATRON_VOCAB_MULTIPLE} x TP)",
        )
    ]


def tensor_parallel_problems(spec, tp: int) -> list[tuple[tuple, str]]:
    """``(field path, message)`` for every field that does not divide by ``tp``."""
    if tp == 1:
        return []
    problems = vocabulary_problems(spec, tp)
    for loc, config in _blocks(spec):
        problems += [(loc + where, message) for where, message in config.tensor_parallel_problems(tp, spec.d_model)]
    return problems


def expert_parallel_problems(spec, ep: int) -> list[tuple[tuple, str]]:
    """``(field path, message)`` for every block whose experts ``ep`` ranks cannot split as the
    recipes run it (each block's ``expert_parallel_problems``: an expert count the degree does
    not divide, a block that keeps its experts as separate modules), or the first stack's ``ffn``
    when no block routes to experts. :func:`layout_problems` asks less: what any EP could split."""
    if ep == 1:
        return []
    problems, routed = [], False
    for loc, config in _blocks(spec):
        if experts_of(config):
            routed = True
            problems += [(loc + where, message) for where, message in config.expert_parallel_problems(ep)]
    if not routed:
        problems.append(
            ((next(iter(spec.stacks())), "ffn"), f"{spec.name} has no experts for expert parallelism to split")
        )
    return problems


def context_parallel_problems(spec, cp: int) -> list[tuple[tuple, str]]:
    """``(field path, message)`` for every block that cannot run its share of a sequence split
    ``cp`` ways as the recipes run it (each block's ``context_parallel_problems``: an attention
    whose module has no context-parallel path, a head with attention layers of its own).
    :func:`layout_problems` asks less: what any context parallelism could split."""
    if cp == 1:
        return []
    return [
        (loc + where, message)
        for loc, config in _blocks(spec)
        for where, message in config.context_parallel_problems(cp)
    ]


def pipeline_parallel_problems(spec, pp: int, schedule: str = "1f1b") -> list[tuple[tuple, str]]:
    """``(field path, message)`` for what keeps ``spec`` from ``pp`` pipeline stages as the
    recipes run them under ``schedule`` (the runtime's name or the performance model's): each
    block's ``pipeline_parallel_problems`` (a head with losses of its own), and a head tied to the
    embedding under a schedule that places the first and the last stage on one rank (zbv,
    dualpipev: the runtime keeps the two copies of a tied tensor on the first and last stages'
    ranks and sums their gradients, which a V placement would hold on one rank twice)."""
    if pp == 1:
        return []

    problems = []
    if getattr(spec, "tie_embeddings", False) and stage_placement(schedule)[1] == "v":
        problems.append(
            (
                ("tie_embeddings",),
                f"a head tied to the embedding needs the first and last stages on different ranks; {schedule} "
                "places both on the first (use 1f1b, interleaved_1f1b or gpipe)",
            )
        )
    problems += [
        (loc + where, message)
        for loc, config in _blocks(spec)
        for where, message in config.pipeline_parallel_problems(pp)
    ]
    return problems


def check_tensor_parallel(spec, tp: int) -> None:
    """Raise :class:`LayoutError` (argument ``tensor_parallel``) naming each field that does not divide."""
    problems = tensor_parallel_problems(spec, tp)
    if problems:
        raise LayoutError(
            "tensor_parallel", tp, "; ".join(f"{'.'.join(map(str, loc))}: {msg}" for loc, msg in problems)
        )


def tensor_parallel_spec(spec, tp: int):
    """The spec as one of ``tp`` tensor-parallel ranks runs it: every block replaced by its
    ``tensor_parallel`` view, so that estimating it gives one rank's FLOPs, activations and KV
    cache. No sequence parallelism: each layer's input, the norms and the dropout masks stay whole
    on every rank; the vocabulary stays whole too, as the head's gathered logits are (its
    parameter count is then not one rank's: :func:`rank_states` counts those)."""
    if tp == 1:
        return spec
    check_tensor_parallel(spec, tp)
    d = spec.d_model

    def view(config):
        return config.tensor_parallel(tp, d) if config is not None else None

    def view_blocks(section):
        return section.model_copy(
            update={k: view(getattr(section, k)) for k in _LAYER_BLOCKS if getattr(section, k, None) is not None}
        )

    update: dict[str, Any] = {}
    for name, stack in spec.stacks().items():
        local = view_blocks(stack)
        update[name] = local.model_copy(update={"overrides": [view_blocks(o) for o in stack.overrides]})
    embedding = spec.embedding.model_copy(update={"norm": view(spec.embedding.norm)})
    return spec.model_copy(
        update={**update, "embedding": embedding, "position": view(spec.position), "head": view(spec.head)}
    )
