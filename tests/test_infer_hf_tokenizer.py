"""A real BPE tokenizer and chat template, and a Hugging Face checkpoint folder served by the engine.

Offline: the tokenizer is a small byte-level BPE trained here, in under a second, on a few
hundred KB of the Python standard library's source, saved as tokenizer.json with a
tokenizer_config.json whose chat template is tests/data/tokenizer/chat_template.jinja (ChatML,
as Qwen's); the model is a tiny Qwen3-style `Transformer` with random weights, saved with
`stacklib.llm.hf.save_pretrained`. One server, started from the command line, serves the folder.
"""

import json
import os
import pathlib
import random
import shutil
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import jinja2
import numpy as np
import openai
import pytest
import tokenizers
from conftest import ROOT, stop_process
from tokenizers import decoders, models, pre_tokenizers, trainers

import stacklib.nn as nnx
import stacklib.quant as qwix
from stacklib import llm as stack_llm
from stacklib.infer import LLM, SamplingParams
from stacklib.infer.detokenizer import IncrementalDetokenizer
from stacklib.infer.engine import load_model
from stacklib.llm import data, hf
from stacklib.llm.hf_tokenizer import HFTokenizer, render_chat_template

TEMPLATE = (ROOT / "tests" / "data" / "tokenizer" / "chat_template.jinja").read_text()
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB, MODEL_VOCAB = 400, 416  # the model embeds a few ids more than the tokenizer has, as Qwen's do
SETTINGS = dict(max_num_seqs=2, block_size=4, max_num_batched_tokens=8)  # two token buckets: compiles fast
MULTI_BYTE = "é → 😀 naïve ∑"
CHAT = [{"role": "user", "content": "What does os.path.join do?"}]
WAIT = 120.0


def _train_bpe() -> tokenizers.Tokenizer:
    """A byte-level BPE (GPT-2's and Qwen's kind) of VOCAB ids, on ~300 KB of the standard library."""
    texts, size = [], 0
    for file in sorted(data.stdlib_root().glob("*.py")):
        texts.append(file.read_text(encoding="utf-8", errors="replace"))
        size += len(texts[-1])
        if size > 300_000:
            break
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    return bpe


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> pathlib.Path:
    """A checkpoint folder as the Hub has them: config.json, model.safetensors, tokenizer files."""
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    bpe = _train_bpe()
    bpe.save(str(folder / "tokenizer.json"))
    special = {"eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({**special, "chat_template": TEMPLATE}))
    eos = [bpe.token_to_id("<|im_end|>"), bpe.token_to_id("<|endoftext|>")]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    config = stack_llm.load_config(None, vocab_size=MODEL_VOCAB, d_model=32, n_layers=2, n_heads=4,
                                   n_kv_heads=2, head_dim=16, d_ff=64, max_seq_len=128, seq_len=128,
                                   qk_norm=True, tie_embeddings=True, progress=False)
    hf.save_pretrained(folder, config, stack_llm.Transformer(config, rngs=nnx.Rngs(0)))
    return folder


@pytest.fixture(scope="module")
def tokenizer(folder) -> HFTokenizer:
    return HFTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def model(folder):
    return hf.load_pretrained(folder)[1]


@pytest.fixture(scope="module")
def engine(folder) -> LLM:
    return LLM(folder, **SETTINGS)


@pytest.fixture(scope="module")
def reference(model, tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of 4 tokens each and `stack_llm.generate`'s 12 greedy tokens after each, in one batch."""
    texts = ("import os\n", "def main(argv):\n", MULTI_BYTE)
    prompts = [tokenizer.encode(text)[:4].tolist() for text in texts]
    return prompts, stack_llm.generate(model, np.array(prompts), 12)[:, 4:].tolist()


def _greedy(n: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kwargs)


# -- the tokenizer and the chat template --------------------------------------------------------


def test_the_bpe_round_trips_text_in_fewer_tokens_than_bytes(tokenizer):
    text = (data.stdlib_root() / "textwrap.py").read_text()[:4000] + MULTI_BYTE
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int32 and tokenizer.decode(ids) == text
    assert len(ids) < 0.75 * len(text.encode())  # merges learned from code pack several bytes a token


def test_special_tokens_are_single_ids_and_every_eos_id_is_collected(tokenizer):
    im_start, im_end, end = (tokenizer.tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>",
                                                                           "<|endoftext|>"))
    assert tokenizer.encode("<|im_start|>user").tolist()[0] == im_start
    assert tokenizer.eos_id == im_end and tokenizer.eos_token_ids == {im_end, end}
    assert tokenizer.vocab_size == VOCAB
    assert tokenizer.decode([im_start, *tokenizer.encode("hi")], skip_special_tokens=True) == "hi"
    with pytest.raises(UnicodeEncodeError):
        tokenizer.encode("\ud800")  # a lone surrogate, which JSON can carry


@pytest.mark.parametrize("messages, variables", [
    (CHAT, {}),
    ([{"role": "system", "content": "Be brief."}, *CHAT, {"role": "assistant", "content": "It joins."},
      {"role": "user", "content": MULTI_BYTE}], {}),
    (CHAT, {"enable_thinking": False}),
])
def test_the_chat_template_renders_as_transformers_renders_it(tokenizer, messages, variables):
    from transformers.utils.chat_template_utils import render_jinja_template

    expected = render_jinja_template([messages], chat_template=TEMPLATE, add_generation_prompt=True,
                                     **tokenizer.special_tokens, **variables)[0][0]
    assert tokenizer.apply_chat_template(messages, **variables) == expected
    assert expected.endswith("<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if variables else ""))
    ids = tokenizer.apply_chat_template(messages, tokenize=True, **variables)
    assert ids == tokenizer.encode(expected, add_special_tokens=False).tolist()


def test_the_template_environment_is_transformers(tokenizer):
    # tojson keeps the characters (Jinja's own escapes <, >, & for HTML); raise_exception refuses.
    assert render_chat_template("{{ messages[0] | tojson }}", [{"role": "user", "content": "<é>"}]) == \
        '{"role": "user", "content": "<é>"}'
    with pytest.raises(jinja2.TemplateError, match="A system message must come first"):
        render_chat_template(TEMPLATE, [*CHAT, {"role": "system", "content": "late"}])
    with pytest.raises(ValueError, match="The chat template refused the messages: A system message must"):
        tokenizer.apply_chat_template([*CHAT, {"role": "system", "content": "late"}])
    with pytest.raises(ValueError, match="no chat template"):
        HFTokenizer(tokenizer.tokenizer, eos_token_ids=[0]).apply_chat_template(CHAT)


# -- token ids to text, a step at a time --------------------------------------------------------


def _stream(detokenizer, ids, rng):
    """Feed `ids` in random steps of 1-3 tokens, the last final; the texts shown after each step."""
    shown, at = [], 0
    while at < len(ids):
        step = ids[at:at + rng.randint(1, 3)]
        at += len(step)
        found = detokenizer.update(step, final=at == len(ids))
        shown.append(detokenizer.output_text(finished=found is not None or at == len(ids)))
        if found is not None:
            break
    return shown


def test_subword_streams_never_take_text_back_and_end_as_the_whole_decode(tokenizer):
    rng = random.Random(0)
    text_ids = tokenizer.encode(MULTI_BYTE * 3 + "def f(x):\n    return x\n").tolist()
    split = [i for i in text_ids if "\ufffd" in tokenizer.decode([i])]  # byte tokens of cut characters
    assert split  # so the test cannot pass vacuously
    sequences = [text_ids] + [[rng.randrange(VOCAB) for _ in range(40)] for _ in range(20)]  # with specials
    for ids in sequences:
        shown = _stream(IncrementalDetokenizer(tokenizer=tokenizer), ids, rng)
        assert all(after.startswith(before) for before, after in zip(shown, shown[1:], strict=False))
        assert shown[-1] == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_strings_cut_subword_text_even_inside_a_token(tokenizer):
    ids = tokenizer.encode("def f(x):\n    return x\n\n\nclass A:\n").tolist()
    detokenizer = IncrementalDetokenizer(["\n\n"], tokenizer=tokenizer)
    shown = _stream(detokenizer, ids, random.Random(1))
    assert shown[-1] == "def f(x):\n    return x" and detokenizer.text == shown[-1]


# -- the engine on a checkpoint folder ------------------------------------------------------------


def test_llm_of_a_folder_serves_its_checkpoint_with_its_tokenizer(engine, folder, model, tokenizer):
    assert isinstance(engine.get_tokenizer(), HFTokenizer) and engine.model_name == folder.name
    assert engine.llm_engine.eos_token_ids == tokenizer.eos_token_ids
    ours = nnx.state(model, nnx.Param).flat_state()
    served = dict(engine.llm_engine.runner.params.flat_state())
    assert all(np.array_equal(value.value, served[path].value) for path, value in ours)


def test_greedy_tokens_through_the_engine_equal_plain_generation(engine, tokenizer, reference):
    prompts, expected = reference
    outputs = engine.generate([{"prompt_token_ids": p} for p in prompts], _greedy(12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [o.outputs[0].text for o in outputs] == [tokenizer.decode(e, skip_special_tokens=True)
                                                    for e in expected]
    text = tokenizer.decode(prompts[0])  # a text prompt is encoded with the BPE
    assert engine.generate(text, _greedy(12, ignore_eos=True))[0].outputs[0].token_ids == expected[0]


def test_generation_stops_on_any_of_the_eos_ids(model, tokenizer, reference):
    prompts, expected = reference
    # The latest step at which a prompt's greedy continuation shows a token of the tokenizer's that it
    # had not shown before (random weights also pick the model's padding ids, which no tokenizer has):
    # made the second EOS id, it must end that continuation there.
    firsts = [(p, k) for p, tokens in enumerate(expected) for k in range(12)
              if tokens[k] not in tokens[:k] and tokens[k] < VOCAB]
    p, k = max(firsts, key=lambda pk: pk[1])
    eos = HFTokenizer(tokenizer.tokenizer, eos_token_ids=[tokenizer.eos_id, expected[p][k]])
    stopping = LLM(model, tokenizer=eos, **SETTINGS)  # the same compiled programs as `engine`
    prompt = {"prompt_token_ids": prompts[p]}
    completion = stopping.generate(prompt, _greedy(12))[0].outputs[0]
    assert completion.token_ids == expected[p][:k + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", None)
    assert stopping.generate(prompt, _greedy(12, ignore_eos=True))[0].outputs[0].token_ids == expected[p]


def test_int8_weight_only_serving_of_the_checkpoint_equals_plain_generation_of_it(folder, reference):
    quantized = LLM(folder, quantization="int8", max_num_seqs=1, block_size=4, max_num_batched_tokens=4)
    runner = quantized.llm_engine.runner
    kernels = [leaf for leaf in jax.tree.leaves(runner.params, is_leaf=lambda x: isinstance(x, qwix.QArray))
               if isinstance(leaf, qwix.QArray)]
    assert len(kernels) == 7 * 2 and {k.qvalue.dtype for k in kernels} == {jnp.dtype("int8")}  # 2 layers
    # The engine's paged steps run the quantized model's own forward pass: plain generation of it agrees.
    prompt = reference[0][0]
    expected = stack_llm.generate(nnx.merge(runner.graphdef, runner.params), prompt, 8)[4:].tolist()
    completion = quantized.generate({"prompt_token_ids": prompt}, _greedy(8, ignore_eos=True))[0].outputs[0]
    assert completion.token_ids == expected


def test_a_folder_without_tokenizer_json_is_refused_unless_its_model_is_byte_level(folder, tmp_path, model):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(folder / name, tmp_path / name)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_model(tmp_path)
    config = model.config.replace(vocab_size=256)
    hf.save_pretrained(tmp_path / "bytes", config, stack_llm.Transformer(config, rngs=nnx.Rngs(0)))
    assert isinstance(load_model(tmp_path / "bytes")[1], stack_llm.ByteTokenizer)


def test_a_tokenizer_with_more_ids_than_the_model_embeds_is_refused(model, tokenizer):
    config = model.config.replace(vocab_size=256)
    small = jax.eval_shape(lambda: stack_llm.Transformer(config, rngs=nnx.Rngs(0)))  # refused before use
    with pytest.raises(ValueError, match="has 400 token ids but the model embeds only vocab_size=256"):
        LLM(small, tokenizer=tokenizer)


# -- the OpenAI server, from the command line ----------------------------------------------------


@pytest.fixture(scope="module")
def client(folder, tmp_path_factory):
    """`python -m stacklib.infer.serve --model FOLDER` on a free port, and an openai client of it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path_factory.mktemp("server") / "stderr.txt"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SETTINGS.items()]
    command = [sys.executable, "-m", "stacklib.infer.serve", "--model", str(folder), "--port", str(port),
               *flags]
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                   stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               timeout=WAIT)
        deadline = time.monotonic() + WAIT
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert process.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.25)
        yield client
    finally:
        stop_process(process)


def test_served_greedy_completions_equal_the_engines(client, engine, folder):
    expected = engine.generate("def main(", _greedy(16))[0]
    response = client.completions.create(model=folder.name, prompt="def main(", max_tokens=16, temperature=0)
    assert response.choices[0].text == expected.outputs[0].text
    assert response.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids) < len("def main(")


def test_chat_renders_the_models_template_and_answers_as_the_engine(client, engine, folder, tokenizer):
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=True)
    expected = engine.generate({"prompt_token_ids": prompt}, _greedy(16))[0].outputs[0]
    response = client.chat.completions.create(model=folder.name, messages=CHAT, max_tokens=16, temperature=0)
    assert response.usage.prompt_tokens == len(prompt)
    assert response.choices[0].message.content == expected.text
    thinking_off = client.chat.completions.create(
        model=folder.name, messages=CHAT, max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert thinking_off.usage.prompt_tokens == len(tokenizer.apply_chat_template(CHAT, tokenize=True,
                                                                                enable_thinking=False))


def test_streamed_text_equals_the_whole_text_for_completions_and_chat(client, folder):
    # Sampled at temperature 1 from random weights: byte tokens of cut characters come out mid-stream.
    for api, kwargs, text in (
            (client.completions, dict(prompt=MULTI_BYTE), lambda c: c.text),
            (client.chat.completions, dict(messages=CHAT), lambda c: c.message.content)):
        whole = api.create(model=folder.name, n=2, max_tokens=40, temperature=1.0, seed=5, **kwargs)
        streamed = ["", ""]
        for chunk in api.create(model=folder.name, n=2, max_tokens=40, temperature=1.0, seed=5, stream=True,
                                **kwargs):
            for choice in chunk.choices:
                piece = choice.text if hasattr(choice, "text") else choice.delta.content
                streamed[choice.index] += piece or ""
        assert streamed == [text(c) for c in whole.choices]


def test_messages_the_template_refuses_are_a_400_naming_messages(client, folder):
    with pytest.raises(openai.BadRequestError, match="A system message must come first") as error:
        client.chat.completions.create(model=folder.name,
                                       messages=[*CHAT, {"role": "system", "content": "x"}])
    assert error.value.body["param"] == "messages"
