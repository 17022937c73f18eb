"""Issue 12 pieces: token-balanced shares, chunked response logprobs (equal to full logits, memory that does not
grow with vocabulary x sequence), the learner group on real Ray with gloo + FSDP2 (world_size 2 == 1), and the
learner section's refusals at start."""
import json

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from spillover.infra.config.run_config import build_config
from learner_batches import random_batch
from reference_logprobs import full_entropy, full_token_logprobs
from spillover.infra.config.learner import LearnerConfig, check_learner_start
from spillover.infra.tensor_memory import TensorMemoryProbe
from spillover.bench.batches import from_sequences
from spillover.tasks.learner.micro_batches import make_micro_batch
from spillover.tasks.learner.distributed import balanced_shards
from spillover.tasks.learner.token_logprobs import ResponseLogprobModel


def test_balanced_shards_equal_counts_and_tokens_within_one_row():
    rng = np.random.default_rng(0)
    for trial in range(200):
        world = int(rng.integers(1, 6))
        lengths = rng.integers(1, 500, size=int(rng.integers(0, 40)))
        shares = balanced_shards(lengths, world)
        assert sorted(i for s in shares for i in s) == list(range(len(lengths)))
        counts = [len(s) for s in shares]
        assert max(counts) - min(counts) <= 1
        sums = [int(lengths[s].sum()) for s in shares]
        assert max(sums) - min(sums) <= (lengths.max() if len(lengths) else 0), (trial, sums)
        assert shares == balanced_shards(lengths.tolist(), world)  # deterministic
    assert balanced_shards([5, 1, 1, 1, 1, 1], 2) == [[0, 3, 5], [1, 2, 4]]  # 7 vs 3: the best equal-count split


def _random_lm(vocab: int, hidden: int = 32) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=64, tie_word_embeddings=False)
    return Qwen2ForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()


def _micro_batch(vocab: int, rows: int, seq: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(0, vocab, seq - int(rng.integers(0, 3))).tolist() for _ in range(rows)]
    resp = [int(rng.integers(1, len(t) - 1)) for t in tokens]
    batch = from_sequences(tokens, resp, [[0.0] * r for r in resp], [[0] * r for r in resp], advantages=[0.0] * rows)
    return make_micro_batch(batch, list(range(rows)), pad_id=0)


def _args(mb):
    return mb.input_ids, mb.attention_mask, mb.logit_positions, mb.targets, mb.response_mask


def test_chunked_logprobs_equal_full_logits_values_entropy_and_gradients():
    lm, mb = _random_lm(300), _micro_batch(300, rows=5, seq=12)
    logits = lm(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
    logits = torch.gather(logits, 1, mb.logit_positions.unsqueeze(-1).expand(-1, -1, logits.size(-1)))
    mask = mb.response_mask
    full = full_token_logprobs(logits, mb.targets, 0.7) * mask
    (full.sum()).backward()
    want_grad = {n: p.grad.clone() for n, p in lm.named_parameters()}
    lm.zero_grad()
    for chunk in (1, 3, 1000):  # one token per chunk, uneven chunks, one chunk
        logp, entropy = ResponseLogprobModel(lm, 0.7, chunk)(*_args(mb), with_entropy=True)
        torch.testing.assert_close(logp, full.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy, (full_entropy(logits, 0.7) * mask).detach(), atol=1e-5, rtol=0)
        logp.sum().backward()
        for n, p in lm.named_parameters():
            torch.testing.assert_close(p.grad, want_grad[n], atol=1e-5, rtol=1e-5)
        lm.zero_grad()


def test_packed_row_equals_padded_rows_values_entropy_and_gradients():
    """One packed row (position ids restarting per sequence, attention within each: packed_attention) gives the
    padded rows' logprobs, entropy and gradients."""
    from spillover.tasks.learner.packed_attention import PACKED, use_packed_attention

    padded_lm, packed_lm = _random_lm(300), _random_lm(300)
    use_packed_attention(packed_lm)
    assert packed_lm.config._attn_implementation == PACKED
    rng = np.random.default_rng(3)
    tokens = [rng.integers(0, 300, int(n)).tolist() for n in (12, 3, 9, 2, 12)]
    resp = [int(rng.integers(1, len(t))) for t in tokens]
    batch = from_sequences(tokens, resp, [[0.0] * r for r in resp], [[0] * r for r in resp], advantages=[0.0] * 5)
    rows = [2, 0, 4, 1, 3]  # not in batch order: the outputs follow the micro-batch's rows either way
    padded, packed = make_micro_batch(batch, rows, pad_id=0), make_micro_batch(batch, rows, pad_id=0, packed=True)
    want, want_entropy = ResponseLogprobModel(padded_lm, 0.7, 4)(*_args(padded), with_entropy=True)
    got, entropy = ResponseLogprobModel(packed_lm, 0.7, 4)(
        packed.input_ids, None, packed.logit_positions, packed.targets, packed.response_mask, with_entropy=True,
        position_ids=packed.position_ids, cu_seqlens=packed.cu_seqlens, max_seqlen=packed.max_seqlen)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-5, rtol=0)
    (want * torch.arange(1.0, 1 + want.numel()).view_as(want)).sum().backward()  # every token its own weight
    (got * torch.arange(1.0, 1 + got.numel()).view_as(got)).sum().backward()
    grads = dict(packed_lm.named_parameters())
    for name, p in padded_lm.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, atol=1e-5, rtol=1e-4)


def _logprob_memory(lm, mb, chunk: int | None) -> TensorMemoryProbe:
    with torch.no_grad(), TensorMemoryProbe() as probe:
        if chunk is None:  # the old way: full [B, L, V] logits, then gather
            logits = lm(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
            index = mb.logit_positions.unsqueeze(-1).expand(-1, -1, logits.size(-1))
            full_token_logprobs(torch.gather(logits, 1, index), mb.targets)
        else:
            ResponseLogprobModel(lm, 1.0, chunk)(*_args(mb))
    return probe


def test_logprob_memory_does_not_grow_with_vocab_times_sequence():
    """Vocabulary 32768, 4 rows: full logits are 4 x L x V (32 MiB at L = 64, 128 MiB at L = 256); the chunked
    path (64 tokens per chunk) never makes a tensor larger than one chunk's [64, V] (8 MiB), and its peak of live
    op outputs stays within two of those plus activations, whatever the sequence length."""
    vocab, chunk, rows = 32768, 64, 4
    lm = _random_lm(vocab)
    chunk_bytes, peaks = chunk * vocab * 4, {}
    for seq in (64, 256):
        mb = _micro_batch(vocab, rows, seq)
        full_bytes = rows * mb.input_ids.size(1) * vocab * 4
        old, new = _logprob_memory(lm, mb, None), _logprob_memory(lm, mb, chunk)
        assert old.largest_bytes >= full_bytes  # the probe sees the [B, L, V] tensor when it is made
        assert new.largest_bytes <= chunk_bytes < full_bytes / 3, new.largest_shape
        assert new.peak_bytes <= 2 * chunk_bytes + 2**20, new.peak_bytes  # 2 x [chunk, V] + < 1 MiB activations
        peaks[seq] = (old.peak_bytes, new.peak_bytes)
    assert peaks[256][0] > 3.5 * peaks[64][0]  # full logits: peak grows with the sequence
    print({seq: {"full_peak_mib": round(o / 2**20, 2), "chunked_peak_mib": round(n / 2**20, 2)}
           for seq, (o, n) in peaks.items()})


@pytest.fixture(scope="module")
def started_groups(tiny_model_dir, ray_session):
    from spillover.tasks.learner.group import create_learners

    cfg = build_config(overrides=["grpo.kl_coef=0.05", "grpo.micro_batch_size=2", "rollout.global_batch_size=2",
                                  "rollout.n_samples_per_prompt=4", "rollout.temperature=0.7",
                                  "learner.world_size=2", "learner.reference_placement=separate"])
    policy, ref = create_learners(tiny_model_dir, cfg)
    yield cfg, policy, ref
    for group in (policy, ref):
        group.shutdown()


@pytest.fixture
def groups(started_groups, tiny_model_dir):
    """The module's sharded policy and reference, reset to a fresh start (weight version 0, new optimizer, seeded
    RNG) for each test, whatever the tests before it trained."""
    from warm_parts import start_learner_group_over

    cfg, policy, ref = started_groups
    start_learner_group_over(policy, tiny_model_dir, cfg, trainable=True)
    start_learner_group_over(ref, tiny_model_dir, cfg, trainable=False)
    return started_groups


def _single(tiny_model_dir, cfg):
    from spillover.tasks.learner.actor import LearnerActor

    return LearnerActor(str(tiny_model_dir), cfg.grpo, cfg.optimizer, cfg.rollout.temperature, cfg.model.seed, True,
                        total_steps=cfg.schedule.num_iterations,
                        learner_cfg=cfg.learner.model_copy(update={"world_size": 1}))


def _assert_same_weights(sharded: dict, single: torch.nn.Module) -> float:
    """Equal within 2e-5 everywhere and within 1e-6 on all but 0.1% of the elements -> the largest difference.

    AdamW's first steps move each weight by about lr * g / (|g| + eps): where a gradient is ~eps (1e-8), the
    float32 summation order of the ranks' gradients (a few ulp of terms that cancel) shows up at ~lr * 1e-2 in
    that one weight (1e-5 at the default lr 1e-3; 1.03e-5 seen), so a handful of elements may differ by more than
    1e-6."""
    plain = single.state_dict()
    assert set(sharded) == set(plain)
    diffs = torch.cat([(sharded[k].float() - v.float()).abs().reshape(-1) for k, v in plain.items()])
    assert float(diffs.max()) <= 2e-5 and float((diffs > 1e-6).float().mean()) < 1e-3, float(diffs.max())
    return float(diffs.max())


def test_world_size_2_equals_1_logprobs_update_and_resume_across_sizes(groups, tiny_model_dir, ray_session, tmp_path):
    from safetensors.torch import load_file, save_file

    ray = ray_session
    cfg, policy, ref = groups
    assert policy.world_size == ref.world_size == 2  # the reference is sharded the same way (kl_coef > 0)
    single = _single(tiny_model_dir, cfg)
    batch = random_batch(0, max_response=14)
    old2, ref2 = ray.get([policy.compute_logprobs.remote(batch), ref.compute_logprobs.remote(batch)])
    old1 = single.compute_logprobs(batch)
    np.testing.assert_allclose(old2, old1, atol=1e-6)
    np.testing.assert_allclose(ref2, old1, atol=1e-6)
    m2, m1 = ray.get(policy.update.remote(batch, old2, ref2)), single.update(batch, old1, old1)
    for key in ("loss", "pg_loss", "kl", "grad_norm", "entropy", "clip_fraction", "tis_weight_mean", "ppo_kl",
                "tis_weight_max", "logprob_mismatch_kl", "logprob_mismatch_tokens"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), key
    assert m2["weight_version"] == m1["weight_version"] == 1 == ray.get(policy.weight_version.remote())
    assert m1["grad_norm"] > 0 and m2["num_trained_tokens"] == m1["num_trained_tokens"]
    print("update_max_abs_diff", _assert_same_weights(ray.get(policy.state_dict_ref.remote()), single.model))

    # world_size 2 -> 1: rank 0's full state (safetensors + JSON meta) into one process; both train on
    tensors, meta = ray.get(policy.get_state.remote())
    save_file(tensors, tmp_path / "ws2.safetensors")
    resumed = _single(tiny_model_dir, cfg)
    resumed.set_state(load_file(tmp_path / "ws2.safetensors"), meta)
    again, again_meta = resumed.get_state()  # the group's weights and AdamW moments, exactly, in one process
    assert set(again) == set(tensors) and all(torch.equal(again[k], tensors[k]) for k in tensors)
    assert again_meta == meta
    b2 = random_batch(1, version=1, max_response=14)
    lp = resumed.compute_logprobs(b2)
    resumed.update(b2, lp, lp), single.update(b2, lp, lp)
    _assert_same_weights(resumed.model.state_dict(), single.model)
    # world_size 1 -> 2: the single process's state into the group; one more update on each
    tensors, meta = single.get_state()
    ray.get(policy.set_state.remote(tensors, meta))
    assert ray.get(policy.weight_version.remote()) == 2
    b3 = random_batch(2, version=2, max_response=14)
    lp = single.compute_logprobs(b3)
    m2, m1 = ray.get(policy.update.remote(b3, lp, lp)), single.update(b3, lp, lp)
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5, abs=1e-6)
    _assert_same_weights(ray.get(policy.state_dict_ref.remote()), single.model)


def test_world_size_2_token_budget_packed_equals_1_padded(groups, tiny_model_dir, ray_session):
    """learner.max_tokens_per_micro_batch with packed rows on 2 ranks (FSDP2: the same number of micro-batches on
    both, padding micro-batches where a rank has fewer rows) == one rank of padded count micro-batches."""
    from warm_parts import start_learner_group_over

    ray = ray_session
    cfg, policy, _ = groups
    # model_copy skips the config's budget >= rollout.max_model_len check: these rows hold <= 20 tokens
    budget = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"max_tokens_per_micro_batch": 24})})
    start_learner_group_over(policy, tiny_model_dir, budget, trainable=True)
    single = _single(tiny_model_dir, cfg)
    batch = random_batch(4, max_response=14)
    old2, old1 = ray.get(policy.compute_logprobs.remote(batch)), single.compute_logprobs(batch)
    np.testing.assert_allclose(old2, old1, atol=1e-5)
    m2, m1 = ray.get(policy.update.remote(batch, old2, old2)), single.update(batch, old1, old1)
    for key in ("loss", "pg_loss", "grad_norm", "entropy", "clip_fraction", "tis_weight_mean", "tis_weight_max"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
    assert m2["padding_share"] < m1["padding_share"] and m1["padding_share"] > 0
    _assert_same_weights(ray.get(policy.state_dict_ref.remote()), single.model)
    # rows of 23, 13 and 12 tokens: rank 0 holds the 23 alone, rank 1 needs two micro-batches for 13 + 12 > 24, so
    # rank 0 runs one padding micro-batch beside it (no loss tokens; the collectives still match)
    rng = np.random.default_rng(5)
    tokens = [rng.integers(2, 40, n).tolist() for n in (23, 13, 12)]
    uneven = from_sequences(tokens, [18, 8, 7], [[-3.0] * r for r in (18, 8, 7)], [[1] * r for r in (18, 8, 7)],
                            advantages=[1.0, -0.5, 0.3])
    old2, old1 = ray.get(policy.compute_logprobs.remote(uneven)), single.compute_logprobs(uneven)
    np.testing.assert_allclose(old2, old1, atol=1e-5)
    m2, m1 = ray.get(policy.update.remote(uneven, old2, old2)), single.update(uneven, old1, old1)
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-4, abs=1e-6)
    assert m2["padding_share"] == pytest.approx(12 / (23 + 13 + 12 + 12))  # the padding micro-batch: the shortest row
    _assert_same_weights(ray.get(policy.state_dict_ref.remote()), single.model)


def test_bad_learner_settings_are_refused_at_start(ray_session, tiny_model_dir):
    from spillover.infra.config.parsing import ConfigError
    from spillover.tasks.learner.group import create_learners

    with pytest.raises(ConfigError, match=r"learner.world_size \(3\) must divide the samples of one optimizer step"):
        build_config(overrides=["learner.world_size=3"])
    cuda = build_config(overrides=["learner.device=cuda", "learner.world_size=2"])
    assert ray_session.cluster_resources().get("GPU", 0) == 0
    with pytest.raises(ValueError, match=r"learner.device=cuda needs 2 GPUs .* the Ray cluster has 0"):
        create_learners(tiny_model_dir, cuda)  # refused before any actor starts
    with pytest.raises(ConfigError, match=r"learner.max_tokens_per_micro_batch \(32\) must be >= "
                       r"rollout.max_model_len \(64\)"):
        build_config(overrides=["learner.max_tokens_per_micro_batch=32", "rollout.max_model_len=64"])
    flash = LearnerConfig(device="cuda", attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="attn_implementation=flash_attention_2 but flash_attn is not installed"):
        check_learner_start(flash, {"GPU": 8})


def test_gradient_checkpointing_and_eager_attention_do_not_change_the_update(tiny_model_dir):
    """learner.gradient_checkpointing recomputes decoder layers in backward (same weights after a step, same
    state_dict keys); learner.attn_implementation=eager gives the same logprobs as sdpa."""
    from spillover.tasks.learner.actor import LearnerActor

    from spillover.infra.config.training import GRPOConfig, OptimizerConfig

    batch, learners = random_batch(5, max_response=14), {}
    for name, lcfg in {"plain": LearnerConfig(), "ckpt": LearnerConfig(gradient_checkpointing=True),
                       "eager": LearnerConfig(attn_implementation="eager")}.items():
        learners[name] = LearnerActor(str(tiny_model_dir), GRPOConfig(micro_batch_size=3), OptimizerConfig(), 1.0, 0,
                                      True, learner_cfg=lcfg)
    old = learners["plain"].compute_logprobs(batch)
    np.testing.assert_allclose(learners["eager"].compute_logprobs(batch), old, atol=1e-5)
    for name in ("plain", "ckpt"):
        learners[name].update(batch, old)
    a, b = learners["plain"].model.state_dict(), learners["ckpt"].model.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_sharded_checkpoint_each_rank_writes_its_slices_one_manifest(groups, tiny_model_dir, ray_session, tmp_path):
    """Each rank of the world_size 2 policy writes its own slices (safetensors) under the checkpoint prefix; the
    driver's manifest, written last, lists and verifies them; put back together they are exactly the state
    rank 0 gathers, and a world_size 1 learner resumes from them."""
    from spillover.infra.storage.checkpoint import CheckpointState, checkpoint_name, load_checkpoint, save_checkpoint
    from spillover.infra.config.run_config import StorageConfig
    from spillover.infra.storage.store import open_store
    from spillover.tasks.learner.shards import assemble

    ray = ray_session
    cfg, policy, _ = groups
    b = random_batch(7, max_response=14)  # one update first: AdamW moments to save
    lp = ray.get(policy.compute_logprobs.remote(b))
    ray.get(policy.update.remote(b, lp, lp))
    assert ray.get(policy.weight_version.remote()) == 1
    full, meta = ray.get(policy.get_state.remote())
    store = open_store(str(tmp_path / "ckpt"))
    written = ray.get(policy.each("write_state_shards", str(tmp_path / "ckpt"), StorageConfig(), checkpoint_name(3)))
    assert [sorted(w["groups"]["tensors"]) for w in written] == [["policy-rank000"], ["policy-rank001"]]
    infos = [w["info"] for w in written]
    save_checkpoint(store, CheckpointState(iteration=3, meta={"learner_shards": infos}), written=written)
    manifest = json.loads(store.get_bytes(f"{checkpoint_name(3)}/manifest.json"))
    assert {k for w in written for k in w["objects"]} <= set(manifest["objects"])
    loaded = load_checkpoint(store, 3)
    parts = [(loaded.tensors[f"policy-rank{i['rank']:03d}"], i) for i in loaded.meta["learner_shards"]]
    rank1 = loaded.tensors["policy-rank001"]
    assert "rng/torch" not in rank1 and 0 < sum(t.numel() for t in rank1.values()) < sum(
        t.numel() for t in full.values())  # rank 1 holds slices only
    tensors, shard_meta = assemble(parts)
    assert set(tensors) == set(full) and all(torch.equal(tensors[k], full[k]) for k in full)
    assert {k: shard_meta[k] for k in ("weight_version", "model_keys", "kl_coef")} == \
        {k: meta[k] for k in ("weight_version", "model_keys", "kl_coef")}
    single = _single(tiny_model_dir, cfg)
    single.set_state(tensors, shard_meta)
    again, _ = single.get_state()
    assert all(torch.equal(again[k], full[k]) for k in full)
