"""Assemble a PyTorch model from a validated spec: ``build_model(spec)``.

Assembly walks the spec and builds every block through ``yamlformer.blocks.build.build_block``, then hands
the built children to their parents (torchtune style): a layer gets its attention, FFN and
norms (``yamlformer.blocks.build.build_layer``, which tells each its place: ``layer_index``, ``n_layers``);
a stack its embedding, position block, layers and final norm; the model its stacks and head.
A spec's ``adapters`` are attached to the linear layers they target once the base is built
(``yamlformer.blocks.linear``); after the weights are initialised, every parameter but the
adapters' is frozen and, with ``quantize: nf4``, the layers' base weights become NF4.
Blocks are constructed directly on the target device (``device="meta"``: shapes only, instant
even for 175B parameters, no init work) and then initialised by
``yamlformer.blocks.init.init_weights`` (``init_seed``, else a seed drawn from torch's generator: seed with
``torch.manual_seed`` before calling; each parameter's values are a pure function of that seed
and its name, so a sharded start can draw any shard alone). Building on meta
and materialising with ``to_empty`` would skip the constructors' default init, but the first
meta operation of a process imports PyTorch's meta kernels (about a second), too slow for the
tiny specs a test builds.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from yamlformer.blocks import registry
from yamlformer.blocks.build import Dims, build_block, build_layer
from yamlformer.blocks.embeddings import Embeddings
from yamlformer.blocks.init import draw_seed, init_weights
from yamlformer.blocks.linear import AdaptedLayer, adapter_parameters
from yamlformer.blocks.stacks import TransformerStack
from yamlformer.builder.adapters import adapted, quantized
from yamlformer.builder.parametrization import head_for_build, is_mup, layer_for_build
from yamlformer.builder.parametrization import plan as parametrization_plan
from yamlformer.builder.spec.loader import load_spec
from yamlformer.builder.spec.schema import ModelSpec
from yamlformer.kernels.attention import BACKENDS  # the attention backends a model may be built with


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None):
    if dtype is None:
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


#: dtype names ``build_model`` takes besides ``torch.dtype`` objects
DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp64": torch.float64,
    "float64": torch.float64,
}


def build_model(
    spec,
    device=None,
    dtype: torch.dtype | str | None = None,
    attention_backend: str = "auto",
    init_seed: int | None = None,
) -> nn.Module:
    """The ``nn.Module`` a spec describes: a validated ``ModelSpec``, a mapping of spec fields or
    a path to a spec file (both loaded with ``yamlformer.builder.load_spec``).

    ``device``: where the parameters live (``"meta"``: shapes only, no memory, no init);
    ``dtype``: their floating dtype, a ``torch.dtype`` or a name (``"bf16"``; default: torch's
    default, fp32); ``attention_backend``: ``auto`` | ``eager`` | ``sdpa`` | ``triton``, used by
    every attention layer (see ``yamlformer.kernels.attention``); ``init_seed``: the seed of the initial
    weights (default: drawn from torch's global generator).
    """

    if attention_backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {attention_backend!r}")
    if not isinstance(spec, ModelSpec):
        spec = load_spec(spec)  # a path or a mapping; anything else is a TypeError saying what to pass
    dtype = _dtype(dtype)
    device = _device(device)
    if init_seed is not None and (isinstance(init_seed, bool) or not isinstance(init_seed, int)):
        raise TypeError(f"init_seed must be an int, got {init_seed!r}")
    seed = init_seed if init_seed is not None else draw_seed()  # drawn first: the same on every device
    with device, _default_dtype(dtype):
        model = _assemble(spec, attention_backend)
        _attach_adapters(model, spec)
    if is_mup(spec):
        _parametrize(model, parametrization_plan(spec))
    init_weights(model, seed=seed)  # a no-op on meta
    _freeze_base(model, spec)
    model.spec = spec
    return model


def _attach_adapters(model: nn.Module, spec) -> None:
    """The spec's adapter on every linear layer its targets select (``yamlformer.builder.adapters``)."""
    if spec.adapters is None:
        return
    adapter = registry.module_class(spec.adapters)
    for path in adapted(spec):
        linear = model.get_submodule(path)
        if not isinstance(linear, AdaptedLayer):  # a plugin's block built a plain nn.Linear
            raise ValueError(
                f"adapters: {path} is a {type(linear).__module__}.{type(linear).__qualname__}, not a "
                "yamlformer.blocks.linear.Linear: its block builds it so (blocks/README.md), or leaves it out of "
                "its config's linear_layers"
            )
        linear.attach(adapter(spec.adapters, linear))


def _freeze_base(model: nn.Module, spec) -> None:
    """With adapters, only they train; ``quantize: nf4`` stores the frozen layers' weights as NF4."""
    if spec.adapters is None:
        return
    trained = {id(p) for p in adapter_parameters(model).values()}
    for param in model.parameters():
        if id(param) not in trained:
            param.requires_grad_(False)
    for path in quantized(spec):
        model.get_submodule(path).quantize()


class OutputMultiplier:
    """A forward pre-hook multiplying a module's input by ``factor``: muP's output multiplier on
    the module of an output-like tensor (``yamlformer.builder.parametrization``), as ``MuReadout`` scales
    its input (a bias, where there is one, is left as it is)."""

    def __init__(self, factor: float):
        self.factor = factor

    def __call__(self, module, args):
        return (args[0] * self.factor, *args[1:])


def _parametrize(model: nn.Module, made) -> None:
    """The parametrization's init factors (read by ``yamlformer.blocks.init``) and output multipliers."""
    model.init_scales = made.init_scales()
    modules = dict(model.named_modules())
    for name, factor in made.output_multipliers.items():
        modules[name].register_forward_pre_hook(OutputMultiplier(factor))


def _dtype(dtype) -> torch.dtype | None:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be a floating torch.dtype or one of {', '.join(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype (torch.bfloat16) or its name ('bf16'), got {dtype!r}")
    return dtype


def _device(device) -> torch.device:
    """``device`` as a ``torch.device`` that exists here; ``ValueError`` says what to pass."""
    if device is None:
        return torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(
            f"device must be 'cpu', 'cuda', 'cuda:N', 'meta' (or another torch.device), got {device!r}"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {str(device)!r}: CUDA is not available here (no GPU, or a torch built "
                "without CUDA); use 'cpu' or 'meta'"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r}: this machine has {torch.cuda.device_count()} CUDA devices")
    return device


def _assemble(spec, backend: str) -> nn.Module:
    dims = Dims(
        d_model=spec.d_model,
        vocab_size=spec.vocab_size,
        max_seq_len=spec.max_seq_len,
        padded_vocab_size=spec.padded_vocab_size,
    )
    architecture = spec.architecture_config
    stacks: dict[str, TransformerStack] = {}
    shared_embedding = None
    for name, stack_config in spec.stacks().items():
        if spec.share_encoder_decoder_embeddings and shared_embedding:
            embedding = shared_embedding
        else:
            embedding = shared_embedding = _embedding(spec, dims)
        cross = name in architecture.memory_of
        stacks[name] = _stack(spec, dims, stack_config, embedding, architecture.causal[name], cross, backend)
    output_side = stacks[architecture.stacks[-1]]
    tied = output_side.embedding.tokens if spec.tie_embeddings and type(spec.head).projects_to_vocab else None
    # a head running layers of its own numbers them after its stack's (n_layers) and uses its backend
    head = build_block(
        head_for_build(spec, spec.head), dims, tied_embedding=tied, n_layers=output_side.n_layers, backend=backend
    )
    return registry.module_class(architecture)(**stacks, head=head)


def _embedding(spec, dims: Dims) -> Embeddings:
    section = spec.embedding
    norm = build_block(section.norm, dims) if section.norm is not None else None
    return Embeddings(
        dims.padded_vocab_size or dims.vocab_size,
        dims.d_model,
        scale=section.scale,
        segments=section.segments,
        norm=norm,
        dropout=section.dropout,
        scale_in_model_dtype=section.scale_in_model_dtype,
    )


def _stack(spec, dims: Dims, stack_config, embedding, causal: bool, cross: bool, backend: str) -> TransformerStack:
    attention = stack_config.attention
    stack_dims = dataclasses.replace(
        dims, n_heads=attention.query_heads(), rotary_head_dim=attention.rotary_head_dim(dims.d_model)
    )
    position = build_block(spec.position, stack_dims, causal=causal)
    layers = [
        build_layer(
            layer, dims, layer_index=index, n_layers=stack_config.n_layers, causal=causal, cross=cross, backend=backend
        )
        for index, layer in enumerate(layer_for_build(spec, layer) for layer in stack_config.layers())
    ]
    final_norm = build_block(stack_config.norm, dims) if stack_config.final_norm else None
    return TransformerStack(embedding, position, layers, final_norm, causal=causal, max_seq_len=dims.max_seq_len)
