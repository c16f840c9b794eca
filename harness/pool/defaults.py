"""The pool's defaults, apart from :mod:`.parent` so that the plugin's options and the command lines
read them without importing torch: a pytest run that uses no cell never pays for it."""
DEFAULT_SIZE = 8  # most rank processes a pool holds
DEFAULT_DEADLINE = 30.0  # seconds a task may run before its ranks' stacks are taken and it fails
