"""Everything a plugin implements or receives, one module per seam:

* ``kiln.interfaces.platform``: ``Platform``, ``GraphRunner`` (a device);
* ``kiln.interfaces.attention``: ``AttentionBackend``, ``BatchLayout``, ``DecodeGraphInputs``;
* ``kiln.interfaces.model``: ``StepContext`` (a forward pass's context) and the reference ops;
* ``kiln.interfaces.guided``: ``GuidedBackend``, ``CompiledGuide``, ``GuideMatcher``;
* ``kiln.interfaces.parsers``: ``ToolParser``, ``ReasoningParser``.

With ``kiln.registry`` (the specs plugins register) and ``kiln.testing`` (contract
suites), these are the stable import paths for plugins. Nothing here imports the
engine, the worker side or the models.
"""
