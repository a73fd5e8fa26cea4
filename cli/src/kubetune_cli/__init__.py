"""The `kubetune` command line: one entry point for validate, train, checkpoints and dev tools."""
