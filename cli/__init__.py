"""The `prescient` command line, the top floor: one module per command, each holding only its
argument parsing and the call into the library. Nothing in the project imports this package."""
