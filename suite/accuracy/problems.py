"""Seeded multi-step arithmetic word problems in MetaMathQA's format.

Each example is {"query": question, "response": worked steps ending "The answer is: N", "answer": N},
as MetaMathQA's rows are (query/response). Numbers stay small so that a ~100 M parameter model
can learn the task in minutes; every problem has one integer answer, checked by recomputing it.
"""
from __future__ import annotations

import random

NAMES = ("Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jon", "Kira", "Liam")
ITEMS = ("apples", "books", "marbles", "stickers", "pencils", "cards", "shells", "coins")


def _buy_and_give(rng: random.Random) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    start, bags, per_bag = rng.randint(2, 20), rng.randint(2, 6), rng.randint(2, 9)
    bought = bags * per_bag
    give = rng.randint(1, start + bought - 1)
    answer = start + bought - give
    query = (f"{name} has {start} {item}. {name} buys {bags} bags with {per_bag} {item} in each bag "
             f"and then gives away {give} {item}. How many {item} does {name} have now?")
    steps = [f"{name} buys {bags} * {per_bag} = {bought} {item}.",
             f"Then {name} has {start} + {bought} = {start + bought} {item}.",
             f"After giving away {give}, {name} has {start + bought} - {give} = {answer} {item}."]
    return {"query": query, "steps": steps, "answer": answer}


def _share(rng: random.Random) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each = rng.randint(2, 6), rng.randint(2, 9)
    extra = rng.randint(1, friends - 1)  # fewer than the friends: the equal share is unique
    total = friends * each + extra
    answer = each
    query = (f"{name} shares {total} {item} equally among {friends} friends and keeps the {extra} "
             f"left over. How many {item} does each friend get?")
    steps = [f"{name} shares {total} - {extra} = {total - extra} {item}.",
             f"Each friend gets {total - extra} / {friends} = {answer} {item}."]
    return {"query": query, "steps": steps, "answer": answer}


def _weeks(rng: random.Random) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    per_day, days, weeks = rng.randint(1, 9), rng.randint(2, 7), rng.randint(2, 4)
    week = per_day * days
    spent = rng.randint(0, min(9, week * weeks - 1))  # something is always left
    answer = week * weeks - spent
    query = (f"{name} collects {per_day} {item} a day, {days} days a week, for {weeks} weeks, and loses "
             f"{spent} of them. How many {item} does {name} have at the end?")
    steps = [f"In one week {name} collects {per_day} * {days} = {week} {item}.",
             f"In {weeks} weeks that is {week} * {weeks} = {week * weeks} {item}.",
             f"After losing {spent}, {name} has {week * weeks} - {spent} = {answer} {item}."]
    return {"query": query, "steps": steps, "answer": answer}


TEMPLATES = (_buy_and_give, _share, _weeks)


def example(rng: random.Random) -> dict:
    p = rng.choice(TEMPLATES)(rng)
    response = "\n".join(p["steps"]) + f"\nThe answer is: {p['answer']}"
    return {"query": p["query"], "response": response, "answer": str(p["answer"])}


def dataset(n: int, seed: int = 0, train_fraction: float = 0.7) -> tuple[list[dict], list[dict]]:
    """`n` distinct problems, split train/test (the paper's 70/30), both a function of `seed`."""
    if n < 2 or not 0 < train_fraction < 1:
        raise ValueError(f"need n >= 2 and 0 < train_fraction < 1, got n={n}, train_fraction={train_fraction}")
    rng = random.Random(seed)
    seen, rows = set(), []
    for _ in range(100 * n):
        row = example(rng)
        if row["query"] not in seen:
            seen.add(row["query"])
            rows.append(row)
            if len(rows) == n:
                break
    else:
        raise ValueError(f"could not draw {n} distinct problems (got {len(rows)})")
    cut = round(n * train_fraction)
    return rows[:cut], rows[cut:]
