"""What a Hugging Face folder must be before anything in it is used: every file inside the
folder, every JSON file small and shallow enough to read, every ``config.json`` value of the
kind its key takes.

A folder comes from anywhere (a download, a colleague, a hostile upload), so nothing here trusts
it: a path that leads out of the folder (``../``, an absolute path in a shard index, a symlink)
is refused before it is opened; JSON is read with a byte limit and parse errors are one line
that names the file; a ``config.json`` value of the wrong kind names its key. The one way out of
the folder that is allowed is the Hugging Face hub cache's own: ``<repo>/snapshots/<rev>/FILE``
is a symlink to ``<repo>/blobs/<hash>``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from yamlformer.builder.hf.common import HFError

MiB = 1 << 20
#: the most bytes read from each kind of file (the largest real ones are a few MiB)
LIMITS = {"config": 16 * MiB, "index": 64 * MiB, "tokenizer": 512 * MiB}

#: config.json keys by the kind of value they take; ``check_config`` refuses any other kind,
#: naming the key, before a family reads the config. A family that reads a new key adds it here.
LAYER_KEYS = (
    "n_layer",
    "n_layers",
    "num_hidden_layers",
    "num_layers",
    "num_decoder_layers",
    "encoder_layers",
    "decoder_layers",
)
SIZE_KEYS = (
    "n_embd",
    "n_head",
    "n_inner",
    "n_positions",
    "vocab_size",
    "decoder_vocab_size",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "max_position_embeddings",
    "sliding_window",
    "num_local_experts",
    "num_experts_per_tok",
    "d_model",
    "d_kv",
    "d_ff",
    "num_heads",
    "relative_attention_num_buckets",
    "relative_attention_max_distance",
    "type_vocab_size",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "max_window_layers",
    "query_pre_attn_scalar",
    "original_max_position_embeddings",
    # DeepSeek-V2/V3
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "moe_intermediate_size",
    "n_routed_experts",
    "n_shared_experts",
    "n_group",
    "topk_group",
    "first_k_dense_replace",
    "moe_layer_freq",
    "num_nextn_predict_layers",
    # MPT
    "n_heads",
    "max_seq_len",
    # Gemma 3, Llama 4
    "sliding_window_pattern",
    "intermediate_size_mlp",
    "attention_chunk_size",
    "floor_scale",
    "no_rope_layer_interval",
    "interleave_moe_layer_step",
    # Qwen3-MoE
    "num_experts",
    "decoder_sparse_step",
    # a sequence classifier's
    "num_labels",
)
NUMBER_KEYS = (
    "activation_dropout",
    "attention_dropout",
    "attention_probs_dropout_prob",
    "attn_pdrop",
    "dropout",
    "dropout_rate",
    "embd_pdrop",
    "hidden_dropout_prob",
    "resid_pdrop",
    "layer_norm_eps",
    "layer_norm_epsilon",
    "rms_norm_eps",
    "rope_theta",
    "partial_rotary_factor",
    "router_jitter_noise",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "attention_factor",
    "mscale",
    "mscale_all_dim",
    "routed_scaling_factor",
    "classifier_dropout",
    # MPT (attn_config's among them); logit_scale may be a number or a name, and mpt refuses either
    "expansion_ratio",
    "emb_pdrop",
    "embedding_fraction",
    "alibi_bias_max",
    "clip_qkv",
    "softmax_scale",
    # Gemma 3, GPT-OSS, Llama 4
    "rope_local_base_freq",
    "swiglu_alpha",
    "swiglu_limit",
    "attn_scale",
    # GPT-NeoX
    "rotary_pct",
    "rotary_emb_base",
    "hidden_dropout",
)
BOOL_KEYS = (
    "attention_bias",
    "mlp_bias",
    "tie_word_embeddings",
    "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx",
    "scale_embedding",
    "scale_decoder_outputs",
    "share_encoder_decoder_embeddings",
    "use_sliding_window",
    "use_bidirectional_attention",
    "truncate",
    "norm_topk_prob",
    "rope_interleave",
    "use_qk_norm",  # Llama 4
    "use_parallel_residual",  # GPT-NeoX
    # MPT (attn_config's among them)
    "no_bias",
    "learned_pos_emb",
    "alibi",
    "qk_ln",
    "prefix_lm",
    "attn_uses_sequence_id",
)
TEXT_KEYS = (
    "model_type",
    "activation_function",
    "hidden_act",
    "hidden_activation",
    "feed_forward_proj",
    "position_embedding_type",
    "rope_type",
    "type",
    "topk_method",
    "scoring_func",
    "norm_type",
    "attn_type",
    "attn_impl",
)
TOKEN_ID_KEYS = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "forced_eos_token_id",
)
#: size keys for which 0 means something (no token types, no layer without a window, no shared
#: expert, no dense layer, no multi-token-prediction layer)
ZERO_OK = (
    "type_vocab_size",
    "max_window_layers",
    "n_shared_experts",
    "first_k_dense_replace",
    "num_nextn_predict_layers",
)
#: bounds far above any released model, so a typo or a hostile file cannot make us build a
#: billion layers (the deepest released models have under 200)
MAX_LAYERS = 10_000
MAX_SIZE = 2**31 - 1


def inside(folder: str | Path, path: str | Path, where: str | None = None) -> Path:
    """``path`` resolved, if it lies inside ``folder`` (symlinks followed) or in the hub cache's
    blob store beside the snapshot ``folder`` is; otherwise :class:`HFError`, before any read.
    ``where``: what named the path (``"index.json: weight_map['x']"``), to start the message."""
    folder, path = Path(folder), Path(path)
    try:
        root, real = folder.resolve(), path.resolve()
    except (OSError, RuntimeError):  # a symlink loop
        raise HFError(f"{where or path}: a symlink loop") from None
    if real.is_relative_to(root):
        return real
    if root.parent.name == "snapshots" and real.parent == root.parent.parent / "blobs":
        return real  # huggingface_hub's cache: snapshots/<rev>/FILE -> ../../blobs/<hash>
    raise HFError(
        f"{where or path}: leads outside {folder} (through '..', an absolute path or a symlink); "
        "only files inside the model folder are read"
    )


def read_bytes(path: Path, kind: str = "config", folder: Path | None = None) -> bytes:
    """The bytes of ``path`` (inside ``folder`` when given), at most ``LIMITS[kind]`` of them;
    a larger or unreadable file is a one-line :class:`HFError` naming it."""
    path = Path(path)
    if folder is not None:
        inside(folder, path)
    limit = LIMITS[kind]
    try:
        if not path.is_file():
            raise HFError(f"{path}: not a file")
        size = path.stat().st_size
        if size > limit:
            raise HFError(f"{path}: {size / MiB:.0f} MiB; a {kind} file is at most {limit // MiB} MiB here")
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as exc:
        raise HFError(f"{path}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    if len(raw) > limit:  # grew while we looked
        raise HFError(f"{path}: larger than {limit // MiB} MiB; a {kind} file is at most that here")
    return raw


def read_json(path: Path, kind: str = "config", folder: Path | None = None) -> dict:
    """A JSON object from ``path`` (inside ``folder`` when given), at most ``LIMITS[kind]``
    bytes; any other content is a one-line :class:`HFError` naming the file, never its text."""
    raw = read_bytes(path, kind, folder)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise HFError(f"{path}: not JSON (not UTF-8 text; a binary file?)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HFError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise HFError(f"{path}: JSON nested too deeply to be a {kind} file") from None
    if not isinstance(data, dict):
        raise HFError(f"{path}: not a JSON object (a {type(data).__name__} at the top)")
    return data


def check_config(config: Mapping, path: Path | str) -> None:
    """Refuse, naming the key, a ``config.json`` value that is not of its key's kind (integers
    for sizes and layer counts, within bounds; finite numbers; booleans; strings)."""
    for key, value in config.items():
        _check_value(key, value, path, key)
    for nested in ("rope_scaling", "rope_parameters", "attn_config"):
        value = config.get(nested)
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise HFError(f"{path}: {nested}: expected a mapping or null, got {_kind(value)}")
        for key, inner in value.items():
            _check_value(key, inner, path, f"{nested}.{key}")
    types = config.get("layer_types")
    if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
        raise HFError(f"{path}: layer_types: expected a list of strings, got {_kind(types)}")


def _check_value(key: str, value: Any, path, where: str) -> None:
    if value is None:
        return
    if key in LAYER_KEYS or key in SIZE_KEYS:
        top = MAX_LAYERS if key in LAYER_KEYS else MAX_SIZE
        low = 0 if key in ZERO_OK else 1
        if not _is_int(value) or not low <= value <= top:
            raise HFError(f"{path}: {where}: expected an integer from {low} to {top:,}, got {_kind(value)}")
    elif key in NUMBER_KEYS:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise HFError(f"{path}: {where}: expected a finite number, got {_kind(value)}")
    elif key in BOOL_KEYS:
        if not isinstance(value, bool):
            raise HFError(f"{path}: {where}: expected true or false, got {_kind(value)}")
    elif key in TEXT_KEYS:
        if not isinstance(value, str):
            raise HFError(f"{path}: {where}: expected a string, got {_kind(value)}")
    elif key in TOKEN_ID_KEYS:
        ids = value if isinstance(value, list) else [value]
        if not all(_is_int(i) and 0 <= i <= MAX_SIZE for i in ids):
            raise HFError(f"{path}: {where}: expected a token id (or a list of them), got {_kind(value)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    """A value as an error shows it: numbers as written, others by their kind. Never a string's
    text: config.json may be any file the user pointed at, and its text is not ours to print."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        text = repr(value)
        return text if len(text) <= 24 else f"a {len(text)}-digit number"
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    return {"list": "a list", "dict": "a mapping"}.get(type(value).__name__, type(value).__name__)
