"""Finding ``cb-drops-repetition-penalty`` (every transformers release seen: 5.8.0, 5.15.1, 5.24.0): continuous
batching ignores ``repetition_penalty``.

``ContinuousBatchingLogitsProcessorList`` drops ``RepetitionPenaltyLogitsProcessor`` (it declares
``supports_continuous_batching=False`` and ``drop_unsupported_processors`` is on) with only a logger warning, so a
``GenerationConfig`` with ``repetition_penalty`` generates as if it had none: greedy ``generate_batch`` tokens are the
argmax of the unpenalised logits, where ``generate()`` with the same configuration applies the penalty.

Standalone: imports only torch, transformers and the standard library; the model (a 2-layer Llama with seeded random
weights, large enough logits for the penalty to change a greedy choice) is built here. Observed: the greedy tokens of
``generate()`` with and without the penalty, and of ``generate_batch`` with it. Exits 1 while ``generate_batch``
follows the unpenalised tokens, 0 once it applies the penalty, 2 on an unexpected error.
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
    prompt = [1, 5, 6, 7, 5, 6]

    def greedy(penalty):
        return GenerationConfig(do_sample=False, max_new_tokens=8, repetition_penalty=penalty, eos_token_id=2,
                                pad_token_id=0)  # fmt: skip

    with torch.no_grad():
        penalised = model.generate(torch.tensor([prompt]), generation_config=greedy(1.5))[0, len(prompt) :].tolist()
        plain = model.generate(torch.tensor([prompt]), generation_config=greedy(1.0))[0, len(prompt) :].tolist()
    cb_config = ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=128)
    outputs = model.generate_batch([prompt], generation_config=greedy(1.5), continuous_batching_config=cb_config)
    batched = list(next(iter(outputs.values())).generated_tokens)
    print(f"expected: generate_batch with repetition_penalty=1.5 gives generate()'s penalised tokens {penalised}")
    print(f"observed: generate_batch gives {batched}; generate() without the penalty gives {plain}")
    return 1 if batched != penalised and batched == plain else 0


if __name__ == "__main__":
    sys.exit(main())
