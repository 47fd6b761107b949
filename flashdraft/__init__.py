"""flashdraft: DFlash block-diffusion speculative decoding, trainable and tested."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from .batch import BatchDecoder, StepOutput, generate_batch  # noqa: E402
from .decode import GenerationConfig, GenerationResult, generate  # noqa: E402
from .draft import DFlashDraft, DraftConfig, DraftError  # noqa: E402
from .proposers import DFlashProposer, NgramProposer, Proposer  # noqa: E402
from .sampling import SamplingConfig  # noqa: E402
from .target import Target, TargetError, load_target  # noqa: E402

__all__ = [
    "BatchDecoder",
    "DFlashDraft",
    "DFlashProposer",
    "DraftConfig",
    "DraftError",
    "GenerationConfig",
    "GenerationResult",
    "NgramProposer",
    "Proposer",
    "SamplingConfig",
    "StepOutput",
    "Target",
    "TargetError",
    "load_target",
    "generate",
    "generate_batch",
]
__version__ = "0.1.0"
