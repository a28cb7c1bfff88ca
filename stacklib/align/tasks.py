"""The verifiable task: addition of numbers up to 99, checked by a program.

Post-training needs a task whose answers a program can grade, small enough for a tiny
model to learn on a CPU in minutes. Addition is one: `"37+45="` -> `"82\\n"`. The
newline ends the answer, so a completion is graded by reading up to the first "\\n":

    train, heldout = make_problems(seed=0)                # disjoint: no shared problem
    prompts = encode_prompts([p.prompt for p in train[:4]], tokenizer)   # (4, PROMPT_WIDTH)
    exact_match_reward(prompts=["2+2="], completions=["4\\nxx"], answer=["4"])   # [1.0]
    heldout_accuracy(model, tokenizer, heldout)           # greedy, batched: the chapter's metric

Layout of every sequence (SFT, DPO, GRPO alike): the prompt left-padded with the byte
tokenizer's document separator (id 0) to `PROMPT_WIDTH` tokens, then `ANSWER_TOKENS`
completion tokens (the answer, "\\n", then id-0 padding). A fixed layout means one
compiled shape for every step, and the pretrained model reads leading zeros as "a new
document starts here", which is what they are.

Rewards follow tunix's signature `fn(prompts, completions, **kwargs) -> list[float]`,
one number per completion, with the dataset's other columns (here `answer`) as keyword
arguments repeated once per completion.

Problems are split by unordered pair: if "3+4=" is held out, so is "4+3=", so the
held-out accuracy measures addition, not recall of a commuted twin.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

PAD_ID = 0  # the byte tokenizer's eos_id: the document separator the model was trained with
STOP = "\n"  # ends every answer
STOP_ID = 10
MAX_OPERAND = 99
PROMPT_WIDTH = len(f"{MAX_OPERAND}+{MAX_OPERAND}=")  # 6 tokens
ANSWER_TOKENS = len(str(2 * MAX_OPERAND)) + 1  # 4: up to three digits and the "\n"


@dataclasses.dataclass(frozen=True)
class Problem:
    """`a + b`, with its prompt and its graded answer."""

    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    @property
    def completion(self) -> str:
        """The target text after the prompt: the answer and the stop character."""
        return self.answer + STOP


def make_problems(*, seed: int = 0, heldout: int = 256,
                  max_operand: int = MAX_OPERAND) -> tuple[list[Problem], list[Problem]]:
    """Every `a + b` with 0 <= a, b <= max_operand, split into train and held-out sets.

    The split is by unordered pair {a, b}, seeded; the held-out list has `heldout` problems
    (both orders of a pair when a != b, so possibly one more) and the train list has all the
    others, each in a seeded random order.

    Raises:
      ValueError: `max_operand` is outside 1..MAX_OPERAND (the layout's widths), or `heldout` leaves
        no training problem.
    """
    if not 1 <= max_operand <= MAX_OPERAND:
        raise ValueError(f"max_operand={max_operand} must lie in 1..{MAX_OPERAND}: PROMPT_WIDTH and "
                         "ANSWER_TOKENS are sized for two-digit operands.")
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(a, max_operand + 1)]
    if not 0 < heldout < len(pairs):
        raise ValueError(f"heldout={heldout} must be between 1 and {len(pairs) - 1} "
                         f"(there are {len(pairs)} unordered pairs up to {max_operand}).")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(pairs))
    held, train = [], []
    for index in order:
        a, b = pairs[index]
        target = held if len(held) < heldout else train
        target.extend([Problem(a, b)] if a == b else [Problem(a, b), Problem(b, a)])
    train = [train[i] for i in rng.permutation(len(train))]
    return train, held


# -- tokens -------------------------------------------------------------------------------------

def encode_prompts(prompts: Sequence[str], tokenizer, width: int = PROMPT_WIDTH) -> np.ndarray:
    """Prompts as (N, width) int32 ids, left-padded with PAD_ID.

    Raises:
      ValueError: a prompt is longer than `width` (naming it and the fix).
    """
    out = np.full((len(prompts), width), PAD_ID, np.int32)
    for row, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt)
        if len(ids) > width:
            raise ValueError(f"Prompt {row} ({prompt!r}) has {len(ids)} tokens, more than the prompt width "
                             f"{width}; shorten it or pass a larger width.")
        if len(ids):
            out[row, width - len(ids):] = ids
    return out


def encode_completions(completions: Sequence[str], tokenizer, width: int = ANSWER_TOKENS) -> np.ndarray:
    """Completions as (N, width) int32 ids, right-padded with PAD_ID (cut at `width`)."""
    out = np.full((len(completions), width), PAD_ID, np.int32)
    for row, text in enumerate(completions):
        ids = tokenizer.encode(text)[:width]
        out[row, :len(ids)] = ids
    return out


def sft_batch(problems: Sequence[Problem], tokenizer) -> dict[str, np.ndarray]:
    """A supervised batch in tunix's `TrainingInput` fields, the prompt masked out of the loss.

    Returns:
      {"input_tokens": (N, PROMPT_WIDTH + ANSWER_TOKENS) ids,
       "input_mask": same shape, 1 on the answer and its "\\n" only}: the loss
      (peft_trainer.next_token_loss) counts the tokens the model must learn to *write*,
      never the prompt it is given.
    """
    prompts = encode_prompts([p.prompt for p in problems], tokenizer)
    completions = encode_completions([p.completion for p in problems], tokenizer)
    mask = np.zeros((len(problems), PROMPT_WIDTH + ANSWER_TOKENS), np.int32)
    for row, problem in enumerate(problems):
        mask[row, PROMPT_WIDTH:PROMPT_WIDTH + len(problem.completion)] = 1
    return {"input_tokens": np.concatenate([prompts, completions], axis=1), "input_mask": mask}


def _shuffled_batches(problems: Sequence[Problem], batch_size: int, seed: int,
                      num_batches: int | None) -> Iterator[list[Problem]]:
    """Lists of `batch_size` problems, a fresh seeded permutation each epoch (the last partial
    batch of an epoch is dropped); endless, or `num_batches` of them."""
    rng = np.random.default_rng(seed)
    count = 0
    while num_batches is None or count < num_batches:
        order = rng.permutation(len(problems))
        for start in range(0, len(order) - batch_size + 1, batch_size):
            if num_batches is not None and count >= num_batches:
                return
            yield [problems[i] for i in order[start:start + batch_size]]
            count += 1


def sft_batches(problems: Sequence[Problem], tokenizer, batch_size: int, *, seed: int = 0,
                num_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Endless (or `num_batches`) shuffled SFT batches from `problems`, seeded."""
    for chosen in _shuffled_batches(problems, batch_size, seed, num_batches):
        yield sft_batch(chosen, tokenizer)


def prompt_batches(problems: Sequence[Problem], batch_size: int, *, seed: int = 0,
                   num_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """GRPO's input: {"prompts": (batch_size,) str array, "answer": (batch_size,) str array}.

    NumPy arrays, not lists: tunix's GRPO needs its prompts as a NumPy array (a list is
    split per element by its data iterator); ours accepts either.
    """
    for chosen in _shuffled_batches(problems, batch_size, seed, num_batches):
        yield {"prompts": np.array([p.prompt for p in chosen]),
               "answer": np.array([p.answer for p in chosen])}


# -- grading ------------------------------------------------------------------------------------

def parse_answer(completion: str) -> str | None:
    """The answer a completion gives: its digits before the first "\\n"; None if malformed.

    Malformed: no "\\n" (the model never stopped), or anything but 1-3 digits before it.
    """
    head, stop, _ = completion.partition(STOP)
    if not stop or not head.isdigit() or not 1 <= len(head) <= 3:
        return None
    return str(int(head))


def exact_match_reward(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str],
                       **kwargs) -> list[float]:
    """1.0 where the parsed answer equals `answer`, else 0.0: the verifiable reward."""
    return [float(parse_answer(c) == str(a)) for c, a in zip(completions, answer, strict=True)]


def format_reward(prompts: Sequence[str], completions: Sequence[str], **kwargs) -> list[float]:
    """0.1 for a well-formed answer (digits then "\\n"), right or wrong.

    Why a little: a model that rambles past the token budget gets no signal at all from
    exact match; this one says "stop after the number" without paying for wrong numbers
    nearly as much as exact match pays for right ones.
    """
    return [0.1 if parse_answer(c) is not None else 0.0 for c in completions]


def plausible_wrong_answer(problem: Problem, rng: np.random.Generator) -> str:
    """A wrong answer of the kinds people make: off by one or ten, or the carry dropped."""
    right = problem.a + problem.b
    dropped_carry = (problem.a % 10 + problem.b % 10) % 10 + 10 * (problem.a // 10 + problem.b // 10)
    candidates = {right + 1, right - 1, right + 10, right - 10, dropped_carry}
    candidates = sorted(c for c in candidates if c >= 0 and c != right)
    return str(candidates[rng.integers(len(candidates))])


def preference_batch(problems: Sequence[Problem], tokenizer, *, seed: int = 0) -> dict[str, np.ndarray]:
    """DPO pairs in tunix's `dpo_trainer.TrainingInput` fields: the right answer chosen, a wrong one rejected.

    Returns: prompt_ids/prompt_mask (N, PROMPT_WIDTH), chosen_ids/chosen_mask and
    rejected_ids/rejected_mask (N, ANSWER_TOKENS); masks are 1 on real tokens.
    """
    rng = np.random.default_rng(seed)
    prompts = encode_prompts([p.prompt for p in problems], tokenizer)
    chosen = [p.completion for p in problems]
    rejected = [plausible_wrong_answer(p, rng) + STOP for p in problems]
    chosen_ids, rejected_ids = encode_completions(chosen, tokenizer), encode_completions(rejected, tokenizer)
    return {
        "prompt_ids": prompts, "prompt_mask": (prompts != PAD_ID).astype(np.int32),
        "chosen_ids": chosen_ids, "chosen_mask": _length_mask(chosen, ANSWER_TOKENS),
        "rejected_ids": rejected_ids, "rejected_mask": _length_mask(rejected, ANSWER_TOKENS),
    }


def _length_mask(texts: Sequence[str], width: int) -> np.ndarray:
    mask = np.zeros((len(texts), width), np.int32)
    for row, text in enumerate(texts):
        mask[row, :min(len(text.encode()), width)] = 1
    return mask


def complete(model, tokenizer, prompts: Sequence[str], *, temperature: float = 0.0, key=None,
             batch_size: int = 512) -> list[str]:
    """The model's completions of `prompts` (ANSWER_TOKENS tokens each), in batches.

    Greedy by default; with `temperature` > 0 and a `key`, sampled (chapter 12's sampler).
    """
    import jax

    from stacklib.llm.sample import generate

    texts = []
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start:start + batch_size])
        ids = encode_prompts(chunk, tokenizer)
        if len(chunk) < batch_size and len(prompts) > batch_size:  # keep one compiled shape
            ids = np.concatenate([ids, np.repeat(ids[-1:], batch_size - len(chunk), axis=0)])
        chunk_key = None if key is None else jax.random.fold_in(key, start)
        out = generate(model, ids, ANSWER_TOKENS, temperature=temperature, key=chunk_key)
        texts.extend(tokenizer.decode(row) for row in out[:len(chunk), PROMPT_WIDTH:])
    return texts


def heldout_accuracy(model, tokenizer, problems: Sequence[Problem], *, batch_size: int = 512) -> float:
    """The share of `problems` the model answers exactly, greedily: the number each method is judged by."""
    completions = complete(model, tokenizer, [p.prompt for p in problems], batch_size=batch_size)
    return float(np.mean(exact_match_reward([p.prompt for p in problems], completions,
                                            [p.answer for p in problems])))


def pass_at_k(model, tokenizer, problems: Sequence[Problem], k: int, *, temperature: float = 1.0,
              seed: int = 0) -> float:
    """The share of `problems` solved by at least one of `k` samples: what RL can hope to reach."""
    import jax

    prompts = [p.prompt for p in problems for _ in range(k)]
    completions = complete(model, tokenizer, prompts, temperature=temperature, key=jax.random.key(seed))
    hits = np.array(exact_match_reward(prompts, completions, [p.answer for p in problems for _ in range(k)]))
    return float(hits.reshape(len(problems), k).max(axis=1).mean())


__all__ = [
    "ANSWER_TOKENS", "MAX_OPERAND", "PAD_ID", "PROMPT_WIDTH", "STOP", "STOP_ID", "Problem", "complete",
    "encode_completions", "encode_prompts", "exact_match_reward", "format_reward", "heldout_accuracy",
    "make_problems", "parse_answer", "pass_at_k", "plausible_wrong_answer", "preference_batch",
    "prompt_batches", "sft_batch", "sft_batches",
]
