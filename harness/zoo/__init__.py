"""Zoos: a library's whole family of models, each under its own shipped parallel plans, checked
against one process (``python -m harness.zoo transformers``; :mod:`harness.zoo.transformers`)."""


class ZooMissing(RuntimeError):
    """The library a zoo checks is not installed, or not a release it can run; the message says how to
    install one that it can."""


def installed_release(distribution: str) -> str | None:
    """The installed release of ``distribution``; None for a source checkout on the path (no metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def require_release(missing: type[ZooMissing], library: str, installed: str | None, written_for: str,
                    install: str, unsupported: dict[str, str]) -> None:
    """Raise ``missing`` unless ``installed`` is of the release series (major.minor) that the zoo's glue
    is ``written_for``: a framework whose API moves between minor releases (torchtitan, Megatron-Core)
    fails there deep inside its own imports, or builds something else. ``unsupported``: why a series
    cannot run, by its ``major.minor`` (the zoo's ``NOT_RUN`` names the same), said in the line.
    ``installed`` None (a source checkout on the path, no distribution's metadata): not refused."""
    if installed is None:
        return
    series = ".".join(installed.split(".")[:2])
    if series == ".".join(written_for.split(".")[:2]):
        return
    why = unsupported.get(series)
    raise missing(f"the {library} zoo is written against {library} {written_for}, and {installed} is installed"
                  f"{f': {why}' if why else ''}. Install {written_for}: {install}")


def stand_in(name: str, **attributes) -> None:
    """Put a module ``name`` holding ``attributes`` in ``sys.modules``, unless one is there: for what a
    framework imports and no cell here runs (a GPU kernel module, a data stack). Any other attribute is a
    function that raises, naming it, when called: importing it works, running it says why it cannot."""
    import sys
    import types

    module = types.ModuleType(name)
    module.__dict__.update(attributes)

    def missing(attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{name}.{attribute} is a stand-in here (docs/zoo.md, CPU shims): it cannot run")
        return unavailable

    module.__getattr__ = missing
    sys.modules.setdefault(name, module)

