"""One way to build any registered block: ``build_block(config, dims, **extra)``; and one way to
build a layer of blocks: ``build_layer(layer, dims, layer_index=..., n_layers=..., ...)``.

The module class comes from the registry (``yamlformer.blocks.registry.module_class(config)``, the
config's ``module_path``). Its constructor takes the config first and then only the dimensions
it needs, by name (``MLP(config, d_model)``, ``Learned(config, d_model, max_seq_len)``);
``build_block`` fills each from ``extra`` (per-call arguments such as ``causal`` or
``tied_embedding``) or else from ``dims``. A block never sees the whole spec.

Every block built for a layer may take its place by name: ``layer_index`` (0-based) and
``n_layers`` (of its stack; a head's own layers count on after its stack's). An argument a
constructor does not name is not passed.
"""

from __future__ import annotations

import dataclasses
import inspect

from torch import nn

from yamlformer.blocks import registry
from yamlformer.blocks.layers import TransformerLayer


@dataclasses.dataclass(frozen=True)
class Dims:
    """Dimensions shared by the blocks of one model (or one stack)."""

    d_model: int
    vocab_size: int
    max_seq_len: int
    #: the rows of the embedding table and output projection (``vocab_size`` padded; None: the same)
    padded_vocab_size: int | None = None
    n_heads: int | None = None  # the stack's query heads (T5's relative bias table)
    rotary_head_dim: int | None = None  # the width an attention-side position rotates


_SIGNATURES: dict[type, list[inspect.Parameter]] = {}


def _parameters(cls: type) -> list[inspect.Parameter]:
    if cls not in _SIGNATURES:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # drop self
        _SIGNATURES[cls] = params[1:]  # drop config
    return _SIGNATURES[cls]


def build_block(config, dims: Dims, **extra) -> nn.Module:
    """Build the ``nn.Module`` registered for ``config``."""
    cls = registry.module_class(config)
    kwargs = {}
    for param in _parameters(cls):
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.name in extra:
            kwargs[param.name] = extra[param.name]
        elif hasattr(dims, param.name) and getattr(dims, param.name) is not None:
            kwargs[param.name] = getattr(dims, param.name)
        elif param.default is inspect.Parameter.empty:
            raise TypeError(
                f"{cls.__qualname__} needs {param.name!r}, which neither the shared dimensions "
                f"({', '.join(f.name for f in dataclasses.fields(Dims))}) nor the call provide"
            )
    return cls(config, **kwargs)


def build_layer(
    layer,
    dims: Dims,
    *,
    layer_index: int,
    n_layers: int,
    causal: bool,
    cross: bool = False,
    backend: str = "auto",
) -> TransformerLayer:
    """The ``TransformerLayer`` of a ``yamlformer.blocks.configs.layer.LayerConfig``: its self-attention,
    cross-attention (``cross``), FFN and norms, each told its place."""
    place = {"layer_index": layer_index, "n_layers": n_layers}
    attention = build_block(layer.attention, dims, causal=causal, cross=False, backend=backend, **place)
    cross_attention = build_block(layer.cross_attention, dims, cross=True, backend=backend, **place) if cross else None
    ffn = build_block(layer.ffn, dims, **place)
    norms = {name: build_block(layer.norm, dims, **place) for name in layer.norm_names(cross)}
    return TransformerLayer(
        attention,
        ffn,
        norms,
        cross_attention=cross_attention,
        placement=layer.norm.placement,
        dropout=layer.dropout,
        parallel_residual=layer.parallel_residual,
    )
