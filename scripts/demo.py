"""`make demo`: plain vs DFlash decoding on a small random Llama target with a random draft.

Placeholder until the built-in SmolLM2 target and the shipped draft land (issues 3 and 5): it shows
the whole loop running and that speculative output equals plain output, not a speedup.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flashdraft import DFlashDraft, DFlashProposer, GenerationConfig, Target, generate
from flashdraft.draft import init_draft_config

torch.manual_seed(0)
cfg = LlamaConfig(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
)
target = Target(LlamaForCausalLM(cfg).to(torch.bfloat16))
draft = DFlashDraft(init_draft_config(cfg, 2, mask_token_id=999)).to(torch.bfloat16)
prompt = torch.randint(0, 1000, (32,)).tolist()
run = GenerationConfig(max_new_tokens=64)
plain = generate(target, prompt, None, run)
spec = generate(target, prompt, DFlashProposer(draft, target), run)
print(f"plain: {len(plain.tokens)} tokens, {plain.tokens_per_s:.0f} tokens/s")
print(
    f"dflash (random draft): {len(spec.tokens)} tokens, tau {spec.tau:.2f}, {spec.tokens_per_s:.0f} tokens/s"
)
print("identical output:", plain.tokens == spec.tokens)
