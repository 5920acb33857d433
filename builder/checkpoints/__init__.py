"""Training checkpoints, in one place: what they hold, how they prove themselves whole, how they
are written so no save costs the previous one, and every way they are read, each checked.

``builder train`` writes a checkpoint as one ``torch.save`` file (one process, DDP) or, under
``trainer.strategy: fsdp``, as a folder written by ``torch.distributed.checkpoint`` (every rank
its own shards). Both are read here without a process group and verified, so the ``builder``
commands (``consolidate``, ``export-hf``) and the recipes (resume, eval, generate,
``model.init_from``, ``classification.init_from``, the dry run) all read them one way.

* :mod:`~yamlformer.builder.checkpoints.format`: what a checkpoint holds (weights under ``state_dict``, the
  ``builder`` record with spec, recipe and tokenizer, a sharded folder's ``meta.pt``), how one is
  told from other files, its spec and weights as a model; the errors.
* :mod:`~yamlformer.builder.checkpoints.integrity`: the checksums: a CRC-32 of every tensor and value sealed
  into a file, of every shard file into a folder's ``meta.pt``, and their checks.
* :mod:`~yamlformer.builder.checkpoints.write`: the atomic file write (``last.ckpt`` keeping its predecessor
  as ``last-1.ckpt``), the sharded save every rank runs, and the tidying of a save that died.
* :mod:`~yamlformer.builder.checkpoints.read`: every reader side by side (one file, the one cheap peek, a
  sharded folder, the model, the newest intact checkpoint of a run, Lightning's resume load, a
  file into a sharded model), each file read and verified once while it is unchanged.
* :mod:`~yamlformer.builder.checkpoints.averaging`: the average of a run's kept ``step-N.ckpt`` weights.

The Lightning glue (checkpoint IO and callbacks) is ``yamlformer.recipes.training.checkpointing``; what a
run may start from (a checkpoint, an imported or a Hugging Face folder) is ``yamlformer.builder.init_from``.
"""

from __future__ import annotations

from yamlformer.builder.checkpoints.averaging import (
    average_checkpoints,
    average_state_dicts,
    kept_checkpoints,
    step_path,
)
from yamlformer.builder.checkpoints.format import (
    BUILDER_KEY,
    KEEPS_PREVIOUS,
    META_FILE,
    RESUMABLE,
    SHARD_FILES,
    STATE_KEY,
    SUFFIXES,
    CheckpointError,
    CheckpointWriteError,
    DamagedCheckpointError,
    checkpoint_spec,
    empty_model,
    exists,
    is_sharded,
    lightning_names,
    load_weights,
    looks_like_checkpoint,
    model_weights,
    not_ours,
    previous_path,
)
from yamlformer.builder.checkpoints.integrity import digests, file_digests, is_sealed, seal, verify, verify_files
from yamlformer.builder.checkpoints.read import (
    forget,
    load_into_shards,
    load_model,
    newest_intact,
    peek_meta,
    read_checkpoint,
    read_for_resume,
    read_meta,
    read_weights,
    read_whole,
)
from yamlformer.builder.checkpoints.write import (
    save_sharded,
    swap_into,
    tidy,
    user_mode,
    write_checkpoint,
    write_reason,
)

__all__ = [
    "BUILDER_KEY",
    "KEEPS_PREVIOUS",
    "META_FILE",
    "RESUMABLE",
    "SHARD_FILES",
    "STATE_KEY",
    "SUFFIXES",
    "CheckpointError",
    "CheckpointWriteError",
    "DamagedCheckpointError",
    "average_checkpoints",
    "average_state_dicts",
    "checkpoint_spec",
    "digests",
    "empty_model",
    "exists",
    "file_digests",
    "forget",
    "is_sealed",
    "is_sharded",
    "kept_checkpoints",
    "lightning_names",
    "load_into_shards",
    "load_model",
    "load_weights",
    "looks_like_checkpoint",
    "model_weights",
    "newest_intact",
    "not_ours",
    "peek_meta",
    "previous_path",
    "read_checkpoint",
    "read_for_resume",
    "read_meta",
    "read_weights",
    "read_whole",
    "save_sharded",
    "seal",
    "step_path",
    "swap_into",
    "tidy",
    "user_mode",
    "verify",
    "verify_files",
    "write_checkpoint",
    "write_reason",
]
