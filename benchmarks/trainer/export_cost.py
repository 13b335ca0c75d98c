"""Time and peak memory of writing a model as a Hugging Face directory: this package's export
(`grpo_kernels.train.model.export.export_model`, one tensor gathered at a time, at most one shard held) beside
transformers' `save_pretrained` of the same in-memory model, on one process.

Usage (from the repository root):
    .venv/bin/python benchmarks/trainer/export_cost.py --size 1.5b           # Qwen2.5-1.5B's shapes (~6 GB fp32)
    .venv/bin/python benchmarks/trainer/export_cost.py --size tiny --repeats 1 --csv /tmp/x.csv   # a dry run, seconds

The model is a random-init Qwen2 of the named size's shapes (tied embeddings, as Qwen2.5 up to 3B), built in fp32
(a run's master weights on the CPU); its values do not change what is written. Every (method, dtype) runs in a fresh
process, repeats times, the methods alternating:
- "export": export_model(model, dtype=..., max_shard_bytes=5 GB), what a run's `[export]` does (config, tokenizer and
  card included; the tokenizer here is the built-in character one);
- "save_pretrained": model.save_pretrained(out, max_shard_size="5GB"); for bf16 with a bf16 copy of the state dict
  (`state_dict=`), as a trainer that keeps its fp32 weights must give it (casting the model in place with .to() would
  end training).
write_s is the wall time of the call; extra_peak_mb is the process's peak resident memory during the call above its
resident memory just before (Linux: the peak is reset through /proc/self/clear_refs first); model_mb the weights'
size in memory. Rows are appended to benchmarks/results/export_cost_cpu.csv with the load average: a row measured
beside other work is not a result.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # importable from a plain checkout too

from benchmarks.common import append_csv, run_meta, status_kb  # noqa: E402

SIZES = {  # Qwen2.5's shapes (hidden, intermediate, layers, heads, kv heads, vocab)
    "tiny": (64, 128, 2, 4, 2, 1000),
    "0.5b": (896, 4864, 24, 14, 2, 151936),
    "1.5b": (1536, 8960, 28, 12, 2, 151936),
    "3b": (2048, 11008, 36, 16, 2, 151936),
}
METHODS = ("export", "save_pretrained")
SHARD = "5GB"


def build(size: str):
    import torch
    import transformers

    hidden, inter, layers, heads, kv, vocab = SIZES[size]
    config = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                      tie_word_embeddings=True, max_position_embeddings=4096)  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def worker(method: str, size: str, dtype_name: str, out: Path) -> dict:
    """One write in this process; returns its row."""
    import torch

    from grpo_kernels.train.config.run import parse_size
    from grpo_kernels.train.data.tasks import CharTokenizer
    from grpo_kernels.train.model.export import export_model

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    model = build(size)
    model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    reset_peak()
    before = status_kb("VmRSS")
    start = time.perf_counter()
    if method == "export":
        tok = CharTokenizer()
        export_model(model, tok, out, dtype=dtype, max_shard_bytes=parse_size(SHARD), stop_ids=tok.stop_ids)
    else:
        state = None if dtype == torch.float32 else {k: v.to(dtype) for k, v in model.state_dict().items()}
        model.save_pretrained(out, max_shard_size=SHARD, state_dict=state)
    write_s = time.perf_counter() - start
    written = sum(f.stat().st_size for f in Path(out).glob("*.safetensors"))
    return {"method": method, "size": size, "dtype": dtype_name, "write_s": round(write_s, 2),
            "extra_peak_mb": round((status_kb("VmHWM") - before) / 1024), "model_mb": round(model_mb),
            "written_mb": round(written / 2**20)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1.5b")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--csv", type=Path, default=ROOT / "benchmarks" / "results" / "export_cost_cpu.csv")
    parser.add_argument("--worker", nargs=4, metavar=("METHOD", "SIZE", "DTYPE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        method, size, dtype, out = args.worker
        print(json.dumps(worker(method, size, dtype, Path(out))))
        return
    meta = run_meta("cpu")
    for dtype in args.dtypes.split(","):
        for repeat in range(args.repeats):
            for method in METHODS if repeat % 2 == 0 else METHODS[::-1]:
                with tempfile.TemporaryDirectory(prefix="export_cost_") as tmp:
                    load = os.getloadavg()[0]
                    proc = subprocess.run([sys.executable, __file__, "--worker", method, args.size, dtype,
                                           str(Path(tmp) / "model")], capture_output=True, text=True)  # fmt: skip
                if proc.returncode != 0:
                    raise SystemExit(f"{method} {dtype} failed:\n{proc.stderr[-3000:]}")
                row = {**meta, **json.loads(proc.stdout.strip().splitlines()[-1]), "repeat": repeat,
                       "load_avg_1m": round(load, 2)}  # fmt: skip
                print(row)
                append_csv([row], args.csv, list(row))


if __name__ == "__main__":
    main()
