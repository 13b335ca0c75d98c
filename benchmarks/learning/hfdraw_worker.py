"""One run of `benchmarks/learning/vs_trl.py` as "grpo_kernels_hfdraw": `grpo-kernels train` with its training
rollouts drawn the way HF's do_sample draws them (torch.multinomial on softmax(logits / T), from the global RNG the
trainer seeds with the run's seed) instead of its per-row seeded Gumbel-max. The held-out evaluation keeps the seeded
draw, so it is the evaluation of every other run. The mirror of "trl_ourdraw": the random stream swapped, the
trainer kept.

    python -m benchmarks.learning.hfdraw_worker train --seed=0 --model.name=smollm2-135m ...   # (internal)

The global RNG's state is not in our checkpoints: a resumed run goes on with another stream than an uninterrupted
one would (a run of at most checkpoint.every steps never resumes).
"""

import sys

import torch

from grpo_kernels import cli
from grpo_kernels.train.rollout import hf_sampler as sampler_module
from grpo_kernels.train.rollout import sampling as sampling_module


class MultinomialDraw(sampler_module.SeededSampling):
    """`SeededSampling` with HF's do_sample draw while a training rollout is sampled (`drawing`)."""

    drawing = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not MultinomialDraw.drawing:
            return super().__call__(input_ids, scores)
        if self.top_p < 1.0:
            raise SystemExit("learning-vs-trl: grpo_kernels_hfdraw draws without top-p (sampling.top_p = 1)")
        log_probs = torch.log_softmax(scores.float() / self.temperature, -1)
        token = torch.multinomial(log_probs.exp(), num_samples=1)
        self.logps.append(log_probs.gather(-1, token)[:, 0])
        return torch.full_like(scores, float("-inf")).scatter_(-1, token, 0.0)


def patch() -> None:
    """Training rollouts (`sample_scored` without evaluation=True) draw with torch.multinomial; everything else is
    unchanged."""
    sample = sampling_module.sample_scored

    def training_draws(sampler, tok, task, examples, g, seeds, d, **kwargs):
        MultinomialDraw.drawing = not kwargs.get("evaluation")
        try:
            return sample(sampler, tok, task, examples, g, seeds, d, **kwargs)
        finally:
            MultinomialDraw.drawing = False

    sampler_module.SeededSampling = MultinomialDraw
    sampling_module.sample_scored = training_draws


if __name__ == "__main__":
    patch()
    cli.main(sys.argv[1:])
