"""A plan's chosen layout as a launch: what ``builder train`` is told to run, and its command lines (torch-free).

:class:`Launch` is what a launch fixes; the file ``builder train`` runs turns it into its own
settings (its document kind's ``launch``, ``yamlformer.builder.kinds``), the runtime's trainer fields
given by ``yamlformer.builder.analysis.runtime``. :func:`launch_lines` are the ``torchrun`` and SLURM lines.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from yamlformer.builder.analysis import runtime
from yamlformer.builder.analysis.layout import Layout


@dataclass(frozen=True)
class Launch:
    """What a launch of a plan's chosen layout fixes, for the file ``builder train`` runs to set
    (its document kind's ``launch``, ``yamlformer.builder.kinds``): micro-batches of ``seq_len`` tokens
    on ``candidate``'s layout, with its accumulation and checkpointing, in ``dtype``. ``spec`` (a
    file or a zoo name) and ``spec_overrides`` (``KEY=VALUE``) replace the model the file trains,
    ``max_steps`` and ``output_dir`` its own (the plan's budget is steps); ``None``: the file's."""

    candidate: Any  # a yamlformer.builder.analysis.plan.Candidate
    seq_len: int
    dtype: str
    spec: str | None = None
    spec_overrides: tuple[str, ...] = ()
    max_steps: int | None = None
    output_dir: str | None = None

    @property
    def layout(self) -> Layout:
        return self.candidate.layout

    @property
    def trainer_fields(self) -> dict[str, Any]:
        """The runtime's trainer fields this launch sets (``yamlformer.builder.analysis.runtime.launch_fields``):
        strategy, data-parallel mode, degrees, accumulation, recomputation, and under pipeline
        parallelism the schedule and its micro-batches."""
        c = self.candidate
        return runtime.launch_fields(
            self.layout, recompute=c.recompute, schedule=c.run.schedule, microbatches=c.accumulation
        )

    @property
    def optimizer(self) -> str:
        """The optimizer the plan counted the state of (``yamlformer.builder.optim``), by type name."""
        chosen = self.candidate.run.optimizer
        return chosen if isinstance(chosen, str) else chosen.type

    @property
    def batch_size(self) -> int:
        """Sequences one data-parallel rank reads at a time: a micro-batch, or under pipeline
        parallelism every micro-batch of the step (the schedule cuts it)."""
        c = self.candidate
        return c.micro_batch * (c.accumulation if self.layout.pipeline_parallel > 1 else 1)


#: torchrun's agents share their rendezvous store with the ranks by default, and keep it across
#: restarts: ranks restarted by ``--max-restarts`` then read the addresses the dead ones published
#: there and fail to connect (pytorch#135712). Off, rank 0 of each attempt starts a fresh store.
FRESH_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


def launch_lines(recipe: str, sets: list[str], layout: Layout) -> dict[str, str]:
    """``torchrun`` (run on every node, its endpoint ``$MASTER_ADDR`` and ``$MASTER_PORT``, default
    29500) and SLURM (``sbatch``, pre-emptible as ``yamlformer.builder.analysis.sbatch`` says) lines
    for ``builder train``, and ``train``: the ``builder`` command's arguments they both run."""

    flags = " ".join(f"--set {shlex.quote(item)}" for item in sets)
    train = f"train {shlex.quote(recipe)} {flags}"
    if layout.nodes > 1:
        where = (
            f"--nnodes={layout.nodes} --nproc-per-node={layout.per_node} --node-rank=$NODE_RANK "
            "--rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:${MASTER_PORT:-29500}"
        )
    else:
        where = f"--standalone --nproc-per-node={layout.per_node}"
    slurm = (
        f"sbatch --nodes={layout.nodes} --ntasks-per-node={layout.per_node} "
        f"--gpus-per-node={layout.per_node} --signal=USR1@120 --requeue --open-mode=append "
        f"--wrap={shlex.quote(f'srun --kill-on-bad-exit=1 builder {train}')}"
    )
    return {
        "torchrun": f"{FRESH_STORE} torchrun {where} -m yamlformer.builder.cli {train}",
        "slurm": slurm,
        "train": train,
    }
