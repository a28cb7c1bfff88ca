"""stacklib.llm.hf: the checkpoint format, its map, what it refuses; the two architectural options.

Parity with tunix on the same checkpoints is in test_llm_hf_parity.py; here nothing needs tunix.
"""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import stacklib.nn as nnx
from stacklib.llm import Config, Transformer, hf, load_config, sample
from stacklib.llm.config import OPEN_MODEL_KEYS, ConfigError
from stacklib.llm.model import rope_frequencies

TINY = dict(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=48,
            max_seq_len=32, seq_len=32)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 9)))

# config.json of Qwen/Qwen3-0.6B and meta-llama/Llama-3.2-1B as published on the Hub (the keys
# this loader reads; the Llama file in transformers 5's `rope_parameters` form).
QWEN3_0P6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "tie_word_embeddings": True, "use_sliding_window": False,
    "vocab_size": 151936}
LLAMA_3P2_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 131072,
    "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "tie_word_embeddings": True, "vocab_size": 128256,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}


def _model(**changes):
    config = load_config(None, **{**TINY, **changes})
    return config, Transformer(config, rngs=nnx.Rngs(0))


def _logits(model, tokens=TOKENS):
    """The forward pass, compiled once per architecture (op-by-op dispatch costs seconds)."""
    graphdef, params = nnx.split(model, nnx.Param)
    return np.asarray(sample._logits(graphdef, params, tokens))


# The config --------------------------------------------------------------------------------


def test_qwen3_0p6b_s_config_json_reads_into_our_config():
    config = hf.config_from_hf(QWEN3_0P6B)
    assert (config.d_model, config.n_layers, config.n_heads, config.n_kv_heads, config.d_ff) == (
        1024, 28, 16, 8, 3072)
    assert config.head_dim == 128 != config.d_model // config.n_heads  # an explicit head_dim
    assert config.qk_norm and config.tie_embeddings and config.rope_theta == 1e6
    assert config.rope_scaling == "none" and config.max_seq_len == 40960


def test_llama_3p2_s_config_json_reads_with_its_rope_scaling():
    config = hf.config_from_hf(LLAMA_3P2_1B)
    assert not config.qk_norm and config.tie_embeddings and config.rope_theta == 500000.0
    assert config.rope_scaling_params == (32.0, 1.0, 4.0, 8192)
    same_in_transformers_4_form = {**LLAMA_3P2_1B, "rope_theta": 500000.0, "rope_scaling": {
        **LLAMA_3P2_1B["rope_parameters"]}}
    del same_in_transformers_4_form["rope_parameters"]
    assert hf.config_from_hf(same_in_transformers_4_form) == config


def test_our_config_json_reads_back_into_the_same_config():
    for changes in (dict(qk_norm=True, tie_embeddings=True), dict(rope_scaling="llama3", rope_theta=5e5)):
        config = load_config(None, **TINY, **changes)
        assert hf.config_from_hf(hf.config_to_hf(config)) == config


@pytest.mark.parametrize("change, named", [
    (dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]), "model_type='qwen2'"),
    (dict(architectures=["Qwen3ForSequenceClassification"]), "Qwen3ForSequenceClassification"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(use_sliding_window=True), "use_sliding_window=True"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type='yarn'"),
])
def test_a_config_of_another_architecture_is_refused_by_name(change, named):
    with pytest.raises(hf.CheckpointFormatError, match=named.replace("(", r"\(").replace("[", r"\[")):
        hf.config_from_hf({**QWEN3_0P6B, **change})


def test_the_book_s_own_configs_save_as_before_the_open_model_settings():
    config = load_config(None)
    assert not set(OPEN_MODEL_KEYS) & set(config.to_dict())  # saved configs (and zoo files) unchanged
    assert Config(**config.to_dict()) == config
    config.check_checkpoint(config.to_dict(), "old")  # a checkpoint saved without them still resumes
    with pytest.raises(ConfigError, match="qk_norm: checkpoint True vs config False"):
        config.check_checkpoint(config.replace(qk_norm=True).to_dict(), "new")


def test_rope_scaling_settings_are_checked():
    with pytest.raises(ConfigError, match="rope_scaling='yarn' is not one of none, llama3"):
        load_config(None, rope_scaling="yarn")
    with pytest.raises(ConfigError, match="rope_low_freq_factor=4.0 must be positive and below"):
        load_config(None, rope_scaling="llama3", rope_low_freq_factor=4.0)


# The map and the files -----------------------------------------------------------------------


def test_the_map_transposes_projections_and_nothing_else():
    config = load_config(None, **TINY, qk_norm=True)
    mapping = {m.hf: m for m in hf.tensor_map(config)}
    assert len(mapping) == 1 + 11 * config.n_layers + 1 + 1  # embedding, 11 per layer, norm, lm_head
    assert mapping["model.layers.1.self_attn.q_proj.weight"] == hf.TensorMapping(
        ("layers", 1, "self_attn", "q_proj", "kernel"), "model.layers.1.self_attn.q_proj.weight", True)
    transposed = {name.split(".")[-2] for name, m in mapping.items() if m.transposed}
    projections = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}
    assert transposed == projections
    assert "lm_head.weight" not in {m.hf for m in hf.tensor_map(config.replace(tie_embeddings=True))}


@pytest.mark.parametrize("shard_bytes", [None, 20_000])
def test_a_saved_model_loads_back_bit_for_bit(tmp_path, shard_bytes):
    config, model = _model(qk_norm=True, rope_scaling="llama3", rope_original_max_len=16)
    hf.save_pretrained(tmp_path, config, model, max_shard_bytes=shard_bytes)
    index = tmp_path / hf.INDEX_FILE
    assert index.exists() == (shard_bytes is not None)
    if shard_bytes:
        shards = set(json.loads(index.read_text())["weight_map"].values())
        assert len(shards) > 1 and all((tmp_path / s).exists() for s in shards)
    loaded_config, loaded = hf.load_pretrained(tmp_path)
    assert loaded_config == config
    np.testing.assert_array_equal(_logits(loaded), _logits(model))


def test_the_file_holds_pytorch_s_layout(tmp_path):
    config, model = _model()
    hf.save_pretrained(tmp_path, config, model)
    tensors = load_file(tmp_path / "model.safetensors")
    kernel = np.asarray(model.layers[0].self_attn.q_proj.kernel[...])  # (d_model, n_heads * head_dim)
    np.testing.assert_array_equal(tensors["model.layers.0.self_attn.q_proj.weight"], kernel.T)
    np.testing.assert_array_equal(tensors["model.embed_tokens.weight"], model.embed_tokens.embedding[...])


def _edit_saved(tmp_path, edit):
    config, model = _model()
    hf.save_pretrained(tmp_path, config, model)
    tensors = load_file(tmp_path / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})


def test_a_missing_tensor_is_named(tmp_path):
    _edit_saved(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(hf.CheckpointFormatError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is missing"):
        hf.load_pretrained(tmp_path)


def test_a_tensor_of_another_shape_is_named_with_both_shapes(tmp_path):
    def untransposed(tensors):
        tensors["model.layers.0.self_attn.o_proj.weight"] = np.ascontiguousarray(
            tensors["model.layers.0.self_attn.o_proj.weight"][:, :-1])

    _edit_saved(tmp_path, untransposed)
    shapes = r"o_proj\.weight .* has shape \(32, 63\); .* \(32, 64\)"
    with pytest.raises(hf.CheckpointFormatError, match=shapes):
        hf.load_pretrained(tmp_path)


def test_a_tensor_stored_transposed_is_called_so(tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    _edit_saved(tmp_path, lambda tensors: tensors.update({name: np.ascontiguousarray(tensors[name].T)}))
    with pytest.raises(hf.CheckpointFormatError, match=r"up_proj\.weight .* it is stored transposed"):
        hf.load_pretrained(tmp_path)


def test_a_tensor_with_no_place_in_the_architecture_is_named(tmp_path):
    bias = {"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}  # Qwen2 has one
    _edit_saved(tmp_path, lambda tensors: tensors.update(bias))
    with pytest.raises(hf.CheckpointFormatError, match=r"first model\.layers\.0\.self_attn\.q_proj\.bias"):
        hf.load_pretrained(tmp_path)


def test_a_folder_without_config_json_or_weights_says_what_it_needs(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        hf.load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf.config_to_hf(load_config(None, **TINY))))
    with pytest.raises(FileNotFoundError, match="holds no \\*.safetensors"):
        hf.load_pretrained(tmp_path)


def test_saving_a_model_under_another_config_is_refused(tmp_path):
    config, model = _model()
    with pytest.raises(hf.CheckpointFormatError, match="config's model has a parameter layers/0/self_attn/"):
        hf.save_pretrained(tmp_path, config.replace(qk_norm=True), model)


# The architecture's options -----------------------------------------------------------------


def _meta_apply_scaling(freqs, factor, low_freq_factor, high_freq_factor, old_context_len):
    """Llama 3.1's reference code (meta-llama/llama-models, `apply_scaling`), one frequency at a time."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new_freqs = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            new_freqs.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(new_freqs)


@pytest.mark.parametrize("head_dim, theta, scaling", [(128, 500000.0, (8.0, 1.0, 4.0, 8192)),  # Llama 3.1
                                                      (64, 500000.0, (32.0, 1.0, 4.0, 8192)),  # Llama 3.2
                                                      (16, 10000.0, (4.0, 1.0, 4.0, 64))])
def test_llama3_frequency_scaling_is_meta_s_formula(head_dim, theta, scaling):
    plain = np.asarray(rope_frequencies(head_dim, theta), np.float64)
    expected = _meta_apply_scaling(plain, *scaling)
    got = np.asarray(rope_frequencies(head_dim, theta, scaling))
    np.testing.assert_allclose(got, expected, rtol=1e-6)  # float32
    assert got[0] == plain[0] and np.isclose(got[-1], plain[-1] / scaling[0])  # fast kept, slow divided


def test_rope_scaling_changes_the_logits_after_position_0():
    config, model = _model(rope_scaling="llama3", rope_original_max_len=16)
    unscaled = Transformer(config.replace(rope_scaling="none"), rngs=nnx.Rngs(0))  # the same weights
    scaled_logits, plain_logits = _logits(model), _logits(unscaled)
    np.testing.assert_allclose(scaled_logits[:, 0], plain_logits[:, 0], rtol=1e-6)  # angle 0 either way
    assert np.abs(scaled_logits[:, 1:] - plain_logits[:, 1:]).max() > 1e-3


def test_qk_norm_normalises_each_head_s_queries_and_keys():
    config, model = _model(qk_norm=True)
    attention = model.layers[0].self_attn
    assert attention.q_norm.scale.shape == attention.k_norm.scale.shape == (config.head_dim,)
    _, plain = _model()
    normed = dict(nnx.state(model, nnx.Param).flat_state())
    for path, variable in nnx.state(plain, nnx.Param).flat_state():  # the same weights, norms of ones added
        normed[path].set_value(variable[...])
    assert np.abs(_logits(model) - _logits(plain)).max() > 1e-3
