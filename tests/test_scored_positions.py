"""A task that scores few positions (instruction data's answers, MLM's masked tokens) has the head
project only those (``scored``, ``yamlformer.blocks.heads``' ``per_position``): the logits, the loss
and every gradient are the full computation's; where the selection cannot apply (a head over whole
rows, a loss compiled whole, a sequence split by tensor or context parallelism) it is not used."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from yamlformer.blocks.heads import IGNORE
from yamlformer.builder import build_model, load_spec

REPO = Path(__file__).resolve().parents[1]


def _model(name: str, **overrides):
    spec = load_spec(REPO / "specs" / "tiny" / f"{name}.yaml", overrides=overrides)
    model = build_model(spec, init_seed=0)
    return spec, model.train()


def _batch(spec, seq: int = 24, share: float = 0.3):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.vocab_size, (3, seq + 1), generator=generator)
    targets = ids[:, 1:].clone()
    targets[torch.rand(targets.shape, generator=generator) > share] = IGNORE  # ~70% not scored
    targets[0, 0] = ids[0, 1]  # at least one scored position
    return ids[:, :-1], targets


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["llama", "gemma2", "bert"])
def test_the_scored_positions_logits_loss_and_gradients_are_the_full_ones(name):
    spec, model = _model(name)
    assert model.scores_positions()
    inputs, targets = _batch(spec)
    scored = targets != IGNORE
    torch.manual_seed(0)  # the same dropout masks in both forwards
    full = model(inputs)
    F.cross_entropy(full.flatten(0, 1), targets.flatten(), ignore_index=IGNORE).backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    chosen = model(inputs, scored=scored)
    assert chosen.shape == (int(scored.sum()), spec.vocab_size)
    torch.testing.assert_close(chosen, full[scored].detach(), rtol=1e-5, atol=1e-6)
    F.cross_entropy(chosen, targets[scored]).backward()
    selected = _grads(model)
    assert selected.keys() == grads.keys() and grads
    for key, grad in grads.items():
        torch.testing.assert_close(selected[key], grad, rtol=1e-4, atol=1e-7, msg=key)


def test_packed_documents_keep_their_masking_with_scored_positions():
    spec, model = _model("llama")
    inputs, targets = _batch(spec)
    documents = torch.cumsum(torch.rand(inputs.shape, generator=torch.Generator().manual_seed(2)) < 0.1, dim=1)
    scored = targets != IGNORE
    with torch.no_grad():
        full = model(inputs, document_ids=documents)
        chosen = model(inputs, document_ids=documents, scored=scored)
    torch.testing.assert_close(chosen, full[scored], rtol=1e-5, atol=1e-6)


def test_a_head_over_whole_rows_refuses_scored_positions():
    spec, model = _model("llama", head={"type": "classification", "n_classes": 3})
    assert not model.scores_positions()
    inputs, targets = _batch(spec)
    with pytest.raises(ValueError, match="scored: head ClassificationHead computes its logits over whole rows"):
        model(inputs, scored=targets != IGNORE)
    spec, model = _model("llama")
    with pytest.raises(ValueError, match=r"scored: shape \(3, 5\)"):
        model(inputs, scored=torch.ones(3, 5, dtype=torch.bool))


def _modules(tmp_path, **trainer):
    from recipe_helpers import tiny_recipe

    from yamlformer.recipes.learning.module import LMModule
    from yamlformer.recipes.tasks import load_recipe

    class Scoring(LMModule):
        scores_only_targets = True

    recipe = load_recipe(tiny_recipe(tmp_path, trainer=trainer)).recipe
    spec, model = _model("llama")
    return spec, model, LMModule(model, recipe, meta={}), Scoring(model, recipe, meta={})


def test_a_task_that_scores_few_positions_trains_on_the_same_loss(tmp_path):
    spec, model, plain, scoring = _modules(tmp_path)
    assert scoring._select_scored and not plain._select_scored
    inputs, targets = _batch(spec)
    documents = torch.zeros_like(inputs)
    documents[:, 12:] = 1
    for batch in ((inputs, targets), (inputs, targets, documents)):
        loss, _ = plain._losses(*batch)
        loss.backward()
        grads = _grads(model)
        model.zero_grad(set_to_none=True)
        selected, _ = scoring._losses(*batch)
        torch.testing.assert_close(selected, loss, rtol=1e-6, atol=1e-6)
        selected.backward()
        for key, grad in _grads(model).items():
            torch.testing.assert_close(grad, grads[key], rtol=1e-4, atol=1e-7, msg=key)
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    "trainer", [{"compile": "model"}, {"compile": True}], ids=["compile-model", "compile-true-single-device"]
)
def test_a_loss_compiled_whole_keeps_whole_rows(tmp_path, trainer):
    _, _, _, scoring = _modules(tmp_path, **trainer)
    assert not scoring._select_scored  # the selection's size depends on the data: a graph per batch


@pytest.mark.parametrize("split", ["tensor_parallel", "context_parallel"])
def test_a_sequence_split_across_ranks_keeps_whole_rows(tmp_path, split):
    from recipe_helpers import tiny_recipe

    from yamlformer.recipes.learning.module import selects_scored
    from yamlformer.recipes.tasks import load_recipe

    _, model = _model("llama")
    trainer = load_recipe(tiny_recipe(tmp_path)).recipe.trainer
    assert selects_scored(model, trainer)
    # the head reads a rank's share of the sequence (or of the hidden width): whole rows, as before
    assert not selects_scored(model, trainer.model_copy(update={split: 2}))


def test_the_shipped_tasks_that_score_few_positions_declare_it():
    from yamlformer.recipes.learning.module import LMModule
    from yamlformer.recipes.tasks.mlm.training import MLMModule
    from yamlformer.recipes.tasks.sft.training import InstructionModule

    assert MLMModule.scores_only_targets and InstructionModule.scores_only_targets
    assert not LMModule.scores_only_targets  # every position of a window is scored
