"""A spec's adapters to and from PEFT: the folder ``peft.PeftModel.from_pretrained`` loads onto the
``transformers`` model ``builder export-hf`` writes of the base (``adapter_config.json`` and
``adapter_model.safetensors``), read back by ``builder import-hf``; and the adapters folded into
the weights (``export-hf --merge``). ``peft`` itself is never imported.

Each adapted layer of ours becomes a LoRA on the Hugging Face module its weight is stored in, found
through the family's tensor table (``yamlformer.builder.hf.common.Link``): a layer stored as it is
(``q_proj``) keeps its factors; one whose rows the family reorders (DeepSeek's rotary rows) has
``lora_B`` reordered alike; layers the family fuses into one module (GPT-2's ``c_attn``, Phi-3's
``qkv_proj``) become one LoRA of their summed rank, ``lora_A`` stacked and ``lora_B`` block-diagonal
(``rank_pattern`` and ``alpha_pattern`` keep the scale), a member without an adapter contributing
zero rows (and, under DoRA, its weight's own norms as magnitude: no change). Which row goes where
is read from the family's own conversion applied to a probe of row numbers, so a table that can
store the weight can store its adapter. Stacked experts (stored one tensor per expert) and a head
tied to the embedding have no PEFT form here: ``--merge`` folds them in instead (a tied head
cannot be merged either: its weight is the embedding's).

PEFT's names: ``base_model.model.<module>.lora_A.weight``, ``.lora_B.weight`` and, for DoRA,
``.lora_magnitude_vector``; ``r``, ``lora_alpha``, ``use_dora``, ``use_rslora``, ``fan_in_fan_out``
(GPT-2's ``Conv1D``) in the config.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path

from yamlformer.builder.adapters import adapted, model_linears
from yamlformer.builder.hf.checks import read_json
from yamlformer.builder.hf.common import HFError, Link, Unsupported
from yamlformer.builder.hf.families import validate
from yamlformer.builder.hf.reader import IMPORT_FILES, write_import
from yamlformer.builder.outputs import claim_folder

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
TASK_TYPES = {"decoder-only": "CAUSAL_LM", "encoder-decoder": "SEQ_2_SEQ_LM", "encoder-only": "FEATURE_EXTRACTION"}


def dense(state: dict) -> dict:
    """``state`` with NF4 weights (a QLoRA base: tensor subclasses) dequantized to their dtype."""
    return {k: v.to(v.dtype) if hasattr(v, "__tensor_flatten__") else v for k, v in state.items()}


def adapter_model(spec, state: dict):
    """``spec``'s model on the CPU holding ``state`` (adapters and all, a base dequantized: an NF4
    base's weights are stored in its dtype here), to read adapted weights from."""
    # local: torch loads when tensors are read or written (the Hugging Face readers load without it)
    import torch

    from yamlformer.builder.assemble import build_model

    plain = spec.model_copy(update={"adapters": spec.adapters.model_copy(update={"quantize": None})})
    model = build_model(plain, device="meta").to_empty(device=torch.device("cpu"))
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name in state:
                tensor.copy_(state[name])
    return model


def _tied_head(spec) -> None:
    if spec.tie_embeddings and any(path.startswith("head.") for path in adapted(spec)):
        raise Unsupported(
            "an adapter on the head, whose weight is the token embedding (tie_embeddings): neither PEFT nor a "
            "merged model can hold it; leave the head out of adapters.targets"
        )


def merged(spec, state: dict) -> tuple[object, dict]:
    """``(the spec without adapters, its weights with every adapter folded in)``: each adapted
    layer's weight as it applies it (``yamlformer.blocks.linear.Linear.adapted_weight``), an NF4
    base dequantized first."""
    # local: the model's modules (torch) are walked for a built model only (the readers load without torch)
    from yamlformer.blocks.linear import linear_layers

    _tied_head(spec)
    model = adapter_model(spec, dense(state))
    out = {}
    for path, linear in linear_layers(model).items():
        if linear.adapter is not None:
            out[f"{path}.weight"] = linear.adapted_weight().detach()
    base = {k: v for k, v in dense(state).items() if ".adapter." not in k}
    return spec.model_copy(update={"adapters": None}), {**base, **out}


@dataclasses.dataclass
class _Module:
    """One Hugging Face module an adapter lands on: its link, our layers in it, where their rows go."""

    name: str
    link: Link
    members: list[str]  # our layers' paths, in the link's order
    rows: list[int]  # each member's output rows
    order: list[int]  # Hugging Face row j holds our row order[j] (our rows: the members' in turn)
    transposed: bool  # stored (in, out), GPT-2's Conv1D


def _modules(spec, family) -> dict[str, _Module]:
    """The Hugging Face module of each adapted layer of ``spec``, by our layer's path."""
    adapted_layers = adapted(spec)
    links = family.links(spec)
    by_weight = {name: link for link in links for name in link.ours}
    out: dict[str, _Module] = {}
    for path in adapted_layers:
        link = by_weight.get(f"{path}.weight")
        if link is None or len(link.hf) != 1 or not link.hf[0].endswith(".weight"):
            where = "is not stored" if link is None else f"is stored as {len(link.hf)} tensors ({link.hf[0]} ...)"
            raise Unsupported(
                f"{path} {where} in a {family.model_type} folder as one Hugging Face linear module, which is what a "
                "PEFT adapter attaches to; export --merge folds the adapters into the weights instead"
            )
        if path in out:
            continue
        members = [name.removesuffix(".weight") for name in link.ours]
        rows = [_out_features(spec, m, adapted_layers) for m in members]
        order, transposed = _probe(link, rows)
        module = _Module(link.hf[0].removesuffix(".weight"), link, members, rows, order, transposed)
        out.update(dict.fromkeys(members, module))
    return out


def _out_features(spec, path: str, adapted_layers) -> int:
    entry = adapted_layers.get(path) or model_linears(spec).get(path)
    if entry is None:
        raise Unsupported(f"{path} is not a linear layer")
    return entry.layer.out


def _probe(link: Link, rows: list[int]) -> tuple[list[int], bool]:
    """Where the family's conversion puts each of our rows: applied to columns of row numbers."""
    # local: torch loads when tensors are read or written (the Hugging Face readers load without it)
    import torch

    starts = [sum(rows[:i]) for i in range(len(rows))]
    probe = [torch.arange(s, s + n, dtype=torch.float64)[:, None] for s, n in zip(starts, rows)]
    (stored,) = link.to_hf(probe)
    transposed = stored.shape[0] == 1 and sum(rows) > 1
    return [int(v) for v in (stored[0] if transposed else stored[:, 0]).tolist()], transposed


def to_peft(spec, state: dict, folder: str | Path, family, base: str | None = None) -> list[str]:
    """Write ``spec``'s adapters (their tensors in ``state``) as a PEFT folder for the ``family``
    model of the base; returns the Hugging Face modules adapted."""
    # local: torch loads when tensors are read or written (the Hugging Face readers load without it)
    from safetensors.torch import save_file

    tensors, adapter_config = peft_tensors(spec, state, family, base)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{WEIGHTS}.tmp-{os.getpid()}"
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, folder / WEIGHTS)
    (folder / CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
    return adapter_config["target_modules"]


def peft_tensors(spec, state: dict, family, base: str | None = None) -> tuple[dict, dict]:
    """``(tensors, adapter_config)`` of ``spec``'s adapters as PEFT holds them on the ``family``
    model (``base_model.model.<module>.lora_A.weight`` ...), unwritten: :func:`to_peft` writes
    them, ``builder export-gguf --adapters-only`` renames them for llama.cpp."""
    # local: torch loads when tensors are read or written (the Hugging Face readers load without it)
    import torch

    _tied_head(spec)
    config = spec.adapters
    if getattr(config, "type", None) not in ("lora", "dora"):
        raise Unsupported(f"adapters of type {getattr(config, 'type', None)!r} have no PEFT form here (lora, dora)")
    state = dense(state)
    modules = _modules(spec, family)
    tensors, ranks, alphas = {}, {}, {}
    for module in {id(m): m for m in modules.values()}.values():
        adapted = [m for m in module.members if m in modules]
        total = config.rank * len(adapted)
        a = torch.cat([state[f"{m}.adapter.lora_A"] for m in adapted])  # (total, in)
        b = torch.zeros(sum(module.rows), total, dtype=a.dtype)
        magnitude = []
        for i, (member, first) in enumerate(zip(module.members, _starts(module.rows))):
            rows = slice(first, first + module.rows[i])
            if member in modules:
                k = adapted.index(member)
                b[rows, k * config.rank : (k + 1) * config.rank] = state[f"{member}.adapter.lora_B"]
            if config.type == "dora":
                magnitude.append(
                    state[f"{member}.adapter.magnitude"]
                    if member in modules
                    else torch.linalg.vector_norm(state[f"{member}.weight"].to(a.dtype), dim=-1)
                )
        at = f"{PREFIX}{module.name}"
        tensors[f"{at}.lora_A.weight"] = a
        tensors[f"{at}.lora_B.weight"] = b[module.order]
        if magnitude:
            tensors[f"{at}.lora_magnitude_vector"] = torch.cat(magnitude)[module.order]
        if total != config.rank:
            ranks[module.name] = total
            alphas[module.name] = config.scale() * (math.sqrt(total) if config.rank_scaled else total)
    names = sorted({m.name for m in modules.values()})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": TASK_TYPES.get(spec.architecture),
        "base_model_name_or_path": base,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "use_rslora": config.rank_scaled,
        "use_dora": config.type == "dora",
        "target_modules": names,
        "rank_pattern": ranks,
        "alpha_pattern": alphas,
        "fan_in_fan_out": any(m.transposed for m in modules.values()),
        "bias": "none",
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "revision": None,
    }
    return tensors, adapter_config


def _starts(rows: list[int]) -> list[int]:
    return [sum(rows[:i]) for i in range(len(rows))]


def is_peft_folder(folder: str | Path) -> bool:
    return (Path(folder) / CONFIG).is_file()


def read_peft_config(folder: Path, base: str | Path | None = None) -> tuple[dict, Path]:
    """The adapter config of the PEFT ``folder`` (LoRA/DoRA on linear modules only) and the folder of
    its base model (``base``, else the one ``base_model_name_or_path`` names, relative to it)."""
    config = read_json(folder / CONFIG, "config", folder)
    if config.get("peft_type") != "LORA":
        raise HFError(f"{folder / CONFIG}: peft_type {config.get('peft_type')!r}; builder reads LORA adapters")
    for key in ("modules_to_save", "layers_to_transform", "layer_replication", "trainable_token_indices"):
        if config.get(key):
            raise HFError(f"{folder / CONFIG}: {key} is set; builder reads adapters on linear modules only")
    kinds = {"r": int, "lora_alpha": (int, float), "lora_dropout": (int, float), "use_dora": bool, "use_rslora": bool}
    kinds["fan_in_fan_out"] = bool
    for key, kind in kinds.items():
        value = config.get(key)
        wrong = isinstance(value, bool) and kind is not bool  # JSON's true is no number
        if value is not None and (wrong or not isinstance(value, kind) or (key == "r" and value < 1)):
            what = {"r": "a whole number from 1", "use_dora": "true or false", "use_rslora": "true or false"}
            what["fan_in_fan_out"] = "true or false"
            raise HFError(f"{folder / CONFIG}: {key} must be {what.get(key, 'a number')}, got {type(value).__name__}")
    where = base or config.get("base_model_name_or_path")
    if not where:
        raise HFError(f"{folder / CONFIG}: names no base model (base_model_name_or_path); give --base DIR")
    base_folder = Path(where) if base else (folder / where if not Path(where).is_absolute() else Path(where))
    if not (base_folder / "config.json").is_file():
        raise HFError(f"the base model {base_folder} is not a local Hugging Face folder (config.json); give --base DIR")
    return config, base_folder


def from_peft(folder: str | Path, base: str | Path | None = None, name: str | None = None) -> tuple[dict, dict, Path]:
    """``(spec dict with adapters, state, base folder)`` of a PEFT LoRA folder over its base model
    (``base``, else the folder ``base_model_name_or_path`` names, relative to it): the base's
    tensors and each adapter's under our names. One adapter config for every layer: a PEFT module fusing several
    of our layers gives each the whole rank, its rows of ``lora_B``."""
    # local: torch loads when tensors are read or written (the Hugging Face readers load without it)
    import torch

    from yamlformer.builder.hf.families import family_of
    from yamlformer.builder.hf.reader import read_config, read_hf
    from yamlformer.builder.hf.weights import read_weights

    folder = Path(folder)
    config, base_folder = read_peft_config(folder, base)
    spec_dict, spec, state = read_hf(base_folder, name)
    family = family_of(read_config(base_folder), base_folder / "config.json")
    weights = read_weights(folder / WEIGHTS)
    modules = {k.removeprefix(PREFIX).removesuffix(".lora_A.weight") for k in weights if k.endswith(".lora_A.weight")}
    if not modules:
        raise HFError(f"{folder / WEIGHTS}: no lora_A tensors")
    by_hf = {link.hf[0].removesuffix(".weight"): link for link in family.links(spec) if len(link.hf) == 1}
    _check_targets(config, folder, modules, spec, family)
    adapters, ranks, targets = {}, set(), []
    for module in sorted(modules):
        link = by_hf.get(module)
        if link is None:
            raise HFError(f"{folder / WEIGHTS}: {module} is no linear module of the base {family.model_type} model")
        members = [n.removesuffix(".weight") for n in link.ours]
        rows = [state[f"{m}.weight"].shape[0] for m in members]
        order, transposed = _probe(link, rows)
        _check_module(config, folder, weights, module, transposed)
        back = torch.empty(len(order), dtype=torch.long)
        back[torch.tensor(order)] = torch.arange(len(order))  # our row g is Hugging Face row back[g]
        a, b = weights[f"{PREFIX}{module}.lora_A.weight"], weights[f"{PREFIX}{module}.lora_B.weight"]
        magnitude = weights.get(f"{PREFIX}{module}.lora_magnitude_vector")
        in_features = state[f"{members[0]}.weight"].shape[-1]
        if (
            a.ndim != 2
            or b.ndim != 2
            or a.shape[0] != b.shape[1]
            or (a.shape[1], b.shape[0]) != (in_features, len(order))
            or (magnitude is not None and tuple(magnitude.shape) != (len(order),))
        ):
            raise HFError(
                f"{folder / WEIGHTS}: {module}'s lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are no adapter "
                f"of its {in_features} inputs and {len(order)} outputs"
            )
        b = b[back]
        magnitude = magnitude[back] if magnitude is not None else None
        alpha = _alpha(config, folder, module, a.shape[0])
        blocks = _blocks(b, rows)  # a fused module's block-diagonal LoRA (as export writes it): rank a's / k each
        if blocks:
            k = len(members)
            alpha = alpha / (math.sqrt(k) if config.get("use_rslora") else k)
        ranks.add((a.shape[0] // (len(members) if blocks else 1), round(alpha, 6)))  # one scale, to float rounding
        for i, (member, first, n) in enumerate(zip(members, _starts(rows), rows)):
            part = (
                slice(i * a.shape[0] // len(members), (i + 1) * a.shape[0] // len(members)) if blocks else slice(None)
            )
            adapters[f"{member}.adapter.lora_A"] = a[part]
            adapters[f"{member}.adapter.lora_B"] = b[first : first + n, part]
            if magnitude is not None:
                adapters[f"{member}.adapter.magnitude"] = magnitude[first : first + n]
            targets.append(member)
    if len(ranks) != 1:
        raise HFError(f"{folder / CONFIG}: its modules have several ranks or scales; builder's adapters have one")
    ((rank, alpha),) = ranks
    if config.get("r") is not None and not config.get("rank_pattern") and config["r"] != rank:
        raise HFError(f"{folder / CONFIG}: r is {config['r']}, its tensors' rank {rank}")
    spec_dict["adapters"] = {
        "type": "dora" if config.get("use_dora") else "lora",
        "rank": rank,
        "alpha": alpha,
        "dropout": float(config.get("lora_dropout") or 0.0),
        "rank_scaled": bool(config.get("use_rslora")),
        "targets": targets,
    }
    return spec_dict, {**state, **adapters}, base_folder


def _linear_modules(spec, family) -> tuple[set[str], set[str]]:
    """``(every module name of the base Hugging Face model, its linear modules but the output head)``:
    the names PEFT matches ``target_modules`` against, from the tensors the family stores."""
    linears = {f"{path}.weight" for path in model_linears(spec)}
    names, linear, head = set(), set(), set()
    for link in family.links(spec):
        for tensor in link.hf:
            parts = tensor.split(".")[:-1]
            names.update(".".join(parts[:i]) for i in range(len(parts) + 1))  # "" is the model itself
        if len(link.hf) == 1 and link.hf[0].endswith(".weight") and set(link.ours) <= linears:
            module = link.hf[0].removesuffix(".weight")
            (head if any(n.startswith("head.") for n in link.ours) else linear).add(module)
    return names, linear | head, linear


def _selected(pattern, names: set[str], where: str) -> set[str]:
    """The ``names`` PEFT's ``target_modules`` (or ``exclude_modules``) ``pattern`` selects: a string
    is a regular expression the whole name must match, a list entry a name or its last dotted parts."""
    if isinstance(pattern, str):
        try:
            regex = re.compile(pattern)
        except (re.error, RecursionError, OverflowError) as exc:
            raise HFError(f"{where}: is not a regular expression ({getattr(exc, 'msg', exc)})") from None
        return {n for n in names if regex.fullmatch(n)}
    if not isinstance(pattern, list) or not all(isinstance(t, str) for t in pattern):
        raise HFError(f"{where}: must be a list of module names or one regular expression")
    wanted = set(pattern)
    return {n for n in names if n in wanted or any(n.endswith(f".{t}") for t in wanted)}


def _check_targets(config: dict, folder: Path, modules: set[str], spec, family) -> None:
    """The modules the weights adapt must be exactly those ``target_modules`` selects on the base
    (PEFT's matching: ``yamlformer.builder.hf.peft._selected``), every one a linear layer."""
    where = f"{folder / CONFIG}: target_modules"
    target = config.get("target_modules")
    if target is None:
        raise HFError(f"{where}: is not set; builder reads adapters whose config names their modules")
    names, linear, not_head = _linear_modules(spec, family)
    if isinstance(target, str) and target.lower() == "all-linear":
        chosen = set(not_head)
    else:
        chosen = _selected(target, names, where)
    if config.get("exclude_modules"):
        chosen -= _selected(config["exclude_modules"], names, f"{folder / CONFIG}: exclude_modules")
    if not chosen:
        raise HFError(f"{where}: selects no module of the base {family.model_type} model (PEFT refuses it too)")
    other = sorted(chosen - linear)
    if other:
        name = other[0] or "the model itself"
        raise HFError(f"{where}: selects {name}, which is no linear layer (PEFT adapts linear modules only)")
    for missing, why in ((chosen - modules, "has no adapter in"), (modules - chosen, "is adapted in")):
        if missing:
            first = sorted(missing)[0]
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            held = "selects" if why.startswith("has") else "does not select"
            raise HFError(f"{where}: {held} {first}{more}, which {why} {WEIGHTS}; they must agree")


def _check_module(config: dict, folder: Path, weights: dict, module: str, transposed: bool) -> None:
    """``use_dora`` and ``fan_in_fan_out`` agree with ``module``'s tensors and its kind of layer."""
    has_magnitude = f"{PREFIX}{module}.lora_magnitude_vector" in weights
    if bool(config.get("use_dora")) != has_magnitude:
        held = "has no" if config.get("use_dora") else "has a"
        raise HFError(
            f"{folder / CONFIG}: use_dora is {str(bool(config.get('use_dora'))).lower()}, but {module} {held} "
            f"lora_magnitude_vector in {WEIGHTS}"
        )
    fan = config.get("fan_in_fan_out")
    if fan is not None and fan != transposed:
        kind = "a Conv1D stored (in, out)" if transposed else "a Linear stored (out, in)"
        raise HFError(
            f"{folder / CONFIG}: fan_in_fan_out is {str(fan).lower()}, but {module} is {kind} "
            f"(PEFT resets it with a warning); set it to {str(transposed).lower()}"
        )


def _blocks(b, rows: list[int]) -> bool:
    """Whether ``lora_B`` (our row order) of a module fusing ``len(rows)`` layers is block-diagonal:
    each layer's rows zero outside its own equal share of the rank."""
    k, rank = len(rows), b.shape[1]
    if k == 1 or rank % k:
        return False
    width = rank // k
    for i, (first, n) in enumerate(zip(_starts(rows), rows)):
        mine = b[first : first + n]
        if mine[:, : i * width].any() or mine[:, (i + 1) * width :].any():
            return False
    return True


def _alpha(config: dict, folder: Path, module: str, rank: int) -> float:
    """The ``lora_alpha`` of ``module`` (its ``alpha_pattern`` entry, else the config's), checked
    against a ``rank_pattern`` entry for it."""
    patterns = {k: v for k, v in (config.get("rank_pattern") or {}).items() if module == k or module.endswith("." + k)}
    if patterns and next(iter(patterns.values())) != rank:
        raise HFError(f"{folder / CONFIG}: rank_pattern gives {module} another rank than its tensors have")
    alphas = {k: v for k, v in (config.get("alpha_pattern") or {}).items() if module == k or module.endswith("." + k)}
    return float(next(iter(alphas.values())) if alphas else config.get("lora_alpha", 8))


def import_peft(
    folder: str | Path,
    out: str | Path,
    base: str | Path | None = None,
    name: str | None = None,
    overwrite: bool = False,
):
    """``builder import-hf`` of a PEFT folder: ``out/spec.yaml`` (the base's spec with ``adapters``)
    and ``out/model.safetensors`` (the base's tensors and the adapters'), the base's tokenizer and
    config files beside them; returns the two paths. ``out`` is claimed as :func:`import_hf` claims
    it (never the adapter folder nor the base's, an earlier import replaced only with ``overwrite``)."""
    folder = Path(folder)
    _, base_folder = read_peft_config(folder, base)  # a folder that is no PEFT LoRA is named first
    claim_folder(out, IMPORT_FILES, [folder, base_folder], overwrite)  # before any weights are read
    spec_dict, state, base_folder = from_peft(folder, base, name or folder.resolve().name)
    validate(spec_dict, source=folder / CONFIG)
    return write_import(base_folder, out, spec_dict, state)
