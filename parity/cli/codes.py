"""Exit status of every command, and the suites `check` and `export` select from."""

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_MISSING = 0, 1, 2, 3  # EXIT_MISSING: an optional dependency
SUITES = ("ci", "default", "full", "seed")
