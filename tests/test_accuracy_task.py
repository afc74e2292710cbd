"""The accuracy experiment's generator and answer extraction."""
import random
import re

import pytest

from suite.accuracy.answers import exact_match, extract
from suite.accuracy.problems import TEMPLATES, dataset, example


def test_split_is_seeded_distinct_and_70_30():
    train, test = dataset(200, seed=3)
    assert (len(train), len(test)) == (140, 60)
    assert dataset(200, seed=3) == (train, test) and dataset(200, seed=4) != (train, test)
    queries = [r["query"] for r in train + test]
    assert len(set(queries)) == 200


def test_every_template_recomputes_to_its_answer():
    rng = random.Random(0)
    for template in TEMPLATES:
        for _ in range(200):
            p = template(rng)
            # every step's equation holds, and the last step's result is the answer
            for step in p["steps"]:
                a, op, b, result = re.search(r"(\d+) ([-+*/]) (\d+) = (\d+)", step).groups()
                assert eval(f"{a} {op} {b}") == int(result)
            assert int(result) == p["answer"] and p["answer"] > 0
    for _ in range(200):  # sharing: what is left over is too little for another round
        p = TEMPLATES[1](rng)
        total, friends, extra = map(int, re.search(r"shares (\d+) .* among (\d+) friends and keeps the (\d+)",
                                                   p["query"]).groups())
        assert extra < friends and (total - extra) % friends == 0


def test_response_ends_with_the_answer_in_metamathqa_form():
    row = example(random.Random(1))
    assert row["response"].endswith(f"The answer is: {row['answer']}")
    assert extract(row["response"]) == row["answer"]


@pytest.mark.parametrize("text, answer", [
    ("so 3 + 4 = 7\nThe answer is: 7", "7"),
    ("The answer is: 1,234.", "1234"),
    ("The answer is: 2.50 dollars", "5/2"),
    ("The answer is: 6/4", "3/2"),
    ("The answer is: -3", "-3"),
    ("first The answer is: 1\nthen The answer is: 2", "2"),
    ("no final answer here: 42", None),
    ("The answer is: seven", None),
])
def test_extract(text, answer):
    assert extract(text) == answer


def test_exact_match():
    assert exact_match("... The answer is: 12", "12")
    assert exact_match("The answer is: 12.0", "12")
    assert not exact_match("The answer is: 13", "12")
    assert not exact_match("I think 12", "12")


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        dataset(1)
    with pytest.raises(ValueError):
        dataset(10, train_fraction=1.0)
