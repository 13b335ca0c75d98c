"""FSDP2 keeps the root module's parameters (the policy's embeddings, final norm and LM head) gathered after a
forward, for the backward that follows. A no-grad forward has none: `completion_logprobs` (the old and reference
log-probs) gives them back to their shards, or the reference policy, which never runs a backward, would hold its
embeddings and head whole on every rank for the whole run. One process, a one-rank gloo group: FSDP2 swaps the
same parameters in and out as on eight ranks."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from grpo_kernels.packing import pack_sequences
from grpo_kernels.train.model.fsdp import shard
from grpo_kernels.train.model.hf import load_policy, write_tiny_checkpoint
from grpo_kernels.train.model.policy import Policy, completion_logprobs
from grpo_kernels.train.rollout.server import free_port


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _root_parameters(policy) -> dict:
    """{name: type} of the parameters outside the decoder blocks (the root FSDP module's own)."""
    return {n: type(p) for n, p in policy.named_parameters() if ".layers." not in n}


def test_a_no_grad_forward_leaves_the_roots_parameters_sharded_and_the_log_probs_unchanged(tmp_path, one_rank_group):
    write_tiny_checkpoint(tmp_path)
    model, _ = load_policy(tmp_path)
    whole = Policy(copy.deepcopy(model))
    policy = shard(Policy(model), model.model.layers, device=torch.device("cpu"), world=1, dtype=torch.float32)
    assert set(_root_parameters(policy).values()) == {DTensor}
    packed = pack_sequences([[1, 5, 6, 7], [1, 8, 9]], [[10, 11, 2], [12, 2]])

    for _ in range(2):  # the old log-probs, then the reference's: each gives the root's parameters back
        logps = completion_logprobs(policy, packed, temperature=0.7)
        assert set(_root_parameters(policy).values()) == {DTensor}, _root_parameters(policy)
    torch.testing.assert_close(logps, completion_logprobs(whole, packed, temperature=0.7), rtol=0, atol=0)

    # the training step after it: forward and backward as before (FSDP2 gathers the root again)
    advantages = torch.tensor([1.0, -1.0])
    loss, _ = policy(packed.model_kwargs(), packed.logit_rows, packed.completion_ids, advantages, temperature=0.7,
                     cu_seqlens=packed.completion_cu_seqlens, old_logps=logps)  # fmt: skip
    loss.backward()
    grads = {n: p.grad for n, p in policy.named_parameters() if ".layers." not in n}
    assert all(isinstance(g, DTensor) and g.abs().sum() > 0 for g in grads.values()), grads
