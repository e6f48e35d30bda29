"""Finding ``unscorable-completion-scored-as-zero`` (trl < 1.6): GRPOTrainer trains on a completion that no reward
function could score.

A reward function may return ``None`` for a completion it cannot score. TRL sums the reward functions with
``nansum``, so that completion's reward is 0, and the 0 enters its group's mean and std: the unscorable completion
gets a nonzero advantage (and moves the scorable ones'). From 1.6, NaN rewards are left out of the statistics and
their advantage is 0.

Standalone: imports only torch, transformers, trl and datasets; the model is the repository's bundled tiny Llama, read
from disk. Exits 1 while the behaviour is there, 0 once it is gone.
"""

import sys
import tempfile
from pathlib import Path

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

_HERE = Path(__file__).resolve()  # a checkout's golden/models, or an installed cbverify's reference/_models
_MODELS = (_HERE.parents[3] / "golden" / "models", _HERE.parents[2] / "reference" / "_models")
MODEL = next((m for m in _MODELS if m.is_dir()), _MODELS[0]) / "tiny-llama-arith"


def reward(completions, **_):
    """0, 1, None for each group of three: the third completion is unscorable."""
    return [None if i % 3 == 2 else float(i % 3) for i in range(len(completions))]


_OUT = tempfile.TemporaryDirectory(prefix="cbverify-repro-")  # removed when the script exits
args = GRPOConfig(
    output_dir=_OUT.name, report_to="none", use_cpu=True, per_device_train_batch_size=6, num_generations=3,
    max_completion_length=4, save_strategy="no", logging_strategy="no", disable_tqdm=True,
)  # fmt: skip
prompts = [{"prompt": "Q:1+2\n"}, {"prompt": "Q:3+4\n"}]
trainer = GRPOTrainer(
    model=AutoModelForCausalLM.from_pretrained(MODEL), reward_funcs=reward, args=args,
    train_dataset=Dataset.from_list(prompts), processing_class=AutoTokenizer.from_pretrained(MODEL),
)  # fmt: skip
trainer.model.train()
# generation and scoring of one batch, as the training loop calls it (each prompt once per generation); no loss
batch = trainer._generate_and_score_completions([row for row in prompts for _ in range(3)])
advantages = batch["advantages"]
print(f"advantages {advantages.tolist()}; the unscorable completions' (every third) must be 0")
sys.exit(1 if bool((advantages[2::3] != 0).any()) else 0)
