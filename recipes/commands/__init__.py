"""The commands the recipes add to ``builder``: ``train``, ``eval``, ``generate`` and ``tokenize``.

``builder.cli`` reads :data:`COMMANDS` by name (it never imports ``recipes`` at module level), so
imports run one way: these modules import ``builder`` and ``recipes``; ``builder`` imports
neither. A command module exposes ``add_arguments(parser)`` and ``run(args) -> int`` and imports
torch and Lightning inside ``run`` only, so ``builder validate`` stays torch-free.
"""

#: command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("recipes.commands.train", "run a Lightning training recipe"),
    "eval": ("recipes.commands.eval", "validation loss and perplexity of a checkpoint"),
    "generate": ("recipes.commands.generate", "decode from a checkpoint, streaming to stdout"),
    "tokenize": (
        "recipes.commands.tokenize",
        "a corpus (text, JSONL, Parquet, Arrow) as a tokenized dataset to train from",
    ),
}
