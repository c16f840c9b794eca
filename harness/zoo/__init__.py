"""Zoos: a library's whole family of models, each under its own shipped parallel plans, checked
against one process (``python -m harness.zoo transformers``; :mod:`harness.zoo.transformers`)."""
