"""Load for the chaos benchmarks: streamed greedy chats from a fixed set of prompts, sent by
closed-loop clients, every answer recorded (text, chunk times, token count) so that a benchmark can
measure the fleet's capacity, the load it served in any window, and whether each answer equals the
first answer its prompt ever got (greedy decoding: it must, killed worker or not).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx

from kvfleet.shared.models import DEFAULT_MODEL
from tests.helpers.processes import ProcessFleet

NUM_PROMPTS = 48


def start_two_workers(fleet: ProcessFleet) -> ProcessFleet:
    """The fleet's gateway and its workers `a` and `b`."""
    fleet.start_gateway()
    for name in ("a", "b"):
        fleet.start_worker(name)
    return fleet


def chat_body(prompt: int, max_tokens: int, sampled: bool = False) -> dict:
    """Greedy, or (`sampled`) seeded sampling at temperature 0.8 with a seed of its own."""
    body = {"model": DEFAULT_MODEL, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream_options": {"include_usage": True},
            "messages": [{"role": "user",
                          "content": f"Tell story number {prompt} about a lighthouse."}]}
    if sampled:
        body.update(temperature=0.8, top_p=0.95, seed=1000 + prompt)
    return body


@dataclass
class Answer:
    """One streamed answer as its client saw it."""

    prompt: int
    max_tokens: int
    req_id: str = ""
    text: str = ""
    times: list[float] = field(default_factory=list)  # monotonic arrival of content chunks
    chars: int = 0  # content characters received so far
    sampled: bool = False  # seeded sampling (chat_body), not greedy
    tokens: int = 0  # completion tokens (usage)
    finish_reason: str | None = None
    error: str | None = None

    def tokens_in(self, t0: float, t1: float) -> float:
        """Tokens that arrived in [t0, t1), spreading the usage count over the chunks."""
        if not self.times or not self.tokens:
            return 0.0
        per_chunk = self.tokens / len(self.times)
        return per_chunk * sum(1 for t in self.times if t0 <= t < t1)


def stream_answer(url: str, prompt: int, max_tokens: int, answer: Answer | None = None,
                  timeout_s: float = 900, sampled: bool = False) -> Answer:
    """Stream one chat; fills `answer` (made here if not given) as chunks arrive."""
    answer = answer or Answer(prompt, max_tokens)
    answer.sampled = sampled
    pieces = []
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions",
                          json=chat_body(prompt, max_tokens, sampled),
                          timeout=timeout_s) as response:
            if response.status_code != 200:
                answer.error = f"HTTP {response.status_code}: {response.read()[:200]!r}"
                return answer
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    answer.error = str(chunk["error"])
                    continue
                answer.req_id = answer.req_id or chunk.get("id", "")
                if chunk.get("usage"):
                    answer.tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    if choice["delta"].get("content"):
                        pieces.append(choice["delta"]["content"])
                        answer.chars += len(pieces[-1])
                        answer.times.append(time.monotonic())
                    if choice.get("finish_reason"):
                        answer.finish_reason = choice["finish_reason"]
    except httpx.HTTPError as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
    answer.text = "".join(pieces)
    return answer


class ClosedLoop:
    """`concurrency` clients; each sends its next prompt as soon as its last answer ended, until
    `stop()`. Prompts cycle through NUM_PROMPTS, so every prompt is answered many times."""

    def __init__(self, url: str, concurrency: int, max_tokens: int, first_prompt: int = 0):
        self.url = url
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.answers: list[Answer] = []
        self._next = first_prompt
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _client(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                prompt, self._next = self._next % NUM_PROMPTS, self._next + 1
            answer = stream_answer(self.url, prompt, self.max_tokens)
            with self._lock:
                self.answers.append(answer)

    def start(self) -> ClosedLoop:
        self._threads = [threading.Thread(target=self._client, daemon=True)
                         for _ in range(self.concurrency)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> list[Answer]:
        """Let every client finish its answer in flight, then return all answers."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=900)
        return list(self.answers)

    def snapshot(self) -> list[Answer]:
        with self._lock:
            return list(self.answers)


def served_tokens_per_s(answers: list[Answer], t0: float, t1: float) -> float:
    """Output tokens/s the clients received in [t0, t1) (finished answers only)."""
    return sum(a.tokens_in(t0, t1) for a in answers) / (t1 - t0)


def measure_capacity(url: str, concurrencies: list[int], max_tokens: int, seconds: float,
                     warmup_s: float, log=print) -> tuple[float, dict[int, float], list[Answer]]:
    """Tokens/s served at each closed-loop concurrency (after `warmup_s`, over `seconds`, answers
    still in flight at the end included up to then); capacity = the largest."""
    rates, everything = {}, []
    for concurrency in concurrencies:
        loop = ClosedLoop(url, concurrency, max_tokens).start()
        t0 = time.monotonic() + warmup_s
        time.sleep(warmup_s + seconds)
        t1 = time.monotonic()
        answers = loop.stop()
        rates[concurrency] = served_tokens_per_s(answers, t0, t1)
        everything += answers
        log(f"  concurrency {concurrency:3d}: {rates[concurrency]:7.1f} tokens/s")
    return max(rates.values()), rates, everything


class References:
    """The first complete answer of each (prompt, max_tokens); later answers must equal it."""

    def __init__(self) -> None:
        self.text: dict[tuple[int, int], str] = {}
        self.checked = 0
        self.identical = 0
        self.mismatches: list[tuple[int, str]] = []

    def check(self, answers: list[Answer]) -> None:
        for answer in answers:
            if answer.error or answer.finish_reason != "length":
                self.mismatches.append((answer.prompt, f"incomplete: {answer.error}"))
                self.checked += 1
                continue
            want = self.text.setdefault((answer.prompt, answer.max_tokens, answer.sampled),
                                        answer.text)
            self.checked += 1
            if answer.text == want:
                self.identical += 1
            else:
                self.mismatches.append((answer.prompt, answer.req_id))
