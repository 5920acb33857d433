"""builder: declarative Transformer specs, validated, counted and assembled.

``load_spec`` and ``estimate`` stay torch-free; ``build_model`` imports torch when first used.
``estimate(spec, seq_len=1024)`` sizes one device; ``estimate(spec, Step(...), Layout(...))`` a
batch shape and a device layout (``yamlformer.builder.analysis.estimates``, ``yamlformer.builder.analysis.layout``).
"""

from __future__ import annotations

__project__ = "yamlformer"  # checked by yamlformer.builder.packages: this name is ours

__all__ = ["load_spec", "build_model", "estimate", "Step", "Layout", "SpecError", "__version__"]


def _version() -> str:
    # lazy: importlib.metadata costs ~80 ms; only __version__ asks for it
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("yamlformer")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


def __getattr__(name: str):
    # Lazy: `builder validate` and `builder describe` must not pay for importing torch.
    if name == "__version__":  # importlib.metadata costs ~80 ms: only when asked
        return _version()
    if name in ("load_spec", "SpecError", "build_model", "estimate", "Step", "Layout"):
        # lazy: each part of the public API loads when first asked (import yamlformer.builder stays cheap)
        from yamlformer.builder.packages import foreign

        problem = foreign()
        if problem:
            raise ImportError(problem)
    if name in ("load_spec", "SpecError"):
        # lazy: each part of the public API loads when first asked (import yamlformer.builder stays cheap)
        from yamlformer.builder.spec import loader

        return getattr(loader, name)
    if name == "build_model":
        # lazy: each part of the public API loads when first asked (import yamlformer.builder stays cheap)
        from yamlformer.builder.assemble import build_model

        return build_model
    if name in ("estimate", "Step"):
        # lazy: each part of the public API loads when first asked (import yamlformer.builder stays cheap)
        from yamlformer.builder.analysis import estimates

        return getattr(estimates, name)
    if name == "Layout":
        # lazy: each part of the public API loads when first asked (import yamlformer.builder stays cheap)
        from yamlformer.builder.analysis.layout import Layout

        return Layout
    raise AttributeError(f"module 'yamlformer.builder' has no attribute {name!r}")
