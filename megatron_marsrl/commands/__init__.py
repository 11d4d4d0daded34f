"""Entry points of the `marsrl` subcommands (thin: parse args, call the library)."""
