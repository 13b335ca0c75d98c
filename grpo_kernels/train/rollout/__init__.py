"""Where a run's completions come from: the rollout interface (source) and its two implementations (colocated,
decoupled), the samplers (hf_sampler, vllm_sampler), the scored batch (batch) and its sampling (sampling), the
rollout servers (server), the sampler over them (server_sampler), their keys (auth) and the weights streamed to
them (weight_transfer)."""
