"""HF models from a local directory: write_tiny_checkpoint -> load_policy gives CharTokenizer's ids and the tiny
model's logits, runs packed with grpo_varlen, and every broken directory is a one-line ValueError naming the cause."""

import json
import shutil

import pytest
import torch
from helpers import assert_close

from grpo_kernels.packing import pack_sequences
from grpo_kernels.train.data.tasks import CharTokenizer, tiny_model
from grpo_kernels.train.model.hf import load_policy, write_tiny_checkpoint

safetensors_torch = pytest.importorskip("safetensors.torch")

SEED = 3
TEXTS = ["reverse:abc=cba", " spaces  inside and around ", "12+30=42", "a, b. c? d: e*f-g", "0123456789", ""]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=SEED)


def copy_of(checkpoint, path, *, drop=()):
    shutil.copytree(checkpoint, path)
    for name in drop:
        (path / name).unlink()
    return path


def edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))


def test_tokenizer_equals_char_tokenizer(checkpoint):
    _, tok = load_policy(checkpoint, attn_implementation="sdpa")
    chars = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, chars.vocab_size)
    for text in TEXTS:
        for bos, eos in [(False, False), (True, False), (True, True)]:
            assert tok.encode(text, bos=bos, eos=eos) == chars.encode(text, bos=bos, eos=eos), text
        ids = tok.encode(text, bos=True, eos=True)
        assert tok.decode(ids) == text
        assert tok.decode(torch.tensor(ids + chars.encode("junk"))) == text  # up to the first eos; tensors too
    with pytest.raises(ValueError, match="cannot encode 'ABC'"):
        tok.encode("ABC")


def test_tokenizer_without_bos_or_pad(checkpoint, tmp_path):
    """Like Qwen's: bos=True prepends nothing, and pad falls back to eos."""
    path = copy_of(checkpoint, tmp_path / "model")
    edit_json(path / "tokenizer_config.json", bos_token=None, pad_token=None)
    _, tok = load_policy(path, attn_implementation="sdpa")
    assert tok.bos_id is None and tok.pad_id == tok.eos_id == 2
    assert tok.encode("ab", bos=True, eos=True) == CharTokenizer().encode("ab", eos=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_equals_tiny_model(checkpoint, dtype):
    state = torch.get_rng_state()
    write_tiny_checkpoint(checkpoint, seed=SEED)  # rewriting is fine, and the global RNG is left alone
    assert torch.equal(torch.get_rng_state(), state)
    model, tok = load_policy(checkpoint, dtype=str(dtype).removeprefix("torch."), attn_implementation="sdpa")
    reference = tiny_model(CharTokenizer().vocab_size, attn_implementation="sdpa", seed=SEED).to(dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied, as tiny_model's
    ids = torch.tensor([tok.encode("reverse:abc=cba", bos=True)])
    with torch.no_grad():
        logits, expected = (m(input_ids=ids, use_cache=False).logits for m in (model, reference))
    if dtype == torch.float32:
        assert torch.equal(logits, expected)
    else:  # the loaded model keeps its rotary frequencies in float32 where `.to(bfloat16)` casts them
        assert_close(logits.float(), expected.float(), name="bfloat16 logits", dtype=dtype)


def test_packed_forward_with_grpo_varlen(checkpoint):
    """Each sample's hidden states in the packed forward equal the sample run alone with SDPA."""
    packed_model, tok = load_policy(checkpoint)
    alone_model, _ = load_policy(checkpoint, attn_implementation="sdpa")
    assert packed_model.config._attn_implementation == "grpo_varlen"
    prompts = [torch.tensor(tok.encode(p, bos=True)) for p in ("12+3=", "reverse:abcd=", "7+7=")]
    completions = [torch.tensor(tok.encode(c), dtype=torch.long) for c in ("15", "dcba", "")]
    packed = pack_sequences(prompts, completions)
    with torch.no_grad():
        hidden = packed_model.base_model(**packed.model_kwargs()).last_hidden_state[0]
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            alone = alone_model.base_model(input_ids=torch.cat([p, c])[None], use_cache=False).last_hidden_state[0]
            rows = hidden[packed.cu_seqlens[i] : packed.cu_seqlens[i + 1]]
            assert_close(rows, alone, name=f"hidden states of sample {i}", rtol=0, atol=1e-5)


def make_broken(case, path, checkpoint):
    """A model path broken in one way; returns it."""
    if case == "a file":
        path.write_text("{}")
    elif case == "no config.json":
        path.mkdir()
    elif case == "not a causal LM":
        copy_of(checkpoint, path)
        (path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    elif case == "broken config.json":
        copy_of(checkpoint, path)
        (path / "config.json").write_text("{not json")
    elif case == "no tokenizer":
        copy_of(checkpoint, path, drop=["tokenizer.json", "tokenizer_config.json"])
    elif case == "no eos":
        copy_of(checkpoint, path)
        edit_json(path / "tokenizer_config.json", eos_token=None)
    elif case == "no weights":
        copy_of(checkpoint, path, drop=["model.safetensors"])
    elif case == "unreadable weights":
        copy_of(checkpoint, path)
        (path / "model.safetensors").write_bytes(b"\x00" * 64)
    elif case == "missing tensor":
        copy_of(checkpoint, path)
        weights = safetensors_torch.load_file(path / "model.safetensors")
        del weights["model.norm.weight"]
        safetensors_torch.save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    elif case == "tokenizer too big":
        copy_of(checkpoint, path)
        tiny_model(CharTokenizer().vocab_size - 8, attn_implementation="sdpa").save_pretrained(path)
    return path


BROKEN = {
    "missing": (r"model path \S+ does not exist", False),
    "a file": (r"model path \S+ is not a directory", False),
    "no config.json": (r"no config\.json in \S+: not an HF model directory", False),
    "not a causal LM": (r"model_type 't5'\) is not a causal LM", False),
    "broken config.json": (r"cannot read \S+config\.json: .*not a valid JSON", True),
    "no tokenizer": (r"no tokenizer files in \S+ \(none of tokenizer\.json, ", False),
    "no eos": ("has no eos token", False),
    "no weights": (r"cannot load the model in \S+: .*no file named .*model\.safetensors", True),
    "unreadable weights": (r"cannot load the model in \S+: ", True),
    "missing tensor": (r"the weights in \S+ lack 1 of the model's tensors, e\.g\. \['model\.norm\.weight'\]", False),
    "tokenizer too big": (r"the tokenizer in \S+ has 48 tokens but the model's embedding only 40 rows", False),
}


@pytest.mark.parametrize("case", BROKEN)
def test_errors_are_one_line_and_name_the_cause(case, checkpoint, tmp_path):
    pattern, wrapped = BROKEN[case]
    path = make_broken(case, tmp_path / "model", checkpoint)
    with pytest.raises(ValueError, match=pattern) as info:
        load_policy(path)
    assert "\n" not in str(info.value)
    assert (info.value.__cause__ is not None) == wrapped


def test_dtype_is_checked(checkpoint):
    with pytest.raises(ValueError, match=r"dtype must be one of \['bfloat16', 'float16', 'float32'\], got 'fp8'"):
        load_policy(checkpoint, dtype="fp8")


def test_generation_config_eos_ids_are_stop_ids_for_decode_and_sampler(checkpoint, tmp_path):
    """An instruction-tuned model may end a turn with an eos of its generation config that is not the tokenizer's."""
    from grpo_kernels.train.rollout.hf_sampler import HFSampler

    path = copy_of(checkpoint, tmp_path / "model")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5], "bos_token_id": 1}))
    model, tok = load_policy(path, attn_implementation="sdpa")
    assert tok.stop_ids == (2, 5)
    chars = CharTokenizer()
    assert tok.decode(chars.encode("ab") + [5] + chars.encode("cd")) == "ab"
    sampler = HFSampler(model, eos_id=tok.eos_id, pad_id=tok.pad_id, stop_ids=tok.stop_ids, max_new_tokens=24,
                        temperature=3.0)  # fmt: skip
    rollout = sampler.sample([tok.encode_prompt("12+3=")], 64, seeds=[0])
    ends = [int(c[-1]) for c in rollout.completion_ids]
    assert 5 in ends, "no completion ended at the extra stop id: the test proves nothing"
    for c in rollout.completion_ids:
        body = c[:-1].tolist()
        assert 2 not in body and 5 not in body
        assert int(c[-1]) in (2, 5) or len(c) == 24
