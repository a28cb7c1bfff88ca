"""The OpenAI-compatible server, called with the real `openai` client.

Every server runs on a free localhost port, started and stopped by its test module;
every client loop is bounded in requests and in time.
"""

import concurrent.futures
import http.client
import json
import os
import socket
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import openai
import pytest
from conftest import ROOT, stop_process

import stacklib.nn as nnx
from stacklib import http as stack_http
from stacklib import llm as stack_llm
from stacklib.infer import LLM, SamplingParams
from stacklib.infer.serve import create_app

NAME = "stdlib-bytes"
CLIENTS, WAIT = 64, 120.0


@pytest.fixture(scope="module")
def llm():
    return LLM(NAME, max_num_seqs=8, block_size=4)


@pytest.fixture(scope="module")
def server(llm):
    reference = LLM(NAME, max_num_seqs=8, block_size=4)  # generate() on its own engine, same programs
    with stack_http.Server(create_app(llm)) as running:
        running.reference = reference
        yield running


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=WAIT)


def _greedy_text(server, prompt, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return server.reference.generate(prompt, params)[0].outputs[0]


def test_completions_greedy_equal_llm_generate_with_usage(server, client):
    expected = _greedy_text(server, "def main(", 20)
    response = client.completions.create(model=NAME, prompt="def main(", max_tokens=20, temperature=0)
    choice = response.choices[0]
    assert (choice.text, choice.finish_reason) == (expected.text, expected.finish_reason)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (9, len(expected.token_ids))
    assert response.usage.total_tokens == 9 + len(expected.token_ids)


def test_greedy_through_the_server_is_the_same_with_prefix_caching_on_and_off(server, client):
    shared = "import os\nimport sys\n\n\ndef main("
    prompts = [shared + "):", shared + "argv", shared]
    off = LLM(NAME, max_num_seqs=8, block_size=4, enable_prefix_caching=False)
    with stack_http.Server(create_app(off)) as uncached:
        other = openai.OpenAI(base_url=f"{uncached.url}/v1", api_key="unused", max_retries=0, timeout=WAIT)
        for prompt in prompts:
            expected = _greedy_text(server, prompt, 24).text
            for api in (client, other):
                response = api.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0)
                assert response.choices[0].text == expected


def test_completion_logprobs_are_the_engines(server, client):
    expected = server.reference.generate("def ", SamplingParams(temperature=0, max_tokens=6, logprobs=2))
    expected = expected[0].outputs[0]
    response = client.completions.create(model=NAME, prompt="def ", max_tokens=6, temperature=0, logprobs=2)
    logprobs = response.choices[0].logprobs
    assert "".join(logprobs.tokens) == response.choices[0].text == expected.text
    chosen = [step[t].logprob for t, step in zip(expected.token_ids, expected.logprobs, strict=True)]
    assert logprobs.token_logprobs == pytest.approx(chosen)
    assert all(len(top) >= 1 for top in logprobs.top_logprobs)


def test_streamed_completion_joins_to_the_same_text_and_ends_with_done(server, client):
    expected = _greedy_text(server, "import os\n", 24)
    stream = client.completions.create(model=NAME, prompt="import os\n", max_tokens=24, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    connection = http.client.HTTPConnection(server.host, server.port, timeout=WAIT)
    connection.request("POST", "/v1/completions", json.dumps(
        {"model": NAME, "prompt": "x", "max_tokens": 3, "temperature": 0, "stream": True}),
        {"Content-Type": "application/json"})
    raw = connection.getresponse().read().decode()
    assert raw.rstrip().endswith("data: [DONE]") and raw.count("data: ") >= 2


def test_a_batch_of_prompts_gets_one_choice_per_prompt_and_completion_streamed_or_not(server, client):
    prompts, n = ["def ", "import os\n", "class "], 2
    expected = [_greedy_text(server, prompt, 8).text for prompt in prompts]
    response = client.completions.create(model=NAME, prompt=prompts, max_tokens=8, temperature=0, n=n)
    assert [c.index for c in response.choices] == list(range(len(prompts) * n))
    assert [c.text for c in response.choices] == [text for text in expected for _ in range(n)]
    assert response.usage.prompt_tokens == sum(len(prompt) for prompt in prompts)
    as_token_ids = [list(prompt.encode()) for prompt in prompts]
    response = client.completions.create(model=NAME, prompt=as_token_ids, max_tokens=8, temperature=0)
    assert [c.text for c in response.choices] == expected
    streamed = [""] * len(prompts)
    for chunk in client.completions.create(model=NAME, prompt=prompts, max_tokens=8, temperature=0,
                                           stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == expected


def test_a_batch_of_prompts_enters_the_engine_together_and_shares_its_steps(server, client, llm):
    engine = llm.llm_engine
    _wait_until_idle(engine)
    before, max_tokens, prompts = engine.num_steps, 8, ["def ", "import os\n", "class "]
    response = client.completions.create(model=NAME, prompt=prompts, n=2, max_tokens=max_tokens,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in response.choices] == ["length"] * 6
    # One step pre-fills the 6 sequences and samples their first tokens; each later step decodes
    # one more token for all of them. Admitted one prompt after another, they take more steps.
    assert engine.num_steps - before == max_tokens


def _wait_until_idle(engine):
    deadline = time.monotonic() + WAIT
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.has_unfinished_requests()


def test_chat_completions_stream_and_not_use_the_chat_template(server, client):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def f("}]
    prompt = "<|system|>\nYou write Python.\n<|user|>\ndef f(\n<|assistant|>\n"
    expected = _greedy_text(server, prompt, 16)
    response = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0)
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].message.role == "assistant"
    assert response.usage.prompt_tokens == len(prompt)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected.text


def test_models_health_seeds_and_vllm_extras(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    connection = http.client.HTTPConnection(server.host, server.port, timeout=WAIT)
    connection.request("GET", "/health")
    assert connection.getresponse().status == 200
    kwargs = dict(model=NAME, prompt="class ", max_tokens=12, temperature=0.8, seed=3, n=2)
    first, second = (client.completions.create(**kwargs) for _ in range(2))
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, n=2)
    expected = server.reference.generate("class ", params)
    assert [c.text for c in first.choices] == [c.text for c in expected[0].outputs]
    response = client.completions.create(model=NAME, prompt="x", max_tokens=30, temperature=0,
                                         extra_body={"min_tokens": 30, "ignore_eos": True})
    assert response.usage.completion_tokens == 30


def _post(server, body: bytes, path: str = "/v1/completions"):
    connection = http.client.HTTPConnection(server.host, server.port, timeout=WAIT)
    connection.request("POST", path, body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, json.loads(response.read())


@pytest.mark.parametrize("body, status, param, message", [
    (b"{not json", 400, None, "not valid JSON"),
    (json.dumps({"model": NAME}).encode(), 400, "prompt", "prompt"),
    (json.dumps({"model": NAME, "prompt": "x", "temperature": -1}).encode(), 400, "temperature",
     "non-negative"),
    (json.dumps({"model": NAME, "prompt": "x" * 100, "max_tokens": 50}).encode(), 400, "max_tokens",
     "maximum context length is 128 tokens"),
    (json.dumps({"model": NAME, "prompt": "x" * 200, "max_tokens": 1}).encode(), 400, "prompt", "Shorten"),
    (json.dumps({"model": "gpt-4", "prompt": "x"}).encode(), 404, "model", "does not exist"),
    (json.dumps({"model": NAME, "prompt": ["x", 1]}).encode(), 400, "prompt", "a list of strings"),
    (json.dumps({"model": NAME, "prompt": [[1, 2], []]}).encode(), 400, "prompt", "empty"),
    (json.dumps({"model": NAME, "prompt": ["ok", "x" * 200], "max_tokens": 1}).encode(), 400, "prompt",
     "Shorten"),
])
def test_bad_requests_get_vllm_error_bodies_and_the_server_keeps_serving(server, client, llm, body, status,
                                                                        param, message):
    got, payload = _post(server, body)
    assert got == status and set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["code"] == status and payload["error"]["param"] == param
    assert message in payload["error"]["message"], payload
    assert not llm.llm_engine.has_unfinished_requests()  # nothing of a refused batch stays queued
    assert client.completions.create(model=NAME, prompt="ok", max_tokens=2, temperature=0).choices[0].text


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", {"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": "many"}, "n"),  # pydantic's type check, not the engine's
    ("/v1/completions", {"top_p": 0}, "top_p"),
    ("/v1/completions", {"top_k": -2}, "top_k"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/completions", {"seed": -1}, "seed"),
    ("/v1/completions", {"stop": ["\n", ""]}, "stop"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"stop_token_ids": [256], "min_tokens": 1}, "stop_token_ids"),  # past the vocab
    ("/v1/completions", {"prompt": [65, 300]}, "prompt"),
    ("/v1/completions", {"prompt": "\ud800"}, "prompt"),  # a lone surrogate: not text
    ("/v1/chat/completions", {"temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"min_tokens": 20, "max_completion_tokens": 10}, "min_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 200}]}, "messages"),
    ("/v1/chat/completions", {"max_tokens": 200}, "max_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": 200}, "max_completion_tokens"),
])
def test_each_refused_field_is_the_error_param(server, path, fields, param):
    body = {"model": NAME, "prompt": "x"} if path == "/v1/completions" else {"model": NAME, "messages": CHAT}
    status, payload = _post(server, json.dumps({**body, **fields}).encode(), path)
    assert (status, payload["error"]["param"]) == (400, param), payload
    connection = http.client.HTTPConnection(server.host, server.port, timeout=WAIT)
    connection.request("GET", "/health")
    assert connection.getresponse().status == 200  # the engine was not touched


def test_the_openai_client_raises_its_own_errors_for_them(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=NAME, prompt="x", temperature=-0.5)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])


def test_a_client_that_disconnects_mid_stream_is_aborted_and_others_are_served(server, client, llm):
    sock = socket.create_connection((server.host, server.port), timeout=WAIT)
    body = json.dumps({"model": NAME, "prompt": "a", "max_tokens": 120, "temperature": 0, "stream": True,
                       "ignore_eos": True})
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    received = b""
    while b"data: " not in received:  # the headers may arrive before the first event
        chunk = sock.recv(4096)
        assert chunk, f"the server closed the stream before its first event: {received!r}"
        received += chunk
    sock.close()
    deadline = time.monotonic() + WAIT
    while llm.llm_engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not llm.llm_engine.has_unfinished_requests()  # aborted: its blocks are back in the pool
    assert client.completions.create(model=NAME, prompt="ok", max_tokens=2, temperature=0).choices[0].text


def test_64_concurrent_clients_all_get_complete_greedy_answers(server, client):
    prompts = [f"x{i} = " for i in range(CLIENTS)]
    expected = [o.outputs[0].text for o in server.reference.generate(
        prompts, SamplingParams(temperature=0, max_tokens=16))]
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(client.completions.create, model=NAME, prompt=p, max_tokens=16, temperature=0)
                   for p in prompts]
        texts = [f.result(timeout=WAIT).choices[0].text for f in futures]
    assert texts == expected
    assert time.monotonic() - start < WAIT


def _utf8_bigram_model():
    """A one-layer Transformer whose next byte depends on the last one only: a bigram table.

    The byte-level zoo model rarely writes a character of several bytes, so this one is built
    to: after an ASCII byte or a whole character it starts "é" (2 bytes), "→" (3) or "😀" (4)
    with probability 0.2 each, and it sometimes breaks one off ("\xc3x", "\xe2\x86y") or writes
    0xFF, which is never UTF-8. The attention and MLP write nothing (zero output projections),
    so the residual stream is the one-hot embedding of the last token, which the final RMSNorm
    scales to 16 (= sqrt(d_model)); the output projection is the log-probabilities over 16.
    """
    follow = {0xC3: {0xA9: 0.9, ord("x"): 0.1}, 0xE2: {0x86: 1.0}, 0x86: {0x92: 0.9, ord("y"): 0.1},
              0xF0: {0x9F: 1.0}, 0x9F: {0x98: 1.0}, 0x98: {0x80: 1.0}}
    start = {0xC3: 0.2, 0xE2: 0.2, 0xF0: 0.2, ord("a"): 0.2, ord(" "): 0.1, 0xFF: 0.05, ord("\n"): 0.05}
    logp = np.full((256, 256), -30.0, np.float32)  # (last byte, next byte)
    for last in range(256):
        for following, p in follow.get(last, start).items():
            logp[last, following] = np.log(p)
    config = stack_llm.Config(d_model=256, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=8, d_ff=8)
    model = stack_llm.Transformer(config, rngs=nnx.Rngs(0))
    layer = model.layers[0]
    model.embed_tokens.embedding.value = jnp.eye(256)
    layer.self_attn.o_proj.kernel.value = jnp.zeros_like(layer.self_attn.o_proj.kernel.value)
    layer.mlp.down_proj.kernel.value = jnp.zeros_like(layer.mlp.down_proj.kernel.value)
    model.lm_head.kernel.value = jnp.asarray(logp / 16)
    return model


@pytest.fixture(scope="module")
def utf8_client():
    # Small buckets: this model compiles in seconds, and a batch of 2 prompts x n=2 fits.
    bigram = LLM(_utf8_bigram_model(), max_num_seqs=4, block_size=4, max_num_batched_tokens=16)
    with stack_http.Server(create_app(bigram, "utf8")) as running:
        yield openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=WAIT)


def _split_characters(text):
    """The characters of `text` that took several tokens: with bytes as tokens, every non-ASCII one."""
    return {c for c in text if ord(c) > 127 and c != "\ufffd"}  # U+FFFD: bytes that were not UTF-8


@pytest.mark.parametrize("stop", [None, ["é😀"], ["\n😀", "→ "]])
def test_seeded_completion_streams_add_up_to_the_text_with_multi_byte_characters_and_stops(utf8_client, stop):
    kwargs = dict(model="utf8", prompt=["é → 😀 ", "naïve"], n=2, max_tokens=40, temperature=1.0, seed=7,
                  stop=stop)
    whole = utf8_client.completions.create(**kwargs)
    streamed, finish = [""] * 4, [None] * 4
    for chunk in utf8_client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            assert finish[choice.index] is None  # nothing after a choice's last chunk
            streamed[choice.index] += choice.text
            finish[choice.index] = choice.finish_reason
    texts = [c.text for c in whole.choices]
    assert streamed == texts
    assert finish == [c.finish_reason for c in whole.choices]
    assert all(_split_characters(text) for text in texts)  # so the test cannot pass vacuously
    assert any("\ufffd" in text for text in texts)  # and broken characters stream as they end
    if stop:
        assert {c.stop_reason for c in whole.choices} - {None} <= set(stop) and "stop" in finish
        assert not any(s in text for s in stop for text in texts)


def test_seeded_chat_streams_add_up_to_the_message_with_multi_byte_characters(utf8_client):
    kwargs = dict(model="utf8", messages=[{"role": "user", "content": "é → 😀?"}], n=2, max_tokens=30,
                  temperature=1.0, seed=3)
    whole = utf8_client.chat.completions.create(**kwargs)
    streamed = [""] * 2
    for chunk in utf8_client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    texts = [c.message.content for c in whole.choices]
    assert streamed == texts and all(_split_characters(text) for text in texts)


def test_the_command_line_server_starts_serves_and_stops():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "stacklib.infer.serve", "--model", NAME, "--port", str(port),
               "--max-num-seqs", "1"]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               timeout=10)
        deadline = time.monotonic() + WAIT
        while True:
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.5)
        assert models.data[0].id == NAME
        response = client.completions.create(model=NAME, prompt="def ", max_tokens=4, temperature=0)
        assert response.choices[0].text
    finally:
        stop_process(process)
