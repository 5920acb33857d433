"""Hugging Face interoperability: read a local model folder as a spec and weights, write one back.

```python
from yamlformer.builder import build_model
from yamlformer.builder.hf import from_hf, to_hf, load_weights

spec, state_dict = from_hf("path/to/hf-model")   # a validated ModelSpec; tensors under our names
model = load_weights(build_model(spec), state_dict)   # or load_weights(model, "out/model.safetensors")
to_hf(spec, model, "path/to/export")             # config.json + model.safetensors; returns the family

from yamlformer.builder.hf.tokenizer import read_tokenizer, write_tokenizer
state = read_tokenizer("path/to/hf-model")       # the folder's tokenizer as a state dict, or None
to_hf(spec, model, "path/to/export", tokenizer=state)   # + tokenizer.json, tokenizer_config.json,
                                                 #   generation_config.json
```

These functions are the stable API (recipes build on them: ``from_hf`` to start from a folder's
weights, ``read_tokenizer`` for its tokenizer); the submodules are ``families`` (the registry),
``reader`` (import), ``writer`` (export), ``tokenizer``, ``checks`` (untrusted folders),
``weights`` (safe tensor IO) and the family tables (``decoders``, ``qwen``, ``mpt``, ``deepseek``,
``encoders``... every module :data:`yamlformer.builder.hf.families.MODULES` lists).

Only local files are read (``config.json`` and ``*.safetensors``, sharded or not, or
``pytorch_model.bin`` through ``torch.load(weights_only=True)``); nothing is downloaded and
``transformers`` is never imported. A folder is not trusted (:mod:`yamlformer.builder.hf.checks`): no path
that leads out of it is opened, JSON is read with size and depth limits, every ``config.json``
value must be of its key's kind, and each fault is one line of :class:`HFError` naming the file
and the key or tensor. Every family is a table in one of those modules; the spec it produces states every difference
as a field.

Export picks the family whose config expresses the spec exactly: it writes the config, reads it
back as a spec and compares layer by layer (dropout rates aside, which inference never sees; a
family's biases may stand, as zeros, for a spec's absent ones). A spec no family expresses is
:class:`~yamlformer.builder.hf.writer.NoFamily`, one line naming the nearest family and its first difference.
"""

from __future__ import annotations

from yamlformer.builder.hf.common import Family, HFError, Unsupported
from yamlformer.builder.hf.families import FAMILIES, TOKEN_KEYS, family_of, supported_families, validate
from yamlformer.builder.hf.reader import config_to_spec, from_hf, import_hf, read_config, read_hf
from yamlformer.builder.hf.weights import Checkpoint, load_weights, read_weights, save_weights
from yamlformer.builder.hf.writer import NoFamily, choose_family, export_hf, export_line, fit, to_hf

__all__ = [
    "FAMILIES",
    "TOKEN_KEYS",
    "Checkpoint",
    "Family",
    "HFError",
    "NoFamily",
    "Unsupported",
    "choose_family",
    "config_to_spec",
    "export_hf",
    "export_line",
    "family_of",
    "fit",
    "from_hf",
    "import_hf",
    "load_weights",
    "read_config",
    "read_hf",
    "read_weights",
    "save_weights",
    "supported_families",
    "to_hf",
    "validate",
]
