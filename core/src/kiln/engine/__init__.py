"""The engine: requests flow Scheduler -> KVCacheManager -> ModelRunner -> Sampler -> Detokenizer."""
