"""The GRPO trainer: configuration, built-in tasks, sampling, the training loop and its command line."""
