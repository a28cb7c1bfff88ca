"""Chapter 12's language model as an artifact: two symbolic dims, a fresh process, generation, serving.

Unit tests use a tiny untrained model (max_seq_len 32: length buckets 8, 16, 32); the
fresh-process generation test uses the zoo model `stdlib-bytes`, where the tokens mean
something. Nothing here depends on timing.
"""

import concurrent.futures
import http.client
import json

import jax
import numpy as np
import pytest
from conftest import run_python

import stacklib.llm as llm
import stacklib.nn as nnx
import stacklib.serve as serve
from stacklib import http as stack_http
from stacklib.llm.config import load_config
from stacklib.llm.model import Transformer
from stacklib.serve import lm
from stacklib.serve.repository import ModelRepository, length_buckets
from stacklib.serve.server import create_app

TINY = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=32,
            seq_len=32, progress=False)
SHAPES = ((1, 1), (2, 7), (3, 16), (5, 23), (8, 32))  # (batch, length)
MAX_BATCH = 8


@pytest.fixture(scope="module")
def tiny_model():
    return Transformer(load_config(None, **TINY), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tiny_export(tiny_model, tmp_path_factory):
    """(directory, fn, params, traces): the tiny model exported once; traces counts its tracings."""
    fn, params = lm.next_token_function(tiny_model)
    traces = []

    def counted(params, tokens):
        traces.append(tokens.shape)
        return fn(params, tokens)

    directory = tmp_path_factory.mktemp("lm") / "tiny" / "1"
    serve.export(counted, params, (np.zeros((1, 8), np.int32),), directory, platforms=("cpu",),
                 polymorphic_shapes=["b, t"], constraints=["t <= 32"], pad_value=lm.PAD,
                 metadata={"vocab_size": 256, "max_seq_len": 32})
    assert len(traces) == 1  # traced once, at export, with symbolic b and t
    return directory, fn, params, traces


def _rows(batch, length, seed=0):
    """`batch` token rows of lengths 1..length (the last row full), padded with PAD to `length`."""
    rng = np.random.default_rng(seed + 100 * batch + length)
    lengths = [*rng.integers(1, length + 1, batch - 1), length]
    return lm.pad([rng.integers(0, 256, n) for n in lengths], length)


def test_the_manifest_has_two_symbolic_dims_a_length_bound_and_the_pad_value(tiny_export):
    manifest = serve.read_manifest(tiny_export[0])
    assert manifest["inputs"] == [{"shape": ["b", "t"], "dtype": "int32"}]
    assert manifest["outputs"] == [{"shape": ["b", 256], "dtype": "float32"}]
    assert manifest["constraints"] == ["t <= 32"] and manifest["pad_value"] == -1
    assert serve.load(tiny_export[0]).signature == "(int32[b,t]) -> (float32[b,256]) where t <= 32"


def test_one_artifact_is_bitwise_the_jitted_model_at_five_shapes_without_retracing(tiny_export):
    directory, fn, params, traces = tiny_export
    loaded, reference = serve.load(directory), jax.jit(fn)
    traced_before = len(traces)
    for batch, length in SHAPES:
        tokens = _rows(batch, length)
        got = np.asarray(loaded(tokens))
        expected = np.asarray(reference(params, tokens))
        assert got.shape == (batch, 256)
        np.testing.assert_allclose(got, expected, rtol=1e-7, atol=0)
        assert np.array_equal(got, expected)
    assert loaded.compiled_shapes() == len(SHAPES)  # one compile per shape of the one program
    assert len(traces) == traced_before  # the model's Python code never ran again


def test_padding_after_a_row_does_not_change_its_next_token_logits(tiny_model, tiny_export):
    loaded = serve.load(tiny_export[0])
    row = np.random.default_rng(1).integers(0, 256, 5)
    full = np.asarray(jax.jit(lambda t: tiny_model(t))(row[None].astype(np.int32)))[0, -1]
    for length in (5, 8, 32):  # the same row, padded to three lengths
        np.testing.assert_allclose(np.asarray(loaded(lm.pad([row], length)))[0], full, rtol=1e-5, atol=1e-5)


def test_a_length_over_the_bound_is_refused_naming_the_constraint(tiny_export):
    loaded = serve.load(tiny_export[0])
    with pytest.raises(ValueError, match=r"shape \(1, 33\).*where t <= 32"):
        loaded(np.zeros((1, 33), np.int32))
    with pytest.raises(ValueError, match="between 1 and 4"):
        lm.pad([[1, 2, 3, 4, 5]], 4)
    with pytest.raises(ValueError, match="max_seq_len=32"):
        lm.generate(loaded, np.zeros((1, 30), np.int32), 3)


def test_greedy_generation_from_the_artifact_equals_chapter_12s_generate(tiny_model, tiny_export):
    loaded = serve.load(tiny_export[0])
    prompt = np.random.default_rng(2).integers(0, 256, (3, 5)).astype(np.int32)
    expected = llm.generate(tiny_model, prompt, 12, use_cache=False)
    np.testing.assert_array_equal(lm.generate(loaded, prompt, 12), expected)
    compiled = loaded.compiled_shapes()
    lm.generate(loaded, prompt, 12)
    assert loaded.compiled_shapes() == compiled  # one buffer shape: the loop compiled once


def test_the_zoo_model_generates_the_same_tokens_in_a_fresh_process_without_model_code(tmp_path):
    model, tokenizer = llm.pretrained("stdlib-bytes")
    directory = tmp_path / "stdlib-bytes" / "1"
    lm.export(model, directory, platforms=("cpu", "tpu", "cuda"))
    prompts = np.array([tokenizer.encode("def main():\n    "), tokenizer.encode("import os, sys\n\n")])
    expected = llm.generate(model, prompts, 24, use_cache=False)
    np.save(tmp_path / "prompts.npy", prompts)
    result = run_python(f"""
import sys
import numpy as np
import stacklib.serve as serve
from stacklib.serve import lm
model = serve.load({str(directory)!r})
np.save({str(tmp_path / "got.npy")!r}, lm.generate(model, np.load({str(tmp_path / "prompts.npy")!r}), 24))
banned = [m for m in sys.modules
          if m.split(".")[0] == "flax" or m.startswith(("stacklib.nn", "stacklib.llm"))]
assert not banned, banned
print("ok")
""")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
    np.testing.assert_array_equal(np.load(tmp_path / "got.npy"), expected)


def test_length_buckets_are_powers_of_two_up_to_the_bound():
    assert length_buckets(128) == [8, 16, 32, 64, 128]
    assert length_buckets(32) == [8, 16, 32]
    assert length_buckets(100) == [8, 16, 32, 64, 100]
    assert length_buckets(5) == [5]


@pytest.fixture(scope="module")
def lm_server(tiny_export, tmp_path_factory):
    models = tmp_path_factory.mktemp("models")
    (models / "tiny").symlink_to(tiny_export[0].parent)
    repository = ModelRepository(models, max_batch_size=MAX_BATCH, batch_timeout=0.005, poll_interval=60)
    repository.start()
    with stack_http.Server(create_app(repository)) as running:
        yield running, repository
    repository.close()


def _post(server, body):
    connection = http.client.HTTPConnection(server.host, server.port, timeout=60)
    connection.request("POST", "/v1/models/tiny/predict", body=json.dumps(body))
    response = connection.getresponse()
    status, payload = response.status, json.loads(response.read())
    connection.close()
    return status, payload


def _served(loaded, row):
    """What the server must answer for `row`: the artifact on (MAX_BATCH, bucket), row first."""
    bucket = next(b for b in (8, 16, 32) if b >= len(row))
    padded = lm.pad([row] * MAX_BATCH, bucket)
    return np.asarray(loaded(padded))[0]


def test_the_server_buckets_ragged_rows_and_answers_each_as_if_it_were_alone(lm_server, tiny_export):
    server, repository = lm_server
    loaded = serve.load(tiny_export[0])
    assert repository.get("tiny").status()["length_buckets"] == [8, 16, 32]
    rng = np.random.default_rng(3)
    rows = [rng.integers(0, 256, n).tolist() for n in (3, 8, 9, 31, 32)]  # buckets 8, 8, 16, 32, 32
    status, payload = _post(server, {"inputs": rows})
    assert status == 200, payload
    for row, answer in zip(rows, payload["outputs"], strict=True):
        assert np.array_equal(np.array(answer, np.float32), _served(loaded, row))


def test_64_concurrent_clients_of_mixed_lengths_get_bitwise_the_same_answers(lm_server, tiny_export):
    server, _ = lm_server
    loaded = serve.load(tiny_export[0])
    rng = np.random.default_rng(4)
    rows = [rng.integers(0, 256, 1 + i % 32).tolist() for i in range(64)]
    expected = [_served(loaded, row) for row in rows]

    def client(i):
        return [_post(server, {"inputs": [rows[i]]}) for _ in range(2)]

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(client, range(64), timeout=120))
    for i, answers in enumerate(results):
        for status, payload in answers:
            assert status == 200, payload
            assert np.array_equal(np.array(payload["outputs"][0], np.float32), expected[i])


@pytest.mark.parametrize("inputs, message", [
    ([[1] * 33], "has 33 tokens"),
    ([[]], "has 0 tokens"),
    ([[1, -1, 2]], "out of range"),
    ([[1, 256]], "out of range"),
    ([[1.5, 2]], "not integer ids"),
    ([1, 2, 3], "list of lists"),
])
def test_bad_token_rows_get_a_400_naming_the_expected_input(lm_server, inputs, message):
    server, _ = lm_server
    status, payload = _post(server, {"inputs": inputs})
    assert status == 400 and message in payload["error"]["message"], payload
    assert "token rows, each 1 to 32 ids 0..255" in payload["error"]["message"]
    assert _post(server, {"inputs": [[1, 2, 3]]})[0] == 200


def test_max_batch_tokens_caps_rows_per_call_for_long_buckets_and_chunks_big_requests(tiny_export, tmp_path):
    models = tmp_path / "models"
    (models / "tiny").mkdir(parents=True)
    (models / "tiny" / "1").symlink_to(tiny_export[0])
    repository = ModelRepository(models, max_batch_size=MAX_BATCH, max_batch_tokens=64, poll_interval=60)
    repository.start()
    try:
        version = repository.get("tiny")
        assert version.status()["rows_per_call"] == [8, 4, 2]  # 64 tokens: 8 x 8, 4 x 16, 2 x 32
        loaded = serve.load(tiny_export[0])
        rng = np.random.default_rng(5)
        rows = [rng.integers(0, 256, 30).tolist() for _ in range(5)]  # bucket 32: three calls of 2 rows
        with stack_http.Server(create_app(repository)) as server:
            status, payload = _post(server, {"inputs": rows})
        assert status == 200, payload
        for row, answer in zip(rows, payload["outputs"], strict=True):
            alone = np.asarray(loaded(lm.pad([row] * 2, 32)))[0]  # the (2, 32) call, row alone
            assert np.array_equal(np.array(answer, np.float32), alone)
        assert repository.batch_sizes() == {1: 1, 2: 2}  # rows per call: 2 + 2 + 1
    finally:
        repository.close()
