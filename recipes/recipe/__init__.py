"""The recipe file, torch-free: its sections (``sections``: the base recipe every task's extends,
the model spec it resolves to) and the parallelism fields and rules (``parallelism``). What every
section is made of is ``yamlformer.recipes.fields``; loading a recipe file (its task picks its
schema), its JSON Schema and its kind of YAML document sit above the tasks
(``yamlformer.recipes.tasks``, ``yamlformer.recipes.commands.kind``)."""
