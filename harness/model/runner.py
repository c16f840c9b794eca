"""The rank side of a model cell (filled in by the next commit)."""


def run(case, ctx, cfg):
    raise NotImplementedError("harness.model.runner.run")
