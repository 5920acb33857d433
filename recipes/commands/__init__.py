"""The commands the recipes add to ``builder``: ``train``, ``eval``, ``generate`` and ``tokenize``.

Each joins ``builder``'s command line through the ``yamlformer.commands`` entry point declared in
``pyproject.toml`` (``train = "yamlformer.recipes.commands.train"``), its help the first line of its
docstring, so imports run one way: these modules import ``builder`` and ``recipes``; ``builder``
imports neither. A command module exposes ``add_arguments(parser)`` and ``run(args) -> int`` and
imports torch and Lightning inside ``run`` only, so ``builder validate`` stays torch-free.
"""
