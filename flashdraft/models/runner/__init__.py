"""The native runner: our own model code for the target (Llama / Qwen2 / Qwen3 families, Gemma 3) with a
preallocated KV cache and optional int8 / int4 weights, behind the `flashdraft.models.target.Target` interface.

`RunnerTarget.from_target(target, quantize=...)` builds it from a loaded transformers target; the
transformers `Target` stays the fallback for other architectures and the reference in tests.
"""

from flashdraft.models.runner.cache import KVCache
from flashdraft.models.runner.quant import QUANTIZE, Quantization
from flashdraft.models.runner.target import FAMILIES, RunnerTarget, supports

__all__ = ["FAMILIES", "QUANTIZE", "KVCache", "Quantization", "RunnerTarget", "supports"]
