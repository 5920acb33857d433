"""builder: declarative Transformer specs, validated, counted and assembled.

``load_spec`` and ``estimate`` stay torch-free; ``build_model`` imports torch when first used.
"""

from __future__ import annotations

__all__ = ["load_spec", "build_model", "estimate", "SpecError"]


def __getattr__(name: str):
    # Lazy: `builder validate` and `builder describe` must not pay for importing torch.
    if name in ("load_spec", "SpecError"):
        from builder import loader

        return getattr(loader, name)
    if name == "build_model":
        from builder.assemble import build_model

        return build_model
    if name == "estimate":
        from builder.estimates import estimate

        return estimate
    raise AttributeError(f"module 'builder' has no attribute {name!r}")
