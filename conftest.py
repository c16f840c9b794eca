"""Loads the parity plugin when this checkout is used without being installed.

Installed (``pip install -e .``, README's two commands), pytest loads ``harness.plugin`` through the
package's ``pytest11`` entry point and this file changes nothing: pytest skips a plugin named in
``pytest_plugins`` when one of that name is already registered, and the entry point is named after
the module, so the plugin is loaded once (registering it twice would be an error).

Not installed (torch and pytest in the environment, then ``python -m pytest cases/`` from the
checkout, or ``PYTHONPATH=. pytest cases/``; or entry points turned off with
``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``), no entry point names the plugin, and without this line every
cell would fail with "fixture 'parity' not found". pytest puts this directory on ``sys.path`` (the
root conftest's directory, in its default import mode), so ``harness`` imports from the checkout.

Loaded from here, the plugin arrives after pytest's earliest hook: under torchrun, ranks other than
0 then write to the terminal instead of ``--rank-logs``; name it on the command line
(``-p harness.plugin``) to have that too. ``-p no:harness.plugin`` (how ``harness.golden check``
collects) blocks it here as well.
"""
pytest_plugins = ["harness.plugin"]
