"""A module a pool's zygote preloads in tests/test_pool.py: every process the zygote forks after it
exits with code 5 at once, so the pool's ranks die while starting."""
import os

os.register_at_fork(after_in_child=lambda: os._exit(5))
