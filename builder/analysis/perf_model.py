"""What the performance model (``yamlformer.builder.analysis.perf``) reads from a spec, once per
sequence length (torch-free): each layer's FLOPs, linears, memory-bound bytes, saved bytes and
parameters, and the embedding and head. The counts are the blocks' own (``yamlformer.blocks.configs``);
under tensor parallelism one rank's, from the spec as a rank runs it
(``yamlformer.builder.analysis.layout.tensor_parallel_spec``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from yamlformer.blocks.configs.traffic import Traffic
from yamlformer.builder.analysis.estimates import Step, estimate
from yamlformer.builder.analysis.layout import experts_of, tensor_parallel_spec
from yamlformer.builder.analysis.memory import BYTES
from yamlformer.builder.analysis.shards import element_groups, mean_optimizer_bytes, stage_layers

#: the layer's blocks whose 2-D (or stacked 3-D expert) weights are linears
LINEAR_BLOCKS = ("attention", "cross_attention", "ffn")
#: torchao's float8 linears need both dimensions a multiple of this
FLOAT8_ALIGNMENT = 16


@dataclass(frozen=True)
class Linear:
    """One weight a layer multiplies its tokens by: ``k`` input and ``n`` output features (one
    tensor-parallel rank's), in ``block`` (``attention``, ``ffn``...), split ``style`` by the block's
    plan (``colwise``, ``rowwise``, ``replicate``); ``experts`` stacked experts of which each token
    meets ``top_k`` (0: a dense linear every token meets)."""

    block: str
    style: str
    k: int
    n: int
    experts: int = 0
    top_k: int = 0

    @property
    def float8(self) -> bool:
        """Whether float8 training converts it (torchao: dense linears whose sizes align)."""
        return not self.experts and self.k % FLOAT8_ALIGNMENT == 0 and self.n % FLOAT8_ALIGNMENT == 0


class Model:
    """What the performance model reads from a spec at one sequence length, once: each layer's
    forward FLOPs (projections and attention core apart), saved bytes, parameters (experts apart),
    the key/value bytes per token and routing, and the embedding and head; per tensor-parallel
    degree, each layer's linears (:meth:`linears`) and memory-bound bytes (:meth:`traffic`)."""

    def __init__(self, spec, seq_len: int, dtype: str = "bf16", src_len: int | None = None):

        self.spec, self.seq, self.dtype, self.src = spec, seq_len, dtype, src_len
        est = estimate(spec, Step(seq_len=seq_len, src_len=src_len, batch=1, dtype=dtype))
        self.estimate = est
        d = spec.d_model
        self.layers = []
        self.kinds: list[int] = []  # per layer, the index of its first identical layer
        first: dict[int, int] = {}
        memory_of = spec.architecture_config.memory_of
        causal = spec.architecture_config.causal
        lengths = {
            name: (src_len or seq_len) if name in memory_of.values() else seq_len for name in spec.stacks()
        }  # an encoder runs over the source
        configs = [(name, config) for name, stack in spec.stacks().items() for config in stack.layers()]
        self.configs = configs
        for index, (layer, (name, config)) in enumerate(zip(est.layers, configs)):
            self.kinds.append(first.setdefault(id(config), index))
            attention = config.attention
            projections = attention.projection_flops(d, lengths[name], lengths[name])
            core = layer.kernel_flops - (layer.total_flops - layer.flops.get("attention", 0)) - projections
            routed = experts_of(config.ffn)
            expert_params = (routed[0] * config.ffn.expert.params(d)) if routed else 0
            self.layers.append(
                {
                    "linear": layer.total_flops - layer.flops.get("attention", 0) + projections,
                    "core": max(core, 0),
                    "saved": layer.saved_bytes,
                    "params": layer.total_params - expert_params,
                    "expert_params": expert_params,
                    "kv_per_token": attention.kv_cache(d).bytes_per_token(BYTES[dtype]),
                    # keys and values once per query head (what scores and mix read per pair, a
                    # quarter of its FLOPs each), as a kernel without grouped-query support gets them
                    "kv_repeated_per_token": attention.pair_flops(d) // 2 * BYTES[dtype],
                    "routed": routed,
                    "tokens": lengths[name],
                    "causal": causal.get(name, False),
                    "cross": name in memory_of,
                }
            )
        self.embedding = est.params.by_component.get("embedding", 0)
        head = est.params.by_component.get("head", 0)
        self.head_params = head if head else 0
        # the rest (the final norm, learned positions): on the last stage, beside the head
        self.rest_params = (
            est.params.total
            - sum(layer["params"] + layer["expert_params"] for layer in self.layers)
            - self.embedding
            - self.head_params
        )
        self.head_flops = est.flops.by_component.get("head", 0)
        self.other_saved = est.memory.activations - sum(layer["saved"] for layer in self.layers)
        # what a compiled loss does not keep of one sequence's (the head's contract, eager minus compiled)
        head_saved = functools.partial(
            spec.head.saved_bytes, d, spec.padded_vocab_size, seq_len, BYTES[dtype], fused=True, position=spec.position
        )
        self.compiled_loss_saving = head_saved() - head_saved(compiled_loss=True)
        self.train_flops_per_token = est.flops.train_per_token
        self.d = d
        self.vocab = spec.padded_vocab_size
        #: a head tied to the embedding: under pipelining the last stage keeps a copy of the table
        self.tied = bool(spec.tie_embeddings and type(spec.head).projects_to_vocab)
        self.experts = next((layer["routed"] for layer in self.layers if layer["routed"]), None)
        self._stages: dict[tuple[int, int], list[dict[int, int]]] = {}
        self._whole: dict[int, tuple[list[int], int]] = {}
        self._views: dict[int, list] = {}

    @functools.cached_property
    def _element_groups(self) -> list:
        return element_groups(self.spec)

    def optimizer_bytes(self, optimizer) -> float:
        """``optimizer``'s declared state per parameter element
        (:func:`yamlformer.builder.analysis.shards.mean_optimizer_bytes`), the spec's tensors read once."""
        return mean_optimizer_bytes(self.spec, optimizer, self._element_groups)

    def saved(self, tp: int, sequence_parallel: bool) -> tuple[list[int], int]:
        """Bytes one tensor-parallel rank saves for backward per sequence: each layer's, and the rest
        (embedding, final norm, head and loss). Sequence-parallel: a ``tp``-th of the whole; else
        what ``yamlformer.builder.analysis.layout.tensor_parallel_spec`` leaves a rank (inputs, norms and
        logits whole)."""
        whole = [layer["saved"] for layer in self.layers]
        if tp == 1 or sequence_parallel:
            return [b / tp for b in whole], self.other_saved / tp
        if tp not in self._whole:
            est = estimate(self._view(tp), Step(seq_len=self.seq, src_len=self.src, dtype=self.dtype))
            layers = [layer.saved_bytes for layer in est.layers]
            self._whole[tp] = (layers, est.memory.activations - sum(layers))
        return self._whole[tp]

    def _view(self, tp: int):
        """The spec as one of ``tp`` tensor-parallel ranks runs it."""

        return tensor_parallel_spec(self.spec, tp)

    def _rank_configs(self, tp: int) -> list:
        """Each layer's config as one of ``tp`` tensor-parallel ranks holds it."""
        if tp not in self._views:
            self._views[tp] = [config for stack in self._view(tp).stacks().values() for config in stack.layers()]
        return self._views[tp]

    @functools.lru_cache(maxsize=16)  # noqa: B019 (one Model lives as long as its plan)
    def linears(self, tp: int) -> dict[int, tuple[Linear, ...]]:
        """Per kind of layer, the linears one of ``tp`` tensor-parallel ranks multiplies by: every
        2-D weight of its attention, cross-attention and FFN (``param_shapes``: ``(n, k)``) and
        every stacked expert weight (``(experts, n, k)``), split as the block's plan says."""
        d = self.d
        out = {}
        for kind in set(self.kinds):
            config, whole = self._rank_configs(tp)[kind], self.configs[kind][1]
            found = []
            for name, shape in config.param_shapes(d, self.layers[kind]["cross"]).items():
                block, _, rest = name.partition(".")
                if block not in LINEAR_BLOCKS or not name.endswith("weight") or len(shape) not in (2, 3):
                    continue
                plan = getattr(whole, block).parallel_plan() or {}
                module = rest.rsplit(".", 1)[0]
                style = next((s for name, s in plan.items() if module == name or module.startswith(name + ".")), None)
                if len(shape) == 3:
                    routed = experts_of(getattr(whole, block)) or (shape[0], 1)
                    found.append(Linear(block, "replicate", shape[2], shape[1], shape[0], routed[1]))
                else:
                    found.append(Linear(block, style or "replicate", shape[1], shape[0]))
            out[kind] = tuple(found)
        return out

    @functools.lru_cache(maxsize=16)  # noqa: B019
    def traffic(self, tp: int, sequence_parallel: bool) -> dict[int, dict[str, Traffic]]:
        """Per kind of layer, its memory-bound bytes per token on one of ``tp`` tensor-parallel
        ranks, by part (``yamlformer.blocks.configs.layer.LayerConfig.traffic``): the attention,
        position and FFN parts of the rank's heads and hidden width; the norms and residual adds
        of the whole width, a ``tp``-th of the tokens when sequence-parallel."""
        act, d, position = BYTES[self.dtype], self.d, self.spec.position
        out = {}
        for kind in set(self.kinds):
            cross = self.layers[kind]["cross"]
            rank = self._rank_configs(tp)[kind].traffic(d, act, position, cross)
            whole = self.configs[kind][1].traffic(d, act, position, cross)
            split = 1 / tp if sequence_parallel else 1.0
            out[kind] = {
                "attention": rank["attention"],
                "position": rank["position"],
                "ffn": rank["ffn"],
                "norms": whole["norms"] * split,
                "residual": whole["residual"] * split,
            }
        return out

    def head_traffic(self, tp: int, sequence_parallel: bool, compiled_loss: bool) -> Traffic:
        """Memory-bound bytes per token of the last stage's own work: the final norm and the head
        with its loss (the vocabulary a ``tp``-th per rank when sequence-parallel, as
        torchtitan's loss-parallel runs; else whole, as the recipes gather the logits)."""
        act, d = BYTES[self.dtype], self.d
        vocab = self.vocab // tp if sequence_parallel else self.vocab
        head = self.spec.head.traffic(d, vocab, act, compiled_loss)
        last = list(self.spec.stacks().values())[-1]
        norm = last.norm.traffic(d, act) * (1 / tp if sequence_parallel else 1.0) if last.final_norm else Traffic()
        return head + norm

    def stage_counts(self, pp: int, virtual: int = 1) -> list[dict[int, int]]:
        """Per pipeline rank, how many of each kind of layer it holds: the layers split evenly into
        ``pp x virtual`` chunks, rank ``s`` holding chunks ``s, s + pp, ...`` (the looped order)."""
        key = (pp, virtual)
        if key not in self._stages:
            chunks = stage_layers(len(self.layers), pp * virtual)
            out = []
            for s in range(pp):
                counts: dict[int, int] = {}
                for c in range(virtual):
                    for i in chunks[c * pp + s]:
                        counts[self.kinds[i]] = counts.get(self.kinds[i], 0) + 1
                out.append(counts)
            self._stages[key] = out
        return self._stages[key]
