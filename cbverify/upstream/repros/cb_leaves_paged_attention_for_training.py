"""Finding ``cb-leaves-paged-attention-for-training`` (transformers 5.8): after ``generate_batch`` the model keeps the
paged attention implementation.

``generate_batch`` switches the model's attention to ``paged|<implementation>`` for continuous batching and does not
switch it back: afterwards ``model.config._attn_implementation`` is ``paged|sdpa`` where it was ``sdpa``, so the next
ordinary forward (a training step, in TRL's GRPO) runs through paged attention without a paged cache and returns
other logits. transformers 5.9 restores the implementation.

Standalone: imports only torch, transformers and the standard library; the model (a 2-layer Llama with seeded random
weights) is built here. Observed: the attention implementation and an ordinary forward's logits before and after one
``generate_batch`` call. Exits 1 while the behaviour is there, 0 once both are unchanged, 2 on an unexpected error.
"""

import sys
import traceback

sys.excepthook = lambda *exc: (traceback.print_exception(*exc), sys.exit(2))  # an error is not the behaviour

import torch  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation import ContinuousBatchingConfig  # noqa: E402


def tiny_llama():
    """A 2-layer Llama over a 17-token vocabulary (0 pad, 1 bos, 2 eos) with seeded random weights."""
    config = LlamaConfig(vocab_size=17, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, initializer_range=0.2)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def main() -> int:
    model = tiny_llama()
    probe = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        attn_before, logits_before = model.config._attn_implementation, model(probe).logits
    greedy = GenerationConfig(do_sample=False, max_new_tokens=4, eos_token_id=2, pad_token_id=0)
    cb_config = ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=128)
    model.generate_batch([[1, 5, 6, 7]], generation_config=greedy, continuous_batching_config=cb_config)
    with torch.no_grad():
        attn_after, logits_after = model.config._attn_implementation, model(probe).logits
    diff = (logits_before - logits_after).abs().max().item()
    print(f"expected: attention implementation {attn_before!r} and the same forward after generate_batch")
    print(f"observed: attention implementation {attn_before!r} -> {attn_after!r}, forward max |diff| {diff:.3g}")
    return 1 if attn_after != attn_before or diff > 0 else 0


if __name__ == "__main__":
    sys.exit(main())
