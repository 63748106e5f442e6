"""The quoting workload of speculative decoding (issue 36): chat requests whose answers quote
their input, written to benchmarks/data/quoting-32.jsonl from this repository's own text.

    .venv/bin/python -m benchmarks.quoting_trace           # writes benchmarks/data/quoting-32.jsonl
    .venv/bin/python -m benchmarks.quoting_trace --show 3   # print three requests, write nothing

Deterministic, no network, no model: functions of the `kvfleet/` and `shared/` packages and prose
paragraphs of README.md and docs/*.md (short, plain ones: the default model quotes dense ones
less) as committed at `--ref` (HEAD), picked by hashes with a fixed seed, so that an edit
elsewhere leaves the trace as it is (`build`). The committed file is the workload; rerun after
those sources change and a few requests change with them.

Kinds, interleaved: editing code (rename a variable or the function, add a comment; the answer is
the whole function again), editing text (fix planted spelling mistakes, replace a word; the answer
is the whole paragraph again), extraction (copy the lines that mention a word), summarising with
quotes, and multi-turn chats whose earlier assistant answer is in the messages and whose last
turn asks to repeat or revise it. The earlier answers are made here, not by a model: a renamed
function (exact, by tokens), a corrected paragraph (the original).

Format: one object per line, `kvfleet bench`'s trace format plus two keys it ignores:
`{"t": 0.0, "prompt", "max_tokens", "ignore_eos": false, "kind", "messages"}`. `messages` is
what benchmarks/speculation.py sends to /v1/chat/completions (the default model is a chat model
and quotes better inside its chat template); `prompt` is the last user message, or for a
multi-turn chat the whole conversation flattened, so that `kvfleet bench` (which reads only
`prompt`) still sends a quoting request. Every `t` is 0: it is meant for closed loops
(`--concurrency N`).

Lengths: ignore_eos is false and max_tokens (200-400) is about 1.3x the expected answer, so an
answer ends where the model ends it. Natural ends do not make speculation's comparison noisy:
kvfleet's outputs with and without speculation are identical token for token (that is one of the
checks), so both do the same work; against vLLM the answers may differ by a few tokens, and the
per-stream figure (tokens ÷ decode time) does not depend on the length. A fixed length would
instead measure what a small model writes after its answer (often a repeat loop), which flatters
speculation.

How much the default model (SmolLM2-135M-Instruct, greedy) quotes, measured by hand on
2026-12-04: 25 of the 32 answers take at least half of their token 4-grams from their input (the
renames and multi-turn chats most; it often copies without making the edit asked for, and
shortens or drifts from long paragraphs); 25 end before max_tokens, and 4 fall into a loop that
repeats their own words until max_tokens (which any n-gram proposer also predicts well).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import random
import re
import subprocess
import textwrap
import tokenize
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from kvfleet.bench.trace import TraceRequest, load_trace

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "data" / "quoting-32.jsonl"
SOURCES = ("kvfleet", "shared", "README.md", "docs")
SEED = 36  # the number
# (kind, its source: a function or a paragraph, count); 32 in all
KINDS = (("code_rename", "code", 5), ("code_edit", "code", 4), ("chat_code", "code", 3),
         ("extract_lines", "code", 2), ("text_spelling", "prose", 5), ("text_replace", "prose", 2),
         ("extract_lines", "prose", 3), ("summarise_quotes", "prose", 5), ("chat_text", "prose", 3))
CODE_CHARS = (250, 800)  # a function's source, ~80-270 tokens
PROSE_CHARS = (300, 900)
MAX_TOKENS = (200, 400)
CHARS_PER_TOKEN = {"code": 3.0, "prose": 4.0}  # SmolLM2's tokenizer, roughly
RENAMES = ("my_{}", "{}_value", "the_{}", "{}2")


@dataclass(frozen=True)
class Function:
    path: str  # relative to the repository
    name: str
    source: str  # dedented
    local_names: tuple[str, ...]  # parameters and assigned names, safe to rename by token


@dataclass(frozen=True)
class QuotingRequest:
    kind: str
    messages: tuple[dict[str, str], ...]
    max_tokens: int

    def to_line(self) -> str:
        turns = [m for m in self.messages if m["role"] != "system"]
        prompt = turns[0]["content"] if len(turns) == 1 else "\n\n".join(
            f"{m['role'].capitalize()}: {m['content']}" for m in turns)
        return json.dumps({"t": 0.0, "prompt": prompt, "max_tokens": self.max_tokens,
                           "ignore_eos": False, "kind": self.kind,
                           "messages": list(self.messages)})


# ---------------------------------------------------------------- sources


def committed_files(root: Path, ref: str, paths: tuple[str, ...]) -> dict[str, str]:
    """{path: text} of the files under `paths` at the commit `ref`: the trace depends on what
    is committed, not on edits in progress in the working tree."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                              text=True).stdout

    names = git("ls-tree", "-r", "--name-only", ref, "--", *paths).split()
    return {name: git("show", f"{ref}:{name}") for name in sorted(names)}


def functions(files: dict[str, str]) -> list[Function]:
    """Every function of the .py files whose source length is within CODE_CHARS."""
    found = []
    for path, text in files.items():
        if not path.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            source = textwrap.dedent(ast.get_source_segment(text, node, padded=True) or "")
            if CODE_CHARS[0] <= len(source) <= CODE_CHARS[1]:
                found.append(Function(path, node.name, source, _renamable(node)))
    return found


def _renamable(node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    """Names bound in the function that a token rename changes correctly: not used as a keyword
    argument or an attribute anywhere in it, at least 4 characters, used at least twice."""
    args = node.args
    bound = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs} - {"self", "cls"}
    bound |= {n.id for n in ast.walk(node)
              if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    unsafe = {k.arg for k in ast.walk(node) if isinstance(k, ast.keyword)}
    unsafe |= {a.attr for a in ast.walk(node) if isinstance(a, ast.Attribute)}
    uses = [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
    return tuple(sorted(n for n in bound - unsafe if len(n) >= 4 and uses.count(n) >= 2))


def rename(source: str, old: str, new: str) -> str:
    """`source` with every NAME token `old` that is not an attribute replaced by `new`."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    lines = source.splitlines(keepends=True)
    hits = [t.start for i, t in enumerate(tokens) if t.type == tokenize.NAME and t.string == old
            and not (i and tokens[i - 1].string == ".")]
    for row, col in reversed(hits):  # right to left, so earlier columns stay valid
        line = lines[row - 1]
        lines[row - 1] = line[:col] + new + line[col + len(old):]
    return "".join(lines)


def paragraphs(files: dict[str, str]) -> list[str]:
    """The prose paragraphs of the .md files within PROSE_CHARS: no headings, tables, lists,
    quotes, code or link lists, few digits and backticks (BENCHMARKS.md, mostly figures, is left
    out), not the lead-in of a table or list."""
    found = []
    for path, markdown in files.items():
        if not path.endswith(".md") or path.endswith("BENCHMARKS.md"):
            continue
        text = re.sub(r"```.*?```", "", markdown, flags=re.S)
        for block in re.split(r"\n\s*\n", text):
            block = block.strip()
            if (PROSE_CHARS[0] <= len(block) <= PROSE_CHARS[1]
                    and not re.match(r"[#|>*\-\d`<]", block) and "\n|" not in block
                    and not block.endswith(":") and block.count("](") < 3
                    and block.count("`") <= 12
                    and sum(map(str.isdigit, block)) < 0.02 * len(block)):
                found.append(block)
    return found


# ---------------------------------------------------------------- edits


def plant_typos(text: str, rng: random.Random, count: int = 4) -> str:
    """`count` words of 6+ letters with two inner letters swapped (each word once)."""
    spans = [m.span() for m in re.finditer(r"\b[a-z]{6,}\b", text)]
    chosen = sorted(rng.sample(spans, min(count, len(spans))), reverse=True)
    for start, end in chosen:
        i = rng.randrange(start + 1, end - 2)
        text = text[:i] + text[i + 1] + text[i] + text[i + 2:]
    return text


def frequent_word(lines: list[str], rng: random.Random) -> str | None:
    """A word of 5+ letters on 2 to half of the lines, or None."""
    counts: dict[str, int] = {}
    for line in lines:
        for word in set(re.findall(r"\b[a-z][a-z_]{4,}", line.lower())):
            counts[word] = counts.get(word, 0) + 1
    fits = sorted(w for w, c in counts.items() if 2 <= c <= max(2, len(lines) // 2))
    return rng.choice(fits) if fits else None


def budget(answer: str, style: str) -> int:
    """max_tokens for an answer about as long as `answer`: 1.3x its estimated tokens, clipped."""
    tokens = len(answer) / CHARS_PER_TOKEN[style]
    return int(min(MAX_TOKENS[1], max(MAX_TOKENS[0], round(1.3 * tokens / 10) * 10)))


def user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content}


def fenced(source: str) -> str:
    return f"```python\n{source.rstrip()}\n```"


# ---------------------------------------------------------------- request kinds


def code_rename(fn: Function, rng: random.Random) -> QuotingRequest:
    old = rng.choice(fn.local_names)
    new = rng.choice(RENAMES).format(old)
    ask = (f"Rename the variable `{old}` to `{new}` in this function and give back the whole "
           f"function.\n\n{fenced(fn.source)}")
    return QuotingRequest("code_rename", (user(ask),), budget(fn.source, "code"))


def code_edit(fn: Function, rng: random.Random) -> QuotingRequest:
    asks = (f"Rename the function `{fn.name}` to `{fn.name}_v2` and give back the whole function.",
            "Add a one-line comment above the function saying what it does, and give back the "
            "whole function unchanged below it.",
            "Give back this function exactly as it is, with a comment line added above each "
            "return statement.")
    ask = f"{rng.choice(asks)}\n\n{fenced(fn.source)}"
    return QuotingRequest("code_edit", (user(ask),), budget(fn.source, "code"))


def text_spelling(paragraph: str, rng: random.Random) -> QuotingRequest:
    # The default model answers "repeat the whole paragraph, corrected, and nothing else" with
    # that sentence, reworded, 3 times in 5; this wording, 1 in 8.
    ask = f"Correct the spelling in the following paragraph.\n\n{plant_typos(paragraph, rng)}"
    return QuotingRequest("text_spelling", (user(ask),), budget(paragraph, "prose"))


def text_replace(paragraph: str, rng: random.Random) -> QuotingRequest | None:
    word = frequent_word(paragraph.splitlines(), rng)
    if word is None:
        return None
    ask = (f"Repeat this paragraph word for word, except that every \"{word}\" becomes "
           f"\"{word.upper()}\".\n\n{paragraph}")
    return QuotingRequest("text_replace", (user(ask),), budget(paragraph, "prose"))


def extract_lines(text: str, rng: random.Random) -> QuotingRequest | None:
    """Lines that mention a word, from a function or from a paragraph set one sentence a line
    (the docs' wrapped lines cut sentences, and the default model copies whole sentences only);
    None when no word is on 2 lines or more."""
    lines = text.splitlines() if text.startswith(("def ", "async def ")) else sentences(text)
    word = frequent_word(lines, rng)
    if word is None:
        return None
    wanted = "\n".join(line for line in lines if word in line.lower())
    ask = (f"Copy every line of this text that mentions \"{word}\", word for word, one per "
           "line, and nothing else.\n\n" + "\n".join(lines))
    return QuotingRequest("extract_lines", (user(ask),), budget(wanted * 2, "prose"))


def sentences(paragraph: str) -> list[str]:
    """The paragraph's sentences, one a line."""
    return re.split(r"(?<=[.;:])\s+(?=[A-Z`(])", " ".join(paragraph.split()))


def summarise_quotes(paragraph: str, rng: random.Random) -> QuotingRequest:
    ask = ("Summarise this text in two sentences, then quote its two most important sentences "
           f"word for word, each in quotation marks.\n\n{paragraph}")
    return QuotingRequest("summarise_quotes", (user(ask),), budget(paragraph, "prose"))


def chat_code(fn: Function, rng: random.Random) -> QuotingRequest | None:
    """Turn 1 renames one variable (the answer made here, exactly); turn 2 renames another.
    None for a function with fewer than two names to rename."""
    if len(fn.local_names) < 2:
        return None
    first, second = rng.sample(fn.local_names, 2)
    new_first = rng.choice(RENAMES).format(first)
    answer = rename(fn.source, first, new_first)
    ask = (f"Rename the variable `{first}` to `{new_first}` in this function and give back the "
           f"whole function.\n\n{fenced(fn.source)}")
    again = f"Now also rename `{second}` to `{second}_2` and give back the whole function again."
    messages = (user(ask), assistant(f"Here is the function with `{first}` renamed:\n\n"
                                     f"{fenced(answer)}"), user(again))
    return QuotingRequest("chat_code", messages, budget(answer, "code"))


def chat_text(paragraph: str, rng: random.Random) -> QuotingRequest:
    """Turn 1 fixes planted typos (the answer: the original paragraph); turn 2 asks for it again,
    revised."""
    ask = f"Correct the spelling in the following paragraph.\n\n{plant_typos(paragraph, rng)}"
    again = rng.choice(("Repeat your corrected paragraph, but with one sentence per line.",
                        "Repeat your corrected paragraph exactly, then add one sentence that "
                        "says what it is about.",
                        "Revise your answer: put the paragraph in the past tense and repeat it."))
    messages = (user(ask), assistant(paragraph), user(again))
    return QuotingRequest("chat_text", messages, budget(paragraph, "prose"))


MAKERS = {"code_rename": code_rename, "code_edit": code_edit, "chat_code": chat_code,
          "extract_lines": extract_lines, "text_spelling": text_spelling,
          "text_replace": text_replace, "summarise_quotes": summarise_quotes,
          "chat_text": chat_text}


# ---------------------------------------------------------------- the trace


def build(root: Path = REPO, seed: int = SEED, ref: str = "HEAD") -> list[QuotingRequest]:
    """The workload: KINDS' requests, each from a source no other request uses.

    Stable under edits elsewhere in the repository: each kind takes the sources in an order of
    its own (a hash of the kind and the text) and skips those taken or unusable, each request
    draws its choices from a generator seeded by its source, and the requests are interleaved by
    a hash of their messages. An edit changes a request only when it touches its source or adds
    a source that ranks before it (and what that one displaces)."""
    files = committed_files(root, ref, SOURCES)
    pools = {"code": [f for f in functions(files) if f.local_names], "prose": paragraphs(files)}
    taken: set[str] = set()
    requests = []
    for kind, source_kind, count in KINDS:
        made = 0
        for source in by_hash(pools[source_kind], source_text, f"{seed}:{kind}"):
            if made == count:
                break
            text = source_text(source)
            if text in taken:
                continue
            argument = text if kind == "extract_lines" else source
            request = MAKERS[kind](argument, random.Random(f"{seed}:{kind}:{text}"))
            if request is not None:
                taken.add(text)
                requests.append(request)
                made += 1
        if made < count:
            raise ValueError(f"{kind}: {made} usable {source_kind} sources, {count} wanted")
    return by_hash(requests, lambda r: json.dumps(r.messages), seed)


def source_text(source: Function | str) -> str:
    return source.source if isinstance(source, Function) else source


def by_hash(items: list[T], text_of: Callable[[T], str], salt: object) -> list[T]:
    """`items` in the order of a hash of their text: a fixed, arbitrary order that an item
    added or removed elsewhere does not reshuffle."""
    return sorted(items, key=lambda item: hashlib.sha256(f"{salt}:{text_of(item)}".encode())
                  .hexdigest())


def load_requests(path: str | Path, num_requests: int | None = None) -> list[TraceRequest]:
    """The trace's requests as `kvfleet bench` TraceRequests that carry their chat messages
    (kvfleet.bench.trace.load_trace reads only `prompt`), in file order."""
    load_trace(path, num_requests)  # validates the lines as `kvfleet bench` would
    entries = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()
               if line.strip()][:num_requests]
    return [TraceRequest(0.0, e["prompt"], e["max_tokens"], e.get("ignore_eos", False),
                         tuple(e["messages"]) if e.get("messages") else None) for e in entries]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--ref", default="HEAD", help="the commit whose files are the sources")
    p.add_argument("--show", type=int, default=0, help="print N requests instead of writing")
    args = p.parse_args(argv)
    requests = build(seed=args.seed, ref=args.ref)
    if args.show:
        for r in requests[:args.show]:
            print(f"--- {r.kind}, max_tokens {r.max_tokens}")
            for m in r.messages:
                print(f"[{m['role']}]\n{m['content']}\n")
        return 0
    Path(args.out).write_text("".join(r.to_line() + "\n" for r in requests), encoding="utf-8")
    counts = {kind: sum(r.kind == kind for r in requests) for kind, _, _ in KINDS}
    print(f"{len(requests)} requests to {args.out}: {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
