"""A real sub-word tokenizer and chat template, read from a Hugging Face model folder.

    tokenizer = HFTokenizer.from_pretrained("Qwen3-0.6B/")   # tokenizer.json, tokenizer_config.json, ...
    ids = tokenizer.encode("def f(x):")                        # BPE ids, int32
    tokenizer.decode(ids)                                      # "def f(x):"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    tokenizer.eos_token_ids                                    # generation stops on any of them

An open model ships its tokenizer as files next to its weights:

  tokenizer.json          the whole tokenizer (normalizer, pre-tokenizer, BPE vocabulary and merges,
                          added tokens, decoder), read by the `tokenizers` library (Rust, fast)
  tokenizer_config.json   the special tokens by role (`eos_token`, `bos_token`, ...) and the
                          `chat_template`: a Jinja template that turns a list of messages into
                          the one string the model was fine-tuned on
  generation_config.json  `eos_token_id`: one id or a list (an instruct model often ends a turn
                          with a token other than the document's end); else config.json's

`eos_token_ids` is the union of tokenizer_config's `eos_token` and generation_config's (or
config.json's) `eos_token_id`: the engine stops on any of them, as vLLM does.

The chat template is rendered as transformers' `apply_chat_template` renders it
(`transformers/utils/chat_template_utils.py`): a sandboxed Jinja environment with
`trim_blocks` and `lstrip_blocks`, a `tojson` filter that does not escape HTML, the globals
`raise_exception` and `strftime_now`, the `loopcontrols` extension, and the special tokens
(`bos_token`, `eos_token`, ...) as variables. `add_generation_prompt=True` ends the prompt
with the header of the assistant's turn, so the model's continuation is its answer. The
prompt is then encoded without adding special tokens (the template already wrote them).

Mirrors `transformers.PreTrainedTokenizerFast` (`from_pretrained`, `encode`, `decode`,
`apply_chat_template`, `eos_token_id`). Differences: a template's `{% generation %}` blocks
(assistant masks for training), `tools`, `documents` and `continue_final_message` are not
supported; a list of named templates uses the one named "default"; no padding or truncation,
one text at a time.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
import tokenizers

SPECIAL_TOKEN_ROLES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_content(token: str | dict | None) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    """The template compiled in transformers' environment (see the module docstring)."""
    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes <, >, & for HTML; a prompt wants the characters themselves.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env.from_string(template)


def render_chat_template(template: str, messages: Sequence[dict[str, Any]], *,
                         add_generation_prompt: bool = True, **variables: Any) -> str:
    """`messages` as one prompt string, through the Jinja chat `template`.

    Args:
      template: the model's chat template (tokenizer_config.json's `chat_template`).
      messages: `[{"role": "user", "content": "..."}, ...]`.
      add_generation_prompt: end with the header of the assistant's turn.
      **variables: more template variables: the special tokens, or a model's own switches
        (Qwen3's `enable_thinking=False`).

    Raises:
      jinja2.TemplateError: the template refused the messages (its `raise_exception`), or is broken.
    """
    messages = [dict(message) for message in messages]
    return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **variables)


class HFTokenizer:
    """A `tokenizers.Tokenizer` with the special tokens and chat template of its model folder.

    The same interface as `ByteTokenizer` (`vocab_size`, `eos_id`, `eos_token_ids`, `encode`,
    `decode`), so the engine and the server take either.

    Args:
      tokenizer: the BPE (or other) tokenizer, e.g. `tokenizers.Tokenizer.from_file("tokenizer.json")`.
      chat_template: the Jinja chat template; None when the model has none (a base model).
      eos_token_ids: the ids that end generation; the first is `eos_id`.
      special_tokens: role -> token text (`{"eos_token": "<|im_end|>", "bos_token": None}`),
        passed to the template as variables.

    Raises:
      ValueError: no EOS id, or one outside the vocabulary.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, chat_template: str | None = None,
                 eos_token_ids: Iterable[int] = (), special_tokens: dict[str, str | None] | None = None):
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.special_tokens = dict(special_tokens or {})
        eos = list(dict.fromkeys(int(i) for i in eos_token_ids))  # in order, without repeats
        if not eos:
            raise ValueError("The tokenizer has no EOS token id; give eos_token_ids (tokenizer_config.json's "
                             "eos_token, or generation_config.json's eos_token_id).")
        if not all(0 <= i < self.vocab_size for i in eos):
            raise ValueError(f"EOS token ids {eos} must lie in [0, {self.vocab_size}), the tokenizer's "
                             "vocabulary.")
        self.eos_id, self.eos_token_ids = eos[0], frozenset(eos)

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, added (special) tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        """The ids of `text`, int32; `add_special_tokens` runs the tokenizer's post-processor
        (Llama 3's adds `<|begin_of_text|>`; Qwen's adds nothing).

        Raises:
          UnicodeEncodeError: `text` is not valid Unicode (a lone surrogate), as `str.encode` says.
        """
        text.encode("utf-8")  # the Rust side says only "TextInputSequence must be str"
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids, np.int32)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The text of `ids`; bytes of a cut character become U+FFFD; ids past the vocabulary are skipped."""
        return self.tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                                     skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
                            tokenize: bool = False, **variables: Any) -> str | list[int]:
        """The prompt of a conversation (see `render_chat_template`); its ids if `tokenize`.

        Raises:
          ValueError: the model has no chat template, or the template refused the messages (a
            `jinja2.TemplateError` in transformers); a `UnicodeEncodeError` for a message that is
            not valid Unicode (only with `tokenize`).
        """
        if self.chat_template is None:
            raise ValueError("This model's tokenizer has no chat template (tokenizer_config.json has no "
                             "chat_template): it is not a chat model. Send the text as a completion instead.")
        try:
            text = render_chat_template(self.chat_template, messages,
                                        add_generation_prompt=add_generation_prompt,
                                        **{**self.special_tokens, **variables})
        except jinja2.TemplateError as error:  # a ValueError, as every other way a request can be wrong
            raise ValueError(f"The chat template refused the messages: {error}") from None
        if not tokenize:
            return text
        return self.encode(text, add_special_tokens=False).tolist()

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> HFTokenizer:
        """The tokenizer of a model folder (tokenizer.json; tokenizer_config.json, generation_config.json,
        config.json and chat_template.jinja when present).

        Raises:
          FileNotFoundError: the folder has no tokenizer.json.
          ValueError: no EOS token can be found in the folder's files.
        """
        folder = pathlib.Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json; copy it from the model's repository "
                                    "(with tokenizer_config.json), or pass tokenizer= a folder that has one.")

        def read(name: str) -> dict[str, Any]:
            file = folder / name
            return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}

        tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = read("tokenizer_config.json")
        special = {role: _token_content(config.get(role)) for role in SPECIAL_TOKEN_ROLES}
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            template = {t["name"]: t["template"] for t in template}.get("default")
        if template is None and (folder / "chat_template.jinja").is_file():  # newer transformers save it so
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        eos = [tokenizer.token_to_id(special["eos_token"])] if special["eos_token"] else []
        generation = read("generation_config.json").get("eos_token_id")
        if generation is None:
            generation = read("config.json").get("eos_token_id")
        eos += [generation] if isinstance(generation, int) else list(generation or [])
        return cls(tokenizer, chat_template=template, eos_token_ids=[i for i in eos if i is not None],
                   special_tokens=special)
