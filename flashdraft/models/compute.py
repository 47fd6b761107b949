"""What runs: the one decision, from the device, the CPU and the file, of the target's activations, its
weights and the kernel path that computes them (`choose`). The next CPU or file type is a change here.

The rules, for `--dtype auto` and `--quantize auto`:
- On the CPU, where our kernels built and the native runner runs the model's layers in one C++ call
  (the Llama / Qwen and Gemma 3 families): bfloat16 activations on quantized weights (a GGUF's own Q4_1 / Q8_0, q8_0
  for other checkpoints), on every CPU our kernels run on, AVX2 included. This is the exact combination
  (a verify row equals a one-token step bitwise), and our kernels never use torch's bf16 matmuls, so a CPU
  without native bf16 runs it at full speed (a Zen 3 EPYC: 1.77x llama.cpp, where dense float32 ran 0.19x).
- Where torch's own ops carry the layers (the transformers target, no compiler): bf16
  only where torch's bf16 is native (`cpu_has_fast_bf16`: avx512_bf16 / amx_bf16; elsewhere torch
  emulates it, about 25x slower than float32), float32 otherwise; with bf16, torch's int8 weights.
- On a GPU: bf16 activations, torch's int8 weights (our kernels read CPU memory).

`FLASHDRAFT_KERNEL=avx2` (or `reference`) forces our kernels' path and makes these rules act as on a CPU
of that kind: without native bf16. (`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2` make torch's own
kernels act so too.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.models import target
from flashdraft.models.runner import QUANTIZE, Quantization, gemma, kernels, llama
from flashdraft.models.target import TargetError

# families whose layers our kernels run in one C++ call (layers.cpp)
ONE_CALL = frozenset(llama.FAMILIES + gemma.FAMILIES)
OURS = (*kernels.KINDS, "gguf")  # the weights our kernels run


@dataclass(frozen=True)
class Compute:
    """What runs a target: `runner` "native" or "transformers", its activations, its weights (the native
    runner's; None on the transformers target) and the path of our kernels ("torch" where none run)."""

    runner: str
    dtype: torch.dtype
    quantization: Quantization | None
    kernels: str


def _check_quantize(quantize: str, cpu: bool) -> None:
    if quantize != "auto" and quantize not in QUANTIZE:
        raise TargetError(f"quantize must be auto or one of {', '.join(QUANTIZE)}, got {quantize!r}")
    if quantize in OURS and not cpu:
        raise TargetError(
            f"--quantize {quantize} runs on our CPU kernels: use --device cpu, or --quantize int8"
        )
    if quantize in OURS and not kernels.available():
        raise TargetError(
            f"--quantize {quantize} needs flashdraft's CPU kernels, which could not be built "
            "here (see the line above): install a C++ compiler (g++), or use --quantize int8"
        )


def choose(
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = "auto",
    quantize: str = "auto",
    runner: str = "native",
    family: str | None = None,
    stored: Quantization | None = None,
) -> Compute:
    """What runs a target of model type `family` on `device`. `runner`: "native" or "transformers" (load_target
    resolves "auto" first: native where it covers the family). `stored`: the runner's weights that keep a
    GGUF's own blocks (`load.gguf_quantization`), None for other checkpoints. Explicit `dtype` and
    `quantize` are kept as asked (a bad one is a TargetError that says which values are allowed)."""
    device = torch.device(device)
    cpu = device.type == "cpu"
    if runner == "transformers":
        if quantize not in ("auto", "none"):
            raise TargetError(f"--quantize {quantize} needs the native runner: drop --runner transformers")
        act = target.resolve_dtype(dtype, device)  # as asked; auto: bf16 where torch's bf16 is native
        return Compute("transformers", act, None, "torch")
    _check_quantize(quantize, cpu)
    one_call = cpu and family in ONE_CALL and kernels.available()
    if dtype in (None, "auto") and one_call and quantize in ("auto", *OURS):
        act = torch.bfloat16  # our kernels and C++ layers: bf16 at full speed on any CPU they run on
    else:
        act = target.resolve_dtype(dtype, device)  # as asked; auto: bf16 where torch's bf16 is native
    if quantize != "auto":
        plan = Quantization.of(quantize)
    elif act != torch.bfloat16:
        plan = Quantization()  # dense: quantized weights are exact with bf16 activations only
    elif cpu and kernels.available():
        plan = stored or Quantization.of("q8_0")
    else:
        plan = Quantization.of("int8")  # a GPU, or no compiler: torch's int8 (bf16 activations)
    return Compute("native", act, plan, kernels.path_name() if cpu and plan.ours else "torch")
