"""The torch-free side of the engine: a request goes InputProcessor -> EngineCore
(Scheduler, KVCacheManager; the tensor side in ``kiln.worker``) -> OutputProcessor.
``LLMEngine`` builds and drives them."""
