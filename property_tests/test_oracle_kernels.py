"""The oracle and teacher forcing run with cuDNN's SDPA kernel off, and only they (``cbverify.devices``).

cuDNN's attention builds a plan for every new shape (~4 ms a call measured in bf16 on an H200); the oracle's full
recompute and teacher forcing give nearly every call a new shape. The flag SDPA reads is recorded at every forward:
off inside the oracle's generation, its teacher forcing and the golden check's, back on afterwards for the engines.
"""

from __future__ import annotations

import torch

from cbverify.compare import teacher_force
from cbverify.engines import get_engine
from cbverify.tolerances import tier_for
from reference.spec import RolloutRequest, SamplingParams


def test_the_oracle_and_teacher_forcing_run_without_cudnn_attention_and_restore_it(llama):
    model = llama.model
    seen: list[bool] = []
    hook = model.register_forward_pre_hook(lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    request = RolloutRequest("r0", (1, 6, 5, 16, 7), SamplingParams(temperature=1.0, max_new_tokens=3), seed=3)
    try:
        assert torch.backends.cuda.cudnn_sdp_enabled()
        rollouts = get_engine("reference", model).generate([request])
        generated = len(seen)
        teacher_force(model, [request], rollouts, "processed", tier_for(torch.float32))
    finally:
        hook.remove()
    assert generated >= 1 and len(seen) > generated, seen
    assert not any(seen), f"cuDNN attention was allowed in {sum(seen)} of {len(seen)} oracle forwards"
    assert torch.backends.cuda.cudnn_sdp_enabled(), "the oracle left cuDNN attention off for the engines"
