"""Which versions of the harness and of the libraries under test ran, and which ones the
``thirdparty`` extra pins.

The cells of the third-party implementations certify one version of each library: the one pinned in
``pyproject.toml``'s ``thirdparty`` extra, the only place the pins are written. A maintainer who
installs another version over the pin must see that at once (the run header, the parity summary,
the junit XML and ``python -m harness.report`` say which versions ran and warn when one is not the
pin), and the skip and xfail reasons name the version installed, saying when a declared divergence
was declared for the pinned one.

Everything here reads package metadata (``importlib.metadata``): nothing imports torch,
transformers or Megatron-Core, so it costs the pytest process no import time.
"""
from __future__ import annotations

import functools
import importlib.metadata as metadata
import json
from dataclasses import dataclass

from .known import Known

# the distributions a run reports, in this order: torch is pinned in the install command (README,
# .ci/run), not in the package metadata, so it has no pin here
LIBRARIES = ("torch", "transformers", "megatron-core", "accelerate")
EXTRA = "thirdparty"
PACKAGE = "paritytest"
# the name of the testsuite-level junit property (and of the report's line): a JSON list of Library
PROPERTY = "versions"


@dataclass(frozen=True)
class Library:
    """One library under test: its distribution name, the version installed (None: not installed)
    and the version the ``thirdparty`` extra pins (None: no ``==`` pin)."""

    name: str
    installed: str | None
    pinned: str | None

    @property
    def differs(self) -> bool:
        """Installed, pinned, and not the pin."""
        return bool(self.installed and self.pinned and self.installed != self.pinned)

    def __str__(self) -> str:
        if not self.installed:
            return f"{self.name} not installed"
        return f"{self.name} {self.installed}" + (f" (pinned {self.pinned})" if self.differs else "")

    def as_dict(self) -> dict:
        return {"name": self.name, "installed": self.installed, "pinned": self.pinned}


def _pins_from(requirements: list[str]) -> dict[str, str]:
    """``{distribution: version}`` of the ``==`` requirements of the thirdparty extra."""
    from packaging.requirements import Requirement  # pytest's own dependency: always installed with it
    from packaging.utils import canonicalize_name

    pins = {}
    for text in requirements:
        requirement = Requirement(text)
        if requirement.marker is None or not requirement.marker.evaluate({"extra": EXTRA}):
            continue
        exact = [spec.version for spec in requirement.specifier if spec.operator == "=="]
        if exact:
            pins[canonicalize_name(requirement.name)] = exact[0]
    return pins


@functools.cache
def pins() -> dict[str, str]:
    """The thirdparty extra's ``==`` pins, read from paritytest's installed metadata (empty when
    paritytest runs from a checkout that was never installed)."""
    try:
        return _pins_from(metadata.requires(PACKAGE) or [])
    except metadata.PackageNotFoundError:
        return {}


@functools.cache
def installed(name: str) -> str | None:
    """The installed version of distribution ``name``, or None."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def library(name: str) -> Library:
    """The installed and pinned versions of one distribution (``transformers``, ``megatron-core``)."""
    return Library(name, installed(name), pins().get(name))


def libraries() -> list[Library]:
    """Every library under test, in :data:`LIBRARIES` order."""
    return [library(name) for name in LIBRARIES]


def harness() -> Library:
    """paritytest itself, as installed (``paritytest not installed``: a checkout run without its
    install): which release's checks gave the verdicts."""
    return Library(PACKAGE, installed(PACKAGE), None)


def recorded() -> list[Library]:
    """What a run records of itself: the harness, then every library under test."""
    return [harness(), *libraries()]


def line(libs: list[Library] | None = None) -> str:
    """``torch 2.13.0, transformers 5.22.2 (pinned 5.23.0), megatron-core 0.16.1``."""
    return ", ".join(map(str, libraries() if libs is None else libs))


def mismatch_warning(libs: list[Library] | None = None) -> str | None:
    """One line when an installed library is not its pin (None when every one is): what it means
    for the run's verdicts, and the command that restores the pins."""
    differ = [lib for lib in (libraries() if libs is None else libs) if lib.differs]
    if not differ:
        return None
    which = "; ".join(f"{lib.name} {lib.installed} is installed, the {EXTRA} extra pins {lib.pinned}"
                      for lib in differ)
    restore = " ".join(f"{lib.name}=={lib.pinned}" for lib in differ)
    return (f"WARNING: {which}: the third-party cells certify the pinned versions and their declared "
            f"divergences (strict xfail) were declared for them; to run the pins: pip install {restore}")


def named(name: str) -> str:
    """The library as a message names it: ``transformers 5.22.2`` (the installed version, else the
    pin, else the bare name)."""
    lib = library(name)
    version = lib.installed or lib.pinned
    return f"{name} {version}" if version else name


def about(name: str, reason: str) -> str:
    """A skip reason that states a library's behaviour, prefixed with the version it is about."""
    return f"{named(name)}: {reason}"


class Declared(Known):
    """A declared divergence of a library (:func:`declared`): its reason names the version."""


def declared(name: str, reason: str, strict: bool = True, shows: str = "") -> Declared:
    """A declared divergence's reason, naming the installed version, and the pinned one it was
    declared for when they differ; ``strict`` and ``shows``: see :class:`harness.known.Known`."""
    lib = library(name)
    return Declared(f"{name} {lib.installed} is installed, this was declared for the pinned {lib.pinned}: {reason}"
                    if lib.differs else about(name, reason), shows=shows, strict=strict)


def from_json(value: str) -> list[Library]:
    """The libraries of a :data:`PROPERTY` junit property."""
    return [Library(d["name"], d.get("installed"), d.get("pinned")) for d in json.loads(value)]


def to_json(libs: list[Library] | None = None) -> str:
    """The :data:`PROPERTY` junit property's value: ``libs`` (by default :func:`recorded`, the harness
    and the libraries installed here) as JSON."""
    return json.dumps([lib.as_dict() for lib in (recorded() if libs is None else libs)])


def record_in_junit(config) -> None:
    """The versions as a testsuite-level property of the junit XML (``--junitxml``), once per run
    rather than in each cell's ``parity`` property. Written where the XML is written: the xdist
    controller, rank 0 under torchrun (pytest's ``record_testsuite_property`` fixture is a no-op in
    xdist workers, so the plugin adds it to the writer directly)."""
    try:
        from _pytest.junitxml import xml_key  # the LogXML pytest stashes; public API has only the fixture
    except ImportError:  # a pytest that moved it: the header and summary still say the versions
        return
    xml = config.stash.get(xml_key, None)
    if xml is not None:
        xml.add_global_property(PROPERTY, to_json())
