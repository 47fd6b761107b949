"""flashdraft: DFlash block-diffusion speculative decoding, trainable and tested."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flashdraft.engine.decode import GenerationConfig, GenerationResult, generate, generate_batch  # noqa: E402
from flashdraft.engine.engine import Engine, StepOutput  # noqa: E402
from flashdraft.engine.proposers import DFlashProposer, NgramProposer, Proposer  # noqa: E402
from flashdraft.engine.sampling import SamplingConfig  # noqa: E402
from flashdraft.models.draft import DFlashDraft, DraftConfig, DraftError  # noqa: E402
from flashdraft.models.load import load_target  # noqa: E402
from flashdraft.models.target import Target, TargetError  # noqa: E402

__all__ = [
    "DFlashDraft",
    "DFlashProposer",
    "DraftConfig",
    "DraftError",
    "Engine",
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
