"""The `agoq` subcommands, one module each: the only place where stages are composed (the profiler, the
search and the trainer never import each other). Each module has `HELP`, a docstring that is its --help
text, `configure(parser)` and a function that runs it; `arguments` holds the shared value types."""
