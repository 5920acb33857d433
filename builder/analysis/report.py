"""Reports of an estimate: rich tables for people, plots, and counting a built model.

``describe_table(spec, est, actual=None)`` is the table ``builder describe`` prints; a training
recipe passes ``actual`` (a built model, or its counts by component from
:func:`actual_params`) to show the real parameter counts beside the estimate. Torch-free:
counting a model only calls its methods.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from yamlformer.builder.adapters import adapted
from yamlformer.builder.analysis.layout import Layout
from yamlformer.builder.parametrization import describe_lines

BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human(n: float, digits: int = 2) -> str:
    """1234567 -> '1.23M' (decimal, as parameter and FLOP counts are quoted)."""
    for unit, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.{digits}f}{unit}"
    return f"{n:g}" if isinstance(n, float) else str(n)


def human_bytes(n: float) -> str:
    """Binary units: 1536 -> '1.50 KiB'."""
    value = float(n)
    for unit in BYTE_UNITS:
        if abs(value) < 1024 or unit == BYTE_UNITS[-1]:
            return f"{value:.2f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    raise AssertionError("unreachable")


def percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


# ---------------------------------------------------------------------------------------------
# Counting a built model by component


def component_of(name: str) -> str:
    """The estimate's component key for a parameter name of a built model.

    ``decoder.layers.3.ffn.up_proj.weight`` -> ``decoder.ffn``; ``decoder.layers.0.attention_norm
    .weight`` and ``decoder.final_norm.weight`` -> ``decoder.norm``; ``encoder.embedding.tokens
    .weight`` -> ``embedding``; ``head.proj.bias`` -> ``head``; an adapter's tensor
    (``decoder.layers.0.attention.q_proj.adapter.lora_A``) -> ``decoder.adapters`` (``head.adapters``).
    A name outside this layout keys as its first two parts, which no estimate has, so a comparison
    flags it.
    """
    parts = name.split(".")
    if "adapter" in parts[:-1]:
        return f"{parts[0]}.adapters"
    if parts[0] == "head":
        return "head"
    if len(parts) < 3:
        return ".".join(parts[:2])
    stack, section = parts[0], parts[1]
    if section == "embedding":
        return "embedding.norm" if parts[2] == "norm" else "embedding"
    if section == "position":
        return "position"
    if section == "final_norm":
        return f"{stack}.norm"
    if section == "layers" and len(parts) > 3:
        block = parts[3]
        return f"{stack}.norm" if block.endswith("norm") else f"{stack}.{block}"
    return f"{stack}.{section}"


def trainable_params(model) -> int:
    """The parameters of a built model that train (``requires_grad``), a shared tensor once."""
    unique = {id(param): param for param in model.parameters()}
    return sum(param.numel() for param in unique.values() if param.requires_grad)


def actual_params(model) -> dict[str, int]:
    """``numel`` by component key of a built model; a shared tensor counted once, under the
    embedding when one of its names is there (a tied output projection)."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, Any] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        tensors[id(param)] = param
    counts: dict[str, int] = {}
    for key, param_names in names.items():
        components = [component_of(n) for n in param_names]
        component = next((c for c in components if c.startswith("embedding")), components[0])
        counts[component] = counts.get(component, 0) + tensors[key].numel()
    return counts


def compare_rows(estimated: Mapping[str, int], actual: Mapping[str, int]) -> list[dict[str, Any]]:
    """One row per component in either mapping: estimated, actual, difference, match."""
    keys = list(estimated) + [k for k in actual if k not in estimated]
    rows = []
    for key in keys:
        est, act = estimated.get(key, 0), actual.get(key, 0)
        rows.append({"component": key, "estimated": est, "actual": act, "difference": act - est, "match": est == act})
    return rows


# ---------------------------------------------------------------------------------------------
# Tables


def describe_table(spec, est, actual=None):
    """A rich renderable: parameters and FLOPs by component, a per-layer summary, totals,
    memory and the counting conventions. ``actual``: a built model or its counts by component."""

    if actual is not None and not isinstance(actual, Mapping):
        actual = actual_params(actual)
    p, f, m, s = est.params, est.flops, est.memory, est.settings
    seq = f.seq_len
    title = f"{est.name}: {spec.architecture}, d_model {spec.d_model}, vocab {spec.vocab_size}, seq_len {seq}" + (
        f", src_len {f.src_len}" if f.src_len else ""
    )

    components = Table(title=title, title_justify="left")
    components.add_column("component")
    components.add_column("params", justify="right")
    components.add_column("share", justify="right")
    if actual is not None:
        components.add_column("built", justify="right")
        components.add_column("match", justify="center")
    components.add_column("fwd FLOPs/token", justify="right")
    components.add_column("share", justify="right")
    forward = f.forward_per_sequence
    keys = list(p.by_component) + [k for k in (actual or {}) if k not in p.by_component]
    for key in keys:
        # a component's auxiliary parts (head.mtp) are rows of their own, after what is left of it
        parts = [part for part in p.auxiliary if part.startswith(key + ".")]
        held, held_flops = sum(p.auxiliary[k] for k in parts), sum(f.auxiliary.get(k, 0) for k in parts)
        n = p.by_component.get(key, 0) - held
        row = [key, f"{n:,}", percent(n, p.total)]
        if actual is not None:
            built = actual.get(key, 0) - held
            row += [f"{built:,}", "[green]ok[/]" if built == n else "[red]DIFF[/]"]
        flops = f.by_component.get(key, 0) - held_flops
        row += [human(flops / seq), percent(flops, forward)]
        components.add_row(*row)
        for part in parts:
            built = ["", ""] if actual is not None else []
            flops = f.auxiliary.get(part, 0)
            components.add_row(
                f"{part} (training only)",
                f"{p.auxiliary[part]:,}",
                percent(p.auxiliary[part], p.total),
                *built,
                human(flops / seq),
                percent(flops, forward),
            )
    total_row = ["total", f"{p.total:,}", "100%"]
    if actual is not None:
        built_total = sum(actual.values())
        total_row += [f"{built_total:,}", "[green]ok[/]" if built_total == p.total else "[red]DIFF[/]"]
    total_row += [human(f.forward_per_token), "100%"]
    components.add_row(*total_row, style="bold")

    layers = Table(title="layers (figures per layer; FLOPs per token)", title_justify="left")
    for column, justify in (
        ("stack", "left"),
        ("layers", "left"),
        ("blocks", "left"),
        ("params", "right"),
        ("active", "right"),
        ("fwd FLOPs", "right"),
        ("saved for bwd", "right"),
    ):
        layers.add_column(column, justify=justify)
    for stack, indices, layer in _layer_groups(est.layers):
        layers.add_row(
            stack,
            _span(indices),
            layer.description,
            human(layer.total_params),
            human(layer.active_params),
            human(layer.total_flops / seq),
            human_bytes(layer.saved_bytes),
        )

    totals = Table(title="totals", title_justify="left", show_header=False)
    totals.add_column("what")
    totals.add_column("value", justify="right")
    totals.add_column("note")
    totals.add_row("params", f"{p.total:,}", human(p.total))
    if p.auxiliary:
        without = ", ".join(p.auxiliary)
        totals.add_row("main-model params", f"{p.main:,}", f"{human(p.main)}: without {without}, what decoding runs")
    if p.frozen:
        share = f"{percent(p.trainable, p.total)} of total: {_adapters(spec)}"
        totals.add_row("trainable params", f"{p.trainable:,}", share)
        totals.add_row("frozen params", f"{p.frozen:,}", "weights only: no gradients, no optimizer state")
    totals.add_row("embedding params", f"{p.embedding:,}", "token, segment, learned-position tables")
    totals.add_row("non-embedding params", f"{p.non_embedding:,}", "Kaplan's N")
    totals.add_row("active params/token", f"{p.active:,}", percent(p.active, p.total) + " of total")
    totals.add_row("forward FLOPs/token", f"{f.forward_per_token:,}", human(f.forward_per_token))
    factor = "4x" if s["activation_checkpointing"] else "3x"
    totals.add_row("train FLOPs/token", f"{f.train_per_token:,}", f"{factor} forward")
    totals.add_row(
        "kernel train FLOPs/token", f"{f.kernel_train_per_token:,}", "attention over visible pairs only (for MFU)"
    )
    totals.add_row("forward FLOPs/sequence", f"{f.forward_per_sequence:,}", human(f.forward_per_sequence))

    memory = memory_table(m, s, seq)

    notes = Text("\n".join(f"- {c}" for c in est.conventions), style="dim")
    shown = Text("\n".join(describe_lines(spec)))
    return Group(components, layers, totals, memory, shown, Text("conventions:", style="dim"), notes)


def memory_table(m, s, seq: int):
    """Training memory per device (rank 0 under FSDP/TP, with the rank holding the least), the KV
    cache and inference."""

    layout = m.layout
    extras = (", checkpointing" if s["activation_checkpointing"] else "") + (
        ", fused attention" if s["fused_attention"] else ", eager attention"
    )
    if layout is None:
        title = f"memory per device: batch {s['batch']}, {s['dtype']}, {s['devices']} device(s) {s['strategy']}"
        rows = (
            ("weights", m.weights),
            ("fp32 master weights", m.master_weights),
            ("gradients", m.gradients),
            (f"optimizer state ({s.get('optimizer', 'adamw')})", m.optimizer),
            ("activations", m.activations),
            ("reference model (frozen copy)", m.reference),
        )
    else:
        mesh = Layout.from_dict(layout)
        title = (
            f"memory per device, rank 0 (holds the most): {mesh.describe()}; batch {s['batch']} per "
            f"data-parallel rank, {s['dtype']} compute"
        )
        rows = (
            ("weights (fp32 shards: the master weights)", m.weights),
            ("gradients (fp32 shards)", m.gradients),
            (f"optimizer state ({s.get('optimizer', 'adamw')}, fp32 shards)", m.optimizer),
            ("FSDP units in flight (2 gathered, 1 unit's grads)", m.sharding_buffers),
            ("activations" + (" (one tensor-parallel rank)" if mesh.tensor_parallel > 1 else ""), m.activations),
            ("reference model (frozen copy, shards)", m.reference),
        )
    memory = Table(title=title + extras, title_justify="left", show_header=False)
    memory.add_column("what")
    memory.add_column("bytes", justify="right")
    for label, value in rows:
        if value or label.startswith(("weights", "activations")):
            memory.add_row(label, human_bytes(value))
    memory.add_row("training total", human_bytes(m.training_total), style="bold")
    least = layout["smallest"] if layout is not None else None
    held = least["weights"] + least["gradients"] + least["optimizer"] if least else 0
    most = m.weights + m.gradients + m.optimizer
    if least and held != most:
        memory.add_row(
            f"rank {least['rank']} (holds the least: torch.chunk's last shard)",
            f"{human_bytes(held)} of states, {human_bytes(most - held)} less",
        )
    memory.add_row(f"KV cache (batch {s['batch']}, {seq} tokens)", human_bytes(m.kv_cache))
    memory.add_row("inference total (weights + KV cache)", human_bytes(m.inference_total))
    return memory


def summary_line(spec, est, actual=None) -> str:
    """The estimate in one line (what a run prints before its first step; the tables are
    :func:`describe_table`'s): parameters (checked against ``actual``, a built model), training
    FLOPs per token and training memory per device."""
    p, f, m = est.params, est.flops, est.memory
    check = ""
    if actual is not None:
        built = sum(actual_params(actual).values())
        check = " (= the built model)" if built == p.total else f" ([red]the built model has {built:,}[/])"
        trained = trainable_params(actual)
        if trained < built and not p.frozen:  # frozen by the run (model.freeze), not by the spec's adapters
            check += f", {trained:,} of them trained"
    trains = f", {p.trainable:,} trainable ({_adapters(spec)})" if p.frozen else ""
    return (
        f"{spec.name}: {p.total:,} parameters ({human(p.total)}){check}{trains}; {human(f.train_per_token)} FLOPs "
        f"per training token; {human_bytes(m.training_total)} training memory per device ({est.settings['dtype']})"
    )


def _adapters(spec) -> str:
    """What trains, in a few words: ``lora r16 on 64 linear layers``."""
    return f"{spec.adapters.describe()} on {len(adapted(spec)):,} linear layers"


def print_describe(spec, est, actual=None, console=None) -> None:
    """Print :func:`describe_table` (a recipe calls this with the built model as ``actual``)."""

    (console or Console()).print(describe_table(spec, est, actual))


def _layer_groups(layers):
    """Identical layers of a stack together: (stack, their indices, one of them)."""
    groups: dict[tuple, tuple[str, list[int], Any]] = {}
    for layer in layers:
        key = (layer.stack, layer.description, layer.total_params, layer.total_flops, layer.saved_bytes)
        groups.setdefault(key, (layer.stack, [], layer))[1].append(layer.index)
    return list(groups.values())


def _span(indices: list[int]) -> str:
    """[0..31] -> '0-31'; [0, 2, .., 24] -> '0-24 step 2'; else the list."""
    if len(indices) == 1:
        return str(indices[0])
    steps = {b - a for a, b in zip(indices, indices[1:])}
    if len(steps) == 1:
        step = steps.pop()
        return f"{indices[0]}-{indices[-1]}" + (f" step {step}" if step > 1 else "")
    return ",".join(map(str, indices))


def diff_table(rows, effects, name_a: str, name_b: str, measured: str = ""):
    """The fields that differ and what the change does (see ``builder diff``); ``measured``: how
    the effects were measured (the sequence length both are counted at), in the effect table's title."""

    fields = Table(title=f"fields: {name_a} -> {name_b}", title_justify="left")
    fields.add_column("field")
    fields.add_column(name_a)
    fields.add_column(name_b)
    for path, a, b in rows:
        fields.add_row(path, _show(a), _show(b))
    if not rows:
        fields.add_row("(no differences)", "", "")
    change = Table(title=f"effect, {measured}" if measured else "effect", title_justify="left")
    for column in ("quantity", name_a, name_b, "change", "%"):
        change.add_column(column, justify="left" if column == "quantity" else "right")
    for effect in effects:
        fmt = human_bytes if effect["unit"] == "bytes" else (lambda v: f"{v:,}")
        pct = "-" if effect["percent"] is None else f"{effect['percent']:+.2f}%"
        sign = "+" if effect["change"] > 0 else ""
        change.add_row(effect["quantity"], fmt(effect["a"]), fmt(effect["b"]), sign + fmt(effect["change"]), pct)
    return Group(fields, change)


class _Missing:
    """A field one spec has and the other lacks."""

    def __repr__(self) -> str:
        return "(absent)"


MISSING = _Missing()


def _show(value) -> str:
    return repr(value)


# ---------------------------------------------------------------------------------------------
# Plots


def plot(spec, est, path: str, estimate_fn=None) -> None:
    """Save a figure: parameters and FLOPs by component, FLOPs per token against seq_len."""
    try:
        # optional extra: matplotlib (pip install 'yamlformer[plot]')
        import matplotlib

        matplotlib.use("Agg")
        # optional extra: matplotlib (pip install 'yamlformer[plot]')
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("error: --plot needs matplotlib; install it with `pip install 'yamlformer[plot]'`") from None
    if estimate_fn is None:
        # local: builder validate loads this module; the estimate loads only when this asks for one
        from yamlformer.builder.analysis.estimates import estimate as estimate_fn
    p, f, s = est.params, est.flops, est.settings
    fig, (ax_params, ax_flops, ax_seq) = plt.subplots(1, 3, figsize=(16, 5))
    names = list(p.by_component)
    ax_params.barh(names, [p.by_component[n] for n in names], color="tab:blue")
    ax_params.set_title(f"parameters by component (total {human(p.total)})")
    ax_params.set_xlabel("parameters")
    ax_params.invert_yaxis()
    flop_names = [n for n in f.by_component if f.by_component[n]]
    ax_flops.barh(flop_names, [f.by_component[n] / f.seq_len for n in flop_names], color="tab:orange")
    ax_flops.set_title(f"forward FLOPs/token by component at seq_len {f.seq_len}")
    ax_flops.set_xlabel("FLOPs per token")
    ax_flops.invert_yaxis()
    lengths = _lengths(spec.max_seq_len)
    forward, kernel = [], []
    for n in lengths:
        e = estimate_fn(spec, seq_len=n, dtype=s["dtype"])
        forward.append(e.flops.forward_per_token)
        kernel.append(e.flops.kernel_forward_per_token)
    ax_seq.plot(lengths, forward, marker="o", label="forward (full attention matrix, eager)")
    ax_seq.plot(lengths, kernel, marker=".", linestyle="--", label="forward (tiled kernel, mask-aware)")
    ax_seq.set_xscale("log", base=2)
    ax_seq.set_title("forward FLOPs per token vs seq_len")
    ax_seq.set_xlabel("seq_len")
    ax_seq.set_ylabel("FLOPs per token")
    ax_seq.legend()
    fig.suptitle(f"{est.name} ({spec.architecture})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _lengths(max_seq_len: int) -> list[int]:
    """Sequence lengths for the FLOPs-vs-length plot: doubling up to the spec's max_seq_len."""
    lengths, n = [], max(1, max_seq_len // 64)
    while n < max_seq_len:
        lengths.append(n)
        n *= 2
    return lengths + [max_seq_len]
