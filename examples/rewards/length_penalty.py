"""A soft length penalty in TRL's form (DAPO's overlong shaping): 0 up to MAX_TOKENS - BUFFER completion tokens,
then falling linearly to -1 at MAX_TOKENS (set them to the run's sampling.max_new_tokens). It logs the share of
completions it penalized as `length_penalty/penalized` through TRL's log_metric."""

MAX_TOKENS, BUFFER = 24, 8


def length_penalty(completion_ids, log_metric=None, **kwargs) -> list:
    out = [min(0.0, (MAX_TOKENS - BUFFER - len(ids)) / BUFFER) for ids in completion_ids]
    if log_metric is not None:
        log_metric("length_penalty/penalized", sum(p < 0 for p in out) / max(1, len(out)))
    return out
