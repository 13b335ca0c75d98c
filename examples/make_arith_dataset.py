"""Writes a small dataset of arithmetic questions for examples/train_smollm2_dataset_cpu.toml: one JSON object per
line with the columns `question` (the prompt), `solution` (the answer, for the reward functions) and `operands`.

    python examples/make_arith_dataset.py data/arith.jsonl [--rows 600] [--seed 0]

The repository cannot download GSM8K here; where the hub is reachable, examples/prepare_gsm8k.py writes GSM8K in the
same spirit (its columns: prompt, answer).
"""

import argparse
import json
import random
from pathlib import Path


def rows(n: int, seed: int) -> list:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        out.append({"question": f"What is {a} + {b}? Reply with only the number.", "solution": str(a + b),
                    "operands": 2})
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--rows", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(args.rows, args.seed)))
    print(f"wrote {args.rows} rows to {path}")


if __name__ == "__main__":
    main()
