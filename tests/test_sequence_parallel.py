"""Sequence parallelism (Ulysses) over packed rows: 2 gloo processes, each with a contiguous shard of every row,
compute the unsharded run's log-probs, loss and gradients (summed over the group), for every loss type, with shard
boundaries inside a sequence, inside a shared prompt and on a sequence boundary, uneven lengths, grouped-query
attention with KV heads split across ranks or replicated (fewer KV heads than ranks)."""

import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

from grpo_kernels.packing import pack_sequences
from grpo_kernels.sequence_parallel import shard_packed
from grpo_kernels.train.model.fsdp import Dist
from grpo_kernels.train.model.policy import Policy, completion_logprobs, run_policy

pytestmark = pytest.mark.distributed

LOSSES = [dict(loss_type=t) for t in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")] + [
    dict(loss_type="grpo", importance_sampling_level="sequence"),  # GSPO: a sequence-level weight across shards
    dict(loss_type="dapo", beta=0.05, delta=1.5),
]


def _model(kv_heads, seed=0):
    config = transformers.Qwen2Config(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=32,
                                      max_position_embeddings=512, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="grpo_varlen")


def _layouts():
    """(name, prompts, completions, group ids, shared_prefix, where the 2-way cut must fall)."""
    g = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(3, 61, (n,), generator=g)  # noqa: E731
    p1, p2 = ids(9), ids(4)
    # plain, 9 + 14 + 4 + 1 + 4 + 21 = 53 tokens (odd: one pad token), the cut at 27 inside sample 1's completion
    inside = ("inside_a_sequence", [p1, p2, p2], [ids(14), ids(1), ids(21)], [0, 1, 1], False)
    # shared prefix, 30 + 3 + 7 + 2 + 4 + 5 + 2 = 53 tokens: the cut at 27 is inside the shared prompt
    prompt = ids(30)
    in_prefix = ("inside_a_shared_prompt", [prompt] * 3 + [p2] * 2, [ids(3), ids(7), ids(2), ids(5), ids(2)],
                 [0, 0, 0, 1, 1], True)  # fmt: skip
    # plain, 9 + 11 = 20 | 4 + 16 = 20: the cut at 20 is exactly a sequence boundary
    boundary = ("at_a_sequence_boundary", [p1, p2], [ids(11), ids(16)], [0, 1], False)
    return [inside, in_prefix, boundary]


def _inputs(layout, current=None, seed=5):
    """The packed batch, advantages, and old / reference log-probs near `current` (the policy's own, so that
    ratios fall on both sides of the clip range and the clipped and unclipped branches both carry gradient)."""
    _, prompts, completions, groups, shared = layout
    packed = pack_sequences(prompts, completions, shared_prefix=shared, group_ids=groups)
    g = torch.Generator().manual_seed(seed)
    n = packed.completion_ids.shape[0]
    adv = torch.randn(len(prompts), generator=g)
    base = torch.full((n,), -4.0) if current is None else current
    old = base + torch.randn(n, generator=g) * 0.3
    ref = base + torch.randn(n, generator=g) * 0.3
    return packed, adv, old, ref


def _loss_and_grads(model, packed, adv, old, ref, d, options):
    policy = Policy(model)
    policy.zero_grad(set_to_none=True)
    n = int(packed.completion_ids.shape[0])
    extra = {"ref_logps": ref} if options.get("beta") else {}
    loss, metrics = run_policy(policy, packed, adv, dist=d, temperature=0.8, cu_seqlens=packed.completion_cu_seqlens,
                         old_logps=old, num_items_in_batch=n, **options, **extra)  # fmt: skip
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return loss.detach(), {k: v.detach() for k, v in metrics.items()}, grads


def _worker(rank, world, init, kv_heads, errors):
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        torch.set_num_threads(1)
        d = Dist(rank=rank, world=world, distributed=True, sp=world, sp_group=dist.group.WORLD)
        model = _model(kv_heads)
        for layout in _layouts():
            packed, *_ = _inputs(layout)
            shard = shard_packed(packed, group=dist.group.WORLD)
            if layout[0] == "at_a_sequence_boundary":
                assert shard.shard_len == 20 and packed.num_tokens == 40
            # log-probs (no grad): the whole row's on every rank
            want = completion_logprobs(Policy(model), packed, temperature=0.8)
            got = completion_logprobs(Policy(model), packed, temperature=0.8, dist=d)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=layout[0])
            packed, adv, old, ref = _inputs(layout, want)
            for options in LOSSES:
                loss1, m1, g1 = _loss_and_grads(model, packed, adv, old, ref, Dist(), options)
                loss2, m2, g2 = _loss_and_grads(model, packed, adv, old, ref, d, options)
                dist.all_reduce(g2)  # each rank holds the gradient of its own shard's part
                what = f"{layout[0]} {options}"
                assert loss1 != 0, what
                torch.testing.assert_close(loss2, loss1, rtol=1e-5, atol=1e-7, msg=what)
                scale = float(g1.abs().max())
                assert scale > 0, what
                assert float((g2 - g1).abs().max()) <= 1e-5 * scale, (what, float((g2 - g1).abs().max()), scale)
                assert m2.keys() == m1.keys(), what
                for key in m1:
                    torch.testing.assert_close(m2[key], m1[key], rtol=1e-5, atol=1e-6, msg=f"{what} {key}")
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        errors.put(f"rank {rank}: {traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(tmp_path, kv_heads, world=2):
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_worker, args=(world, init, kv_heads, errors), nprocs=world, start_method="spawn")
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, "\n".join(found)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv_heads_split", "kv_heads_replicated"])
def test_two_sequence_parallel_ranks_compute_the_unsharded_loss_gradients_and_metrics(tmp_path, kv_heads):
    _spawn(tmp_path, kv_heads)


@pytest.mark.parametrize("layout", _layouts()[:2], ids=lambda x: x[0])
def test_shard_layout_pads_the_row_with_its_own_segment_and_splits_the_predicted_tokens(layout):
    class Group:  # the two ranks' view without a process group
        def __init__(self, rank):
            self.rank = rank

    packed, *_ = _inputs(layout)
    shards = []
    for rank in range(2):
        with pytest.MonkeyPatch.context() as mpatch:
            mpatch.setattr(dist, "get_world_size", lambda group: 2)
            mpatch.setattr(dist, "get_rank", lambda group: group.rank)
            shards.append(shard_packed(packed, group=Group(rank)))
    a, b = shards
    assert a.shard_len == b.shard_len == 27 and packed.num_tokens == 53
    assert a.cu_seqlens.tolist() == packed.cu_seqlens.tolist() + [54]  # the pad token: a segment of its own
    assert torch.equal(torch.cat([a.input_ids, b.input_ids], 1)[:, :53], packed.input_ids)
    assert b.position_ids[0, -1] == 0  # the pad segment starts its own positions
    if packed.prefix_groups is not None:  # shared prefix: the pad is a prompt of its own, attending to itself
        assert a.prefix_groups == (*packed.prefix_groups, (53, 54, ()))
    both = torch.cat([a.token_index, b.token_index])
    assert sorted(both.tolist()) == list(range(packed.completion_ids.shape[0]))  # every predicted token once
    assert torch.equal(torch.cat([a.logit_rows, b.logit_rows + 27]), packed.logit_rows[both])
