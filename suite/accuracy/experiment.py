"""The accuracy experiment (the paper's Table 3): the same initial model, data order and
hyper-parameters trained by each system; exact-match accuracy of greedy answers on held-out problems.

    python -m suite accuracy --out results/h100/accuracy --systems megatrain,native,zero3 --model 100m

Data: generated arithmetic problems (problems.py), or a local MetaMathQA file (`--metamath`,
rows with `query` and `response`); either split 70/30 with the seed. Every system reads the
training split through megatrain's data pipeline (megatrain/data: tokenised once into datasets'
cache, the prompt masked, in the plain template that the evaluation prompts with). Model: a seeded random init of
a llama shape (MODELS) with a tokenizer built from the problems, or a local pretrained checkpoint
(`--pretrained`, its own tokenizer). Each system trains in its own process through the harness
(suite.runner) and saves its weights as a `transformers` checkpoint, which is loaded back and
evaluated with batched greedy generation. The work directory holds data, the initial model and the
checkpoints; the output directory gets per-system results, `summary.json`, the Table 3 rows and
the loss curves.
"""
from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatrain.io import check_writable, write_json
from suite.accuracy import answers, problems
from suite.spec import RunSpec
from suite.system import SYSTEMS, check_spec_options

PROMPT = "Question: {query}\nAnswer: "

# llama shapes for the generated task (vocabulary from its tokenizer)
MODELS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "100m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4),
}


UNKEYED = ("out", "work", "systems", "timeout_s")


@dataclass
class Settings:
    out: str
    work: str
    systems: list[str] = field(default_factory=lambda: ["megatrain", "native"])
    model: str = "tiny"  # a MODELS entry (ignored with `pretrained`)
    pretrained: str | None = None  # a local checkpoint directory with its tokenizer
    metamath: str | None = None  # a local MetaMathQA json/jsonl file (query, response)
    problems: int = 2000  # generated problems, before the 70/30 split
    seed: int = 0
    steps: int = 100
    batch: int = 16  # sequences per step (one micro-batch)
    seq: int = 192
    lr: float = 1e-3
    eval_limit: int | None = 500  # test problems evaluated (None: all)
    eval_batch: int = 64
    timeout_s: float = 3600.0
    options: dict = field(default_factory=dict)  # per-system harness options, by system

    def __post_init__(self):
        if self.pretrained is None and self.model not in MODELS:
            raise ValueError(f"accuracy model: unknown {self.model!r}; known: {sorted(MODELS)}")
        if unknown := [s for s in self.systems if s not in SYSTEMS]:
            raise ValueError(f"accuracy systems: unknown {unknown}; known: {list(SYSTEMS)}")
        for system, options in self.options.items():
            if system not in self.systems:
                raise ValueError(f"accuracy --option {system}:...: {system} is not among the systems {self.systems}")
            check_spec_options(system, options)
        if "native" not in self.systems:
            raise ValueError("accuracy systems: native is the reference the loss gap is measured against")
        for path in (self.pretrained, self.metamath):
            if path is not None and not Path(path).exists():
                raise ValueError(f"accuracy: {path} does not exist")
        check_writable(self.out, "accuracy --out")
        check_writable(self.work, "accuracy --work")


def _metamath_rows(path: str) -> list[dict]:
    text = Path(path).read_text()
    rows = json.loads(text) if text.lstrip().startswith("[") else [json.loads(line) for line in text.splitlines() if line.strip()]
    out = []
    for row in rows:
        if "query" not in row or "response" not in row:
            raise ValueError(f"{path}: MetaMathQA rows need query and response; got {sorted(row)}")
        answer = answers.extract(row["response"])
        if answer is not None:  # a response without a final answer cannot be scored
            out.append({"query": row["query"], "response": row["response"], "answer": answer})
    return out


def split(s: Settings) -> tuple[list[dict], list[dict]]:
    """Train and test problems: generated, or the MetaMathQA file shuffled with the seed, 70/30."""
    if s.metamath is None:
        return problems.dataset(s.problems, s.seed)
    rows = _metamath_rows(s.metamath)
    random.Random(s.seed).shuffle(rows)
    cut = round(0.7 * len(rows))
    return rows[:cut], rows[cut:]


def prepare(s: Settings) -> dict:
    """Write the data files and the initial model (with its tokenizer) into the work directory."""
    work = Path(s.work)
    (work / "data").mkdir(parents=True, exist_ok=True)
    train, test = split(s)
    with open(work / "data" / "train.jsonl", "w") as f:
        for row in train:
            f.write(json.dumps({"prompt": PROMPT.format(query=row["query"]), "response": row["response"]}) + "\n")
    with open(work / "data" / "test.jsonl", "w") as f:
        for row in test:
            f.write(json.dumps({"query": row["query"], "answer": row["answer"]}) + "\n")
    if s.pretrained:
        init = Path(s.pretrained)
    else:
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig

        from suite.accuracy import tokenizer
        init = work / "init"
        texts = [PROMPT.format(query=r["query"]) + r["response"] for r in train + test]
        tok = tokenizer.build(texts, init)
        # positions for a prompt of up to seq tokens and as many generated
        config = LlamaConfig(vocab_size=len(tok), max_position_embeddings=2 * s.seq, tie_word_embeddings=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                             **MODELS[s.model])
        torch.manual_seed(s.seed)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(init)
    return {"train": len(train), "test": len(test), "init": str(init)}


def evaluate(checkpoint: str | Path, tokenizer_dir: str | Path, test: list[dict], batch: int = 64,
             max_new_tokens: int = 192) -> dict:
    """Exact match of the final answer, greedy generation in float32, batched (left padding)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device).eval()
    correct, samples = 0, []
    for lo in range(0, len(test), batch):
        rows = test[lo: lo + batch]
        # as trained: BOS (where the tokenizer has one) and the prompt
        enc = tok([(tok.bos_token or "") + PROMPT.format(query=r["query"]) for r in rows], return_tensors="pt",
                  padding=True, add_special_tokens=False).to(device)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for row, text in zip(rows, texts):
            ok = answers.exact_match(text, row["answer"])
            correct += ok
            if len(samples) < 5:
                samples.append({"query": row["query"], "answer": row["answer"], "generated": text, "correct": ok})
    return {"accuracy": correct / len(test), "correct": correct, "evaluated": len(test), "samples": samples}


def run(s: Settings) -> dict:
    """Prepare, evaluate the untrained model, train and evaluate each system; write the summary.

    Resumable: a system whose result in `out` has this run's exact spec and status ok, with its
    evaluation beside it (`<system>.eval.json`), is not trained again, so a run longer than one
    sitting on a lent GPU goes on where it stopped (the data and the initial model are a function
    of the settings and are rebuilt identically)."""
    from suite.runner import run_point
    out, work = Path(s.out), Path(s.work)
    out.mkdir(parents=True, exist_ok=True)
    prepared = prepare(s)
    test = [json.loads(line) for line in (work / "data" / "test.jsonl").read_text().splitlines()]
    test = test[: s.eval_limit] if s.eval_limit else test
    tok_dir = prepared["init"]
    # what an evaluation depends on: not where files go, which other systems run, or time limits,
    # so that a run resumed with other systems or limits keeps what is done
    key = {"init": prepared, "evaluated": len(test),
           "settings": {k: v for k, v in asdict(s).items() if k not in UNKEYED}}

    def cached(name: str) -> dict | None:
        file = out / f"{name}.eval.json"
        old = json.loads(file.read_text()) if file.is_file() else {}
        return old["evaluation"] if old.get("key") == key else None

    def evaluated(name: str, checkpoint) -> dict:
        if (evaluation := cached(name)) is None:
            evaluation = evaluate(checkpoint, tok_dir, test, s.eval_batch, s.seq)
            write_json(out / f"{name}.eval.json", {"key": key, "evaluation": evaluation})
        return evaluation

    rows = {"untrained": {"status": "ok", **evaluated("untrained", prepared["init"])}}
    for system in ["native", *[x for x in s.systems if x != "native"]]:
        saved = work / "checkpoints" / system
        spec = RunSpec(system=system, model={"pretrained": prepared["init"]}, seq_len=s.seq, batch_size=s.batch,
                       grad_accum=1, steps=s.steps, warmup=0, seed=s.seed, lr=s.lr, timeout_s=s.timeout_s,
                       options=s.options.get(system, {}), save_to=str(saved),
                       # the plain template (BOS, prompt, response, EOS: megatrain/data/formats.py),
                       # which is what evaluate() prompts with, whatever chat template the tokenizer has
                       data={"path": str(work / "data" / "train.jsonl"), "format": "instruction",
                             "prompt_field": "prompt", "response_field": "response", "tokenizer": tok_dir,
                             "template": "plain", "separator": ""})
        file = out / f"{system}.json"
        result = json.loads(file.read_text()) if file.is_file() else {}
        done = result.get("status") == "ok" and _unlimited(result.get("spec", {})) == _unlimited(spec.to_dict())
        if not (done and cached(system)):
            (out / f"{system}.eval.json").unlink(missing_ok=True)
            shutil.rmtree(saved, ignore_errors=True)
            result = run_point(spec, file)
        row = {"status": result["status"], "reason": result.get("reason"),
               "losses": [step["loss"] for step in result.get("steps", [])]}
        if result["status"] == "ok":
            row.update(evaluated(system, saved))
        rows[system] = row
    summary = {"settings": asdict(s), "data": prepared, "evaluated": len(test), "systems": rows,
               **loss_gaps(rows)}
    write_json(out / "summary.json", summary)
    return summary


def _unlimited(spec: dict) -> dict:
    """A run's spec without its time limit (a result stands whatever limit it finished within)."""
    return {k: v for k, v in RunSpec.stored(spec).items() if k != "timeout_s"}


def loss_gaps(rows: dict) -> dict:
    """The largest per-step loss difference between any system and native (absolute, and relative
    to native's loss at that step), over the steps both ran."""
    ref = rows.get("native", {}).get("losses") or []
    gaps = {}
    for system, row in rows.items():
        losses = row.get("losses") or []
        if system in ("native", "untrained") or not losses or not ref:
            continue
        diffs = [(abs(a - b), abs(a - b) / abs(b)) for a, b in zip(losses, ref)]
        gaps[system] = {"max_abs": max(d[0] for d in diffs), "max_rel": max(d[1] for d in diffs), "steps": len(diffs)}
    worst = max(gaps.items(), key=lambda kv: kv[1]["max_abs"], default=(None, None))
    return {"loss_gap_to_native": gaps, "largest_loss_gap": {"system": worst[0], **(worst[1] or {})}}
