"""Variant studies: ``builder sweep STUDY.yaml`` runs a family of recipe variants as ordinary
``builder train`` runs and keeps their results in an Optuna study database; ``builder study``
reports them (table, Pareto front, plots, exports) and fits a scaling law to them.

One module per concern: :mod:`~recipes.studies.schema` (the study file), :mod:`~recipes.studies.variants`
(axes to checked variants and their budgets), :mod:`~recipes.studies.store` (the Optuna storage),
:mod:`~recipes.studies.runner` (trials as processes), :mod:`~recipes.studies.report` (tables and
plots), :mod:`~recipes.studies.scaling` (Chinchilla's fit), :mod:`~recipes.studies.harness` (an
lm-evaluation-harness model over our checkpoints).
"""
