"""Lightning training recipes on top of ``builder``: a recipe YAML -> a trained checkpoint.

``yamlformer.recipes.recipe.sections`` (the recipe schema) is torch-free; the other modules import torch and
Lightning and are imported by ``builder train`` / ``eval`` / ``generate`` inside ``run``.
"""

__project__ = "yamlformer"  # checked by yamlformer.builder.packages: this name is ours
