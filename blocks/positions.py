"""Position blocks: sinusoidal, learned, RoPE (with its scalings), ALiBi, T5 relative bias, none.

Two kinds, by where they act (``config.acts_on``):

* ``embedding``: :class:`Sinusoidal` and :class:`Learned` return a ``(batch, seq, d_model)``
  tensor that the stack adds to the token embeddings, from ``positions`` ``(batch, seq)``
  (``(1, seq)`` when every row has the same positions: the sum broadcasts it).
* ``attention``: the stack hands the block to every self-attention layer (through
  ``yamlformer.blocks.attention.AttentionInputs``), which calls its hooks, each a no-op in
  :class:`PositionModule`: ``rotate(q, k, positions)`` (:class:`Rope` rotates the rotary part
  of each head), ``alibi_slopes(n_heads, device)`` (:class:`Alibi`'s per-head slopes for the
  attention kernel) and ``score_bias(query_index, key_index, n_heads)`` (:class:`RelativeBias`'s
  additive ``(1, n_heads, seq_q, seq_k)`` bias from token indices) and ``score_scale()`` (a
  factor on every score: YaRN's temperature under DeepSeek's ``mscale_all_dim``; 1 otherwise).
  An attention block decides which part of its heads it hands to ``rotate`` (multi-head
  attention: every head whole; latent attention: the decoupled rotary part).

Positions restart in every document of a packed row: :func:`document_positions` gives the
stack its positions when the forward gets ``document_ids`` (the attention then masks across
documents, so the relative positions (ALiBi, T5's bias) need nothing more).

Nothing here keeps a buffer: frequencies and slopes are recomputed from the config (a few
hundred floats), so the blocks build instantly on the meta device and never go stale after
``.to()``. No position computation is a matrix product (outer products are broadcast
multiplies), so FLOP counters see only the model's real matmuls.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from yamlformer.kernels.masks import document_starts


class PositionModule(nn.Module):
    """Base of the position modules: ``acts_on`` ("embedding" | "attention") comes from the
    config; the attention-side hooks do nothing unless a block overrides them."""

    def __init__(self, config):
        super().__init__()
        self.acts_on = type(config).acts_on

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, theta: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` ``(batch, heads, seq, width)`` and ``k`` ``(batch, kv_heads, seq, width)`` at
        ``positions`` ``(batch, seq)``, rotated (unchanged by default). ``theta``: a layer's own
        base, asked only of a block whose config ``rotates``."""
        return q, k

    def alibi_slopes(self, n_heads: int, device=None) -> torch.Tensor | None:
        """``(n_heads,)`` slopes the kernel turns into ``-slope * (i - j)`` (None by default)."""
        return None

    def score_bias(self, query_index: torch.Tensor, key_index: torch.Tensor, n_heads: int) -> torch.Tensor | None:
        """An additive ``(1, n_heads, seq_q, seq_k)`` score bias for token indices (None by default)."""
        return None

    def score_scale(self) -> float:
        """A factor on every attention score, on top of the attention's own scale (1 by default)."""
        return 1.0


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """``(batch, seq)`` long position of each token within its document, for ``document_ids``
    ``(batch, seq)`` (a document is a run of equal ids along the row): ``[0, 0, 0, 1, 1, 2]``
    -> ``[0, 1, 2, 0, 1, 0]``. The token index minus where its document starts."""
    index = torch.arange(document_ids.shape[1], device=document_ids.device)
    return index - document_starts(document_ids).long()  # (batch, seq)


def _check_positions(positions: torch.Tensor) -> None:
    if positions.dim() != 2:
        raise ValueError(f"positions must be (batch, seq), got shape {tuple(positions.shape)}")


class Sinusoidal(PositionModule):
    """Vaswani et al. 2017: ``PE[p, 2i] = sin(p / 10000^(2i/d))``, ``PE[p, 2i+1] = cos(...)``.

    ``layout: split`` puts the ``ceil(d/2)`` sines first and the cosines after them, with the
    same frequencies (tensor2tensor, Marian).
    """

    def __init__(self, config, d_model: int):
        super().__init__(config)
        self.d_model = d_model
        self.layout = config.layout

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        _check_positions(positions)
        pairs = (self.d_model + 1) // 2
        inv_freq = 10000.0 ** (-torch.arange(pairs, device=positions.device, dtype=torch.float32) * 2 / self.d_model)
        angles = positions.float()[..., None] * inv_freq  # (batch, seq, pairs)
        if self.layout == "split":
            return torch.cat((angles.sin(), angles[..., : self.d_model // 2].cos()), dim=-1)  # (batch, seq, d_model)
        table = torch.stack((angles.sin(), angles.cos()), dim=-1)  # (batch, seq, pairs, 2)
        return table.flatten(-2)[..., : self.d_model]  # (batch, seq, d_model), sin/cos interleaved


class Learned(PositionModule):
    """A learned table of absolute position embeddings (GPT-2's ``wpe``, BERT)."""

    def __init__(self, config, d_model: int, max_seq_len: int):
        super().__init__(config)
        self.max_positions = config.max_positions or max_seq_len
        self.weight = nn.Parameter(torch.empty(self.max_positions, d_model))

    def init_rules(self, std: float) -> dict[str, tuple[str, float]]:
        return {"weight": ("normal", std)}

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        _check_positions(positions)
        # From the shape, always; from the values only where reading one costs no device sync and
        # breaks no compiled graph (eager, on the CPU). Elsewhere indexing past the table fails.
        beyond = positions.shape[-1] > self.max_positions
        if not beyond and positions.device.type == "cpu" and not torch.compiler.is_compiling() and positions.numel():
            beyond = int(positions.max()) >= self.max_positions
        if beyond:
            raise ValueError(
                f"positions reach beyond the learned table of {self.max_positions} positions; shorten the "
                "input or raise position.max_positions"
            )
        return self.weight[positions]  # (batch, seq, d_model)


def rope_frequencies(config, head_dim: int, device=None, theta: float | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``(rotary_dim / 2,)`` and the cos/sin multiplier of a RoPE config.

    The scalings follow Hugging Face's ``transformers.modeling_rope_utils`` formulas
    (``_compute_{linear_scaling,dynamic_ntk,yarn,llama3}_parameters``). ``ntk`` is static
    NTK-aware scaling, ``theta * factor^(d / (d - 2))``: Hugging Face's dynamic formula at the
    length where its growth ratio reaches ``factor``. ``d`` is the rotary dimension.
    ``theta``: a layer's own base (an attention's ``rope_theta``), rotating without the config's
    scaling, which belongs to its own base (Gemma 3's local layers: Hugging Face's per-layer-type
    ``rope_parameters`` give them the default, unscaled rotation).
    """
    dim = config.rotary_dim(head_dim)
    base = config.theta if theta is None else theta
    scaling = config.scaling if theta is None else None
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    if scaling is not None and scaling.type == "ntk":
        base = base * scaling.factor ** (dim / (dim - 2))
    inv_freq = 1.0 / (base**exponents)
    if scaling is None or scaling.type == "ntk":
        return inv_freq, 1.0
    if scaling.type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if scaling.type == "yarn":
        return _yarn(inv_freq, dim, base, scaling)
    raise ValueError(f"unknown rope scaling {scaling.type!r}")


def _llama3(inv_freq: torch.Tensor, s) -> torch.Tensor:
    low_freq_wavelen = s.original_max_seq_len / s.low_freq_factor
    high_freq_wavelen = s.original_max_seq_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    if s.high_freq_factor == s.low_freq_factor:  # one threshold: no band to smooth
        return scaled
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``sqrt(1/t) = 0.1 * mscale * ln(factor) + 1`` (1 when
    ``factor <= 1``); DeepSeek's ``yarn_get_mscale``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(inv_freq: torch.Tensor, dim: int, base: float, s) -> tuple[torch.Tensor, float]:
    factor = s.factor
    if s.attention_factor is not None:
        attention_factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:  # DeepSeek: the rest of the temperature is on the scores
        attention_factor = yarn_mscale(factor, s.mscale) / yarn_mscale(factor, s.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(s.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:  # whole dimensions (GPT-OSS keeps the fractional ends)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # prevents a division by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: interpolate it
    blended = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return blended, attention_factor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rope(PositionModule):
    """Rotary embedding (Su et al. 2021), GPT-NeoX layout: ``rotate_half`` on the first
    ``rotary_dim`` dimensions of each head, the rest passed through."""

    def __init__(self, config):
        super().__init__(config)
        self.config = config
        # Eager memos (a decoding step's cost is mostly such small ops): the frequencies per head
        # width, device and base, and for each base the last cosines and sines, which every layer
        # of one forward rotating at it asks for with the same positions tensor. Not used while
        # torch.compile traces.
        self._frequencies: dict = {}
        self._last: dict = {}

    def cos_sin(self, positions: torch.Tensor, head_dim: int, dtype: torch.dtype, theta: float | None = None):
        """``(batch, 1, seq, rotary_dim)`` cosines and sines at ``positions`` ``(batch, seq)``
        (``theta``: at a layer's own base, see :func:`rope_frequencies`)."""
        _check_positions(positions)
        eager = not torch.compiler.is_compiling()
        last = self._last.get(theta)
        if eager and last is not None and last[0] is positions and last[1] == head_dim and last[2] == dtype:
            return last[3], last[4]
        key = (head_dim, positions.device, theta)
        frequencies = self._frequencies.get(key) if eager else None
        if frequencies is None:
            frequencies = rope_frequencies(self.config, head_dim, positions.device, theta)
            if eager:
                self._frequencies[key] = frequencies
        inv_freq, attention_factor = frequencies
        angles = positions.float()[..., None] * inv_freq  # (batch, seq, rotary_dim / 2)
        angles = torch.cat((angles, angles), dim=-1)[:, None]  # (batch, 1, seq, rotary_dim)
        cos, sin = (angles.cos() * attention_factor).to(dtype), (angles.sin() * attention_factor).to(dtype)
        if eager:
            self._last[theta] = (positions, head_dim, dtype, cos, sin)
        return cos, sin

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, theta: float | None = None):
        return self(q, k, positions, theta)

    def score_scale(self) -> float:
        """DeepSeek's YaRN: ``yarn_mscale(factor, mscale_all_dim) ** 2`` on every score."""
        s = self.config.scaling
        if s is not None and s.type == "yarn" and s.mscale_all_dim:
            return yarn_mscale(s.factor, s.mscale_all_dim) ** 2
        return 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, theta: float | None = None):
        """Rotate ``q`` ``(batch, n_heads, seq, head_dim)`` and ``k`` ``(batch, n_kv_heads, ...)``
        (at base ``theta`` when given instead of the config's)."""
        head_dim = q.shape[-1]
        rotary_dim = self.config.rotary_dim(head_dim)
        cos, sin = self.cos_sin(positions, head_dim, q.dtype, theta)

        def rotate(x):
            rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
            return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)

        return rotate(q), rotate(k)


def alibi_slopes(n_heads: int, device=None) -> torch.Tensor:
    """The ALiBi paper's head slopes, a geometric series from ``2^(-8/n)``; for a head count
    that is not a power of two, the closest power's slopes and then every other slope of twice
    that count (as in the ALiBi repository and Hugging Face's ``build_alibi_tensor``)."""
    closest = 2 ** math.floor(math.log2(n_heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = base ** torch.arange(1, 1 + closest, dtype=torch.float32, device=device)
    if closest != n_heads:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        remaining = min(closest, n_heads - closest)
        extra = extra_base ** torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.float32, device=device)
        slopes = torch.cat((slopes, extra))
    return slopes


class Alibi(PositionModule):
    """ALiBi (Press et al. 2021): the kernel adds ``-slope_h * (i - j)`` to score (i, j)."""

    def __init__(self, config):
        super().__init__(config)

    def alibi_slopes(self, n_heads: int, device=None) -> torch.Tensor:
        return self(n_heads, device)

    def forward(self, n_heads: int, device=None) -> torch.Tensor:
        return alibi_slopes(n_heads, device)


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's bucket of ``key - query``: exact for small distances, log-spaced up to
    ``max_distance``; bidirectional buckets split the range between past and future."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    log_ratio = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


class RelativeBias(PositionModule):
    """T5's learned relative position bias: one ``(num_buckets, n_heads)`` table per stack,
    shared by its layers. Causal (one-sided) buckets in a decoder, bidirectional in an encoder."""

    def __init__(self, config, n_heads: int, causal: bool):
        super().__init__(config)
        self.num_buckets = config.num_buckets
        self.max_distance = config.max_distance
        self.n_heads = n_heads
        self.bidirectional = not causal
        self.weight = nn.Parameter(torch.empty(config.num_buckets, n_heads))

    def init_rules(self, std: float) -> dict[str, tuple[str, float]]:
        return {"weight": ("normal", std)}

    def score_bias(self, query_index: torch.Tensor, key_index: torch.Tensor, n_heads: int) -> torch.Tensor:
        return self(query_index, key_index, n_heads)

    def forward(self, query_index: torch.Tensor, key_index: torch.Tensor, n_heads: int) -> torch.Tensor:
        """``(1, n_heads, seq_q, seq_k)`` bias for token indices ``(seq_q,)`` and ``(seq_k,)``."""
        if n_heads != self.n_heads:
            raise ValueError(
                f"the stack's relative bias table has {self.n_heads} heads but a layer has {n_heads}; "
                "relative_bias needs the same n_heads in every layer of a stack"
            )
        relative = key_index[None, :] - query_index[:, None]  # (seq_q, seq_k)
        buckets = relative_position_bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
        return self.weight[buckets].permute(2, 0, 1)[None]  # (1, n_heads, seq_q, seq_k)


class NoPosition(PositionModule):
    """No position information (NoPE): the causal mask alone orders the tokens."""

    def __init__(self, config):
        super().__init__(config)
