"""The models: the target (transformers or our native runner) and its batch state (cache, slots, masks),
the DFlash draft and its checkpoint format, loading built-in targets, export to other engines."""
