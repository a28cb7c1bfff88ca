"""The chapters' prose reads as a finished book: no retyped measurements, no lab notes.

Two rules, checked on every Markdown cell of `chapters/*.md` (the jupytext twins of the notebooks):

1. A measured quantity (a number with a unit: ms, s, %, ×, tok/s, MB, points, steps, ...) is never typed into
   the prose. The notebook computes it and the Markdown shows it through MyST-NB's glue role,
   `` {glue:text}`name:.1f` `` (with `stacklib.hw.glue("name", value, display=False)` in the code cell),
   or its paragraph (or the paragraph ending in ':' that introduces its table) names where the figure comes
   from: a `make bench` / `make margins` / `make test-accelerator` command together with the hardware it ran
   on, a citation such as "(Dao et al. 2022)", or a link. Values in inline code (`seq_len=128`) and in math
   (`$2^{10}$`) are definitions, not measurements: not checked. `ALLOWED` lists the few other definitions.
2. Nothing about how the book was made: the phrases in `PROCESS_PHRASES` fail in Markdown and in code cells
   alike (a print or a comment is read as well).

The checker's own tests plant a figure and a phrase and watch it fail.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.md"))

# A number (optionally approximate, signed, with thousands separators, decimals or an exponent)...
_NUMBER = r"(?<![\w.])[~≈±+\-−]?\d[\d,]*(?:\.\d+)?(?:e[+\-−]?\d+)?"
# ...followed by a unit of something measured. "×"/"x" count only as a ratio ("3×", not "3x3" or "2 x 4").
_UNIT = (
    r"(?:"
    r"[kMGTP]?FLOP/s|FLOPs?/s|[kMGT]?FLOPs?\b|tok(?:ens)?/s|it/s|records/s|steps/s|samples/s|req(?:uests)?/s"
    r"|bits/byte|bits per byte|[kKMGTP]i?B/s|[kKMGTP]i?B\b|bytes?\b|kB\b"
    r"|ms\b|µs\b|us\b|ns\b|s\b|sec\b|seconds?\b|minutes?\b|min\b|hours?\b"
    r"|%|percentage points?\b|points?\b|steps?\b"
    r"|×(?!\s?\d)|x\b(?!\s?\d)"
    r")"
)
MEASURED = re.compile(_NUMBER + r"\s?" + _UNIT)

# A paragraph that says where its figures come from.
_SOURCE = [
    # A make target that measures it, with the hardware it ran on.
    re.compile(r"make (?:bench|margins|test-accelerator)\b.*?\b(?:TPU|GPU|H100|H200|A100|v[456][ep]?|CPU)\b"
               r"|\b(?:TPU|GPU|H100|H200|A100|v[456][ep]?|CPU)\b.*?make (?:bench|margins|test-accelerator)\b",
               re.S),
    # A citation: "(Dao et al. 2022)", "(Kaplan et al., 2020)", "(Ho and Salimans 2022)", "Dao et al. (2022)".
    re.compile(r"\([A-Z][\w\-]+(?: et al\.| and [A-Z][\w\-]+)?,? (?:19|20)\d\d[a-z]?[);]"
               r"|[A-Z][\w\-]+(?: et al\.| and [A-Z][\w\-]+)? \((?:19|20)\d\d[a-z]?\)"),
    # A link to the source.
    re.compile(r"\]\((?:https?://|\.\./|\.\/)"),
]

# Numbers with a unit that are definitions, not measurements. Keep this short; each entry says why.
ALLOWED: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"[1248] bytes?"), "the size of a dtype (an int8 is 1 byte, a bfloat16 2, a float32 4)"),
    (re.compile(r"[1-6] FLOPs?"), "a count by definition (a multiply-add is 2 FLOPs)"),
    (re.compile(r"0 ?(?:%|steps?|points?|s)"), "zero is a definition (no steps, no change)"),
    (re.compile(r"100 ?%"), "'100%' is the whole of something, not a measurement"),
    (re.compile(r"[12] ?[×x]"), "'1×'/'2×' name a factor by definition (a float32 is 2× a bfloat16)"),
]

# Process text: how the book was made, not what it teaches. Case-insensitive regexes.
PROCESS_PHRASES: list[str] = [
    r"when we (?:tried|ran|measured)",
    r"\bwe (?:measured|tried|observed|logged)\b",
    r"\bthis machine\b",
    r"\bour machine\b",
    r"the test logged",
    r"\blogged on\b",
    r"under nbval",
    r"measured (?:under|with) nbval",
    r"before [^.]{0,60}\b(?:landed|lands)\b",
    r"\bwhen (?:that|this|the) chapter lands\b",
    r"gets its row when",
    r"(?-i:BOOK's|BOOK\.md)",  # the plan the book was written from, not the book
    r"which the tests found",
    r"the tests (?:found|caught)",
    r"load average",
    r"at the time of writing",
    r"\b(?:TODO|FIXME|XXX)\b",
    r"in (?:an|one) earlier (?:run|version)",
    r"\bwave [0-9]\b",
    r"\bthe lead\b",
    r"\bissue \d+\b",
]
_PROCESS = re.compile("|".join(f"(?:{p})" for p in PROCESS_PHRASES), re.I)

_CODE_CELL = re.compile(r"^(`{3,})\{code-cell\}")
_FENCE = re.compile(r"^(`{3,}|~{3,})(\S*)")
# Inline spans the figure rule ignores: glue roles and other roles, inline code, math, link targets.
_ROLE = re.compile(r"\{[\w:\-]+\}`[^`]*`")
_INLINE_CODE = re.compile(r"(`+)(?:.+?)\1")
_MATH = re.compile(r"\$\$.+?\$\$|\$[^$\n]+\$", re.S)
_LINK_TARGET = re.compile(r"\]\([^)]*\)")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One cell of a MyST Markdown notebook: its kind, the line its text starts on, and the text."""

    kind: str  # "markdown" or "code"
    line: int  # 1-based line number of the cell's first line in the .md file
    text: str


@dataclasses.dataclass(frozen=True)
class Finding:
    """A sentence that breaks a rule: where it is, what it says, and how to fix it."""

    path: str
    line: int
    text: str
    fix: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text!r}\n    fix: {self.fix}"


def cells(source: str) -> list[Cell]:
    """Split a MyST Markdown notebook into cells (front matter dropped, `+++` separates Markdown cells)."""
    lines = source.splitlines()
    start = 0
    if lines and lines[0].strip() == "---":
        end = next((i for i in range(1, len(lines)) if lines[i].strip() == "---"), 0)
        start = end + 1
    out: list[Cell] = []
    buffer: list[str] = []
    buffer_line = start + 1
    i = start
    while i < len(lines):
        match = _CODE_CELL.match(lines[i])
        if match or lines[i].strip() == "+++":
            if "".join(buffer).strip():
                out.append(Cell("markdown", buffer_line, "\n".join(buffer)))
            if match:
                fence, first = match.group(1), i
                i += 1
                while i < len(lines) and lines[i].strip() != fence:
                    i += 1
                out.append(Cell("code", first + 2, "\n".join(lines[first + 1:i])))
            buffer, buffer_line = [], i + 2
        else:
            buffer.append(lines[i])
        i += 1
    if "".join(buffer).strip():
        out.append(Cell("markdown", buffer_line, "\n".join(buffer)))
    return out


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines of a Markdown cell the figure rule reads: not inside ```python/```text examples."""
    out, fence = [], None
    for offset, line in enumerate(text.splitlines()):
        match = _FENCE.match(line.strip())
        if fence is None and match and not match.group(2).startswith("{"):
            fence = match.group(1)  # a literal block (code or output example): not prose
            continue
        if fence is not None:
            if line.strip() == fence:
                fence = None
            continue
        if match and match.group(2).startswith("{"):
            continue  # a directive's fence line (```{admonition} Answer): its body is prose
        out.append((offset, line))
    return out


def _strip_definitions(line: str) -> str:
    for pattern in (_ROLE, _INLINE_CODE, _MATH, _LINK_TARGET):
        line = pattern.sub(" ", line)
    return line


def _names_a_source(text: str) -> bool:
    return any(pattern.search(text) for pattern in _SOURCE)


def _paragraphs(text: str) -> list[list[tuple[int, str]]]:
    """The prose lines of a Markdown cell grouped into paragraphs (blocks between blank lines)."""
    paragraphs: list[list[tuple[int, str]]] = [[]]
    for offset, line in _prose_lines(text):
        if line.strip():
            paragraphs[-1].append((offset, line))
        elif paragraphs[-1]:
            paragraphs.append([])
    return [paragraph for paragraph in paragraphs if paragraph]


def _sourced(paragraphs: list[list[tuple[int, str]]]) -> list[bool]:
    """Whether each paragraph names its source, or follows one that does and ends with ':' ."""
    texts = [_MATH.sub(" ", "\n".join(line for _, line in paragraph)) for paragraph in paragraphs]
    named = [_names_a_source(text) for text in texts]
    introduced = [False] + [named[i] and texts[i].rstrip().endswith(":") for i in range(len(texts) - 1)]
    return [own or intro for own, intro in zip(named, introduced, strict=True)]


def check(source: str, path: str = "<string>") -> list[Finding]:
    """Every breach of the two rules in one MyST Markdown notebook's text."""
    findings: list[Finding] = []
    for cell in cells(source):
        for offset, line in enumerate(cell.text.splitlines()):
            for match in _PROCESS.finditer(line):
                findings.append(Finding(
                    path, cell.line + offset, line.strip(),
                    f"process text {match.group(0)!r}: say what the reader learns, not how the book was made "
                    f"(delete the sentence, or say 'your machine' for the reader's)"))
        if cell.kind != "markdown":
            continue
        paragraphs = _paragraphs(cell.text)
        for paragraph, sourced in zip(paragraphs, _sourced(paragraphs), strict=True):
            if sourced:
                continue
            for offset, line in paragraph:
                for match in MEASURED.finditer(_strip_definitions(line)):
                    if any(pattern.fullmatch(match.group(0)) for pattern, _ in ALLOWED):
                        continue
                    findings.append(Finding(
                        path, cell.line + offset, line.strip(),
                        f"figure {match.group(0)!r} typed into the prose: compute it in a code cell, "
                        f"`glue(\"name\", value, display=False)`, and write {{glue:text}}`name:.1f` here; or "
                        f"name its source in this paragraph (`make bench ONLY=...` on <hardware>, a "
                        f"citation, a link); or, for a configuration value, put it in backticks"))
    return findings


# --- the checker's own tests -----------------------------------------------------------------------------

_CLEAN = """---
jupytext:
  formats: ipynb,md:myst
---

# A chapter

```{code-cell} ipython3
from stacklib.hw import glue
speedup = glue("speedup", 3.2, display=False)
```

The fused kernel runs {glue:text}`speedup:.1f`× faster than the unfused one, with `block_size=128`.
"""


def test_a_glued_figure_and_a_backticked_config_value_pass():
    assert check(_CLEAN) == []


def test_a_typed_figure_fails_and_names_the_line_and_the_fix():
    source = _CLEAN + "\n+++\n\nEach step takes 230 ms and the model reaches 53.3% accuracy.\n"
    findings = check(source, "chapters/99_x.md")
    assert [f.text for f in findings] == ["Each step takes 230 ms and the model reaches 53.3% accuracy."] * 2
    assert findings[0].line == source.splitlines().index(findings[0].text) + 1
    message = str(findings[0])
    assert "'230 ms'" in message and "glue" in message and "chapters/99_x.md:" in message
    assert "'53.3%'" in str(findings[1])


@pytest.mark.parametrize("figure", [
    "3×", "1.99x", "40 tok/s", "12 MB", "2.4 bits/byte", "5 points", "600 steps", "1.5 s", "3 seconds",
    "125 GFLOP/s", "~4,000 tokens/s", "0.4 percentage points",
])
def test_every_unit_of_a_measurement_is_caught(figure):
    assert len(check(f"It does {figure} here.\n")) == 1, figure


@pytest.mark.parametrize("sentence", [
    "A 3x3 convolution over a 2 x 4 grid.",  # dimensions, not ratios
    "Chapter 12 trains for `steps=600`.",  # configuration in backticks
    "The cost is $6 N$ FLOPs, $2^{10}$ bytes.",  # math
    "A bfloat16 weight is 2 bytes; an int8 one is 1 byte.",  # allowed definitions
    "Step 3 of 5 runs on 8 devices.",  # numbers without a unit of measure
    "The book's next chapter starts from 0% accuracy.",  # "book's" is not "BOOK's"; zero is a definition
])
def test_definitions_are_not_figures(sentence):
    assert check(sentence + "\n") == []


@pytest.mark.parametrize("source", [
    "Flash attention is 3× faster on an A100 (Dao et al. 2022).",
    "On a TPU v5e, `make bench ONLY=flash` gives 410 tok/s.",
    "The [TPU v5e spec sheet](https://cloud.google.com/tpu/docs/v5e) gives 197 TFLOP/s.",
])
def test_a_paragraph_that_names_its_source_passes(source):
    assert check(source + "\n") == []


def test_a_source_covers_its_own_paragraph_and_the_table_it_introduces_only():
    table = "With `make bench ONLY=infer` on a TPU v5e:\n\n| int8 | 410 tok/s |\n\nThen 9 ms a step.\n"
    assert [f.text for f in check(table)] == ["Then 9 ms a step."]


@pytest.mark.parametrize("phrase", [
    "When we tried it, it failed.", "The test logged 3 runs on this machine.", "Timed under nbval.",
    "Before chunked prefill landed, it waited.", "BOOK's 3× target.", "A bug which the tests found.",
    "Chapter 18 gets its row when that chapter lands.",
])
def test_process_phrases_fail(phrase):
    findings = check(phrase + "\n")
    assert findings and all("process text" in f.fix or "figure" in f.fix for f in findings)
    assert any("process text" in f.fix for f in findings)


def test_process_phrases_in_code_cells_fail_too():
    source = "Text.\n\n```{code-cell} ipython3\nprint('measured under nbval')\n```\n"
    assert [f.line for f in check(source)] == [4]


def test_figures_in_code_cells_are_not_prose():
    assert check("Text.\n\n```{code-cell} ipython3\nprint(f'{3.2:.1f}× faster, 230 ms')\n```\n") == []


# --- the chapters ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", CHAPTERS, ids=[path.stem for path in CHAPTERS])
def test_chapter_prose_states_no_typed_figure_and_no_process_text(path):
    findings = check(path.read_text(), str(path.relative_to(ROOT)))
    assert not findings, f"{len(findings)} sentence(s) to fix:\n" + "\n".join(map(str, findings))


# --- glue roles and the cells that glue them ----------------------------------------------------------------

_GLUE_ROLE = re.compile(r"\{glue(?::[a-z]+)?\}`([^`:]+)")
_GLUE_CALL = re.compile(r"""glue\(\s*(f?)(["'])(.+?)\2""")


def unglued_roles(source: str) -> list[str]:
    """The keys the prose's glue roles name that no `glue("key", ...)` call in the chapter writes.

    A call with an f-string name (`glue(f"acc_{bits}", ...)`) writes every key its pattern matches.
    The structural book build (tests/test_book.py) executes nothing, so this is where a role
    whose key was renamed or never glued is caught before `make book` meets it.
    """
    written = []
    for match in _GLUE_CALL.finditer(source):
        is_f_string, name = match.group(1), match.group(3)
        pattern = re.escape(name)
        if is_f_string:
            pattern = re.sub(r"\\\{[^}]*\\\}", ".+", pattern)  # each {expression} stands for some text
        written.append(re.compile(pattern + "$"))
    return sorted({key for key in _GLUE_ROLE.findall(source) if not any(p.match(key) for p in written)})


def test_a_glue_role_whose_key_no_cell_glues_is_found():
    source = ('```{code-cell} ipython3\nglue("speedup", 2.0, display=False)\n'
              'for bits in (4, 8):\n    glue(f"acc_{bits}", 0.5, display=False)\n```\n\n'
              "A {glue:text}`speedup:.1f`× gain; int8 keeps {glue:text}`acc_8:.0%`, {glue}`spedup`.\n")
    assert unglued_roles(source) == ["spedup"]


@pytest.mark.parametrize("path", CHAPTERS, ids=[path.stem for path in CHAPTERS])
def test_every_glue_role_names_a_key_the_chapter_glues(path):
    missing = unglued_roles(path.read_text())
    assert not missing, (f"{path.name}: glue roles name {missing}, which no code cell glues; add "
                         "`glue(\"key\", value, display=False)` where the value is computed, or fix the name")
