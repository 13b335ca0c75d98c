"""A plain TRL GRPO script where the one change is the trainer class: FusedGRPOTrainer instead of GRPOTrainer.

    .venv/bin/python examples/trl_dropin.py

Runs on CPU, offline, in well under a minute: a tiny random-init Qwen2 built from a config and a word-level
tokenizer built in memory (the model is saved to a temporary directory, which TRL loads, reference model too), an
in-memory dataset of prompts, and a reward function. The task: write words with even numbers. With plain TRL the
line is `trainer = GRPOTrainer(...)`; everything else (config, dataset, rewards, logging) is unchanged, and the
training loss is computed by grpo_kernels from the hidden states and the LM head, never building [T, V] logits.
For a trainer class of your own, `grpo_kernels.integrations.use_grpo_kernels(trainer)` does the same on the
instance.
"""

import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config
from trl import GRPOConfig

from grpo_kernels.integrations import FusedGRPOTrainer  # was: from trl import GRPOTrainer

WORDS = [f"w{i}" for i in range(60)]


def build_model_dir() -> tuple[str, PreTrainedTokenizerFast]:
    vocab = {"<pad>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0,
                         eos_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="tiny_qwen2_")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path, tokenizer


def even_words_reward(completions, **_) -> list[float]:
    """The fraction of the completion's words with an even number (w0, w2, ...); 0 for an empty completion."""
    return [sum(int(w[1:]) % 2 == 0 for w in c.split()) / max(len(c.split()), 1) for c in completions]


def main() -> None:
    path, tokenizer = build_model_dir()
    g = torch.Generator().manual_seed(0)
    prompts = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (4,), generator=g)) for _ in range(64)]
    args = GRPOConfig(output_dir=f"{path}/out", per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, max_steps=30, learning_rate=1e-2, beta=0.04, loss_type="dapo",
                      logging_steps=10, report_to="none", save_strategy="no", bf16=False)  # fmt: skip
    trainer = FusedGRPOTrainer(model=path, reward_funcs=even_words_reward, args=args, processing_class=tokenizer,
                               train_dataset=Dataset.from_dict({"prompt": prompts}))  # fmt: skip
    trainer.train()
    for entry in trainer.state.log_history[:-1]:
        print(f"step {entry['step']:>3}: loss {entry['loss']:+.4f}  reward {entry['reward']:.3f}  "
              f"kl {entry['kl']:.5f}  entropy {entry['entropy']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
