"""One module per `builder` command: `add_arguments(parser)` and `run(args) -> int`."""
