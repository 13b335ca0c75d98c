"""The trained model as a Hugging Face directory (grpo_kernels.train.model.export): what a run leaves in
<run_dir>/model/ loads with transformers alone (a subprocess where `import grpo_kernels` fails) and computes the
trained policy's logits; sharding, dtypes, the tokenizer with the run's system prompt, and a failed export that
leaves nothing that looks complete."""

import contextlib
import json
import subprocess
import sys
import types

import pytest
import torch

from grpo_kernels.train.build import build, load
from grpo_kernels.train.config.io import load_config
from grpo_kernels.train.data.tasks import CharTokenizer
from grpo_kernels.train.model import export
from grpo_kernels.train.model.converters import hf_state_dict
from grpo_kernels.train.model.fsdp import SINGLE
from grpo_kernels.train.model.hf import HFTokenizer, char_tokenizer
from grpo_kernels.train.trainer import train

TINY = ["--model.name=tiny", "--task.name=add", "--task.num_eval_prompts=8", "--sampling.group_size=4",
        "--sampling.prompts_per_step=4", "--sampling.max_new_tokens=3", "--model.activation_checkpointing=none",
        "--task.sft_warmup_steps=0"]  # fmt: skip
IDS = [[1, 7, 8, 30, 9, 40], [1, 12, 5, 33, 0, 0]]  # two padded rows of the tiny vocabulary
MASK = [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
LENGTHS = [sum(m) for m in MASK]
PACKED = [[i for row, n in zip(IDS, LENGTHS, strict=True) for i in row[:n]]]  # the two rows in one, no padding
POSITIONS = [[p for n in LENGTHS for p in range(n)]]  # restarting at each row: transformers' packed-sequence form

# Run in a fresh interpreter where this package cannot be imported: each directory's logits on IDS (eager attention)
# and on PACKED (sdpa, no cache: transformers then masks each row from the restarting position ids)
LOAD_ALONE = """
import json, sys
sys.modules["grpo_kernels"] = None  # import grpo_kernels fails
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
ids, mask, packed, positions = json.loads(sys.argv[1])
out = {}
for directory in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(directory)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
        model.set_attn_implementation("sdpa")
        packed_logits = model(input_ids=torch.tensor(packed), position_ids=torch.tensor(positions),
                              use_cache=False).logits
    out[directory] = {"dtype": str(next(model.parameters()).dtype), "logits": logits.float().tolist(),
                      "packed": packed_logits.float().tolist(), "decoded": tok.decode([7, 8, 30])}
print(json.dumps(out))
"""


def _parts(tmp_path, *extra):
    config = load_config(None, [*TINY, f"--logging.run_dir={tmp_path}", *extra])
    stack = contextlib.ExitStack()
    torch.manual_seed(config.seed)
    parts = build(config, SINGLE, resources=stack, run_dir=tmp_path, resuming=False, log=lambda *a, **k: None)
    return config, parts, stack


def _load_alone(*directories) -> dict:
    out = subprocess.run([sys.executable, "-c", LOAD_ALONE, json.dumps([IDS, MASK, PACKED, POSITIONS]),
                          *map(str, directories)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _logits(model) -> torch.Tensor:
    """The trained model's logits on IDS with eager attention (a copy: the run's model keeps its own)."""
    import copy

    twin = copy.deepcopy(model).eval()
    twin.set_attn_implementation("eager")
    with torch.no_grad():
        return twin(input_ids=torch.tensor(IDS), attention_mask=torch.tensor(MASK)).logits


def _packed_logits(model) -> torch.Tensor:
    """The trained model's logits on PACKED as the trainer runs it (its own attention, the rows' cu_seqlens)."""
    cu = torch.tensor([0, LENGTHS[0], sum(LENGTHS)], dtype=torch.int32)
    with torch.no_grad():
        return model(input_ids=torch.tensor(PACKED), position_ids=torch.tensor(POSITIONS), cu_seq_lens_q=cu,
                     cu_seq_lens_k=cu, max_length_q=max(LENGTHS), max_length_k=max(LENGTHS), use_cache=False).logits


def test_an_export_loads_without_the_package_and_computes_the_trained_logits(tmp_path):
    config, parts, stack = _parts(tmp_path / "run")
    with stack:
        model = parts.policy.model
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))  # not the initial weights
        fp32 = export.export_model(model, parts.tok, tmp_path / "fp32", dtype=torch.float32,
                                   max_shard_bytes=200_000, stop_ids=parts.tok.stop_ids)  # fmt: skip
        bf16 = export.export_model(model, parts.tok, tmp_path / "bf16", dtype=torch.bfloat16,
                                   max_shard_bytes=10**9, stop_ids=parts.tok.stop_ids)  # fmt: skip
        want, state, want_packed = _logits(model), hf_state_dict(model), _packed_logits(model)
    assert config.model.attn_implementation == "grpo_varlen"  # the packed rows above ran this package's attention
    index = json.loads((fp32 / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((fp32 / s).stat().st_size <= 200_000 + 70_000 for s in shards)  # one tensor over
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once
    assert not (bf16 / "model.safetensors.index.json").exists() and (bf16 / "model.safetensors").exists()
    got = _load_alone(fp32, bf16)
    assert got[str(fp32)]["dtype"] == "torch.float32" and got[str(bf16)]["dtype"] == "torch.bfloat16"
    assert torch.equal(torch.tensor(got[str(fp32)]["logits"]), want)  # the same weights and ops: the same bits
    packed = torch.tensor(got[str(fp32)]["packed"])  # transformers' own packed attention, another kernel than ours
    torch.testing.assert_close(packed, want_packed, rtol=1e-5, atol=1e-5)
    unpadded = torch.cat([want[0, : LENGTHS[0]], want[1, : LENGTHS[1]]])  # and the padded rows' logits, unpadded
    torch.testing.assert_close(packed[0], unpadded, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(packed[0, LENGTHS[0]:], want[0, : LENGTHS[1]], atol=1e-3)  # row 2 does not see row 1
    assert got[str(fp32)]["decoded"] == parts.tok.decode([7, 8, 30])
    from safetensors.torch import load_file

    halves = load_file(str(bf16 / "model.safetensors"))
    assert all(torch.equal(halves[k], state[k].to(torch.bfloat16)) for k in halves)
    generation = json.loads((fp32 / "generation_config.json").read_text())
    assert generation["eos_token_id"] == parts.tok.eos_id


def test_a_run_ends_with_its_model_and_its_card(tmp_path):
    config = load_config(None, [*TINY, "--optim.steps=2", f"--logging.run_dir={tmp_path}"])
    summary = train(config, log=lambda *a, **k: None)
    card = (tmp_path / "model" / "README.md").read_text()
    assert f"{summary['eval_success_end']:.3f} ± {summary['eval_success_se_end']:.3f} after" in card
    assert "`numeric` x 1" in card and "G = 4" in card and "dapo" in card
    assert "fresh draws of the task's generator" in card  # add's held-out prompts may have been trained on
    jsonl = load_config(None, ["--task.name=jsonl", "--task.path=sums.jsonl"])
    rewards = types.SimpleNamespace(names=["exact"], weights=[1.0], success=0)
    jsonl_card = export.model_card(jsonl, summary, rewards=rewards, tok=CharTokenizer(), command="c")
    assert "(held out of the data: never trained on)" in jsonl_card and "fresh draws" not in jsonl_card
    got = _load_alone(tmp_path / "model")
    assert len(got[str(tmp_path / "model")]["logits"]) == 2
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".model")]  # no partial directory left


def test_the_saved_chat_template_renders_the_runs_system_prompt(tmp_path):
    from transformers import AutoTokenizer


    hf = char_tokenizer(CharTokenizer())
    hf.chat_template = ("{% for m in messages %}{{ m['role'][0] }}{{ m['content'] }}{% endfor %}"
                        "{% if add_generation_prompt %}{{ 'a' }}{% endif %}")  # fmt: skip
    tok = HFTokenizer(hf, chat_template=True, system_prompt="be brief")
    model = torch.nn.Linear(1, 1)
    model.config = type("C", (), {"tie_word_embeddings": False})()
    export._write_tokenizer(tok, tmp_path)
    saved = AutoTokenizer.from_pretrained(tmp_path)
    for prompt in ("1+2=", "34+5="):
        ids = saved.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert list(ids) == tok.encode_prompt(prompt)
    own = [{"role": "system", "content": "x"}, {"role": "user", "content": "1+2="}]
    rendered = saved.apply_chat_template(own, add_generation_prompt=True, tokenize=False)
    assert rendered == "sxu1+2=a"  # a system message of the user's own: the run's is not added
    assert hf.chat_template.startswith("{% for")  # the run's tokenizer is not changed


def test_a_failed_export_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    config, parts, stack = _parts(tmp_path / "run")
    with stack:
        model, out = parts.policy.model, tmp_path / "model"
        export.export_model(model, parts.tok, out, dtype=torch.float32, max_shard_bytes=10**9)
        before = (out / "model.safetensors").read_bytes()
        with torch.no_grad():
            next(model.parameters()).add_(1.0)

        def broken(tok, directory):
            raise OSError("disk full")

        monkeypatch.setattr(export, "_write_tokenizer", broken)
        with pytest.raises(OSError, match="disk full"):
            export.export_model(model, parts.tok, out, dtype=torch.float32, max_shard_bytes=10**9)
    assert (out / "model.safetensors").read_bytes() == before  # the older export untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no partial directory left


def test_export_options_are_checked():
    with pytest.raises(ValueError, match="export.max_shard_size"):
        load_config(None, ["--export.max_shard_size=lots"])
    with pytest.raises(ValueError, match="export.dtype"):
        load_config(None, ["--export.dtype=float16"])
    from grpo_kernels.train.config.run import parse_size

    assert [parse_size(s) for s in ("5GB", "500MB", "2GiB", "1.5KB", 7)] == [5 * 10**9, 5 * 10**8, 2 * 2**30, 1500, 7]


def varied(completions, **kwargs):
    """A reward the untrained tiny model earns unevenly (the task's own it never earns): the steps change weights."""
    return [(len(c) % 3) / 2 for c in completions]


def _tensors(directory) -> dict:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def test_export_of_a_checkpoint_equals_the_run_stopped_there(tmp_path, capsys, monkeypatch):
    from grpo_kernels.cli import main

    short, long, graded = tmp_path / "short", tmp_path / "long", ["--task.reward_funcs=test_export:varied"]
    quiet = dict(log=lambda *a, **k: None)
    train(load_config(None, [*TINY, *graded, "--optim.steps=2", f"--logging.run_dir={short}"]), **quiet)
    train(load_config(None, [*TINY, *graded, "--optim.steps=4", "--checkpoint.every=2", f"--logging.run_dir={long}"]),
          **quiet)  # fmt: skip
    main(["export", str(long), str(tmp_path / "at2"), "--step", "2"])
    main(["export", str(long / "checkpoints" / "step_4"), str(tmp_path / "at4")])
    at2, at4 = _tensors(tmp_path / "at2"), _tensors(tmp_path / "at4")
    end, stopped, start = _tensors(long / "model"), _tensors(short / "model"), load(load_config(None, TINY)).model
    assert sorted(at2) == sorted(stopped) and all(torch.equal(at2[k], stopped[k]) for k in at2)
    assert any(not torch.equal(at2[k], v) for k, v in start.state_dict().items() if k in at2)  # two steps trained
    assert all(torch.equal(at4[k], end[k]) for k in end) and any(not torch.equal(at4[k], at2[k]) for k in at2)
    card = (tmp_path / "at2" / "README.md").read_text()
    assert "Exported from the checkpoint" in card and "step_2" in card and "2 steps of" in card
    (long / "checkpoints" / "step_4" / "trainer_state.json").write_text("{}")
    with pytest.raises(SystemExit, match="damaged checkpoint: .*trainer_state.json"):
        main(["export", str(long), str(tmp_path / "broken")])
    with pytest.raises(SystemExit, match="no checkpoint step_3 .*there are: step_2, step_4"):
        main(["export", str(long), str(tmp_path / "broken"), "--step", "3"])
    assert not (tmp_path / "broken").exists()
    with pytest.raises(SystemExit, match="exists and is not empty: .* --overwrite"):
        main(["export", str(long), str(tmp_path / "at2"), "--step", "2"])
    main(["export", str(long), str(tmp_path / "at2"), "--step", "2", "--overwrite"])
    with pytest.raises(SystemExit, match="inside the run's checkpoints"):
        main(["export", str(long), str(long / "checkpoints" / "exported"), "--step", "2"])
    monkeypatch.setattr(export.shutil, "disk_usage", lambda path: type("U", (), {"free": 1000})())
    with pytest.raises(SystemExit, match=r"needs about 0\.00 GiB and .* has 0\.00 GiB free"):
        main(["export", str(long), str(tmp_path / "full"), "--step", "2"])
    assert not (tmp_path / "full").exists() and not (tmp_path / ".full.partial").exists()


def test_export_of_a_run_whose_base_model_moved_names_it_and_the_option(tmp_path):
    from grpo_kernels.cli import main
    from grpo_kernels.train.model.hf import write_tiny_checkpoint

    base, run = write_tiny_checkpoint(tmp_path / "base"), tmp_path / "run"
    train(load_config(None, [*TINY, f"--model.name={base}", "--optim.steps=1", "--checkpoint.every=1",
                             f"--logging.run_dir={run}"]), log=lambda *a, **k: None)  # fmt: skip
    moved = base.rename(tmp_path / "moved")
    with pytest.raises(SystemExit, match=rf"the base model {base}, named in the config of .*step_1, cannot be found "
                                         r"\(.*\): point to it with --base-model PATH"):  # fmt: skip
        main(["export", str(run), str(tmp_path / "out")])
    with pytest.raises(SystemExit, match=r"--base-model .*nowhere: no such directory"):
        main(["export", str(run), str(tmp_path / "out"), "--base-model", str(tmp_path / "nowhere")])
    other = write_tiny_checkpoint(tmp_path / "other", hidden_size=64)
    with pytest.raises(SystemExit, match=rf"weights of .*step_1 do not fit the base model {other}: Size mismatch"):
        main(["export", str(run), str(tmp_path / "out"), "--base-model", str(other)])
    assert not (tmp_path / "out").exists()
    main(["export", str(run), str(tmp_path / "out"), "--base-model", str(moved)])
    got, end = _tensors(tmp_path / "out"), _tensors(run / "model")
    assert sorted(got) == sorted(end) and all(torch.equal(got[k], end[k]) for k in end)


def test_an_untied_head_is_exported_with_its_own_weights(tmp_path):
    from grpo_kernels.train.data.tasks import tiny_model

    tok = CharTokenizer()
    model = tiny_model(tok.vocab_size, attn_implementation="sdpa", seed=3)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach() + 0.1)  # untied, different
    out = export.export_model(model, tok, tmp_path / "untied", dtype=torch.float32, max_shard_bytes=10**9)
    saved = _tensors(out)
    assert torch.equal(saved["lm_head.weight"], model.lm_head.weight.detach())
    assert not torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])
    got = _load_alone(out)
    assert torch.equal(torch.tensor(got[str(out)]["logits"]), _logits(model))
