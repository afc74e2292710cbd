"""The data pipeline at MetaMathQA's size: tokenise time (cold, then from datasets' cache), host
memory of the examples, and the data time of a step, on a generated dataset with MetaMathQA's
schema (query, response, type, original_question) and about its length distribution.

    python experiments/probes/data_pipeline.py --rows 395000 --out results/cpu-bench/probes/data_pipeline.json

The tokenizer is a byte-level BPE trained here on the generated text (32K vocabulary) with the
Qwen2.5 chat template (tests/fixtures), so every example goes through the chat template, the exact
masks and the cache as a real instruction-tuning run's would. Each measurement runs in this one
process, after the dataset is written; the cache lives in a fresh temporary folder.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("the of and to a in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there one all we their has been if more when will would who so no she how many "
         "total each cost dollars apples half twice number sum find value what if than per day week hours").split()


def generate(path: Path, rows: int, seed: int) -> None:
    """Rows of MetaMathQA's schema: queries of about 50-60 tokens, responses of about 150-250
    (log-normal, long tails), a few with LaTeX and digits."""
    rng = np.random.default_rng(seed)
    q_words = np.clip(rng.lognormal(3.7, 0.45, rows), 8, 400).astype(int)
    r_words = np.clip(rng.lognormal(4.9, 0.55, rows), 10, 1500).astype(int)
    vocab = np.array(WORDS)
    types = np.array(["GSM_Rephrased", "GSM_AnsAug", "GSM_SV", "GSM_FOBAR", "MATH_AnsAug", "MATH_Rephrased"])
    with open(path, "w") as f:
        for k in range(rows):
            q = " ".join(vocab[rng.integers(0, len(vocab), q_words[k])]) + f" {rng.integers(1, 999)}?"
            body = " ".join(vocab[rng.integers(0, len(vocab), r_words[k])])
            answer = int(rng.integers(1, 10_000))
            r = f"{body} $\\frac{{{answer}}}{{2}}$ = {answer / 2}.\nThe answer is: {answer}"
            f.write(json.dumps({"query": q, "response": r, "type": str(types[k % len(types)]),
                                "original_question": q}) + "\n")


def tokenizer(path: Path, data: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    sample = []
    with open(data) as f:
        for _, line in zip(range(20_000), f):
            row = json.loads(line)
            sample += [row["query"], row["response"]]
    tok.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=32_000, special_tokens=[
        "<|endoftext|>", "<|im_start|>", "<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = (ROOT / "tests" / "fixtures" / "chat_templates" / "qwen2.5.jinja").read_text()
    fast.save_pretrained(path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=395_000)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=256, help="sequences per step (the issue's 256-sample step)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--num-proc", type=int, default=None, help="data.num_proc (default: the pipeline's choice)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="megatrain-data-bench-"))
    os.environ["HF_DATASETS_CACHE"] = str(work / "cache")  # cold: nothing cached before the first run
    sys.path.insert(0, str(ROOT))
    from megatrain.config import DataConfig
    from megatrain.data import make_sources
    from megatrain.metrics import environment, tree_rss_bytes

    data = work / "metamath.jsonl"
    t = time.perf_counter()
    generate(data, args.rows, 0)
    generate_s = time.perf_counter() - t
    tokenizer(work / "tok", data)
    result = {"rows": args.rows, "file_bytes": data.stat().st_size, "generate_s": generate_s,
              "env": environment(), "cpu_count": os.cpu_count()}
    runs = {}
    for packing in (False, True):
        cfg = DataConfig(source="file", path=str(data), format="instruction", prompt_field="query",
                         response_field="response", template="chat", seq_len=args.seq_len,
                         batch_size=args.batch, packing=packing, num_proc=args.num_proc)
        rss0 = tree_rss_bytes()
        t = time.perf_counter()
        src, _ = make_sources(cfg, 32_000, str(work / "tok"))
        load_s = time.perf_counter() - t
        times = []
        for _ in range(args.steps + 2):
            t = time.perf_counter()
            b = src.next()
            times.append(time.perf_counter() - t)
        ex = src.examples
        runs["packed" if packing else "padded"] = {
            # the first run tokenises; the second (packing) reads datasets' cache of the same map
            "load_s": load_s, "tokenised": not packing,
            "examples": len(ex), "tokens": int(ex.lengths.sum()), "mean_tokens": float(ex.lengths.mean()),
            "p99_tokens": float(np.percentile(ex.lengths, 99)), "dropped": ex.dropped,
            "data_bytes": src.nbytes, "rss_growth_bytes": tree_rss_bytes() - rss0,
            "rows_per_epoch": src.rows_per_epoch(), "batch_shape": list(b.input_ids.shape),
            "warmup_next_s": times[:2], "next_s": times[2:], "next_median_s": statistics.median(times[2:]),
        }
        print(json.dumps({k: v for k, v in runs["packed" if packing else "padded"].items() if k != "next_s"}),
              flush=True)
    result["runs"] = runs
    result["config"] = {"seq_len": args.seq_len, "batch_size": args.batch, "steps": args.steps, "template": "qwen2.5 (ChatML)",
                        "num_proc": args.num_proc or "auto"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
