"""One training run: the recipe resolved once (``resolved``) and the run's stages (``run``), its
dry run, the Trainer's callbacks and checkpoints, the run folder and its logs, signals, precision
and speed settings, starting from trained weights. Above the tasks: the run asks a task for its
data and module (``yamlformer.recipes.tasks``); the module they extend is
``yamlformer.recipes.learning``."""
