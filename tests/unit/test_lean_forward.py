"""The lean decoder forward against HF's, for every cache-read path, and the attention planner."""
from __future__ import annotations

import pytest
import torch

from spillover.rollout.torch_engine.attn_plan import plan_attention
from spillover.rollout.torch_engine.lean_forward import AttnGroup, DecoderShape, KVCache, LeanDecoder


def tiny_hf(model_type: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=model_type != "llama")
    config = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config}[model_type](**common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model, config


@pytest.mark.parametrize("model_type", ["qwen2", "llama", "qwen3"])
def test_prefill_and_decode_paths_match_hf(model_type):
    model, config = tiny_hf(model_type)
    shape = DecoderShape.from_config(config.to_dict())
    decoder = LeanDecoder(shape, model.state_dict(), torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 40, (3, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    cache = KVCache(shape, slots=6, max_len=32, dtype=torch.float32, device=torch.device("cpu"))
    slots = torch.tensor([4, 0, 2])
    prefill = decoder.forward(ids[:, :8], torch.arange(8).expand(3, 8), cache, slots, None)
    torch.testing.assert_close(prefill, ref[:, :8], atol=1e-5, rtol=1e-5)
    for t in range(8, 14):
        tok, pos = ids[:, t:t + 1], torch.full((3, 1), t)
        if t % 2:  # two length groups (here of equal length), gathered
            groups = [AttnGroup(torch.tensor([0, 2]), slots[[0, 2]], t + 1), AttnGroup(torch.tensor([1]), slots[[1]], t + 1)]
        else:
            groups = [AttnGroup(None, slots, t + 1)]
        out = decoder.forward(tok, pos, cache, slots, groups, last_index=torch.zeros(3, dtype=torch.long))
        torch.testing.assert_close(out, ref[:, t], atol=1e-5, rtol=1e-5)


def test_view_path_with_idle_rows_matches_hf():
    model, config = tiny_hf("qwen2")
    shape = DecoderShape.from_config(config.to_dict())
    decoder = LeanDecoder(shape, model.state_dict(), torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids).logits
    cache = KVCache(shape, slots=4, max_len=16, dtype=torch.float32, device=torch.device("cpu"))
    decoder.forward(ids[:, :6], torch.arange(6).expand(2, 6), cache, torch.tensor([0, 2]), None)
    for t in range(6, 10):  # rows 0..2 through one view; slot 1 is idle (token 0 at position 0)
        tok = torch.stack([ids[0, t], torch.tensor(0), ids[1, t]]).view(3, 1)
        pos = torch.tensor([[t], [0], [t]])
        out = decoder.forward(tok, pos, cache, torch.arange(3), [AttnGroup(None, slice(0, 3), t + 1)],
                              last_index=torch.zeros(3, dtype=torch.long))
        torch.testing.assert_close(out[[0, 2]], ref[:, t], atol=1e-5, rtol=1e-5)


def test_load_rejects_unknown_and_misshaped_tensors():
    model, config = tiny_hf("qwen2")
    decoder = LeanDecoder(DecoderShape.from_config(config.to_dict()), model.state_dict(), torch.float32,
                          torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown tensor names"):
        decoder.load({"model.layers.9.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="has shape"):
        decoder.load({"model.norm.weight": torch.zeros(7)})


def test_unsupported_model_type_is_refused():
    with pytest.raises(ValueError, match="not supported"):
        DecoderShape.from_config({"model_type": "gpt2"})


def test_plan_attention_splits_long_tails_only():
    use_view, groups = plan_attention(list(range(8)), [10] * 8)
    assert use_view and groups == [(list(range(8)), 10)]
    lens = [20] * 60 + [480] * 4
    use_view, groups = plan_attention(list(range(64)), lens)
    assert not use_view and len(groups) == 2
    (short, k_short), (long, k_long) = groups
    assert k_short == 20 and k_long == 480 and sorted(short + long) == list(range(64)) and len(long) == 4
    use_view, groups = plan_attention([0, 50], [30, 30])  # sparse slots: gather two rows, not a 51-row view
    assert not use_view and groups == [([0, 1], 30)]
