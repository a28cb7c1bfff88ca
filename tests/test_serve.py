"""stacklib.serve's artifacts: export, verify, load (in a fresh process), and the dynamic batcher."""

import json
import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_python

import stacklib.nn as nnx
import stacklib.serve as serve
from stacklib.nn import digits_classifier
from stacklib.serve.batching import DynamicBatcher, bucket_sizes

BATCH_SIZES = (1, 2, 3, 7, 16, 33)


@pytest.fixture(scope="module")
def classifier():
    """(predict, params, traces): the chapter-02 classifier and a count of its traces."""
    predict, params = digits_classifier.predict_function(digits_classifier.Classifier(rngs=nnx.Rngs(0)))
    traces = []

    def counted(params, x):
        traces.append(x.shape)
        return predict(params, x)

    return counted, params, traces


@pytest.fixture(scope="module")
def exported(classifier, tmp_path_factory):
    predict, params, traces = classifier
    directory = tmp_path_factory.mktemp("artifacts") / "digits" / "1"
    manifest = serve.export(predict, params, (np.zeros((4, 64), np.float32),), directory)
    assert len(traces) == 1  # traced once, at export
    return directory, manifest


def _inputs(batch):
    return np.random.default_rng(batch).random((batch, 64), dtype=np.float32)


def test_manifest_records_symbolic_signature_platforms_versions_and_hashes(exported):
    directory, manifest = exported
    assert manifest == json.loads((directory / "manifest.json").read_text())
    assert manifest["inputs"] == [{"shape": ["b", 64], "dtype": "float32"}]
    assert manifest["outputs"] == [{"shape": ["b", 10], "dtype": "float32"}]
    assert manifest["platforms"] == ["cpu", "tpu", "cuda"]
    assert manifest["versions"]["jax"] == jax.__version__
    listed = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}
    assert set(manifest["files"]) == listed - {"manifest.json"}
    assert all(len(digest) == 64 for digest in manifest["files"].values())
    assert serve.load(directory).signature == "(float32[b,64]) -> (float32[b,10])"


def test_one_export_serves_six_batch_sizes_bitwise_without_retracing_the_model(classifier, exported):
    predict, params, traces = classifier
    loaded = serve.load(exported[0])
    traced_before = len(traces)
    for batch in BATCH_SIZES:
        x = _inputs(batch)
        got = np.asarray(loaded(x))
        assert got.shape == (batch, 10)
        expected = jax.jit(predict)(params, x)  # compiled, as the artifact is (eager differs by an ulp)
        np.testing.assert_allclose(got, expected, rtol=1e-7, atol=0)  # jax.export's own bar
        assert np.array_equal(got, expected)  # and bitwise, same backend
    assert loaded.compiled_shapes() == len(BATCH_SIZES)  # one compile per shape of the one program
    # The loaded function never called the model's Python code (only the references above did).
    assert len(traces) - traced_before == len(BATCH_SIZES)


def test_a_fresh_process_loads_the_artifact_without_flax_or_model_code(exported, tmp_path):
    directory = exported[0]
    x = _inputs(5)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "expected.npy", np.asarray(serve.load(directory)(x)))
    result = run_python(f"""
import sys
import numpy as np
import stacklib.serve as serve
model = serve.load({str(directory)!r})
got = np.asarray(model(np.load({str(tmp_path / "x.npy")!r})))
assert np.array_equal(got, np.load({str(tmp_path / "expected.npy")!r}))
banned = [m for m in sys.modules
          if m.split(".")[0] == "flax" or m.startswith("stacklib.nn")]
assert not banned, banned
print("ok")
""")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.fixture
def copy_of(exported, tmp_path):
    directory = tmp_path / "copy"
    shutil.copytree(exported[0], directory)
    return directory


def test_an_altered_weight_file_is_refused_naming_it(copy_of):
    path = next((copy_of / "weights").glob("*kernel*"))
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(serve.ArtifactError, match=f"{path.name} fails its SHA-256 check"):
        serve.load(copy_of)


def test_a_truncated_program_is_refused_naming_it(copy_of):
    path = copy_of / "program.bin"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(serve.ArtifactError, match="program.bin fails its SHA-256 check"):
        serve.load(copy_of)


def test_a_missing_file_an_extra_file_and_a_missing_manifest_are_refused(copy_of):
    extra = copy_of / "weights" / "extra.bin"
    extra.write_bytes(b"0")
    with pytest.raises(serve.ArtifactError, match="does not list.*extra.bin"):
        serve.load(copy_of)
    extra.unlink()
    next((copy_of / "weights").glob("*bias*")).unlink()
    with pytest.raises(serve.ArtifactError, match="bias.bin is missing"):
        serve.load(copy_of)
    (copy_of / "manifest.json").unlink()
    with pytest.raises(serve.ArtifactError, match="manifest.json is missing"):
        serve.load(copy_of)


def test_a_program_for_other_platforms_is_refused_on_this_one(classifier, tmp_path):
    predict, params, _ = classifier
    serve.export(predict, params, (np.zeros((1, 64), np.float32),), tmp_path / "tpu", platforms=("tpu",))
    with pytest.raises(serve.ArtifactError, match=r"exported for \['tpu'\], not for this cpu machine"):
        serve.load(tmp_path / "tpu")


def test_an_existing_directory_and_an_nnx_state_are_refused_at_export(classifier, exported):
    predict, params, _ = classifier
    with pytest.raises(FileExistsError, match="new directory"):
        serve.export(predict, params, (np.zeros((1, 64), np.float32),), exported[0])
    state = nnx.state(digits_classifier.Classifier(rngs=nnx.Rngs(0)), nnx.Param)
    with pytest.raises(TypeError, match="nnx.to_pure_dict"):
        serve.export(predict, state, (np.zeros((1, 64), np.float32),), exported[0].parent / "2")


def test_gradients_flow_through_an_artifact_exported_with_vjp_order_1(classifier, tmp_path):
    predict, params, _ = classifier
    serve.export(predict, params, (np.zeros((1, 64), np.float32),), tmp_path / "grad", vjp_order=1)
    loaded = serve.load(tmp_path / "grad")
    x = _inputs(3)

    def loss(f):
        return lambda x: jnp.sum(f(x) ** 2)

    np.testing.assert_allclose(jax.grad(loss(loaded))(x), jax.grad(loss(lambda x: predict(params, x)))(x),
                               rtol=1e-6, atol=1e-7)


def test_bucket_sizes_are_powers_of_two_up_to_the_maximum():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert bucket_sizes(48) == [1, 2, 4, 8, 16, 32, 48]


def test_the_batcher_returns_each_request_its_own_rows_under_concurrency():
    calls, gate, submitted = [], threading.Event(), threading.Semaphore(0)

    def model(batch):
        gate.wait(timeout=30)  # hold the first call until every request is queued behind it
        calls.append(len(batch))
        return batch * 2.0

    batcher = DynamicBatcher(model, max_batch_size=8, batch_timeout=0.01, allowed_batch_sizes=[2, 4, 8])
    results, errors = {}, []

    def client(i):
        rows = np.full((1 + i % 3, 2), float(i))
        try:
            future = batcher.submit(rows)
            submitted.release()
            results[i] = (rows, future.result(timeout=30))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(24)]
    for thread in threads:
        thread.start()
    assert all(submitted.acquire(timeout=30) for _ in threads)
    gate.set()
    for thread in threads:
        thread.join(timeout=60)
    batcher.close()
    assert not errors and len(results) == 24
    for rows, outputs in results.values():
        np.testing.assert_array_equal(outputs, rows * 2.0)
    # 48 rows queued at once go in full calls of up to 8 rows: far fewer calls than requests.
    assert sum(batcher.batch_sizes.values()) == len(calls) <= 24 // 2
    assert all(size <= 8 for size in batcher.batch_sizes) and set(calls) <= {2, 4, 8}  # padded
    with pytest.raises(ValueError, match="between 1 and 8 rows"):
        DynamicBatcher(model, max_batch_size=8).submit(np.zeros((9, 2)))
    with pytest.raises(ValueError, match="end with max_batch_size=8"):
        DynamicBatcher(model, max_batch_size=8, allowed_batch_sizes=[1, 4])


def test_a_failing_model_fails_only_its_batch_and_the_batcher_keeps_going():
    state = {"fail": True}

    def model(batch):
        if state["fail"]:
            raise RuntimeError("boom")
        return batch

    batcher = DynamicBatcher(model, max_batch_size=4, batch_timeout=0.0)
    with pytest.raises(RuntimeError, match="boom"):
        batcher.submit(np.ones((1, 2))).result(timeout=30)
    state["fail"] = False
    np.testing.assert_array_equal(batcher.submit(np.ones((2, 2))).result(timeout=30), np.ones((2, 2)))
    batcher.close()
