"""Which of the planner's layouts the recipes' runtime runs, for a spec (torch-free): what its
blocks cannot split as the recipes run them (:func:`block_problems`), and the filters
``builder plan --launchable`` searches with, each noting its first reason once."""

from __future__ import annotations

from yamlformer.builder.analysis import runtime
from yamlformer.builder.analysis.layout import (
    Layout,
    context_parallel_problems,
    expert_parallel_problems,
    pipeline_parallel_problems,
)


def block_problems(spec, layout: Layout, schedule: str = "1f1b") -> tuple[tuple[str, str], ...]:
    """``(trainer field, reason)`` for each block of ``spec`` that cannot run ``layout``'s expert,
    context or pipeline parallelism as the recipes run it (the blocks' ``expert_parallel_problems``,
    ``context_parallel_problems`` and ``pipeline_parallel_problems``)."""
    found = [("expert_parallel", loc, m) for loc, m in expert_parallel_problems(spec, layout.expert_parallel)]
    found += [("context_parallel", loc, m) for loc, m in context_parallel_problems(spec, layout.context_parallel)]
    launched = runtime.SCHEDULE_NAMES.get(schedule, schedule)  # the runtime's zero-bubble is zbv
    found += [
        ("pipeline_parallel", loc, m) for loc, m in pipeline_parallel_problems(spec, layout.pipeline_parallel, launched)
    ]
    return tuple((field, f"{'.'.join(map(str, loc))}: {message}") for field, loc, message in found)


def context_refused(spec, cp: int, reasons: list[str]) -> bool:
    """Whether a block of ``spec`` cannot run ``cp``-way context parallelism as the recipes run
    it (``context_parallel_problems``), the first such block noted once."""
    problems = context_parallel_problems(spec, cp)
    if problems and not any(r.startswith("not launchable (context_parallel)") for r in reasons):
        loc, message = problems[0]
        reasons.append(f"not launchable (context_parallel): {'.'.join(map(str, loc))}: {message}")
    return bool(problems)


def blocked(spec, layout: Layout, schedule: str, reasons: list[str]) -> bool:
    """Whether the spec's blocks cannot run ``layout`` under ``schedule`` as the recipes run it
    (:func:`block_problems`: a tied head under a V-placed schedule), the first such reason noted once."""
    problems = block_problems(spec, layout, schedule)
    if problems and not any(r.startswith(f"not launchable ({problems[0][0]})") for r in reasons):
        reasons.append(f"not launchable ({problems[0][0]}): {problems[0][1]}")
    return bool(problems)


def not_launchable(layout: Layout, recompute: str, schedule: str, reasons: list[str]) -> bool:
    """Whether the runtime refuses ``layout`` with ``schedule`` (micro-batches aside), the first
    reason of each trainer field noted once."""
    refused = runtime.launch_problems(layout, recompute=recompute, schedule=schedule)
    if refused:
        field, reason = refused[0]
        if not any(r.startswith(f"not launchable ({field})") for r in reasons):
            reasons.append(f"not launchable ({field}): {reason}")
    return bool(refused)
