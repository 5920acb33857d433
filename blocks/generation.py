"""Decoding: ``generate`` (greedy, sampling, beam) over a KV cache every attention block shapes.

Allocation policy (what :meth:`KVCache.nbytes` reports and what ``generate`` allocates): for a
decoding batch of ``B`` rows (``batch * num_beams``), a prompt of ``P`` tokens (the decoder
prompt for an encoder-decoder) and ``N = max_new_tokens``, every layer of the decoding stack
holds what its attention's config declares (``kv_cache(d_model)``, a
``yamlformer.blocks.configs.base.CacheLayout``): ``B * min(P + N, window) * bytes_per_token``, in the
model's dtype. Multi-head attention's bytes per token are ``2 * n_kv_heads * head_dim *
itemsize`` (keys and values); a windowed layer whose capacity is the window keeps a ring buffer.
A cross-attending layer adds its cross-attention's layout over the ``S`` source tokens,
projected once from the encoder output. ``yamlformer.builder.analysis.memory.kv_cache_bytes`` sums the same
layouts, so ``describe`` and ``generate`` agree to the byte (see ``yamlformer.blocks.cache``).

Steps: the prompt is fed at once (the prefill, the model's forward), then each new token is one
static step (``TransformerStack.step``) whose shapes never change: it writes its cache slot at a
position tensor and attends over whole buffers under masks built from each slot's token index.
``compile=True`` runs that step as one ``torch.compile`` graph (compiled once per model, batch
and cache size). A stack with an attention block that does not declare ``static_decode``
(``yamlformer.blocks.attention``'s protocol) feeds each token through the forward instead.

``generate`` semantics (mirroring Hugging Face): greedy unless sampling is asked for.
``do_sample=None`` (the default) samples exactly when ``temperature`` (other than 0),
``top_k`` or ``top_p`` is given; ``temperature=0`` is always greedy; an explicit ``do_sample``
wins otherwise. After a row emits ``eos_token_id`` it is filled with ``pad_token_id`` (default:
the EOS id), and decoding stops when every row has finished. Beam search scores a finished
hypothesis by ``sum log p / new_tokens ** length_penalty`` (new tokens including the EOS) and
stops a batch item once it holds ``num_beams`` finished hypotheses none of which the best running
beam can still beat (or at once with ``early_stopping=True``). Batched prompts with padding
must be left-padded, with ``attention_mask`` marking the real tokens. The model is put in eval
mode while decoding and restored afterwards.
"""

from __future__ import annotations

import math
import time
import warnings
import weakref

import torch
from torch._dynamo.utils import counters

from yamlformer.blocks.cache import KVCache


class _DecodeState:
    """The growing decoder-side sequence, its mask, the encoder memory and the cache.

    With a cache, the first call of :meth:`next_logits` (the prefill: the whole prompt) runs the
    model's forward; every later one is a static step (``TransformerStack.step``) over the
    preallocated cache, optionally compiled (``step``: the model's ``_decode_step`` or its
    ``torch.compile`` of it), fed the token index as a tensor and a mask and position table
    built once for every token the cache holds.
    """

    def __init__(self, model, tokens, mask, memory, memory_mask, use_cache: bool, max_new_tokens: int, step=None):
        self.model, self.tokens, self.mask = model, tokens, mask
        self.memory, self.memory_mask = memory, memory_mask
        self.fed = 0
        self.vocab_size: int | None = None  # ids from here on are never picked (see next_logits)
        self.cache = None
        self.step = step or model._decode_step
        self.step_calls = 0
        self.last = None  # the last appended tokens, (rows, 1)
        if use_cache:
            param = next(model.parameters())
            self.cache = KVCache.for_stack(
                model.decoder, tokens.shape[0], tokens.shape[1] + max_new_tokens, param.dtype, tokens.device
            )
        self.static = use_cache and model.decoder.static_decode() is None
        if step is not None and not self.static:
            raise ValueError(
                f"compile=True needs every attention block to take the static decoding step; "
                f"{model.decoder.static_decode()} does not declare static_decode (decode without compile)"
            )
        if self.static:
            total = tokens.shape[1] + max_new_tokens
            # Every token's key mask and position id, built once: (rows, total)
            rows = tokens.shape[0]
            if mask is not None:
                self.key_mask = torch.cat((mask, mask.new_ones(rows, max_new_tokens)), dim=1)
                self.position_ids = (self.key_mask.long().cumsum(-1) - 1).clamp(min=0)
            else:
                self.key_mask = None
                self.position_ids = torch.arange(total, device=tokens.device).expand(rows, total)

    def next_logits(self) -> torch.Tensor:
        """Logits ``(rows, vocab)`` for the token after the current sequence; those of the ids
        from ``vocab_size`` on (an embedding's padding rows past the tokenizer) are -inf."""
        logits = self._logits()
        if self.vocab_size is not None and self.vocab_size < logits.shape[-1]:
            logits = logits.clone()
            logits[:, self.vocab_size :] = float("-inf")
        return logits

    def _logits(self) -> torch.Tensor:
        if self.static and self.fed:
            return self._static_step()
        ids = self.tokens[:, self.fed :] if self.cache is not None else self.tokens
        if self.memory is not None:
            logits = self.model(
                None,
                self.memory_mask,
                decoder_input_ids=ids,
                decoder_attention_mask=self.mask,
                memory=self.memory,
                cache=self.cache,
            )
        else:
            logits = self.model(ids, self.mask, cache=self.cache)
        if logits.dim() != 3:
            raise ValueError("generate needs a head that returns vocabulary logits (head type lm or mlm)")
        self.fed = self.tokens.shape[1]
        return logits[:, -1].float()

    def _static_step(self) -> torch.Tensor:
        if self.tokens.shape[1] != self.fed + 1:
            raise ValueError(f"a static decoding step feeds one token; {self.tokens.shape[1] - self.fed} are new")
        index = torch.tensor([self.fed], device=self.tokens.device)  # (1,): the new token's index
        logits = self.step(
            self.last, index, self.position_ids, self.cache, self.key_mask, self.memory, self.memory_mask
        )
        self.cache.advance(1)
        self.fed += 1
        self.step_calls += 1
        return logits

    def append(self, next_tokens: torch.Tensor) -> None:
        self.last = next_tokens[:, None]  # (rows, 1), strides (1, 1): the next static step's input
        self.tokens = torch.cat((self.tokens, self.last), dim=1)
        if self.mask is not None and not self.static:
            self.mask = torch.cat((self.mask, self.mask.new_ones(self.mask.shape[0], 1)), dim=1)

    def reorder(self, index: torch.Tensor) -> None:
        self.tokens = self.tokens[index]
        if self.mask is not None:
            self.mask = self.mask[index]
        if self.cache is not None:
            self.cache.reorder(index)
        if self.static:
            self.position_ids = self.position_ids[index]
            if self.key_mask is not None:
                self.key_mask = self.key_mask[index]


def sample_next(
    logits: torch.Tensor,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row from ``logits`` ``(rows, vocab)``: temperature, then top-k, then top-p
    (the smallest set of tokens whose probability reaches ``top_p``, at least one kept)."""
    if temperature is not None and temperature != 1.0:
        logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1)  # ascending
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative <= 1 - top_p
        drop_sorted[:, -1] = False
        logits = logits.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)


def _check_args(
    max_new_tokens,
    num_beams,
    top_k,
    top_p,
    temperature,
    length_penalty,
    streamer,
    generator,
    compile=False,
    use_cache=True,
):
    """The decoding options, before any work: a wrong type is a ``TypeError``, a value out of its
    range a ``ValueError``, each naming the argument and what it takes."""
    for name, value in (("compile", compile), ("use_cache", use_cache)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {type(value).__name__}")
    if compile and not use_cache:
        raise ValueError("compile=True compiles the cached decoding step; it needs use_cache=True")
    for name, value, optional in (
        ("max_new_tokens", max_new_tokens, False),
        ("num_beams", num_beams, False),
        ("top_k", top_k, True),
    ):
        if (value is not None or not optional) and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    for name, value in (("top_p", top_p), ("temperature", temperature), ("length_penalty", length_penalty)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
        ):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if num_beams < 1:
        raise ValueError(f"num_beams must be >= 1, got {num_beams}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature is not None and temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if streamer is not None and not (callable(streamer) or callable(getattr(streamer, "put", None))):
        raise TypeError(
            f"streamer must be a callable or have a put() method (a Hugging Face streamer), "
            f"got {type(streamer).__name__}"
        )
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")


class GenerationMixin:
    """``generate`` for models with a ``decoder`` stack (decoder-only and encoder-decoder)."""

    last_cache_nbytes: int | None = None
    last_compile_seconds: float = 0.0

    def _decode_step(self, input_ids, index, position_ids, cache, key_mask, memory, memory_mask) -> torch.Tensor:
        """Logits ``(rows, vocab)`` (fp32) of one static decoding step (``TransformerStack.step``):
        what ``generate(..., compile=True)`` compiles."""
        hidden = self.decoder.step(
            input_ids, index, position_ids, cache, key_mask, memory=memory, memory_mask=memory_mask
        )
        return self.head(hidden).logits[:, -1].float()

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 20,
        *,
        attention_mask=None,
        decoder_input_ids=None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        do_sample: bool | None = None,
        num_beams: int = 1,
        length_penalty: float = 1.0,
        early_stopping: bool = False,
        eos_token_id=None,
        pad_token_id: int | None = None,
        decoder_start_token_id: int | None = None,
        streamer=None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
        compile: bool = False,
        vocab_size: int | None = None,
    ) -> torch.Tensor:
        """Token ids ``(batch, prompt + new)`` (the decoder side for an encoder-decoder).

        ``streamer``: a callable, or an object with ``put``/``end`` (Hugging Face streamers),
        called with each new ``(batch,)`` token tensor (greedy and sampling only).
        ``use_cache=False`` recomputes the whole sequence at every step (a reference).
        ``compile=True``: the one-token step over the static cache runs as one graph compiled by
        ``torch.compile`` (``fullgraph``, static shapes), compiled on the first call for each
        model, batch and cache size and reused after; the prompt's prefill stays eager. It pays
        where per-token overhead dominates (small models, small batches); the first call pays
        the compile (``self.last_compile_seconds``).
        ``vocab_size``: only ids below it are generated (the tokenizer's size, where the
        embedding has padding rows past it: their logits are -inf before sampling or argmax;
        at or past the model's vocabulary it changes nothing).
        After the call ``self.last_cache_nbytes`` holds the cache's bytes (see module doc).
        """
        _check_args(
            max_new_tokens,
            num_beams,
            top_k,
            top_p,
            temperature,
            length_penalty,
            streamer,
            generator,
            compile,
            use_cache,
        )
        self._check_prompt(
            input_ids,
            decoder_input_ids,
            attention_mask,
            max_new_tokens,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            decoder_start_token_id=decoder_start_token_id,
        )
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)):
            raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if do_sample is None:
            do_sample = (temperature is not None and temperature != 0) or top_k is not None or top_p is not None
        if temperature == 0:
            do_sample = False
        if num_beams > 1 and do_sample:
            raise ValueError("beam search with sampling is not supported; drop temperature/top_k/top_p or num_beams")
        if num_beams > 1 and streamer is not None:
            raise ValueError("a streamer works with greedy or sampled decoding, not beam search")
        eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
        pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else None)

        was_training = self.training
        self.eval()
        step = _CompiledStep(self) if compile else None
        try:
            state = self._decode_state(
                input_ids,
                attention_mask,
                decoder_input_ids,
                decoder_start_token_id,
                pad,
                num_beams,
                use_cache,
                max_new_tokens,
                step,
            )
            state.vocab_size = vocab_size
            if num_beams > 1:
                out = _beam_search(state, num_beams, max_new_tokens, eos, pad, length_penalty, early_stopping)
            else:
                out = _greedy_or_sample(
                    state, max_new_tokens, do_sample, temperature, top_k, top_p, eos, pad, streamer, generator
                )
            self.last_cache_nbytes = state.cache.nbytes() if state.cache is not None else 0
            self.last_compile_seconds = step.compile_seconds if step is not None else 0.0
            return out
        finally:
            self.train(was_training)

    def _check_prompt(self, input_ids, decoder_input_ids, attention_mask, max_new_tokens: int, **special) -> None:
        """Token ids a decode can start from, before any work: tensors of (batch, seq) integer
        ids inside the vocabulary (checked here once: a forward on a GPU does not), not empty,
        and room for ``max_new_tokens`` within ``max_seq_len``."""
        decoder = self.decoder
        vocab = decoder.embedding.tokens.num_embeddings
        prompts = [("input_ids", input_ids)]
        if decoder_input_ids is not None:
            prompts.append(("decoder_input_ids", decoder_input_ids))
        for name, ids in prompts:
            if not isinstance(ids, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor of token ids (batch, seq), got {type(ids).__name__}")
            if ids.dim() != 2:
                raise ValueError(f"{name} must be (batch, seq), got shape {tuple(ids.shape)}")
            if ids.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name} must be integer token ids, got dtype {ids.dtype}")
            if ids.numel() == 0:
                raise ValueError(
                    f"{name} is empty, shape {tuple(ids.shape)}: pass at least one token per row "
                    "(a start-of-sequence id)"
                )
            if ids.device.type != "meta" and bool(((ids < 0) | (ids >= vocab)).any()):
                raise ValueError(f"{name} holds ids outside the vocabulary: ids must be in [0, {vocab - 1}]")
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            raise TypeError(
                f"attention_mask must be a torch.Tensor (batch, seq) of 1s and 0s, got {type(attention_mask).__name__}"
            )
        for name, value in special.items():
            values = value if isinstance(value, (list, tuple)) else [value]
            for v in values:
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab):
                    raise ValueError(f"{name} must be a token id in [0, {vocab - 1}], got {v!r}")
        limit = decoder.max_seq_len
        if hasattr(self, "encoder") and self.encoder.max_seq_len is not None:
            if input_ids.shape[1] > self.encoder.max_seq_len:
                raise ValueError(
                    f"input_ids has {input_ids.shape[1]} tokens, more than the model's max_seq_len "
                    f"{self.encoder.max_seq_len}"
                )
        prompt = prompts[-1][1].shape[1] if decoder_input_ids is not None or not hasattr(self, "encoder") else 1
        if limit is not None and prompt + max_new_tokens - 1 > limit:
            room = limit - prompt + 1
            hint = f"at most {room} new tokens" if room >= 1 else f"a prompt of at most {limit} tokens"
            raise ValueError(
                f"a prompt of {prompt} tokens and max_new_tokens {max_new_tokens} need "
                f"{prompt + max_new_tokens - 1} positions, more than the model's max_seq_len {limit}; "
                f"ask for {hint} (or slide a window over the context, as `builder generate` does)"
            )

    def _decode_state(
        self,
        input_ids,
        attention_mask,
        decoder_input_ids,
        start_id,
        pad,
        num_beams,
        use_cache,
        max_new_tokens,
        step=None,
    ) -> _DecodeState:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        expand = (lambda t: t.repeat_interleave(num_beams, dim=0)) if num_beams > 1 else (lambda t: t)
        if not hasattr(self, "encoder"):
            if decoder_input_ids is not None:
                raise ValueError("decoder_input_ids is for encoder-decoder models; pass the prompt as input_ids")
            mask = expand(attention_mask) if attention_mask is not None else None
            return _DecodeState(self, expand(input_ids), mask, None, None, use_cache, max_new_tokens, step)
        memory = self.encode(input_ids, attention_mask)
        if decoder_input_ids is None:
            start = start_id if start_id is not None else pad
            if start is None:
                raise ValueError("pass decoder_input_ids, decoder_start_token_id or pad_token_id to start the decoder")
            decoder_input_ids = torch.full((input_ids.shape[0], 1), start, dtype=torch.long, device=input_ids.device)
        memory_mask = expand(attention_mask) if attention_mask is not None else None
        return _DecodeState(
            self, expand(decoder_input_ids), None, expand(memory), memory_mask, use_cache, max_new_tokens, step
        )


_COMPILED_STEP = None
#: graphs the one compiled step may hold: one per model, batch and cache size decoded in this
#: process (Dynamo's default of 8 would end a long-lived process's compiled decoding in an error)
STEP_GRAPHS = 64
#: models whose step does not compile as one graph (a sparse MoE dispatch), with the reason
_UNCOMPILABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled_decode_step(model, *args) -> torch.Tensor:
    return model._decode_step(*args)


class _CompiledStep:
    """``model._decode_step`` through one process-wide ``torch.compile`` (``fullgraph``, static
    shapes; Dynamo guards recompile it for another model, batch or cache size, up to
    ``STEP_GRAPHS``). The seconds of a call that compiled are kept apart in ``compile_seconds``.

    A model whose step cannot be one graph (a data-dependent MoE dispatch) decodes eagerly, with
    a warning naming why, once per model; ``reason`` then holds it.
    """

    def __init__(self, model):
        global _COMPILED_STEP
        if _COMPILED_STEP is None:
            _COMPILED_STEP = torch.compile(_compiled_decode_step, fullgraph=True, dynamic=False)
        self.model = model
        self.compile_seconds = 0.0
        self.reason = _UNCOMPILABLE.get(model)

    def __call__(self, *args) -> torch.Tensor:

        if self.reason is not None:
            return self.model._decode_step(*args)
        graphs = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        limit = max(STEP_GRAPHS, torch._dynamo.config.recompile_limit)
        try:
            with torch._dynamo.config.patch(recompile_limit=limit):
                out = _COMPILED_STEP(self.model, *args)
        except Exception as exc:
            self.compile_seconds += time.perf_counter() - start
            self.reason = _UNCOMPILABLE[self.model] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
            warnings.warn(
                f"generate(compile=True): the decoding step does not compile as one graph "
                f"({self.reason}); decoding eagerly",
                stacklevel=4,
            )
            return self.model._decode_step(*args)
        if counters["stats"]["unique_graphs"] != graphs:
            self.compile_seconds += time.perf_counter() - start
        return out


def _greedy_or_sample(state, max_new_tokens, do_sample, temperature, top_k, top_p, eos, pad, streamer, generator):
    rows = state.tokens.shape[0]
    unfinished = torch.ones(rows, dtype=torch.bool, device=state.tokens.device)
    eos_ids = torch.tensor(eos, device=state.tokens.device) if eos else None
    for _ in range(max_new_tokens):
        logits = state.next_logits()
        if do_sample:
            next_tokens = sample_next(logits, temperature, top_k, top_p, generator)
        else:
            next_tokens = logits.argmax(dim=-1)
        if eos_ids is not None:
            next_tokens = torch.where(unfinished, next_tokens, torch.full_like(next_tokens, pad))
            unfinished &= ~torch.isin(next_tokens, eos_ids)
        state.append(next_tokens)
        if streamer is not None:
            (streamer.put if hasattr(streamer, "put") else streamer)(next_tokens)
        if eos_ids is not None and not unfinished.any():
            break
    if streamer is not None and hasattr(streamer, "end"):
        streamer.end()
    return state.tokens


def _beam_search(state, num_beams, max_new_tokens, eos, pad, length_penalty, early_stopping):
    rows = state.tokens.shape[0]
    batch, prompt_len, device = rows // num_beams, state.tokens.shape[1], state.tokens.device
    beam_scores = torch.zeros(batch, num_beams, device=device)
    beam_scores[:, 1:] = float("-inf")  # every beam starts identical: expand the first only
    beam_scores = beam_scores.view(-1)
    finished: list[list[tuple[float, torch.Tensor]]] = [[] for _ in range(batch)]
    done = [False] * batch

    def add(b: int, score: float, tokens: torch.Tensor):
        hyps = finished[b]
        hyps.append((score / max(tokens.numel(), 1) ** length_penalty, tokens))
        hyps.sort(key=lambda h: -h[0])
        del hyps[num_beams:]

    for step in range(max_new_tokens):
        logprobs = torch.log_softmax(state.next_logits(), dim=-1)  # (rows, vocab)
        vocab = logprobs.shape[-1]
        scores = (logprobs + beam_scores[:, None]).view(batch, num_beams * vocab)
        top_scores, top_ids = scores.topk(min(2 * num_beams, num_beams * vocab), dim=1)
        next_scores = torch.zeros(batch, num_beams, device=device)
        next_tokens = torch.full((batch, num_beams), pad if pad is not None else 0, dtype=torch.long, device=device)
        next_rows = torch.arange(batch, device=device)[:, None].mul(num_beams).expand(batch, num_beams).clone()
        for b in range(batch):
            if done[b]:
                continue
            chosen = 0
            for rank, (score, flat) in enumerate(zip(top_scores[b].tolist(), top_ids[b].tolist())):
                beam, token = divmod(flat, vocab)
                row = b * num_beams + beam
                if token in eos:
                    if rank < num_beams:
                        add(b, score, torch.cat((state.tokens[row, prompt_len:], torch.tensor([token], device=device))))
                    continue
                next_scores[b, chosen], next_tokens[b, chosen], next_rows[b, chosen] = score, token, row
                chosen += 1
                if chosen == num_beams:
                    break
            if len(finished[b]) == num_beams:
                best_running = top_scores[b].max().item() / (step + 1) ** length_penalty
                done[b] = early_stopping or finished[b][-1][0] >= best_running
        if all(done):
            break
        state.reorder(next_rows.view(-1))
        state.append(next_tokens.view(-1))
        beam_scores = next_scores.view(-1)

    for b in range(batch):
        if not done[b]:
            for beam in range(num_beams):
                row = b * num_beams + beam
                add(b, beam_scores[row].item(), state.tokens[row, prompt_len:])
    best = [finished[b][0][1] for b in range(batch)]
    width = max(t.numel() for t in best)
    if pad is None and any(t.numel() != width for t in best):
        raise ValueError("beams finished at different lengths; pass pad_token_id to pad them")
    out = torch.full((batch, prompt_len + width), pad if pad is not None else 0, dtype=torch.long, device=device)
    for b, tokens in enumerate(best):
        out[b, :prompt_len] = state.tokens[b * num_beams, :prompt_len]
        out[b, prompt_len : prompt_len + tokens.numel()] = tokens
    return out
