"""Our state-dict names, in one place (``yamlformer.blocks.stacks``, ``yamlformer.blocks.layers``,
``yamlformer.blocks.heads``).

Every family table names our tensors through these helpers, so a renamed module is one edit
here. ``stack`` is ``"encoder"`` or ``"decoder"``; a layer's sub-layers are ``"attention"``,
``"cross_attention"`` and ``"ffn"``.
"""

from __future__ import annotations


def token_embedding(stack: str) -> str:
    return f"{stack}.embedding.tokens.weight"


def segment_embedding(stack: str) -> str:
    return f"{stack}.embedding.segments.weight"


def embedding_norm(stack: str) -> str:
    return f"{stack}.embedding.norm"


def learned_positions(stack: str) -> str:
    return f"{stack}.position.weight"


def relative_bias(stack: str) -> str:
    return f"{stack}.position.weight"


def layer(stack: str, i: int) -> str:
    return f"{stack}.layers.{i}"


def attention(stack: str, i: int, which: str = "attention") -> str:
    return f"{stack}.layers.{i}.{which}"


def ffn(stack: str, i: int) -> str:
    return f"{stack}.layers.{i}.ffn"


def layer_norm(stack: str, i: int, sublayer: str, post: bool = False) -> str:
    """The norm of one sub-layer (``*_post_norm``: the second norm of a sandwich)."""
    return f"{stack}.layers.{i}.{sublayer}_{'post_' if post else ''}norm"


def final_norm(stack: str) -> str:
    return f"{stack}.final_norm"


def head_projection() -> str:
    return "head.proj.weight"


def head_bias() -> str:
    return "head.proj.bias"


def head(part: str) -> str:
    """A head's own module (``dense``, ``norm`` of BERT's MLM head)."""
    return f"head.{part}"
