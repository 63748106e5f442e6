"""The multi-tenant, multi-turn chat trace of benchmarks/fleet_affinity.py, generated from a seed.

Each tenant has a long system prompt of its own (a slice of benchmarks/data/kv_corpus.txt behind
the tenant's name, so two tenants differ from the first block on); each conversation belongs to
one tenant and asks `turns` questions. The client resends the whole history every turn (system
prompt, every question, every answer the server gave), so turn k's prompt begins with turn k-1's
prompt and answer: a worker that served turn k-1 holds most of turn k in its prefix cache.

Arrivals: conversation starts are spread uniformly over `start_window_s`; each later turn is
sent `think_s` after the previous answer ended (a closed loop per conversation, as a person
chats). With `skew` one tenant (tenant 0) owns that share of the conversations, and so of the
requests; the others share the rest round-robin.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "data" / "kv_corpus.txt"
TENANT_NAMES = ("Northwind Freight", "Contoso Health", "Fabrikam Bank", "Tailspin Travel",
                "Litware Insurance", "Adatum Energy", "Proseware Books", "Wingtip Toys")
QUESTIONS = ("What does this passage say: \"{}\"?", "Summarise in one sentence: \"{}\".",
             "Which words matter most in \"{}\"?", "Explain to a child: \"{}\".",
             "Give a title to \"{}\".")


@dataclass(frozen=True)
class TraceShape:
    # 24 (6 users a tenant): on a 2-core CPU with SmolLM2-135M, 3 workers sharing the cores are
    # busy (TTFT p90 in seconds with shared routing) and a configuration runs in 1-2 minutes;
    # the first observation had 8
    conversations: int = 24
    tenants: int = 4
    turns: int = 5
    system_words: int = 500  # ~600 tokens of SmolLM2's tokenizer with the tenant's heading
    question_words: tuple[int, int] = (12, 30)  # corpus words quoted in a question, min..max
    start_window_s: float = 8.0
    think_s: tuple[float, float] = (0.5, 2.0)  # pause before a turn after the last answer
    skew: float | None = None  # tenant 0's share of the conversations; None: round-robin


@dataclass(frozen=True)
class Conversation:
    index: int
    tenant: int
    start_s: float  # first turn's send time, from the run's start
    system: str
    questions: tuple[str, ...]  # the user's message of each turn
    think_s: tuple[float, ...]  # before turns 2.., after the previous answer (len: turns - 1)


def corpus_words(path: Path = CORPUS) -> list[str]:
    return path.read_text(encoding="utf-8").split()


def tenant_of(shape: TraceShape) -> list[int]:
    """Each conversation's tenant, in conversation order (before the starts are shuffled)."""
    n, tenants = shape.conversations, shape.tenants
    if shape.skew is None or tenants == 1:
        return [i % tenants for i in range(n)]
    if not 0.0 < shape.skew < 1.0:
        raise ValueError(f"skew must be in (0, 1), got {shape.skew}")
    heavy = min(n - 1, max(1, round(shape.skew * n)))  # every tenant keeps >= 1 if it can
    return [0] * heavy + [1 + i % (tenants - 1) for i in range(n - heavy)]


def excerpt(words: list[str], start: int, count: int) -> str:
    """`count` words from `start`, wrapping around the corpus."""
    return " ".join(words[(start + i) % len(words)] for i in range(count))


def system_prompt(tenant: int, words: list[str], rng: random.Random, num_words: int) -> str:
    name = TENANT_NAMES[tenant] if tenant < len(TENANT_NAMES) else f"Tenant {tenant}"
    heading = (f"{name} assistant. Answer the customer's question briefly, using the reference "
               f"text below.\n\nReference:\n")
    return heading + excerpt(words, rng.randrange(len(words)), num_words)


def generate_trace(shape: TraceShape, seed: int = 0,
                   words: list[str] | None = None) -> list[Conversation]:
    """The conversations, sorted by start time; the same seed and shape give the same trace."""
    if shape.conversations < 1 or shape.tenants < 1 or shape.turns < 1:
        raise ValueError("conversations, tenants and turns must be at least 1")
    words = words if words is not None else corpus_words()
    rng = random.Random(seed)
    systems = [system_prompt(t, words, rng, shape.system_words) for t in range(shape.tenants)]
    tenants = tenant_of(shape)
    rng.shuffle(tenants)  # the heavy tenant's conversations spread over the start window
    conversations = []
    for index, tenant in enumerate(tenants):
        questions = tuple(
            f"(user {index}, question {turn + 1}) " + rng.choice(QUESTIONS).format(
                excerpt(words, rng.randrange(len(words)), rng.randint(*shape.question_words)))
            for turn in range(shape.turns))
        think_s = tuple(round(rng.uniform(*shape.think_s), 3) for _ in range(shape.turns - 1))
        conversations.append(Conversation(index, tenant,
                                          round(rng.uniform(0.0, shape.start_window_s), 3),
                                          systems[tenant], questions, think_s))
    return sorted(conversations, key=lambda c: (c.start_s, c.index))


def history(conversation: Conversation, answers: list[str]) -> tuple[dict[str, str], ...]:
    """The messages of turn len(answers) + 1: system prompt, then every earlier question and
    answer, then this turn's question."""
    turn = len(answers)
    messages = [{"role": "system", "content": conversation.system}]
    for question, answer in zip(conversation.questions[:turn], answers):
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": conversation.questions[turn]})
    return tuple(messages)
