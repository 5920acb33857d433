"""Stacks of layers and the three model architectures built from them.

A :class:`TransformerStack` owns its embedding (shared between the encoder and decoder of an
encoder-decoder when the spec says so), its position block (one per stack: a learned table or
T5's relative-bias table is shared by that stack's layers), its layers and its final norm. It
computes positions and padding once per forward and hands them to every layer.

Forward contract (Hugging Face conventions; ``attention_mask`` is 1 for real tokens, 0 for
padding):

* :class:`DecoderOnlyModel`, :class:`EncoderOnlyModel`:
  ``model(input_ids, attention_mask=None, token_type_ids=None, *, document_ids=None)`` -> the
  head's logits: ``(batch, seq, vocab_size)``, ``(batch, n_classes)`` for classification,
  hidden states for head ``none``.
* :class:`EncoderDecoderModel`: ``model(input_ids, attention_mask=None, decoder_input_ids=...,
  decoder_attention_mask=None)`` -> the head's logits over the decoder positions.

Auxiliary training losses go through one channel, :meth:`_Model.aux_losses` after a forward: the
head's (returned with its logits, already weighted by their spec fields: multi-token prediction)
and, under :data:`MOE_BALANCE`, every block's load-balancing loss summed, times the weight a
recipe gives (its ``loss.moe_aux_coef``). A forward without a KV cache gives the head a
``yamlformer.blocks.heads.HeadContext`` (the input ids, the stack's embedding and attention inputs); a cached
forward (decoding) gives none, and the head computes its logits only.

Position ids are ``cumsum(attention_mask) - 1`` when a mask is given (a left-padded sequence
starts at position 0, as in Hugging Face), else ``0 .. seq - 1`` after any cached tokens.

Packed documents: ``document_ids`` ``(batch, seq)``, the document of each token within its row,
non-decreasing along the row (``[0, 0, 0, 1, 1, 2, 2, 2]``), makes each document of a packed row
what it is alone: no query attends across documents (causally in a causal stack, both ways in
an encoder; a sliding window still applies inside a document) and positions restart at 0 at
each document's first token (``yamlformer.blocks.positions.document_positions``), for every position
block. Every attention block of the stack must declare ``document_masking``
(``yamlformer.blocks.attention``'s protocol). It is refused with a KV cache, with ``attention_mask`` (give
padding a document of its own instead) and in an encoder-decoder. A pooling head
(classification) still pools the whole row.
"""

from __future__ import annotations

import torch
from torch import nn

from yamlformer.blocks.attention import AttentionInputs
from yamlformer.blocks.generation import GenerationMixin
from yamlformer.blocks.heads import HeadContext, HeadOutput
from yamlformer.blocks.positions import document_positions

#: the key of the blocks' load-balancing losses in :meth:`_Model.aux_losses` (their sum, weighted there)
MOE_BALANCE = "moe_balance"


class TransformerStack(nn.Module):
    def __init__(
        self,
        embedding: nn.Module,
        position: nn.Module,
        layers: list[nn.Module],
        final_norm: nn.Module | None,
        *,
        causal: bool,
        max_seq_len: int | None = None,
    ):
        super().__init__()
        self.max_seq_len = max_seq_len  # positions beyond it are refused (None: no limit)
        self.embedding = embedding  # None in a pipeline stage after the first (it takes hidden states)
        #: whether forward looks token ids up in the embedding (False: hidden states come in; the last
        #: stage of a tied model holds the table for its head without running it)
        self.embeds = embedding is not None
        self.position = position
        self.layers = layers if isinstance(layers, LayerRange) else nn.ModuleList(layers)
        self.final_norm = final_norm
        self.causal = causal
        self.stack_layers = len(self.layers)  # the whole stack's (a pipeline part holds some of them)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def pipeline_part(self, layers: list[int], hold_embedding: bool = False) -> TransformerStack:
        """The part of this stack a pipeline stage holds: the layers numbered ``layers`` (of the
        whole stack, each under its own index, so parameter names stay the whole model's), the
        embedding with layer 0 (else the part takes hidden states; ``hold_embedding``: it holds the
        embedding without running it, for a head tied to it, so the table keeps the whole model's
        name), the final norm with the last layer, the position block where it acts (in attention:
        every part; on the embedding: the first). Modules are shared with this stack, not copied.
        ValueError when the stack cannot be cut: a position block with weights every layer's
        attention reads (T5's bias)."""
        held = {int(k): m for k, m in self.layers._modules.items()}
        missing = [i for i in layers if i not in held]
        if missing or not layers:
            raise ValueError(f"a pipeline part needs layers this stack holds ({sorted(held)}), got {layers}")
        first, last = 0 in layers, self.stack_layers - 1 in layers
        in_attention = self.position is not None and self.position.acts_on == "attention"
        if in_attention and any(True for _ in self.position.parameters()) and not (first and last):
            raise ValueError(
                f"position {type(self.position).__name__} has weights every layer's attention reads; "
                "pipeline stages cannot split them"
            )
        part = TransformerStack(
            self.embedding if first or hold_embedding else None,
            self.position if in_attention or first else None,
            LayerRange({i: held[i] for i in sorted(layers)}),
            self.final_norm if last else None,
            causal=self.causal,
            max_seq_len=self.max_seq_len,
        )
        part.stack_layers = self.stack_layers
        part.embeds = first
        return part

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        *,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        cache=None,
        document_ids: torch.Tensor | None = None,
        token_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states ``(batch, seq, d_model)`` of ``input_ids`` ``(batch, seq)`` (:meth:`run`)."""
        return self.run(
            input_ids,
            attention_mask,
            token_type_ids,
            memory=memory,
            memory_mask=memory_mask,
            cache=cache,
            document_ids=document_ids,
            token_index=token_index,
        )[0]

    def run(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        *,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        cache=None,
        document_ids: torch.Tensor | None = None,
        token_index: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, AttentionInputs]:
        """Hidden states ``(batch, seq, d_model)`` of ``input_ids`` ``(batch, seq)``, and the
        ``AttentionInputs`` its layers were given (a head runs its own layers over them).

        With a ``cache`` (``yamlformer.blocks.generation.KVCache``) the ids are the tokens after the cached
        ones and ``attention_mask`` covers the cached and the new tokens. ``document_ids``
        ``(batch, seq)``: the documents packed in each row (module doc); a ValueError naming it
        when it is not an integer tensor of ``input_ids``' shape, decreases along a row, or
        comes with a ``cache``, an ``attention_mask``, a ``memory`` or an attention block that
        does not declare ``document_masking``. ``token_index`` ``(seq,)``: where each token sits
        in the whole sequence when these are a context-parallel rank's share of it
        (``yamlformer.recipes.parallel.context``); the positions are those indices, and the attention layers
        (``use_context_parallel``) mask by them. Not with a cache, a mask or documents.
        """
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(
                f"input_ids must be a torch.Tensor of token ids (batch, seq), got {type(input_ids).__name__}"
            )
        embedded = not self.embeds  # a pipeline stage after the first: hidden states come in
        if input_ids.dim() != (3 if embedded else 2):
            shape = "hidden states (batch, seq, d_model)" if embedded else "(batch, seq)"
            raise ValueError(f"input_ids must be {shape}, got shape {tuple(input_ids.shape)}")
        if embedded and (cache is not None or attention_mask is not None or document_ids is not None):
            raise ValueError("a pipeline stage after the first takes hidden states alone (no cache, mask or documents)")
        batch, seq = input_ids.shape[:2]
        start = cache.length if cache is not None else 0
        if self.max_seq_len is not None and start + seq > self.max_seq_len:
            raise ValueError(
                f"{start + seq} positions ({start} cached + {seq} new) exceed the model's max_seq_len "
                f"{self.max_seq_len}; shorten the input (or build the model with a longer max_seq_len)"
            )
        if token_index is not None:
            if cache is not None or attention_mask is not None or document_ids is not None:
                raise ValueError(
                    "token_index (a context-parallel share) takes no cache, attention_mask or document_ids"
                )
            if tuple(token_index.shape) != (seq,):
                raise ValueError(f"token_index must be (seq,) = ({seq},), got shape {tuple(token_index.shape)}")
            shared = token_index[None]  # (1, seq): every row's positions
            positions = shared.expand(batch, seq)
        elif document_ids is not None:
            self._check_documents(document_ids, input_ids, attention_mask, cache, memory)
            positions = document_positions(document_ids)  # (batch, seq): 0 at each document's first token
            shared = positions
        elif attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor):
                raise TypeError(
                    f"attention_mask must be a torch.Tensor (batch, seq) of 1s and 0s, "
                    f"got {type(attention_mask).__name__}"
                )
            if tuple(attention_mask.shape) != (batch, start + seq):
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)}; expected "
                    f"(batch, cached + new tokens) = {(batch, start + seq)}"
                )
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, start:]  # (batch, seq)
            shared = positions
        else:
            shared = torch.arange(start, start + seq, device=input_ids.device)[None]  # (1, seq): every row's
            positions = shared.expand(batch, seq)
        position = self.position
        in_attention = position is not None and position.acts_on == "attention"
        # Embedded once for rows that share their positions and broadcast in the sum: a learned
        # table's backward then accumulates seq rows, not batch * seq (a few % of a small model's step).
        if embedded:
            x = input_ids
        else:
            x = self.embedding(input_ids, token_type_ids, None if in_attention else position(shared))
        inputs = AttentionInputs(
            start,
            seq,
            positions=positions,
            key_mask=attention_mask,
            position=position if in_attention else None,
            document_ids=document_ids,
            query_index=token_index,
        )
        if cache is None:
            # The stack's shared score bias (padding, a relative-bias table) is built here, outside
            # the layers, so that a layer recomputed under activation checkpointing reads the same
            # tensor instead of building (and saving for backward) its own.
            attention = self.layers[0].attention  # all its heads (a tensor-parallel rank computes a share)
            inputs.bias(0, seq, getattr(attention, "total_heads", attention.n_heads), x.device)
        x = self._layers(x, inputs, cache, memory, memory_mask)
        if cache is not None:
            cache.length += seq
        return x, inputs

    def _check_documents(self, document_ids, input_ids, attention_mask, cache, memory) -> None:
        """Refuse ``document_ids`` this forward cannot honour (see :meth:`forward`)."""
        if not isinstance(document_ids, torch.Tensor):
            raise TypeError(
                f"document_ids must be a torch.Tensor (batch, seq) of document indices, "
                f"got {type(document_ids).__name__}"
            )
        if tuple(document_ids.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"document_ids has shape {tuple(document_ids.shape)}; expected input_ids' "
                f"(batch, seq) = {tuple(input_ids.shape)}"
            )
        if document_ids.dtype == torch.bool or document_ids.is_floating_point() or document_ids.is_complex():
            raise ValueError(
                f"document_ids must be an integer tensor (a document index per token), got {document_ids.dtype}"
            )
        if document_ids.device != input_ids.device:
            raise ValueError(f"document_ids is on {document_ids.device} but input_ids is on {input_ids.device}")
        if cache is not None:
            raise ValueError(
                "document_ids cannot be combined with a KV cache (cache=...): decode one "
                "document per row, or run packed documents without a cache"
            )
        if attention_mask is not None:
            raise ValueError(
                "document_ids cannot be combined with attention_mask: give padding tokens a "
                "document of their own (and no loss) instead"
            )
        if memory is not None:
            raise ValueError(
                "document_ids is not supported with cross-attention (an encoder-decoder): "
                "its queries would read every document of the source row"
            )
        unsupported = next((name for layer in self.layers if (name := layer.document_masking()) is not None), None)
        if unsupported is not None:
            raise ValueError(
                f"document_ids needs every attention block to keep documents apart; {unsupported} "
                "does not declare document_masking (blocks/README.md)"
            )
        # From the values only where reading them costs no device sync and breaks no compiled graph
        # (eager, on the CPU), as the learned position table does; elsewhere the documents are the
        # runs of equal ids along the row whatever their order.
        if document_ids.device.type == "cpu" and not torch.compiler.is_compiling() and document_ids.shape[1] > 1:
            drops = (document_ids[:, 1:] < document_ids[:, :-1]).nonzero()
            if len(drops):
                row, token = drops[0].tolist()
                raise ValueError(
                    f"document_ids must be non-decreasing along each row; row {row} goes from "
                    f"{int(document_ids[row, token])} to {int(document_ids[row, token + 1])} "
                    f"at token {token + 1}"
                )

    def static_decode(self) -> str | None:
        """None when every layer can take :meth:`step`; else the attention block that cannot."""
        return next((name for layer in self.layers if (name := layer.static_decode()) is not None), None)

    def step(
        self,
        input_ids: torch.Tensor,
        index: torch.Tensor,
        position_ids: torch.Tensor,
        cache,
        key_mask: torch.Tensor | None = None,
        *,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One static decoding step: hidden states ``(batch, 1, d_model)`` of the token
        ``input_ids`` ``(batch, 1)`` at token index ``index`` (a ``(1,)`` long tensor), over a
        ``cache`` that holds the tokens before it (``yamlformer.blocks.cache``: every attention writes its
        slot and attends over its whole buffer). ``position_ids`` ``(batch, total)`` and
        ``key_mask`` ``(batch, total)`` (None: no padding) cover every token the cache was
        allocated for; the step reads them at ``index``. No shape or Python value depends on
        ``index``, so ``torch.compile`` traces it once (``fullgraph``, static shapes); nothing
        is checked here that costs a sync (``generate`` checks the lengths up front) and the
        caller counts the token (``cache.advance(1)``) outside it.
        """
        positions = position_ids.index_select(1, index)  # (batch, 1)
        position = self.position
        in_attention = position.acts_on == "attention"
        x = self.embedding(input_ids, None, None if in_attention else position(positions))
        inputs = AttentionInputs(
            0, 1, positions=positions, key_mask=key_mask, position=position if in_attention else None, index=index
        )
        return self._layers(x, inputs, cache, memory, memory_mask)

    def _layers(self, x, inputs: AttentionInputs, cache, memory, memory_mask) -> torch.Tensor:
        """Every layer, then the final norm."""
        memory_inputs = AttentionInputs(0, x.shape[1], key_mask=memory_mask) if memory is not None else None
        for i, layer in enumerate(self.layers):
            layer_cache = cache.layers[i] if cache is not None else None
            x = layer(x, inputs, cache=layer_cache, memory=memory, memory_inputs=memory_inputs)
        return self.final_norm(x) if self.final_norm is not None else x


class LayerRange(nn.ModuleList):
    """Some of a stack's layers (a pipeline stage's), each registered under its index in the
    whole stack (``layers.3``), so parameter names, init seeds and checkpoint keys are the whole
    model's; indexed and iterated by position like a list."""

    def __init__(self, layers: dict[int, nn.Module]):
        nn.Module.__init__(self)
        for index, layer in layers.items():
            self.add_module(str(index), layer)

    def __getitem__(self, idx):
        return list(self._modules.values())[idx]


class _Model(nn.Module):
    """What every architecture shares: ``spec`` (set by ``yamlformer.builder.build_model``), parameter
    counts, the head call and the auxiliary losses (module doc)."""

    spec = None
    _head_losses: dict[str, torch.Tensor] = {}  # the head's, from the last forward

    def scores_positions(self) -> bool:
        """Whether a forward may be given ``scored`` (the head computes each position's logits
        alone: ``per_position``, ``yamlformer.blocks.heads``)."""
        return bool(getattr(self.head, "per_position", False))

    def _head_logits(self, hidden, mask, stack: TransformerStack, input_ids, inputs, cache, scored=None):
        """The head's logits; its losses kept for :meth:`aux_losses`. A cached forward gives the
        head no context (decoding uses the main head only). ``scored`` ``(batch, seq)`` bool: the
        logits of those positions only, ``(n, vocab)`` in row-major order (:meth:`scores_positions`)."""
        if self.head is None:  # a pipeline stage before the last: its hidden states go on
            return hidden
        if scored is not None:
            if not self.scores_positions():
                raise ValueError(
                    f"scored: head {type(self.head).__name__} computes its logits over whole rows "
                    "(no per_position); score every position"
                )
            if scored.shape != hidden.shape[:2]:
                raise ValueError(f"scored: shape {tuple(scored.shape)}, the hidden states' {tuple(hidden.shape[:2])}")
            hidden, mask = hidden[scored], None  # (n, d_model)
        context = HeadContext(input_ids, stack.embedding, inputs) if cache is None and stack.embeds else None
        out = self.head(hidden, mask, None if scored is not None else context)
        if not isinstance(out, HeadOutput):
            raise TypeError(
                f"a head returns yamlformer.blocks.heads.HeadOutput(logits, losses); "
                f"{type(self.head).__name__} returned {type(out).__name__} (blocks/README.md, the head protocol)"
            )
        self._head_losses = out.losses
        return out.logits

    def stacks(self) -> dict[str, TransformerStack]:
        return {name: getattr(self, name) for name in ("encoder", "decoder") if hasattr(self, name)}

    def pipeline_layers(self) -> int:
        """The layers a pipeline cuts into stages (the one stack's); ValueError for a model of
        several stacks (an encoder-decoder), which stages cannot cut."""
        stacks = self.stacks()
        if len(stacks) != 1:
            raise ValueError(f"pipeline stages cut one stack; {type(self).__name__} has {', '.join(stacks)}")
        return next(iter(stacks.values())).stack_layers

    def pipeline_part(self, layers: list[int]) -> _Model:
        """The model a pipeline stage (or a rank's stages together) holds: the same architecture
        with only the stack's layers numbered ``layers`` (:meth:`TransformerStack.pipeline_part`:
        the embedding with the first, the final norm with the last) and the head with the last.
        It shares this model's modules and parameter names: the last stage of a model whose head
        is tied to its embedding holds the embedding too (not run), so the tied table is named as
        the whole model names it there as well. Its forward takes token ids when it runs the
        embedding, else hidden states ``(batch, seq, d_model)``, and returns the head's logits when
        it has the head, else hidden states."""
        self.pipeline_layers()
        ((name, stack),) = self.stacks().items()
        last = stack.stack_layers - 1 in layers
        part_stack = stack.pipeline_part(list(layers), hold_embedding=last and self.tied_head())
        part = type(self)(**{name: part_stack}, head=self.head if last else None)
        part.spec = self.spec
        return part

    def tied_head(self) -> bool:
        """Whether the head shares a tensor with the (one) stack's embedding (``tie_embeddings``)."""
        stack = next(iter(self.stacks().values()))
        if self.head is None or stack.embedding is None:
            return False
        table = {id(p) for p in stack.embedding.parameters()}
        return any(id(p) in table for p in self.head.parameters())

    def n_params(self) -> int:
        """Parameters, tied and shared tensors counted once."""
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Let every block that keeps training state outside its gradients update it (a block
        module's ``after_optimizer_step()``: DeepSeek-V3's load-balancing expert bias). Training
        loops call this once after each optimizer step."""
        for module in self.modules():
            hook = getattr(module, "after_optimizer_step", None)
            if module is not self and callable(hook):
                hook()

    def generate(self, *args, **kwargs):
        """Models without a causal decoder do not generate (decoder-only and encoder-decoder
        models get ``yamlformer.blocks.generation.GenerationMixin.generate``)."""
        raise TypeError(
            f"{type(self).__name__} has no causal decoder to generate with (an encoder-only model "
            "labels or fills masks: call model(input_ids) for its logits)"
        )

    def aux_loss(self) -> torch.Tensor:
        """The sum of every MoE block's load-balancing loss from the last forward (0 without MoE)."""
        losses = [m.aux_loss for m in self.modules() if isinstance(getattr(m, "aux_loss", None), torch.Tensor)]
        if not losses:
            return torch.zeros((), device=next(self.parameters()).device)
        return torch.stack(losses).sum()

    def has_aux_losses(self) -> bool:
        """Whether a forward leaves auxiliary losses (:meth:`aux_losses`): a block keeps a
        balancing loss (its ``aux_loss`` attribute) or the head names losses it returns
        (``loss_names``). Known before any forward."""
        return bool(getattr(self.head, "loss_names", ())) or any("aux_loss" in vars(m) for m in self.modules())

    def aux_losses(self, balance_weight: float = 1.0) -> dict[str, torch.Tensor]:
        """The auxiliary training losses of the last forward, by name, each weighted: the head's
        (by their own spec fields) and, under :data:`MOE_BALANCE`, the sum of every block's
        load-balancing loss times ``balance_weight`` (a recipe's ``loss.moe_aux_coef``)."""
        losses = dict(self._head_losses)
        balance = [m.aux_loss for m in self.modules() if isinstance(getattr(m, "aux_loss", None), torch.Tensor)]
        if balance:
            losses[MOE_BALANCE] = balance_weight * torch.stack(balance).sum()
        return losses


class DecoderOnlyModel(GenerationMixin, _Model):
    """A causal stack and a head (GPT, Llama)."""

    def __init__(self, decoder: TransformerStack, head: nn.Module):
        super().__init__()
        self.decoder = decoder
        self.head = head

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        *,
        cache=None,
        document_ids: torch.Tensor | None = None,
        token_index: torch.Tensor | None = None,
        scored: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The head's logits for ``input_ids`` ``(batch, seq)``; ``document_ids``: the documents
        packed in each row (module doc; not with ``cache`` or ``attention_mask``); ``token_index``:
        the tokens' places in the whole sequence, for a context-parallel share (:meth:`TransformerStack.run`);
        ``scored``: only those positions' logits, ``(n, vocab)`` (:meth:`_Model._head_logits`)."""
        hidden, inputs = self.decoder.run(
            input_ids, attention_mask, token_type_ids, cache=cache, document_ids=document_ids, token_index=token_index
        )
        mask = attention_mask[:, -input_ids.shape[1] :] if attention_mask is not None else None
        return self._head_logits(hidden, mask, self.decoder, input_ids, inputs, cache, scored)


class EncoderOnlyModel(_Model):
    """A bidirectional stack and a head (BERT)."""

    def __init__(self, encoder: TransformerStack, head: nn.Module):
        super().__init__()
        self.encoder = encoder
        self.head = head

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        *,
        document_ids: torch.Tensor | None = None,
        scored: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The head's logits for ``input_ids`` ``(batch, seq)``; ``document_ids``: the documents
        packed in each row (module doc; not with ``attention_mask``); ``scored``: only those
        positions' logits, ``(n, vocab)`` (:meth:`_Model._head_logits`)."""
        hidden, inputs = self.encoder.run(input_ids, attention_mask, token_type_ids, document_ids=document_ids)
        return self._head_logits(hidden, attention_mask, self.encoder, input_ids, inputs, None, scored)


class EncoderDecoderModel(GenerationMixin, _Model):
    """An encoder and a causal decoder that cross-attends to its output (2017 Transformer, T5)."""

    def __init__(self, encoder: TransformerStack, decoder: TransformerStack, head: nn.Module):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.head = head

    def encode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.encoder(input_ids, attention_mask, token_type_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        *,
        memory: torch.Tensor | None = None,
        cache=None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if document_ids is not None:
            raise ValueError(
                "document_ids (packed documents) is not supported by an encoder-decoder model: "
                "its decoder cross-attends to the whole source row; pack decoder-only or "
                "encoder-only models"
            )
        if decoder_input_ids is None:
            raise ValueError("an encoder-decoder model needs decoder_input_ids (the target side)")
        if memory is None:
            if input_ids is None:
                raise ValueError("pass input_ids (the source) or a precomputed encoder output as memory")
            memory = self.encode(input_ids, attention_mask, token_type_ids)
        hidden, inputs = self.decoder.run(
            decoder_input_ids, decoder_attention_mask, memory=memory, memory_mask=attention_mask, cache=cache
        )
        mask = decoder_attention_mask[:, -decoder_input_ids.shape[1] :] if decoder_attention_mask is not None else None
        return self._head_logits(hidden, mask, self.decoder, decoder_input_ids, inputs, cache)
