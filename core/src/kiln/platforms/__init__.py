"""Choosing a platform for ``--device`` (``kiln.platforms.select``). The interface plugins
implement is ``kiln.interfaces.platform``; ``kiln.platforms.base`` is its old path."""
