"""A trained model back from a checkpoint alone (``builder eval``, ``builder generate``, a task's
final evaluation): its spec, weights and tokenizer, or those of a model folder; the tokenizer a
run starting from a checkpoint (``model.init_from``) takes with its weights; and the weights a
checkpoint's run started from, as its record says.

Checkpoints are read and verified by :mod:`yamlformer.builder.checkpoints`; this module adds what only the
recipes know (the tokenizers, the device to run on) and turns every fault into one
:class:`~yamlformer.recipes.errors.RecipeError` line naming the file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from yamlformer.builder import build_model
from yamlformer.builder.checkpoints import (
    CheckpointError,
    checkpoint_spec,
    is_sealed,
    is_sharded,
    load_model,
    load_weights,
    model_weights,
    not_ours,
    read_checkpoint,
)
from yamlformer.builder.hf import HFError, from_hf
from yamlformer.builder.hf import load_weights as load_folder_weights
from yamlformer.builder.hf.tokenizer import read_tokenizer
from yamlformer.builder.spec.loader import SpecError, load_spec
from yamlformer.recipes.data.tokenizers import from_state
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.recipe.init_from import init_from_path


def pick_device(name: str | None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def read_verified(path: str | Path) -> dict:
    """A checkpoint file, verified against its checksums: :class:`RecipeError` naming the file
    when it is missing, damaged or not loadable safely. One without checksums (written before
    they were added) loads with a note."""

    try:
        checkpoint = read_checkpoint(path)
    except CheckpointError as exc:
        raise RecipeError(str(exc)) from None
    if not is_sealed(checkpoint) and isinstance(checkpoint.get("builder"), dict):  # another program's: refused later
        print(
            f"note: {path} has no checksums (written by an older builder); it is loaded unverified",
            file=sys.stderr,
            flush=True,
        )
    return checkpoint


def load_trained(path: str | Path, device: str | None = None, folders: bool = False):
    """``(model, tokenizer, meta)`` from a checkpoint written by ``builder train`` (a file, or a
    sharded folder read whole into this process) or, with ``folders``, from a model folder (see
    :func:`load_folder`)."""

    path = Path(path)
    if is_sharded(path):
        try:
            model, meta = load_model(path)
        except CheckpointError as exc:
            raise RecipeError(str(exc)) from None
        return model.to(pick_device(device)).eval(), checkpoint_tokenizer(path, meta.get("tokenizer")), meta
    if path.is_dir():
        if folders:
            return load_folder(path, device)
        raise RecipeError(f"{path} is a folder; this command needs a checkpoint written by `builder train`")
    checkpoint = read_verified(path)
    meta = checkpoint.get("builder")
    if (
        not isinstance(meta, dict)
        or not isinstance(meta.get("spec"), dict)
        or not isinstance(checkpoint.get("state_dict"), dict)
        or not isinstance(meta.get("tokenizer"), dict)
    ):
        raise RecipeError(not_ours(path, checkpoint))
    spec = _checkpoint_spec(path, meta["spec"])
    tokenizer = checkpoint_tokenizer(path, meta["tokenizer"])
    model = build_model(spec)
    try:
        load_weights(model, model_weights(checkpoint["state_dict"]), path)
    except CheckpointError as exc:
        raise RecipeError(str(exc)) from None
    model.to(pick_device(device)).eval()
    meta = dict(meta, global_step=checkpoint.get("global_step"))
    return model, tokenizer, meta


def checkpoint_tokenizer(path: Path, state: dict):
    """The checkpoint's tokenizer, or one line naming ``path`` when its record cannot rebuild one."""
    try:
        return from_state(state)
    except (KeyError, TypeError, ValueError, RuntimeError, OSError, RecipeError) as exc:
        reason = (
            f"no {exc}"
            if isinstance(exc, KeyError)
            else str(exc).strip().splitlines()[0][:160]
            if str(exc).strip()
            else type(exc).__name__
        )
        raise RecipeError(f"{path}: its tokenizer cannot be rebuilt ({reason})") from None


def pretrained_tokenizer(run):
    """The tokenizer of the run checkpoint ``model.init_from`` names, else None (``run``: a
    :class:`yamlformer.recipes.training.resolved.Run`, which read that checkpoint's tokenizer)."""
    if run.pretrained is None:
        return None
    path = run.source.path
    print(f"tokenizer: the one {path.name} was trained with (model.init_from)", flush=True)
    try:
        return checkpoint_tokenizer(path, run.pretrained)
    except RecipeError as exc:
        raise RecipeError(f"model.init_from: {exc}") from None


def starting_weights(meta: dict) -> Path | None:
    """The weights the run of a checkpoint's ``builder`` record (``meta``) started from: the
    model its ``model.init_from`` was read from, as the run recorded it (``starting_weights``),
    or None: the run drew its own, seeded by ``trainer.seed``. A checkpoint written before runs
    recorded it keeps working: its recipe's ``model.init_from`` is found again from the recipe
    file it names, as ``builder eval`` found it then."""
    if "starting_weights" in meta:
        recorded = meta["starting_weights"]
        return None if recorded is None else Path(recorded)
    init_from = ((meta.get("recipe") or {}).get("model") or {}).get("init_from")
    if init_from is None:
        return None
    recipe_file = meta.get("recipe_file")
    return init_from_path(init_from, Path(recipe_file) if recipe_file else None)


def load_folder(folder: Path, device: str | None = None):
    """``(model, tokenizer, meta)`` of a decoder-only model folder: a ``builder import-hf``
    output (``spec.yaml``, ``model.safetensors``) or a Hugging Face folder (``config.json`` and
    its weights), with the folder's tokenizer (``tokenizer.json``, else ``tokenizer.model``)."""

    try:
        if (folder / "spec.yaml").is_file():
            spec = load_spec(folder / "spec.yaml")
            model = load_folder_weights(build_model(spec), folder / "model.safetensors")
        elif (folder / "config.json").is_file() or (folder / "config.json").is_symlink():
            spec, state = from_hf(folder)
            model = load_folder_weights(build_model(spec), state)
        else:
            raise RecipeError(f"{folder} is not a model folder (no spec.yaml or config.json) nor a checkpoint")
        state = read_tokenizer(folder)
    except (HFError, SpecError) as exc:
        raise RecipeError(str(exc)) from None
    if spec.architecture != "decoder-only":
        raise RecipeError(
            f"{folder} holds an {spec.architecture} model; generating from a folder takes a decoder-only one"
        )
    if state is None:
        raise RecipeError(f"{folder} has no tokenizer (tokenizer.json or tokenizer.model) to encode the prompt with")
    tokenizer = from_state(state)
    if tokenizer.vocab_size > spec.vocab_size:
        raise RecipeError(
            f"{folder}: the tokenizer has {tokenizer.vocab_size:,} tokens, more than the model's "
            f"vocab_size {spec.vocab_size:,}"
        )
    model.to(pick_device(device)).eval()
    meta = {"task": "lm", "spec": spec.model_dump(mode="json"), "tokenizer": state, "global_step": None}
    return model, tokenizer, meta


def _checkpoint_spec(path: Path, data: dict):
    """The checkpoint's spec, validated against the blocks registered now."""

    try:
        return checkpoint_spec(path, data)
    except CheckpointError as exc:
        raise RecipeError(str(exc)) from None
