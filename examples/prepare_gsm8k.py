"""GSM8K's train split as the trainer's JSONL ({"prompt", "answer"} per line; the answer is the final number).

    python examples/prepare_gsm8k.py data/gsm8k_train.jsonl [--split train]

Needs the `datasets` package and network access to the Hugging Face hub (run it once, where both exist).
"""

import argparse
import json
from pathlib import Path

PROMPT = "{question}\nSolve step by step, then give the final answer after '####'.\n"


def to_row(example: dict) -> dict:
    """One GSM8K record -> {"prompt", "answer"}: the answer is the text after the last '####', commas removed."""
    answer = example["answer"].rsplit("####", 1)[-1].strip().replace(",", "")
    return {"prompt": PROMPT.format(question=example["question"].strip()), "answer": answer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--split", default="train")
    args = parser.parse_args()
    from datasets import load_dataset

    rows = [to_row(e) for e in load_dataset("openai/gsm8k", "main", split=args.split)]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} examples to {args.out}")


if __name__ == "__main__":
    main()
