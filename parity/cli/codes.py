"""Exit status of every command, and the suites `check` and `export` select from."""

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
SUITES = ("ci", "default", "full", "seed")
