"""ember's engine on CUDA against transformers on CUDA: tiny random Llama and Qwen3 models in
float32 and bfloat16, prompts batched together and cut into chunks; greedy tokens equal the
reference's choice and their log probabilities are close (the reference is run over ember's own
tokens, so one early difference does not hide the rest)."""

from __future__ import annotations

import pytest
import torch
import transformers

from ember import SamplingParams
from ember.config import EngineConfig, ModelConfig
from ember.engine.core import EngineCore
from ember.engine.loading import build_model
from tests.engine.test_architectures import TINY, run

CUDA = torch.device("cuda")
ARCHITECTURES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
# dtype -> (log probability tolerance, the top-two gap under which the reference's own choice is a tie)
TOLERANCES = {torch.float32: (1e-3, 1e-3), torch.bfloat16: (5e-2, 5e-2)}


def reference_model(case: str, dtype: torch.dtype) -> torch.nn.Module:
    config_cls, model_cls = ARCHITECTURES[case]
    config = getattr(transformers, config_cls)(**TINY)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).float().eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # O(1) activations, so every weight moves the logits
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.3 * noise if "norm" in name else noise * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.2))
    return model.to(CUDA, dtype)


def cuda_engine(reference: torch.nn.Module, dtype: torch.dtype) -> EngineCore:
    model_config = ModelConfig.from_hf(reference.config.to_dict())
    model_config.eos_token_ids = []
    model = build_model(model_config, dtype, CUDA)
    model.load_weights((name, tensor.to(dtype)) for name, tensor in reference.state_dict().items())
    config = EngineConfig(max_num_batched_tokens=8, max_num_seqs=8, kv_cache_tokens=1024, device="cuda",
                          dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype])
    return EngineCore(model, model_config, config, set(), CUDA, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(ARCHITECTURES))
def test_batched_chunked_requests_on_cuda_match_transformers_on_cuda(case, dtype):
    reference = reference_model(case, dtype)
    engine = cuda_engine(reference, dtype)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (37, 6, 21)]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
    tolerance, tie = TOLERANCES[dtype]
    for prompt, (tokens, logprobs, _) in zip(prompts, run(engine, prompts, params)):
        assert len(tokens) == 8
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens], device=CUDA)).logits[0].float()
        expected = torch.log_softmax(logits, dim=-1).cpu()
        for step, (token, lp) in enumerate(zip(tokens, logprobs)):
            row = expected[len(prompt) - 1 + step]
            best = row.topk(2).values
            assert token == int(row.argmax()) or float(best[0] - best[1]) < tie, f"step {step}"
            assert lp.logprob == pytest.approx(float(row[token]), abs=tolerance)
