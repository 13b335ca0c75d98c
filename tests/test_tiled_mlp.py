"""Sequence-tiled MLP (model.mlp_tile_tokens): the same loss and gradients as the plain MLP, alone and under block
checkpointing, on the tiny Qwen2 and a tiny HF Llama, tiles that do not divide the row, fp32 and bf16 autocast,
through the fused LM-head loss; the forward really stops keeping the MLP's intermediates; bad values are refused."""

import copy

import pytest
import torch
from test_activation_checkpointing import _batch, _llama, _loss_and_grads, _saved_bytes

from grpo_kernels.packing import pack_sequences
from grpo_kernels.train.config.io import load_config
from grpo_kernels.train.data.tasks import tiny_model
from grpo_kernels.train.model.activation import checkpoint_blocks, tile_mlps


def _options(packed):
    return dict(loss_type="dapo", num_items_in_batch=int(packed.completion_ids.shape[0]))


@pytest.mark.parametrize("blocks", [False, True], ids=["no_ckpt", "blocks"])
@pytest.mark.parametrize("arch", ["qwen2_tiny", "llama_gqa1"])
@pytest.mark.parametrize("tile", [1, 7, 16])
def test_tiled_mlp_gives_the_same_loss_and_gradients_fp32(arch, blocks, tile):
    model = tiny_model(97) if arch == "qwen2_tiny" else _llama()
    packed, adv, old = _batch(97, shared_prefix=arch == "llama_gqa1")
    assert packed.num_tokens > 16 and packed.num_tokens % 7  # several tiles, the last one short
    plain_loss, plain = _loss_and_grads(model, packed, adv, old, False, **_options(packed))
    tiled = copy.deepcopy(model)
    if blocks:
        checkpoint_blocks(tiled.base_model.layers)
    tile_mlps(tiled.base_model.layers, tile)
    loss, grads = _loss_and_grads(tiled, packed, adv, old, False, **_options(packed))
    assert plain_loss != 0
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=0)
    assert grads.keys() == plain.keys()
    for name in plain:  # a matmul over a tile may round differently in the last bit
        torch.testing.assert_close(grads[name], plain[name], rtol=1e-5, atol=1e-8, msg=name)


def test_tiled_mlp_gives_the_same_gradients_under_bf16_autocast():
    model = tiny_model(97)
    packed, adv, old = _batch(97, True)
    plain_loss, plain = _loss_and_grads(model, packed, adv, old, True, **_options(packed))
    tiled = copy.deepcopy(model)
    checkpoint_blocks(tiled.base_model.layers)
    tile_mlps(tiled.base_model.layers, 5)
    loss, grads = _loss_and_grads(tiled, packed, adv, old, True, **_options(packed))
    torch.testing.assert_close(loss, plain_loss, rtol=2e-2, atol=0)  # bf16 matmuls over other shapes
    for name in plain:
        err = (grads[name] - plain[name]).norm() / plain[name].norm()
        assert err < 2e-2, (name, err.item())


def test_tiled_mlp_keeps_only_its_input_and_leaves_names_and_no_grad_passes_alone():
    model = _llama()  # 3 layers, intermediate size 96
    g = torch.Generator().manual_seed(0)
    packed = pack_sequences([torch.randint(3, 97, (20,), generator=g)] * 4,
                            [torch.randint(3, 97, (200,), generator=g) for _ in range(4)])  # fmt: skip
    names, keys = [n for n, _ in model.named_parameters()], list(model.state_dict())
    with torch.no_grad():
        reference = model.base_model(**packed.model_kwargs()).last_hidden_state
    before = _saved_bytes(model, packed)
    tile_mlps(model.base_model.layers, 64)
    tile_mlps(model.base_model.layers, 64)  # idempotent
    after = _saved_bytes(model, packed)
    # the plain SwiGLU MLP keeps gate, up, act(gate) and their product: 4 x 96 floats per token in each of 3 layers;
    # the tiled one keeps its tiles' input, a view of the normed hidden states that the norm keeps anyway
    mlp_bytes = 3 * packed.num_tokens * 4 * 96 * 4
    assert before - after >= 0.95 * mlp_bytes, (before, after, mlp_bytes)
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys
    with torch.no_grad():  # generation / log-prob passes run the MLP plainly
        torch.testing.assert_close(model.base_model(**packed.model_kwargs()).last_hidden_state, reference)
    copied = copy.deepcopy(model).base_model.layers[0].mlp
    assert copied._grpo_tile_tokens == 64 and copied.forward.args[0].__self__ is copied  # a copy tiles its own MLP
    with pytest.raises(ValueError, match="already tiled at 64 tokens, not 32"):
        tile_mlps(model.base_model.layers, 32)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_tile_mlps_refuses_bad_tiles_and_blocks_without_an_mlp(bad):
    with pytest.raises(ValueError, match="tile_tokens must be an integer >= 1"):
        tile_mlps(_llama().base_model.layers, bad)
    with pytest.raises(ValueError, match="cannot tile the MLP of Linear: it has no `mlp` submodule"):
        tile_mlps([torch.nn.Linear(2, 2)], 4)


def test_mlp_tile_tokens_config_default_and_bounds():
    assert load_config().model.mlp_tile_tokens == 0
    assert load_config(overrides=["--model.mlp_tile_tokens=512"]).model.mlp_tile_tokens == 512
    with pytest.raises(ValueError, match="model.mlp_tile_tokens must be >= 0"):
        load_config(overrides=["--model.mlp_tile_tokens=-1"])
    with pytest.raises(ValueError, match=r"model.mlp_tile_tokens must be below packing.token_budget \(4096"):
        load_config(overrides=["--model.mlp_tile_tokens=4096"])
