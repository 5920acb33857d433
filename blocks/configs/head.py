"""Output head configs: language-model, BERT masked-LM, classification, none.

``params(d_model, vocab_size, tied)`` counts the head's own tensors (a tied output projection
is the embedding table and is counted there); ``flops(d_model, vocab_size, tokens)`` is one
sequence of ``tokens`` tokens; ``saved_bytes`` takes the run's keywords (``batch``, ``fused``,
``position``: ``yamlformer.blocks.configs.base.HeadBlock``), which a head without layers of its own ignores,
and ``compiled_loss``, which a vocabulary head's loss reads (``yamlformer.blocks.configs.base.loss_saved_bytes``).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from yamlformer.blocks.configs.base import Classes, HeadBlock, Shapes, loss_saved_bytes
from yamlformer.blocks.configs.ffn import Activation
from yamlformer.blocks.configs.norm import LayerNormConfig
from yamlformer.blocks.configs.tensors import hidden, output, prefixed, vector, vocab_classes
from yamlformer.blocks.configs.traffic import Traffic, activation, cross_entropy
from yamlformer.blocks.limits import MAX_FACTOR, MAX_VOCAB
from yamlformer.blocks.registry import register


@register("head", "yamlformer.blocks.heads:LMHead")
class LMHeadConfig(HeadBlock):
    """Projects hidden states to vocabulary logits (tied to the embeddings or not)."""

    projects_to_vocab: ClassVar[bool] = True
    type: Literal["lm"] = "lm"
    bias: bool = Field(False, description="A bias on the output projection.")
    softcap: float | None = Field(
        None, gt=0, le=MAX_FACTOR, description="A float c: logits become c * tanh(logits / c) (Gemma 2)."
    )
    output_scale: float | None = Field(
        None,
        gt=0,
        le=MAX_FACTOR,
        description="Multiply hidden states by this before the projection; T5 with tied "
        "embeddings uses d_model ** -0.5. null: no scaling.",
    )

    examples: ClassVar[list[dict]] = [{}, {"bias": True}, {"softcap": 30.0, "output_scale": 0.5}]

    def params(self, d_model: int, vocab_size: int, tied: bool) -> int:
        return (0 if tied else d_model * vocab_size) + (vocab_size if self.bias else 0)

    def param_shapes(self, d_model: int, vocab_size: int, tied: bool) -> Shapes:
        return _vocab_projection("proj", d_model, vocab_size, tied, self.bias)

    def tensor_classes(self, d_model: int, vocab_size: int, tied: bool) -> Classes:
        return vocab_classes("proj", self.bias)

    def parallel_plan(self) -> dict[str, str]:
        # vocab-parallel logits: each rank projects to its slice of the vocabulary
        return {"proj": "colwise"}

    def flops(self, d_model: int, vocab_size: int, tokens: int) -> int:
        return 2 * tokens * d_model * vocab_size

    def traffic(self, d_model: int, vocab_size: int, act_bytes: int, compiled_loss: bool = False) -> Traffic:
        # the loss; under softcap its division, tanh and product (each read, write; backward read two,
        # write one), fused into one kernel by compile
        a = act_bytes
        softcap = Traffic(6 * a, 9 * a, 2 * a, 3 * a) * vocab_size if self.softcap is not None else Traffic()
        return cross_entropy(vocab_size, a, compiled_loss) + softcap

    def saved_bytes(self, d_model: int, vocab_size: int, tokens: int, act_bytes: int, **run) -> int:
        # the projection input; the logits the caller holds; the loss's (loss_saved_bytes); under
        # softcap the tanh output
        logits = tokens * vocab_size
        softcap = logits * act_bytes if self.softcap is not None else 0
        loss = loss_saved_bytes(tokens, vocab_size, run.get("compiled_loss", False))
        return tokens * d_model * act_bytes + logits * act_bytes + loss + softcap


@register("head", "yamlformer.blocks.heads:MLMHead")
class MLMHeadConfig(HeadBlock):
    """BERT's masked-LM head: dense, activation, norm, then the vocabulary projection with a bias."""

    projects_to_vocab: ClassVar[bool] = True
    type: Literal["mlm"] = "mlm"
    activation: Activation = Field("gelu", description="Activation after the dense transform.")
    norm: LayerNormConfig = Field(
        default_factory=lambda: LayerNormConfig(eps=1e-12),
        description="The norm after the transform (BERT: LayerNorm, eps 1e-12).",
    )

    examples: ClassVar[list[dict]] = [{}, {"activation": "relu", "norm": {"bias": False}}]

    def params(self, d_model: int, vocab_size: int, tied: bool) -> int:
        transform = d_model * d_model + d_model + self.norm.params(d_model)
        return transform + (0 if tied else d_model * vocab_size) + vocab_size

    def param_shapes(self, d_model: int, vocab_size: int, tied: bool) -> Shapes:
        norm = {f"norm.{name}": shape for name, shape in self.norm.param_shapes(d_model).items()}
        return {
            "dense.weight": (d_model, d_model),
            "dense.bias": (d_model,),
            **norm,
            **_vocab_projection("proj", d_model, vocab_size, tied, bias=True),
        }

    def tensor_classes(self, d_model: int, vocab_size: int, tied: bool) -> Classes:
        return {
            "dense.weight": hidden(),
            "dense.bias": vector(),
            **prefixed("norm.", self.norm.tensor_classes(d_model)),
            **vocab_classes("proj", bias=True),
        }

    def parallel_plan(self) -> dict[str, str]:
        return {"proj": "colwise"}  # the transform replicated, the vocabulary split

    def flops(self, d_model: int, vocab_size: int, tokens: int) -> int:
        return 2 * tokens * d_model * (d_model + vocab_size)

    def traffic(self, d_model: int, vocab_size: int, act_bytes: int, compiled_loss: bool = False) -> Traffic:
        # the transform's activation and norm, then the loss
        transform = activation(d_model, act_bytes, gated=False) + self.norm.traffic(d_model, act_bytes)
        return transform + cross_entropy(vocab_size, act_bytes, compiled_loss)

    def saved_bytes(self, d_model: int, vocab_size: int, tokens: int, act_bytes: int, **run) -> int:
        # dense input, activation input and output (the norm's input), the norm, then as lm
        norm = self.norm.saved_bytes(d_model, tokens, act_bytes)
        transform = 2 * tokens * d_model * act_bytes + norm
        loss = loss_saved_bytes(tokens, vocab_size, run.get("compiled_loss", False))
        return transform + tokens * d_model * act_bytes + tokens * vocab_size * act_bytes + loss


@register("head", "yamlformer.blocks.heads:ClassificationHead")
class ClassificationHeadConfig(HeadBlock):
    """Pools the sequence and projects to class logits (one prediction per sequence)."""

    type: Literal["classification"] = "classification"
    n_classes: int = Field(2, ge=1, le=MAX_VOCAB, description="Number of classes.")
    pooling: Literal["first", "mean"] = Field(
        "first", description="first: the first token's state (BERT's [CLS]); mean: the mean over non-pad tokens."
    )
    pooler: bool = Field(False, description="BERT's pooler: a dense layer with tanh before the classifier.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout before the classifier.")

    examples: ClassVar[list[dict]] = [
        {},
        {"n_classes": 3, "pooling": "mean"},
        {"pooler": True, "dropout": 0.1},
        {"pooler": True, "pooling": "mean", "n_classes": 5},
    ]

    def params(self, d_model: int, vocab_size: int, tied: bool) -> int:
        pooler = d_model * d_model + d_model if self.pooler else 0
        return pooler + d_model * self.n_classes + self.n_classes

    def param_shapes(self, d_model: int, vocab_size: int, tied: bool) -> Shapes:
        pooler = {"pooler.weight": (d_model, d_model), "pooler.bias": (d_model,)} if self.pooler else {}
        return {**pooler, "classifier.weight": (self.n_classes, d_model), "classifier.bias": (self.n_classes,)}

    def tensor_classes(self, d_model: int, vocab_size: int, tied: bool) -> Classes:
        pooler = {"pooler.weight": hidden(), "pooler.bias": vector()} if self.pooler else {}
        return {**pooler, "classifier.weight": output(), "classifier.bias": vector(None)}

    def flops(self, d_model: int, vocab_size: int, tokens: int) -> int:
        return 2 * d_model * ((d_model if self.pooler else 0) + self.n_classes)


@register("head", "yamlformer.blocks.heads:NoHead")
class NoHeadConfig(HeadBlock):
    """No head: the model returns the final hidden states."""

    type: Literal["none"] = "none"
    examples: ClassVar[list[dict]] = [{}]


def _vocab_projection(name: str, d_model: int, vocab_size: int, tied: bool, bias: bool) -> Shapes:
    """A (vocab_size, d_model) projection's tensors; a tied weight is the embedding table's."""
    shapes = {} if tied else {f"{name}.weight": (vocab_size, d_model)}
    return {**shapes, **({f"{name}.bias": (vocab_size,)} if bias else {})}
