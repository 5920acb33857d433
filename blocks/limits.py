"""Upper bounds on every size a spec or a command line can state (torch-free, import-free).

Each is far above any model trained so far (noted beside it), so no real spec meets one; they
exist so that a typo or a hostile value (``n_layers: 1000000000``, ``d_model: 10**30``) is a
located error at once instead of an estimate that runs for hours or a build that exhausts memory.
Schema fields state them as ``Field(le=...)``, so the JSON Schema carries them too; command-line
options use the same numbers (``yamlformer.builder.cli.arguments``).
"""

from __future__ import annotations

#: layers in one stack (GPT-3: 96, Llama 3 405B: 126; DeepNet trained 1,000)
MAX_LAYERS = 10_000
#: d_model, head_dim, FFN hidden_dim and any other width (PaLM 540B: d_model 18,432, FFN 73,728)
MAX_WIDTH = 1 << 20
#: query or key/value heads of one attention (largest in use: 128)
MAX_HEADS = 1 << 16
#: token ids, token types, classes (Gemma: 256,000)
MAX_VOCAB = 1 << 24
#: the largest multiple a vocabulary is padded to (Megatron-LM's 128 x a tensor-parallel degree of 512)
MAX_VOCAB_PADDING = 1 << 16
#: tokens in a sequence: max_seq_len, windows, learned tables, rope's original context (10M in use)
MAX_SEQ_LEN = 1 << 30
#: experts of one mixture (DeepSeek-V3: 256)
MAX_EXPERTS = 1 << 16
#: per-layer override entries in one stack (Gemma 2 needs one)
MAX_OVERRIDES = 1_000
#: buckets of a relative-position table (T5: 32)
MAX_BUCKETS = 1 << 16
#: any multiplicative factor or base (rope theta: 500,000 in Llama 3; context scaling factors: 32)
MAX_FACTOR = 1e12
