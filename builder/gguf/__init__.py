"""GGUF export: a model of ours as one file llama.cpp runs (``builder export-gguf``).

```python
from yamlformer.builder.gguf import export_gguf, plan, write_gguf

plan(spec, tokenizer_state)          # the llama.cpp architecture, or GGUFError: one line naming the field
write_gguf(spec, model, "m.gguf", outtype="q8_0", tokenizer=tokenizer_state)
export_gguf("runs/x/last.ckpt", "m.gguf")   # what the command does
```

``command`` is the command's work, ``export`` writes a model (through ``gguf``, llama.cpp's own
writer, an optional extra: ``pip install 'yamlformer[gguf]'``), ``lora`` its LoRA adapters alone
(``--adapters-only``), ``arches`` holds each architecture's keys, layouts and refusals, ``vocab``
the tokenizer. Nothing here imports ``gguf`` or torch until a file is written.
"""

from __future__ import annotations

from yamlformer.builder.gguf.command import export_gguf
from yamlformer.builder.gguf.export import OUTTYPES, GGUFError, Plan, plan, write_gguf

__all__ = ["OUTTYPES", "GGUFError", "Plan", "export_gguf", "plan", "write_gguf"]
