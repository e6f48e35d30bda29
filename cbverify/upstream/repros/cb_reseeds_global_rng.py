"""Finding ``cb-reseeds-global-rng`` (transformers 5.9+): greedy continuous-batching generation replaces the global
torch RNG state.

``ContinuousBatchingManager.__init__`` calls ``DistributedHelper.set_tp_seed``, which runs ``torch.manual_seed(...)``
(with the configuration's seed, or one drawn from the global RNG) on every ``generate_batch``. Greedy decoding
samples nothing, yet the caller's global RNG is reseeded: a training loop that generates between two draws (dropout
masks, data shuffling, TRL's GRPO between optimizer steps) no longer draws what its seed promises. ``generate()``
leaves the RNG alone when it does not sample; transformers 5.8 has no configuration seed and does too.

Standalone: imports only torch, transformers and the standard library; the model (a 2-layer Llama with seeded random
weights) is built here. Observed: whether ``torch.get_rng_state()`` is the same before and after one greedy
``generate_batch`` call. Exits 1 while the behaviour is there, 0 once the RNG is left alone, 2 on an unexpected
error.
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
    greedy = GenerationConfig(do_sample=False, max_new_tokens=4, eos_token_id=2, pad_token_id=0)
    cb_config = ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=128)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    model.generate_batch([[1, 5, 6, 7]], generation_config=greedy, continuous_batching_config=cb_config)
    same = torch.equal(before, torch.get_rng_state())
    print("expected: the global torch RNG state is unchanged by a greedy generate_batch (nothing is sampled)")
    print(f"observed: the global torch RNG state is {'unchanged' if same else 'replaced'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
