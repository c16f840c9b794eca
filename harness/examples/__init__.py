"""Models shipped as model cases, each also an example a user can copy: a :class:`harness.model.ModelCase`
and the functions that parallelize it. Registered with the built-in components (harness/components.py)."""
