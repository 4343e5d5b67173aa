"""Write src/oomless/data/demo_sft.jsonl: the demo's ~200 instruction records.

Deterministic (seeded) and written for this project: simple, varied tasks a
tiny model can start to learn in a few dozen steps (arithmetic, capitals,
unit conversions, string reversal, ...). Alpaca format: instruction / input /
output. Run: ``python scripts/make_demo_data.py`` (the result is committed).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "oomless" / "data" / "demo_sft.jsonl"

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Japan": "Tokyo", "China": "Beijing", "Canada": "Ottawa", "Egypt": "Cairo",
    "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo", "Sweden": "Stockholm",
    "Poland": "Warsaw", "Greece": "Athens", "Portugal": "Lisbon", "Ireland": "Dublin",
    "Austria": "Vienna", "Chile": "Santiago", "Cuba": "Havana", "Thailand": "Bangkok",
    "Vietnam": "Hanoi", "India": "New Delhi", "Mexico": "Mexico City", "Brazil": "Brasilia",
}
WORDS = [
    "apple", "river", "planet", "garden", "window", "silver", "rocket", "basket",
    "candle", "forest", "memory", "pencil", "bridge", "coffee", "dragon", "winter",
    "yellow", "number", "python", "kernel", "tensor", "matrix", "module", "signal",
]
ANTONYMS = {
    "hot": "cold", "big": "small", "fast": "slow", "happy": "sad", "light": "dark",
    "open": "closed", "early": "late", "full": "empty", "high": "low", "hard": "soft",
    "up": "down", "old": "new",
}


def _arithmetic(rng: random.Random) -> dict:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice(["+", "-", "*"])
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"instruction": "Compute the result.", "input": f"{a} {op} {b}", "output": str(value)}


def _capital(rng: random.Random) -> dict:
    country = rng.choice(sorted(CAPITALS))
    return {"instruction": f"What is the capital of {country}?", "input": "",
            "output": f"The capital of {country} is {CAPITALS[country]}."}


def _units(rng: random.Random) -> dict:
    kind = rng.choice(["km", "kg", "h", "m"])
    n = rng.randint(1, 50)
    if kind == "km":
        return {"instruction": "Convert kilometres to metres.", "input": f"{n} km",
                "output": f"{n} km = {n * 1000} m"}
    if kind == "kg":
        return {"instruction": "Convert kilograms to grams.", "input": f"{n} kg",
                "output": f"{n} kg = {n * 1000} g"}
    if kind == "h":
        return {"instruction": "Convert hours to minutes.", "input": f"{n} h",
                "output": f"{n} h = {n * 60} min"}
    return {"instruction": "Convert metres to centimetres.", "input": f"{n} m",
            "output": f"{n} m = {n * 100} cm"}


def _reverse(rng: random.Random) -> dict:
    word = rng.choice(WORDS)
    return {"instruction": "Reverse the string.", "input": word, "output": word[::-1]}


def _upper(rng: random.Random) -> dict:
    words = " ".join(rng.sample(WORDS, 2))
    return {"instruction": "Write the text in upper case.", "input": words, "output": words.upper()}


def _antonym(rng: random.Random) -> dict:
    word = rng.choice(sorted(ANTONYMS))
    return {"instruction": "Give the opposite of the word.", "input": word, "output": ANTONYMS[word]}


def _count_letters(rng: random.Random) -> dict:
    word = rng.choice(WORDS)
    return {"instruction": "How many letters does the word have?", "input": word,
            "output": f"The word {word} has {len(word)} letters."}


def _sequence(rng: random.Random) -> dict:
    start, step = rng.randint(1, 20), rng.randint(2, 9)
    seq = [start + i * step for i in range(4)]
    return {"instruction": "Continue the sequence with the next number.",
            "input": ", ".join(map(str, seq)), "output": str(start + 4 * step)}


TASKS = [_arithmetic, _capital, _units, _reverse, _upper, _antonym, _count_letters, _sequence]


def make_records(n: int = 200, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [TASKS[i % len(TASKS)](rng) for i in range(n)]


def main() -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in make_records())
    tmp = OUT.with_suffix(".jsonl.tmp")
    tmp.write_text(text)
    os.replace(tmp, OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
