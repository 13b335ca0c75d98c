#!/usr/bin/env bash
# GRPO on GSM8K, Qwen2.5-1.5B-Instruct, one node of 8 H100s (examples/train_qwen_gsm8k_h100.toml). It runs:
#
#     torchrun --standalone --nproc_per_node=8 -m grpo_kernels.cli train \
#         --config examples/train_qwen_gsm8k_h100.toml --model.name=$MODEL --task.path=$DATA
#
# MODEL: a local HF directory (e.g. `huggingface-cli download Qwen/Qwen2.5-1.5B-Instruct --local-dir $MODEL`).
# DATA: JSONL of {"prompt", "answer"}; `python examples/prepare_gsm8k.py $DATA` writes GSM8K's train split.
# Install on the node: the commands in examples/train_qwen_gsm8k_h100.toml's header (the README's "Install").
# Resume after a preemption: torchrun --standalone --nproc_per_node=8 -m grpo_kernels.cli train --resume runs/qwen-gsm8k
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-models/Qwen2.5-1.5B-Instruct}
DATA=${DATA:-data/gsm8k_train.jsonl}
NPROC=${NPROC:-8}
if [[ ! -d $MODEL ]]; then echo "no model directory $MODEL (set MODEL=...)" >&2; exit 1; fi
if [[ ! -f $DATA ]]; then echo "no data file $DATA (python examples/prepare_gsm8k.py $DATA)" >&2; exit 1; fi
exec torchrun --standalone --nproc_per_node="$NPROC" -m grpo_kernels.cli train \
    --config examples/train_qwen_gsm8k_h100.toml --model.name="$MODEL" --task.path="$DATA" "$@"
