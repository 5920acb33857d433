"""Pipeline parallelism (``trainer.pipeline_parallel``, ``pipeline_schedule``, ``microbatches``)
with ``torch.distributed.pipelining``, over the ``pp`` dimension of the device mesh, as
torchtitan does it (``torchtitan/distributed/pipeline_parallel.py``):

* the model (on the meta device) is cut at layer boundaries into ``pipeline_parallel x`` (stages
  per rank) stages by its own contract, ``model.pipeline_part(layers)``
  (``yamlformer.blocks.stacks``): the first stage holds the embedding, the last the final norm and head, and
  :func:`stage_layers` gives the first and last one layer fewer where the layers do not divide;
* each rank keeps the part holding all its stages' layers (its parameters keep the whole model's
  names, so checkpoints load on any layout), and each stage is a view of it, parallelised alone
  (tensor parallelism, checkpointing, compile, then ``fully_shard`` with the stage as its root,
  which ``PipelineStage`` drives: its gradients reduce once, after the last micro-batch) and
  wrapped in ``PipelineStage`` on the ``pp`` group;
* the schedule (:data:`SCHEDULES`) runs a step's micro-batches through the stages, the last
  computing the loss; the loss is broadcast over the ``pp`` group, so every rank logs it. The
  zero-bubble schedules (``zbv``, ``dualpipev``) split each backward into an input pass and a
  weight pass; the stages' FSDP2 units keep their gathered parameters from forward to backward
  (``reshard_after_forward=False``, torchtitan's policy under PP), which that weight pass needs;
* a stage's own auxiliary losses (a mixture of experts' balancing loss) enter its backward
  (:func:`attach_auxiliary_losses`), its blocks' statistics are summed over the ranks of its
  stage (``use_statistics_group``) and torch's metadata inference counts none (:func:`_stage_class`);
* under context parallelism each stage's micro-batches are this rank's share of the rows, its
  forward told the tokens' places in the whole sequence (:func:`attach_token_index`).

Lightning's ``ModelParallelStrategy`` has no pipeline: the LightningModule drives the schedule
with manual optimization (``yamlformer.recipes.learning.module.LMModule``): a schedule's step is the forward
and backward of every micro-batch interleaved across ranks, which no ``training_step`` returning
a loss for Lightning to backpropagate can express; the optimizer, its scheduler, checkpoints and
logging stay Lightning's.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.pipelining.schedules import ScheduleLoopedBFS, _Action, _ComputationType

from yamlformer.builder.analysis.layout import pipeline_parallel_problems
from yamlformer.builder.analysis.runtime import stage_placement
from yamlformer.builder.analysis.shards import stage_layers, stages_of_rank
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.parallel.mesh import PIPELINE_PEERS
from yamlformer.recipes.recipe.sections import TrainerSection

#: ``trainer.pipeline_schedule`` -> the torch schedule class; how many stages each rank holds and
#: how they go to ranks is ``yamlformer.builder.analysis.runtime.stage_placement``'s (the planner's too)
SCHEDULES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def stage_count(settings: TrainerSection) -> int:
    """Stages in all: the ranks of a pipeline times the stages each holds."""
    return settings.pipeline_parallel * stage_placement(settings.pipeline_schedule)[0]


def check_pipeline(model: nn.Module, settings: TrainerSection) -> None:
    """Refuse, in one :class:`RecipeError` naming ``trainer.pipeline_parallel``, a model its stages cannot cut."""
    degree, stages = settings.pipeline_parallel, stage_count(settings)
    where = f"trainer.pipeline_parallel {degree}"
    try:
        layers = model.pipeline_layers()
    except ValueError as exc:
        raise RecipeError(f"{where}: {exc}") from None
    if layers < stages:
        per = f" ({settings.pipeline_schedule} holds {stages // degree} per rank)" if stages > degree else ""
        raise RecipeError(f"{where}: {stages} stages{per} but the model has {layers} layers")
    problems = pipeline_parallel_problems(model.spec, degree, settings.pipeline_schedule)  # as the planner asks
    if problems:
        loc, message = problems[0]
        raise RecipeError(f"{where}: {'.'.join(map(str, loc))}: {message}")
    shared = _shared_across(model, stage_layers(layers, stages))
    if shared:
        raise RecipeError(f"{where}: {shared} is shared between stages on different ranks")


def _shared_across(model: nn.Module, layers: list[list[int]]) -> str | None:
    """A parameter two stages hold, by name, other than a head's table tied to the embedding
    (the first and last stages each keep it, their gradients summed: :meth:`Pipeline.tie_gradients`)."""
    tied = {id(p) for p in tied_table(model)}
    owner: dict[int, int] = {}
    for index, part_layers in enumerate(layers):
        for name, p in model.pipeline_part(part_layers).named_parameters():
            if owner.setdefault(id(p), index) != index and id(p) not in tied:
                return name
    return None


def tied_table(model: nn.Module) -> list[nn.Parameter]:
    """The embedding's parameters a model's head shares (a tied head's projection), if it holds both."""
    if not model.tied_head():
        return []
    stack = next(iter(model.stacks().values()))
    head = {id(p) for p in model.head.parameters()}
    return [p for p in stack.embedding.parameters() if id(p) in head]


@dataclass
class Pipeline:
    """A rank's pipeline stages and the schedule that runs them."""

    #: ``() -> schedule``: the training schedule, made again after a separate evaluation schedule ran
    make_schedule: object
    stages: list
    group: object  # the pp process group
    last_rank: int  # the pp rank holding the last stage (the loss)
    microbatches: int
    eval_schedule: object = None  # forward only, where the training schedule has none (V placements)
    #: the whole model's parameter names in its own order (``named_parameters``), which every stage's keep
    names: tuple[str, ...] = ()
    #: under context parallelism, this rank's share of each sequence (``yamlformer.recipes.parallel.context``)
    context_shard: object = None
    #: a head tied to the embedding: ``(group, part, names)``, the process group of the ranks holding the
    #: first and the last stage (their copies of the table), this rank's part and the table's names in
    #: the whole model; None: nothing tied across ranks
    tie: tuple | None = None

    def __post_init__(self):
        self.schedule = self.make_schedule()

    @property
    def has_last(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    @property
    def has_first(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    def _run(self, train: bool, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One schedule step (``train``: forward and backward; else forward only) over ``input_ids``
        cut into micro-batches; the mean of their losses, on every rank of the pipeline."""

        losses: list[torch.Tensor] = []
        if self.context_shard is not None:  # every stage's micro-batches are this rank's share of the rows
            input_ids, targets = self.context_shard.split(input_ids, targets)
        args = (input_ids,) if self.has_first else ()
        target = targets if self.has_last else None
        run = self.schedule.step if train else (self.eval_schedule or self.schedule).eval
        run(*args, target=target, losses=losses, return_outputs=False)
        if not train and self.eval_schedule is not None:
            # the forward-only schedule made the stages' receive buffers again, without gradients
            # (the middle stages' weights then got none): a new training schedule makes its own
            # again at its first step, as one schedule does when it switches between eval and train
            self.schedule = self.make_schedule()
        if self.has_last:
            loss = torch.stack([x.detach().float() for x in losses]).mean()
        else:
            loss = torch.zeros((), device=input_ids.device)
        dist.broadcast(loss, group=self.group, group_src=self.last_rank)
        return loss

    def train_step(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch; the gradients are the whole batch's mean
        (a tied table's copies summed over the first and last stages: :meth:`tie_gradients`)."""
        loss = self._run(True, input_ids, targets)
        self.tie_gradients()
        return loss

    def tied(self) -> list[nn.Parameter]:
        """This rank's copy of a table the head shares with the embedding (on the first and the
        last stage's ranks), or none."""
        if self.tie is None:
            return []
        _, part, names = self.tie
        held = dict(part.named_parameters())
        return [held[name] for name in names if name in held]

    def tie_gradients(self) -> None:
        """Sum the gradients of a tied table's two copies: the first stage's (the embedding's
        lookups) and the last's (the head's projection), as Megatron-LM's embedding all-reduce;
        each rank's shard of them, laid out alike on both (the same tensor and data-parallel split)."""
        for param in self.tied():
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            dist.all_reduce(local, group=self.tie[0])
            param.grad = grad

    @property
    def duplicates(self) -> list[nn.Parameter]:
        """The parameters a gradient norm leaves out here because another rank counts them: the
        last stage's copy of a tied table (the first stage's counts once, as one process does)."""
        return self.tied() if self.has_last and not self.has_first else []

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._run(False, input_ids, targets)

    def whole_groups(self, groups: list[dict], prefix: str = "") -> list[dict]:
        """Optimizer parameter groups named as ``get_optimizer_state_dict`` names them (each
        group's ``params`` this rank's parameter names, ``prefix`` before the model's) with every
        stage's names instead, in the whole model's order: the groups one process training the
        whole model has. A checkpoint written with them reads on any layout (every rank writes the
        same groups, so which rank's copy it keeps does not matter), and a checkpoint keyed by
        position in the whole model's groups (one process wrote it) maps to names through them.
        Every rank of the ``pp`` group calls it."""

        parts: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(parts, [list(group["params"]) for group in groups], group=self.group)
        order = {prefix + name: i for i, name in enumerate(self.names)}
        whole = []
        for index, group in enumerate(groups):
            names = {name for part in parts for name in part[index]}
            missing = names - order.keys()
            if missing:
                raise RuntimeError(f"pipeline stages hold parameters the model does not name: {sorted(missing)[:3]}")
            whole.append(dict(group, params=sorted(names, key=order.__getitem__)))
        return whole


class _WithAuxiliary(torch.autograd.Function):
    """``output`` as it is; its backward also gives ``aux`` (a stage's weighted auxiliary losses)
    the gradient 1, as if added to the micro-batch's loss, which the schedule then scales with it."""

    @staticmethod
    def forward(ctx, output, aux):
        ctx.aux = (aux.dtype, aux.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        dtype, device = ctx.aux
        return grad, torch.ones((), dtype=dtype, device=device)


def attach_auxiliary_losses(stage: nn.Module, balance_weight: float) -> None:
    """Make ``stage``'s training forwards carry its blocks' auxiliary losses (``aux_losses``: the
    experts' balancing loss times ``balance_weight``) into its backward: the last stage's loss
    sees only its own layers, and each stage's losses are its own layers' share of the sum one
    process adds to the loss (``yamlformer.recipes.learning.module``)."""

    def hook(module, args, output):
        losses = module.aux_losses(balance_weight=balance_weight) if torch.is_grad_enabled() else {}
        return _WithAuxiliary.apply(output, sum(losses.values())) if losses else output

    stage.register_forward_hook(hook)


def attach_token_index(stage: nn.Module, shard) -> None:
    """Give ``stage``'s forwards the whole-sequence places of this rank's tokens (``token_index``,
    which positions and the attention masks follow under context parallelism), from the length of
    its input (token ids on the first stage, hidden states on the others): the schedules pass a
    stage only what the previous one returned."""

    def hook(module, args, kwargs):
        if kwargs.get("token_index") is None:
            share = args[0].shape[1]
            kwargs = {**kwargs, "token_index": shard.token_index(share * shard.degree, args[0].device)}
        return args, kwargs

    stage.register_forward_pre_hook(hook, with_kwargs=True)


def _stage_class():
    """torch's ``PipelineStage`` whose metadata inference (a forward run for its outputs' shapes
    before the first step and after a validation: real tokens on the first stage, empty tensors
    on the others) leaves its blocks' statistics alone (``statistics_paused``: the experts'
    loads, which move the routing bias after the step); torch gives no hook for it, so this
    wraps its private method, and the PP x EP test's equal losses say it still runs."""

    class Stage(PipelineStage):
        def _forward_metadata_inference(self, *args, **kwargs):
            with ExitStack() as paused:
                for module in self.submod.modules():
                    if hasattr(module, "statistics_paused"):
                        paused.enter_context(module.statistics_paused())
                return super()._forward_metadata_inference(*args, **kwargs)

    return Stage


def build_pipeline(
    model: nn.Module, settings: TrainerSection, mesh, device, loss_fn, parallelize_stage, balance_weight: float = 0.0
):
    """This rank's part of ``model`` (a ``build_model`` model, on meta) and its :class:`Pipeline`.

    ``loss_fn(output, target)``: the loss of a micro-batch (a mean, as the schedules scale the
    gradients by the micro-batch count); ``parallelize_stage(module)``: the rest of
    :func:`yamlformer.recipes.parallel.parallelize` for one stage (tensor parallelism and FSDP2 on the
    mesh's other dimensions, materialised); ``balance_weight``: the mixture of experts' balancing
    loss coefficient (``loss.moe_aux_coef``), each stage adding its own layers' losses
    (:func:`attach_auxiliary_losses`)."""

    check_pipeline(model, settings)
    table = {id(p) for p in tied_table(model)}  # before the stages split and shard it apart
    tied = [name for name, p in model.named_parameters() if id(p) in table]  # as the whole model names them
    _Stage = _stage_class()
    names = tuple(name for name, _ in model.named_parameters())
    name = SCHEDULES[settings.pipeline_schedule]
    per_rank, style = stage_placement(settings.pipeline_schedule)
    pp_mesh = mesh["pp"]
    rank, ranks = pp_mesh.get_local_rank(), pp_mesh.size()
    n_stages = stage_count(settings)
    layers = stage_layers(model.pipeline_layers(), n_stages)
    mine = stages_of_rank(rank, ranks, per_rank, style)
    part = model.pipeline_part(sorted(i for s in mine for i in layers[s]))
    views = [part.pipeline_part(layers[s]) for s in mine]
    for view in views:
        parallelize_stage(view)
        if model.has_aux_losses():
            attach_auxiliary_losses(view, balance_weight)
        if getattr(view, "context_shard", None) is not None:
            attach_token_index(view, view.context_shard)
    # a block's statistics (the experts' loads) are summed over the ranks holding its stage
    stage_ranks = mesh[PIPELINE_PEERS].get_group()
    for module in part.modules():
        if hasattr(module, "use_statistics_group"):
            module.use_statistics_group(stage_ranks)
    group = pp_mesh.get_group()
    stages = [_Stage(view, s, n_stages, device, group=group) for view, s in zip(views, mine, strict=True)]
    cls = getattr(schedules, name)
    micro = settings.pipeline_microbatches()

    def schedule():
        return cls(stages[0] if per_rank == 1 else stages, n_microbatches=micro, loss_fn=loss_fn)

    evaluation = v_evaluation(stages, micro, loss_fn) if style == "v" else None
    last = _rank_of(n_stages - 1, ranks, style)
    shard = getattr(views[0], "context_shard", None)
    tie = (_tie_group(mesh, last), part, tied) if tied else None
    return part, Pipeline(schedule, stages, group, last, micro, evaluation, names, shard, tie)


def _tie_group(mesh, last: int):
    """The process group of this rank's pipeline's first and last pp ranks (``last``), where a
    tied table's two copies are; every rank makes every pipeline's group, in one order."""
    dim = mesh.mesh_dim_names.index("pp")
    lines = mesh.mesh.movedim(dim, -1).reshape(-1, mesh.mesh.shape[dim]).tolist()
    me = dist.get_rank()
    mine = None
    for line in lines:
        group = dist.new_group([line[0], line[last]])
        if me in line:
            mine = group
    return mine


def v_evaluation(stages: list, microbatches: int, loss_fn):
    """The schedule that validates V-placed stages (rank r: stages r and 2P - 1 - r) under ``zbv``
    and ``dualpipev``, whose steps split the backward into input and weight parts that
    ``eval()`` cannot skip: torch's breadth-first schedule with the V placement, forwards only
    (every micro-batch through a rank's first stage, then its second)."""

    class VBreadthFirst(ScheduleLoopedBFS):
        def _calculate_single_rank_operations(self, rank):
            mapping = {s: _rank_of(s, self.pp_group_size, "v") for s in range(self._num_stages)}
            self.stage_index_to_group_rank = mapping
            for stage in self._stages:
                stage.stage_index_to_group_rank = mapping
            mine, micro = stages_of_rank(rank, self.pp_group_size, 2, "v"), range(self._n_microbatches)
            ops: list = [None] * rank
            ops += [_Action(stage, _ComputationType.FORWARD, mb) for stage in mine for mb in micro]
            ops += [None] * (2 * (self.pp_group_size - 1 - rank))
            ops += [_Action(s, _ComputationType.FULL_BACKWARD, mb) for s in reversed(mine) for mb in reversed(micro)]
            return ops

        def _prepare_schedule_with_comms(self, actions, format="compute_only"):
            # the backwards are there for torch's validation of the order; eval() would still run
            # them between the two stages a rank holds (the V's turn), so the lowered order drops them
            super()._prepare_schedule_with_comms(actions, format)
            self.pipeline_order_with_comms = {
                rank: [a for a in ops if a.computation_type not in BACKWARD]
                for rank, ops in self.pipeline_order_with_comms.items()
            }

    kinds = _ComputationType
    BACKWARD = (kinds.FULL_BACKWARD, kinds.SEND_B, kinds.RECV_B, kinds.REDUCE_GRAD)

    return VBreadthFirst(stages, n_microbatches=microbatches, loss_fn=loss_fn)


def _rank_of(stage: int, ranks: int, style: str) -> int:
    """The pipeline rank holding ``stage`` (the inverse of :func:`stages_of_rank`)."""
    if style == "v":
        return stage if stage < ranks else 2 * ranks - 1 - stage
    return stage % ranks
