"""The torch reference attention backend (``kiln.attention.torch_ref``). The interface
plugins implement is ``kiln.interfaces.attention``; ``kiln.attention.base`` is its old path."""
