"""Variant studies: ``builder sweep STUDY.yaml`` runs a family of recipe variants as ordinary
``builder train`` runs and keeps their results in an Optuna study database; ``builder study``
reports them (table, Pareto front, plots, exports) and fits a scaling law to them.

One module per concern: :mod:`~yamlformer.recipes.studies.schema` (the study file),
:mod:`~yamlformer.recipes.studies.variants` (axes to checked variants and their budgets),
:mod:`~yamlformer.recipes.studies.store` (the Optuna storage), :mod:`~yamlformer.recipes.studies.runner`
(trials as processes), :mod:`~yamlformer.recipes.studies.report` (tables and plots),
:mod:`~yamlformer.recipes.studies.scaling` (Chinchilla's fit). A variant's downstream scores come
from the LM task's lm-evaluation-harness model (:mod:`yamlformer.recipes.tasks.lm.harness`).
"""
