"""What the recipes add to ``builder``, each through an entry point declared in
``pyproject.toml``, so imports run one way (these modules import ``builder`` and ``recipes``;
``builder`` imports neither): the commands ``train``, ``eval``, ``generate``, ``tokenize``,
``sweep`` and ``study`` (``yamlformer.commands``: ``train = "yamlformer.recipes.commands.train"``,
its help the first line of its docstring) and the training recipe as a kind of YAML document
(``yamlformer.kinds``: :mod:`~yamlformer.recipes.commands.kind`). A command module exposes
``add_arguments(parser)`` and ``run(args) -> int`` and imports torch and Lightning inside ``run``
only, so ``builder validate`` stays torch-free.
"""
