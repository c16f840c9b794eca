"""The one-process reference of a model cell (filled in by the next commit)."""


def reference(case, cfg):
    raise NotImplementedError("harness.model.reference.reference")


def reduction_size(case, cfg):
    raise NotImplementedError("harness.model.reference.reduction_size")
