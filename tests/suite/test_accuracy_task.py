"""The accuracy experiment's generator and answer extraction."""
import json
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


def test_tokenizer_round_trips_the_problems(tmp_path):
    from transformers import AutoTokenizer
    from suite.accuracy import tokenizer
    train, test = dataset(40, seed=1)
    texts = [r["query"] + "\n" + r["response"] for r in train + test]
    tokenizer.build(texts, tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids and tok.decode(ids) == text
    assert tok("12", add_special_tokens=False)["input_ids"] == tok("1 2", add_special_tokens=False)["input_ids"][::2]


def test_settings_refuse_what_cannot_run(tmp_path):
    from suite.accuracy.experiment import Settings
    with pytest.raises(ValueError, match="native is the reference"):
        Settings(out=str(tmp_path), work=str(tmp_path), systems=["megatrain"])
    with pytest.raises(ValueError, match="unknown 'huge'"):
        Settings(out=str(tmp_path), work=str(tmp_path), model="huge")
    with pytest.raises(ValueError, match="does not exist"):
        Settings(out=str(tmp_path), work=str(tmp_path), metamath=str(tmp_path / "missing.jsonl"))


def test_loss_gap_is_the_largest_step_difference():
    from suite.accuracy.experiment import loss_gaps
    rows = {"untrained": {}, "native": {"losses": [2.0, 1.0]}, "a": {"losses": [2.1, 1.0]},
            "b": {"losses": [2.0, 1.5]}, "c": {"status": "error", "losses": []}}
    gaps = loss_gaps(rows)
    assert gaps["loss_gap_to_native"]["a"]["max_abs"] == pytest.approx(0.1)
    assert gaps["loss_gap_to_native"]["b"]["max_rel"] == pytest.approx(0.5)
    assert gaps["largest_loss_gap"]["system"] == "b" and "c" not in gaps["loss_gap_to_native"]


def test_experiment_end_to_end_and_the_metamath_route(tmp_path):
    """Generated problems and a tiny model: every system trains from the same init and data, saves,
    is evaluated; MegaTrain's losses equal native's (float32 on the CPU). Then the MetaMathQA route:
    a local file in its format and a local checkpoint with its tokenizer (the first run's init)."""
    from suite.accuracy.experiment import Settings, run
    from workflows.scripts import accuracy_report
    first = run(Settings(out=str(tmp_path / "out"), work=str(tmp_path / "work"), systems=["megatrain", "native"],
                         problems=60, steps=4, batch=4, seq=96, eval_limit=6, eval_batch=6))
    rows = first["systems"]
    assert set(rows) == {"untrained", "native", "megatrain"} and first["evaluated"] == 6
    assert all(r["status"] == "ok" and 0 <= r["accuracy"] <= 1 for r in rows.values())
    assert len(rows["megatrain"]["losses"]) == 4 and rows["native"]["losses"][-1] < rows["native"]["losses"][0]
    assert first["loss_gap_to_native"]["megatrain"]["max_rel"] < 1e-5
    assert (tmp_path / "work" / "checkpoints" / "megatrain" / "config.json").is_file()
    # resumable: a finished system with its evaluation is not trained again, also when the run is
    # resumed with other systems (native first, so the list's order changes) or another time limit
    (tmp_path / "out" / "megatrain.json").touch()
    stamp = (tmp_path / "out" / "megatrain.json").stat().st_mtime_ns
    again = run(Settings(out=str(tmp_path / "out"), work=str(tmp_path / "work"), systems=["native", "megatrain"],
                         problems=60, steps=4, batch=4, seq=96, eval_limit=6, eval_batch=6, timeout_s=999))
    assert again["systems"] == rows and (tmp_path / "out" / "megatrain.json").stat().st_mtime_ns == stamp
    md, png = tmp_path / "t3.md", tmp_path / "t3.png"
    accuracy_report.main(["--summary", str(tmp_path / "out" / "summary.json"), "--hardware", "cpu", "--csv",
                          str(tmp_path / "t3.csv"), "--md", str(md), "--png", str(png), "--pdf", str(tmp_path / "t3.pdf")])
    assert "| megatrain | ok |" in md.read_text() and "## Paper (Table 3" in md.read_text() and png.stat().st_size > 0

    metamath = tmp_path / "MetaMathQA.jsonl"
    train, test = dataset(20, seed=5)
    with open(metamath, "w") as f:
        for r in train + test:
            f.write(json.dumps({"query": r["query"], "response": r["response"], "type": "generated"}) + "\n")
    second = run(Settings(out=str(tmp_path / "out2"), work=str(tmp_path / "work2"), systems=["native"],
                          metamath=str(metamath), pretrained=str(tmp_path / "work" / "init"),
                          steps=2, batch=2, seq=96, eval_limit=None, eval_batch=6))
    assert second["data"]["train"] == 14 and second["data"]["test"] == 6 and second["evaluated"] == 6
    assert second["systems"]["native"]["status"] == "ok"
