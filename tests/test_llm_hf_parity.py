"""Our Transformer on Hugging Face checkpoints against tunix's Qwen3 and Llama 3 (stacklib/llm/hf_tunix.py).

One small checkpoint per family, with random weights drawn for tunix's model and written in
Hugging Face's layout through tunix's own name table: Qwen3 with tied embeddings and a
head_dim (32) that is not d_model / n_heads (16), Llama 3 with an untied head. Both models
read the same file; ours through `stacklib.llm.hf`, tunix's through its
`create_model_from_safe_tensors`.

Tolerance: float32, max |logit difference| <= 1e-4 on logits of standard deviation ~0.8
(measured: ~2.5e-6). The two implementations round differently (RoPE as position times
frequency vs position over timescale, einsum orders, attention's softmax) but compute the
same function. Greedy tokens must be identical.

tunix 0.1.7's models apply RoPE with theta = 1e6 whatever their config says and have no
Llama 3.1 frequency scaling, so these checkpoints use theta = 1e6 and no scaling;
tests/test_llm_hf.py checks the scaling against Meta's formula.
"""

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
import pytest

import stacklib.nn as nnx
from stacklib.llm import Config, KVCache, Transformer, generate, hf, hf_tunix, sample

TOLERANCE = 1e-4
SIZES = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {"qwen3": dict(head_dim=32, tie_word_embeddings=True),
            "llama": dict(head_dim=16, tie_word_embeddings=False)}
PROMPTS = np.random.default_rng(0).integers(0, SIZES["vocab_size"], (3, 12)).astype(np.int32)  # a batch of 3


class Checkpoint(NamedTuple):
    theirs: Any  # tunix's model
    expected: np.ndarray  # tunix's logits of PROMPTS, without a cache
    config: Config
    ours: Transformer


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory) -> Checkpoint:
    """One family's random checkpoint, read by tunix and by us."""
    folder = tmp_path_factory.mktemp(request.param)
    hf_tunix.dummy_checkpoint(folder, request.param, seed=1, **SIZES, **FAMILIES[request.param])
    theirs = hf_tunix.load(folder)
    config, ours = hf.load_pretrained(folder)
    return Checkpoint(theirs, np.asarray(hf_tunix.logits(theirs, PROMPTS)), config, ours)


def _logits(model, tokens):
    """The model's forward pass, compiled (eager dispatch of every operation costs seconds)."""
    graphdef, params = nnx.split(model, nnx.Param)
    return sample._logits(graphdef, params, jnp.asarray(tokens))


def test_the_config_is_read_from_config_json(checkpoint):
    config = checkpoint.config
    family = FAMILIES["qwen3" if config.qk_norm else "llama"]
    assert (config.d_model, config.n_heads, config.n_kv_heads) == (64, 4, 2)
    assert (config.head_dim, config.tie_embeddings) == (family["head_dim"], family["tie_word_embeddings"])
    assert config.rope_theta == hf_tunix.TUNIX_ROPE_THETA and config.rope_scaling == "none"


def test_a_batch_of_prompts_gives_tunix_s_logits(checkpoint):
    got = np.asarray(_logits(checkpoint.ours, PROMPTS))
    assert checkpoint.expected.std() > 0.5  # logits of a useful size, so the tolerance means something
    assert np.abs(got - checkpoint.expected).max() <= TOLERANCE


def test_prefill_and_decode_through_the_kv_cache_give_tunix_s_logits(checkpoint):
    _, expected, config, ours = checkpoint
    B, T = PROMPTS.shape
    P, N = 5, 10  # prefill 5 tokens, decode the other 7 one at a time: `generate(prompt, N)`'s shapes,
    graphdef, params = nnx.split(ours, nnx.Param)  # so the greedy test below reuses these compilations
    cache = KVCache.zeros(config, B, P + N)
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    logits, cache = sample._logits_cached(graphdef, params, jnp.asarray(PROMPTS[:, :P]), positions, cache)
    steps = [np.asarray(logits)]
    for t in range(P, T):
        logits, cache = sample._logits_cached(graphdef, params, jnp.asarray(PROMPTS[:, t:t + 1]),
                                              jnp.full((B, 1), t, jnp.int32), cache)
        steps.append(np.asarray(logits))
    assert np.abs(np.concatenate(steps, axis=1) - expected).max() <= TOLERANCE


def test_greedy_generation_is_tunix_s_token_for_token(checkpoint):
    prompt = PROMPTS[:, :5]  # generate(prompt, 10): the compilations of the KV-cache test above
    expected = hf_tunix.greedy(checkpoint.theirs, prompt, 10)  # recomputing the sequence per token
    np.testing.assert_array_equal(generate(checkpoint.ours, prompt, 10), expected)  # prefill + KV cache


def test_ours_saved_loads_in_tunix_with_the_same_logits(checkpoint, tmp_path):
    hf.save_pretrained(tmp_path, checkpoint.config, checkpoint.ours)
    assert (tmp_path / "config.json").exists() and (tmp_path / "model.safetensors").exists()
    reloaded_by_tunix = hf_tunix.load(tmp_path)  # the same weights: the same logits, bit for bit
    np.testing.assert_array_equal(hf_tunix.logits(reloaded_by_tunix, PROMPTS), checkpoint.expected)
