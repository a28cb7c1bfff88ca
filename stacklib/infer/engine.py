"""The engine: requests in, tokens out, one scheduler step at a time; and `LLM`, its front.

    from stacklib.infer import LLM, SamplingParams
    llm = LLM("stdlib-bytes", max_num_seqs=16, block_size=4)
    outputs = llm.generate(["def main(", "import os\n"], SamplingParams(temperature=0, max_tokens=32))
    outputs[0].outputs[0].text

`LLMEngine.step()` asks the scheduler what to run, pre-fills the admitted prompts,
decodes one token for every running sequence in one batched call, samples on the host,
checks each sequence's stop conditions, frees finished sequences' blocks and returns a
`RequestOutput` for every request that advanced. `LLM.generate` adds all its prompts
and steps until they are done; the OpenAI server (serve.py) runs the same `step()` in a
loop shared by all clients.

Mirrors `vllm.LLM` and `vllm.v1.engine.LLMEngine` (`add_request`, `step`,
`abort_request`, `has_unfinished_requests`). Differences: `add_requests` queues a batch all
or none (vLLM adds a batch's prompts one by one); one process (vLLM runs the
engine core in its own process); the model is a zoo name, a folder, or a `Transformer`; the
cache size comes from `num_gpu_blocks_override` or from `max_num_seqs` full-length sequences,
not from profiling free accelerator memory. A model folder is a Hugging Face checkpoint
(config.json + safetensors, read by `stacklib.llm.hf.load_pretrained`, with its tokenizer.json)
or one in the zoo's format (params + config; a training checkpoint's optimizer state is not read).

The tokenizer is the byte-level `ByteTokenizer` of the book's own models, or a model's real
BPE tokenizer (`stacklib.llm.hf_tokenizer.HFTokenizer`): a folder's tokenizer.json, or one
given as `LLM(model, tokenizer=...)`. Generation stops on any of the tokenizer's
`eos_token_ids` (a chat model ends a turn with its own token, `<|im_end|>`, `<|eot_id|>`).
A folder without tokenizer.json is refused, unless its model has 256 token ids: then it is a
byte-level model, and the `ByteTokenizer` serves it.
"""

from __future__ import annotations

import itertools
import os
import pathlib
from typing import TYPE_CHECKING, Any

import numpy as np

from stacklib.infer.config import EngineConfig
from stacklib.infer.detokenizer import IncrementalDetokenizer
from stacklib.infer.model_runner import ModelRunner
from stacklib.infer.outputs import CompletionOutput, Logprob, RequestOutput
from stacklib.infer.quantization import quantize_weights
from stacklib.infer.sampling_params import InvalidRequestError, SamplingParams, log_softmax, sample_token
from stacklib.infer.scheduler import Scheduler, Sequence, SequenceStatus
from stacklib.llm.model import Transformer
from stacklib.llm.tokenizer import ByteTokenizer

if TYPE_CHECKING:  # imported when a folder needs it: the book's byte models need no tokenizers library
    from stacklib.llm.hf_tokenizer import HFTokenizer

    Tokenizer = ByteTokenizer | HFTokenizer


class _Request:
    """A request's sequences (one per `n`) and the completions reported for them."""

    def __init__(self, request_id, prompt, prompt_token_ids, params, seqs, tokenizer):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.params, self.seqs = params, seqs
        self.detokenizers = [IncrementalDetokenizer(params.stop, params.min_tokens, tokenizer) for _ in seqs]
        self.completions = [CompletionOutput(i, "", [], 0.0 if params.logprobs is not None else None,
                                             [] if params.logprobs is not None else None)
                            for i in range(len(seqs))]

    @property
    def finished(self) -> bool:
        return all(c.finished() for c in self.completions)

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [CompletionOutput(**vars(c)) for c in self.completions], self.finished,
                             num_cached_tokens=self.seqs[0].num_cached_tokens)


class LLMEngine:
    """Continuous-batching generation over a paged KV cache (see the module docstring).

    Args:
      model: a chapter-12 `Transformer`.
      tokenizer: default `ByteTokenizer()`; or an `HFTokenizer`.
      config: the engine's settings (default `EngineConfig()`).

    Raises:
      ValueError: settings that cannot work with this model (`EngineConfig.resolve`), or a
        tokenizer with more ids than the model has embeddings.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer | None = None,
                 config: EngineConfig | None = None):
        self.config = (config or EngineConfig()).resolve(model.config.max_seq_len)
        self.max_model_len = self.config.max_model_len
        self.tokenizer = tokenizer or ByteTokenizer()
        if self.tokenizer.vocab_size > model.config.vocab_size:  # a model may embed more ids (Qwen pads)
            raise ValueError(f"The tokenizer has {self.tokenizer.vocab_size} token ids but the model embeds "
                             f"only vocab_size={model.config.vocab_size}: they are not a pair. Use the "
                             "tokenizer of the model's own folder.")
        if self.config.quantization:
            model = quantize_weights(model, self.config.quantization)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.scheduler = Scheduler(self.config, self.eos_token_ids)
        self.runner = ModelRunner(model, num_blocks=self.config.num_gpu_blocks_override,
                                  block_size=self.config.block_size, max_model_len=self.max_model_len,
                                  max_num_seqs=self.config.max_num_seqs,
                                  max_num_batched_tokens=self.config.max_num_batched_tokens)
        self.requests: dict[str, _Request] = {}
        self._unseeded = itertools.count()
        self.num_steps = 0

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Refuse a request that cannot run here, naming the field at fault as OpenAI's `param`.

        Raises:
          InvalidRequestError: an empty or too long prompt, prompt or stop token ids outside
            the vocabulary, or `max_tokens` past the context.
        """
        P, V = len(prompt_token_ids), self.tokenizer.vocab_size
        if P == 0:
            raise InvalidRequestError("The prompt is empty; give at least one token.", param="prompt")
        if P >= self.max_model_len:
            raise InvalidRequestError(
                f"The prompt has {P} tokens; this model's maximum context length is {self.max_model_len} "
                "tokens, and at least one must be left to generate. Shorten the prompt.", param="prompt")
        if params.max_tokens is not None and P + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{P + params.max_tokens} tokens ({P} in the prompt, {params.max_tokens} in the completion). "
                f"Reduce max_tokens to at most {self.max_model_len - P}.", param="max_tokens")
        if any(not 0 <= t < V for t in prompt_token_ids):
            raise InvalidRequestError(f"Prompt token ids must lie in [0, {V}).", param="prompt")
        if any(not 0 <= t < V for t in params.stop_token_ids):  # sampling indexes the logits with them
            raise InvalidRequestError(f"stop_token_ids must lie in [0, {V}), got {params.stop_token_ids}.",
                                      param="stop_token_ids")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Queue a prompt (text or token ids).

        Raises:
          InvalidRequestError: the prompt or params cannot run here (`param` names the field).
          ValueError: `request_id` is already in use.
        """
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        text = prompt if isinstance(prompt, str) else None
        try:
            ids = [int(t) for t in (self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt)]
        except UnicodeEncodeError as error:  # a lone surrogate, which JSON's "\ud800" can carry
            raise InvalidRequestError(f"The prompt is not valid Unicode text: {error.reason} at character "
                                      f"{error.start}.", param="prompt") from None
        self._validate(ids, params)
        seqs = []
        for index in range(params.n):
            unseeded = (self.config.seed, next(self._unseeded), 1)
            seed = (params.seed, index) if params.seed is not None else unseeded
            seq = Sequence(f"{request_id}/{index}", request_id, index, ids, params,
                           np.random.default_rng(list(seed)))
            seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = _Request(request_id, text, ids, params, seqs, self.tokenizer)

    def add_requests(self, requests: list[tuple[str, str | list[int], SamplingParams]]) -> None:
        """Queue several (request_id, prompt, params) at once, all or none.

        A batch is one answer: when a prompt is refused, the ones queued before it are taken
        out again, so no later step runs part of a batch its caller was told had failed.

        Raises:
          InvalidRequestError, ValueError: as `add_request`; then none of `requests` is queued.
        """
        queued = []
        try:
            for request_id, prompt, params in requests:
                self.add_request(request_id, prompt, params)
                queued.append(request_id)
        except Exception:
            for request_id in queued:
                self.abort_request(request_id)
            raise

    def abort_request(self, request_id: str) -> None:
        """Stop a request (a client went away): its sequences leave and their blocks are freed."""
        request = self.requests.pop(request_id, None)
        for seq in request.seqs if request else []:
            if seq.status is not SequenceStatus.FINISHED:
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _append(self, seq: Sequence, num_new: int, logits: np.ndarray) -> None:
        """Sample seq's next token from `logits`, report it, and stop seq at a stop string."""
        params, request = seq.params, self.requests[seq.request_id]
        completion = request.completions[seq.index]
        token = sample_token(logits, params, seq.rng, len(seq.output_token_ids), self.eos_token_ids)
        stop = self.scheduler.update_from_output(seq, num_new, token)  # eos, stop ids, lengths
        completion.token_ids = list(seq.output_token_ids)
        if params.logprobs is not None:
            logp = log_softmax(logits)
            ranks = np.argsort(-logp, kind="stable")
            top = {int(t): Logprob(float(logp[t]), r + 1, self.tokenizer.decode([t]))
                   for r, t in enumerate(ranks[: params.logprobs])}
            top.setdefault(token, Logprob(float(logp[token]), int(np.flatnonzero(ranks == token)[0]) + 1,
                                          self.tokenizer.decode([token])))
            completion.logprobs.append(top)
            completion.cumulative_logprob += float(logp[token])
        # The text grows by whole characters and holds back what a stop string could still take
        # back, so a stream of its differences adds up to the final text (detokenizer.py).
        detokenizer = request.detokenizers[seq.index]
        stop_string = detokenizer.update([token], final=stop is not None)
        if stop_string is not None:  # a stop string ends it, even on its last token (as in vLLM)
            if stop is None:
                self.scheduler.finish(seq)
            stop = ("stop", stop_string)
        completion.text = detokenizer.output_text(finished=stop is not None)
        if stop is not None:
            completion.finish_reason, completion.stop_reason = stop

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return the outputs of the requests that advanced."""
        work = self.scheduler.schedule()
        touched = set()
        if work.scheduled:  # one forward pass: every decode and prefill chunk of the step
            tables = self.scheduler.kv_cache.block_tables
            logits = self.runner.execute([
                (seq.tokens[seq.num_computed_tokens:seq.num_computed_tokens + n], seq.num_computed_tokens,
                 tables[seq.seq_id]) for seq, n in work.scheduled])
            for (seq, n), row in zip(work.scheduled, logits, strict=True):
                if seq.num_computed_tokens + n < seq.num_tokens:  # a prompt chunk: nothing to sample yet
                    self.scheduler.update_from_output(seq, n, None)
                else:
                    self._append(seq, n, row)
                    touched.add(seq.request_id)
        self.num_steps += 1
        outputs = []
        for request_id in sorted(touched, key=list(self.requests).index):
            request = self.requests[request_id]
            outputs.append(request.output())
            if request.finished:
                del self.requests[request_id]
        return outputs

    def kv_cache_usage(self) -> dict[str, int]:
        """Slots held by running sequences and the tokens whose keys and values fill them.

        Between steps a running sequence's cache holds its computed tokens: all but the last
        one sampled, which the next step writes, or the prompt chunks pre-filled so far.
        """
        running = self.scheduler.running
        tokens = sum(s.num_computed_tokens for s in running)
        slots = self.scheduler.kv_cache.num_used_slots()
        return {"slots": slots, "tokens": tokens, "sequences": len(running)}


def _load_tokenizer(path: str | os.PathLike, vocab_size: int) -> Tokenizer:
    """The tokenizer of a model folder: its tokenizer.json, or bytes for a model of 256 ids.

    Raises:
      FileNotFoundError: no tokenizer.json, and the model is not byte-level.
    """
    from stacklib.llm.hf_tokenizer import HFTokenizer

    if (pathlib.Path(path) / "tokenizer.json").is_file() or vocab_size != ByteTokenizer.vocab_size:
        return HFTokenizer.from_pretrained(path)  # FileNotFoundError names the missing file and the fix
    return ByteTokenizer()


def load_model(model: str | os.PathLike | Transformer,
               tokenizer: str | os.PathLike | Tokenizer | None = None) -> tuple[Transformer, Tokenizer]:
    """The model and tokenizer `LLM(model, tokenizer=...)` serves.

    Args:
      model: a `Transformer`; a folder holding a Hugging Face checkpoint (config.json and
        *.safetensors, `stacklib.llm.hf.load_pretrained`) or a model in the zoo's format;
        or a zoo name (`stacklib.llm.pretrained`).
      tokenizer: a tokenizer, or a folder holding tokenizer.json; default: the model folder's
        (see `_load_tokenizer`), else the `ByteTokenizer` of the book's models.

    Raises:
      FileNotFoundError: a folder that holds neither format, or no tokenizer for a BPE model.
      ValueError: the checkpoint cannot be read into our model (the message names the tensor or key).
    """
    folder = None
    if not isinstance(model, Transformer):
        from stacklib.llm import pretrained, zoo

        folder = pathlib.Path(model)
        if (folder / "config.json").is_file():  # a Hugging Face checkpoint
            from stacklib.llm import hf

            model = hf.load_pretrained(folder)[1]
        elif folder.is_dir():
            model = zoo.load_model_dir(folder)
        else:
            model, folder = pretrained(str(model))[0], None
    if tokenizer is None:
        return model, ByteTokenizer() if folder is None else _load_tokenizer(folder, model.config.vocab_size)
    if isinstance(tokenizer, (str, os.PathLike)):
        from stacklib.llm.hf_tokenizer import HFTokenizer

        tokenizer = HFTokenizer.from_pretrained(tokenizer)
    return model, tokenizer


class LLM:
    """Offline generation, like `vllm.LLM`: `LLM(model, **settings).generate(prompts, sampling_params)`.

    Args:
      model: a zoo name (`stacklib.llm.pretrained`), a folder holding a Hugging Face checkpoint
        (config.json, *.safetensors, tokenizer.json) or a model saved in the zoo's format, or a
        chapter-12 `Transformer` (see `load_model`).
      tokenizer: a tokenizer (`HFTokenizer`, `ByteTokenizer`) or a folder with tokenizer.json;
        default: the model folder's, else bytes.
      **settings: `EngineConfig`'s fields (`max_num_seqs=8`, `block_size=4`, `quantization="int8"`…).

    Raises:
      TypeError: an unknown setting (the message lists the known ones).
      ValueError: a setting out of range, or one that cannot work with this model.
      FileNotFoundError: a model folder without a model, or without the tokenizer it needs.
    """

    def __init__(self, model: str | os.PathLike | Transformer = "stdlib-bytes", *,
                 tokenizer: str | os.PathLike | Tokenizer | None = None, **settings: Any):
        config = EngineConfig.from_kwargs(**settings)  # checked before the model is loaded
        named = isinstance(model, (str, os.PathLike))
        self.model_name = os.path.basename(os.path.normpath(model)) if named else "model"
        self.llm_engine = LLMEngine(*load_model(model, tokenizer), config)
        self.llm_engine.runner.warmup()
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in the order of `prompts`.

        Args:
          prompts: a string, a list of strings, or `{"prompt_token_ids": [...]}` dicts.
          sampling_params: one `SamplingParams` for all, or a list (one per prompt);
            default `SamplingParams()` (vLLM's: temperature 1, 16 tokens).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts; "
                             "give one, or one per prompt.")
        engine, ids = self.llm_engine, [str(next(self._ids)) for _ in prompts]
        prompts = [prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt for prompt in prompts]
        engine.add_requests(list(zip(ids, prompts, params, strict=True)))
        finished = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[i] for i in ids]

