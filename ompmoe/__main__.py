"""``python -m ompmoe``: the ``ompmoe`` command (``ompmoe-demo`` is :mod:`ompmoe.recipes.quickstart`)."""

from .cli import main

main()
