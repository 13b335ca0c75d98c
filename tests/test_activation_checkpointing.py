"""Activation checkpointing (model.activation_checkpointing = "blocks"): the same loss and gradients as without it,
on the tiny Qwen2 and a tiny HF Llama, packed plainly or with shared prefixes, fp32 and bf16 autocast, through the
fused LM-head loss; and it really stops the forward from keeping the blocks' activations."""

import copy

import pytest
import torch
import transformers

from grpo_kernels.packing import pack_sequences
from grpo_kernels.train.config.io import load_config
from grpo_kernels.train.data.tasks import tiny_model
from grpo_kernels.train.model.activation import checkpoint_blocks
from grpo_kernels.train.model.policy import Policy, run_policy


def _llama(seed=0):
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                      max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="grpo_varlen")


def _batch(vocab, shared_prefix, seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts, completions, groups = [], [], []
    for k in range(3):
        prompt = torch.randint(3, vocab, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g)
        for _ in range(2):
            prompts.append(prompt)
            completions.append(torch.randint(3, vocab, (int(torch.randint(1, 13, (1,), generator=g)),), generator=g))
            groups.append(k)
    packed = pack_sequences(prompts, completions, shared_prefix=shared_prefix, group_ids=groups)
    adv = torch.randn(len(prompts), generator=g)
    old = torch.randn(packed.completion_ids.shape[0], generator=g) * 0.1 - 2.0
    return packed, adv, old


def _loss_and_grads(model, packed, adv, old, autocast, **options):
    policy = Policy(model, compute_dtype=torch.bfloat16 if autocast else None)
    policy.zero_grad(set_to_none=True)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        loss, _ = run_policy(policy, packed, adv, temperature=0.9, cu_seqlens=packed.completion_cu_seqlens,
                             old_logps=old, **options)  # fmt: skip
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["blocks", "selective"])
@pytest.mark.parametrize("shared_prefix", [False, True], ids=["plain", "shared_prefix"])
@pytest.mark.parametrize("arch", ["qwen2_tiny", "llama_gqa1"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_checkpointed_blocks_give_the_same_loss_and_gradients_fp32(arch, shared_prefix, loss_type, mode):
    model = tiny_model(97) if arch == "qwen2_tiny" else _llama()
    packed, adv, old = _batch(97, shared_prefix)
    options = dict(loss_type=loss_type, num_items_in_batch=int(packed.completion_ids.shape[0]))
    if loss_type == "grpo":
        options = dict(loss_type="grpo", importance_sampling_level="sequence")
    plain_loss, plain = _loss_and_grads(model, packed, adv, old, False, **options)
    checkpointed = copy.deepcopy(model)
    checkpoint_blocks(checkpointed.base_model.layers, mode)
    loss, grads = _loss_and_grads(checkpointed, packed, adv, old, False, **options)
    assert plain_loss != 0
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=0)
    assert grads.keys() == plain.keys()
    for name in plain:
        torch.testing.assert_close(grads[name], plain[name], rtol=1e-6, atol=1e-9, msg=name)


def test_checkpointed_blocks_give_the_same_gradients_under_bf16_autocast():
    model = tiny_model(97)
    packed, adv, old = _batch(97, True)
    plain_loss, plain = _loss_and_grads(model, packed, adv, old, True, loss_type="dapo",
                                        num_items_in_batch=int(packed.completion_ids.shape[0]))  # fmt: skip
    checkpointed = copy.deepcopy(model)
    checkpoint_blocks(checkpointed.base_model.layers)
    loss, grads = _loss_and_grads(checkpointed, packed, adv, old, True, loss_type="dapo",
                                  num_items_in_batch=int(packed.completion_ids.shape[0]))  # fmt: skip
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=0)  # the recompute repeats the same bf16 ops
    for name in plain:
        torch.testing.assert_close(grads[name], plain[name], rtol=1e-6, atol=1e-9, msg=name)


def _saved_bytes(model, packed):
    """Bytes of the tensors autograd keeps from the forward (what the backward will read)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.base_model(**packed.model_kwargs()).last_hidden_state.sum()
    return total


def test_checkpointing_keeps_far_fewer_activations_and_leaves_names_and_no_grad_passes_alone():
    model = _llama()
    g = torch.Generator().manual_seed(0)
    packed = pack_sequences([torch.randint(3, 97, (20,), generator=g)] * 4,
                            [torch.randint(3, 97, (200,), generator=g) for _ in range(4)])  # fmt: skip
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict())
    before = _saved_bytes(model, packed)
    checkpoint_blocks(model.base_model.layers)
    checkpoint_blocks(model.base_model.layers)  # idempotent
    after = _saved_bytes(model, packed)
    assert after < 0.25 * before, (after, before)
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys
    with torch.no_grad():  # generation / log-prob passes run the blocks plainly
        out = model.base_model(**packed.model_kwargs()).last_hidden_state
    assert out.shape == (1, packed.num_tokens, 64)
    copied = copy.deepcopy(model).base_model.layers[0]
    assert copied._grpo_checkpointed and copied.forward.args[0].__self__ is copied  # a copy recomputes its own block


def test_checkpointing_the_first_blocks_only_keeps_the_rest_and_gives_the_same_loss_and_gradients():
    """What "auto" does when a few blocks' activations fit: "blocks" on the first n, the last keep everything."""
    model = _llama()
    packed, adv, old = _batch(97, True)
    options = dict(loss_type="dapo", num_items_in_batch=int(packed.completion_ids.shape[0]))
    plain_loss, plain = _loss_and_grads(model, packed, adv, old, False, **options)
    saved = {}
    for n in (0, 2, 3):
        partial = copy.deepcopy(model)
        checkpoint_blocks(partial.base_model.layers[:n])
        assert [bool(getattr(b, "_grpo_checkpointed", False)) for b in partial.base_model.layers] == [i < n for i in
                                                                                                      range(3)]
        saved[n] = _saved_bytes(partial, packed)
        loss, grads = _loss_and_grads(partial, packed, adv, old, False, **options)
        torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=0)
        for name in plain:
            torch.testing.assert_close(grads[name], plain[name], rtol=1e-6, atol=1e-9, msg=name)
    # one block's activations fewer per checkpointed block: the saved bytes fall by the same step each time
    step = (saved[0] - saved[3]) / 3
    assert step > 0 and saved[0] - saved[2] == pytest.approx(2 * step, rel=0.05), saved


def test_activation_checkpointing_config_default_and_choices():
    assert load_config().model.activation_checkpointing == "auto"
    assert load_config(overrides=["--model.activation_checkpointing=none"]).model.activation_checkpointing == "none"
    with pytest.raises(ValueError, match="must be one of 'auto', 'none', 'blocks', 'selective', 'offload'"):
        load_config(overrides=["--model.activation_checkpointing=layers"])


def test_offloaded_checkpoints_give_the_same_loss_and_gradients_and_copy_only_the_block_inputs(monkeypatch):
    """"offload": each block's checkpointed input goes through the host-offload hooks (on CPU a copy) once per block
    in the forward and comes back once in the backward; loss and gradients equal "blocks" exactly, with the tiled MLP
    nested inside too; generation passes run plainly."""
    import grpo_kernels.train.model.activation.modes as modes
    from grpo_kernels.train.model.activation import tile_mlps

    model = _llama()
    packed, adv, old = _batch(97, True)
    options = dict(loss_type="dapo", num_items_in_batch=int(packed.completion_ids.shape[0]))
    blocks = copy.deepcopy(model)
    checkpoint_blocks(blocks.base_model.layers)
    ref_loss, ref = _loss_and_grads(blocks, packed, adv, old, False, **options)
    packs, unpacks = [], []
    to_host, from_host = modes._to_host, modes._from_host

    def pack(t):
        out = to_host(t)
        packs.append((tuple(t.shape), out[1].data_ptr() != t.data_ptr()))
        return out

    def unpack(p):
        unpacks.append(p[1].shape)
        return from_host(p)

    monkeypatch.setattr(modes, "_to_host", pack)
    monkeypatch.setattr(modes, "_from_host", unpack)
    for tiled in (False, True):
        offloaded = copy.deepcopy(model)
        checkpoint_blocks(offloaded.base_model.layers, "offload")
        checkpoint_blocks(offloaded.base_model.layers, "offload")  # idempotent
        if tiled:
            tile_mlps(offloaded.base_model.layers, 4)
        packs.clear(), unpacks.clear()
        loss, grads = _loss_and_grads(offloaded, packed, adv, old, False, **options)
        torch.testing.assert_close(loss, ref_loss, rtol=0 if not tiled else 1e-6, atol=0)
        for name in ref:
            torch.testing.assert_close(grads[name], ref[name], rtol=0 if not tiled else 1e-5, atol=0 if not tiled
                                       else 1e-8, msg=name)  # fmt: skip
        assert packs == [((1, packed.num_tokens, 64), True)] * 3, packs  # the 3 blocks' hidden states, copied
        assert len(unpacks) == 3
    with pytest.raises(ValueError, match='already checkpointed in mode "offload", not "blocks"'):
        checkpoint_blocks(offloaded.base_model.layers)
    packs.clear()
    with torch.no_grad():
        offloaded.base_model(**packed.model_kwargs())
    assert packs == []


def test_offload_is_refused_on_a_cpu_run_in_one_line(tmp_path):
    from grpo_kernels.train.trainer import train

    config = load_config(overrides=["--model.activation_checkpointing=offload", "--optim.steps=1",
                                    f"--logging.run_dir={tmp_path / 'run'}"])  # fmt: skip
    with pytest.raises(ValueError, match='"offload" needs a CUDA device .*this run trains on cpu: use "blocks"'):
        train(config, log=lambda *a: None)
    assert not (tmp_path / "run").exists()


def _backward_matmuls(model, packed):
    """How many matmuls the backward runs (a recompute runs the forward's again)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
            return func(*args, **(kwargs or {}))

    out = model.base_model(**packed.model_kwargs()).last_hidden_state.square().sum()
    with Count():
        out.backward()
    return Count.n


def test_selective_checkpointing_recomputes_no_matmul():
    """"selective" keeps the matmul outputs: its backward runs as many matmuls as without checkpointing, while
    "blocks" runs each block's forward matmuls again."""
    g = torch.Generator().manual_seed(0)
    packed = pack_sequences([torch.randint(3, 97, (5,), generator=g)] * 2,
                            [torch.randint(3, 97, (9,), generator=g) for _ in range(2)])  # fmt: skip
    counts = {}
    for mode in ("none", "blocks", "selective"):
        model = _llama()
        if mode != "none":
            checkpoint_blocks(model.base_model.layers, mode)
        counts[mode] = _backward_matmuls(model, packed)
    # "blocks" recomputes 6 of each block's 7 projections (q, k, v, o, gate, up; the recompute stops early once it
    # has down's saved input, so down itself is not run again): 3 x 6
    assert counts["selective"] == counts["none"] and counts["blocks"] == counts["none"] + 18, counts
