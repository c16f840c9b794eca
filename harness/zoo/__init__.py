"""Zoos: a library's whole family of models, each under its own shipped parallel plans, checked
against one process (``python -m harness.zoo transformers``; :mod:`harness.zoo.transformers`)."""


class ZooMissing(RuntimeError):
    """The library a zoo checks is not installed; the message says how to install it."""
