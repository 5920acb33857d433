"""How a model learns, for every task: the LightningModule each task's module extends
(:mod:`~yamlformer.recipes.learning.module`: the loss and its auxiliary terms, the optimizer's
parameter groups, the learning-rate schedule, the losses logged and kept, the state a resume
restores); the optimizers it builds are :mod:`yamlformer.recipes.optim`'s. Below the
tasks, which subclass the module, and below the run (``yamlformer.recipes.training``), which
drives it."""
