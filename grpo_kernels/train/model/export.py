"""A run's model as a Hugging Face directory that transformers and `vllm serve` load without this package.

    export_model(model, tok, out, dtype=torch.bfloat16, max_shard_bytes=5 << 30, card=text, stop_ids=..., d=d)

The directory: config.json (its dtype the weights'), the weights as safetensors under their HF names (a converted
model's translated back; a tied LM head stored once), one file or shards of at most max_shard_bytes with
model.safetensors.index.json, generation_config.json with the run's end-of-sequence ids, the tokenizer with its chat
template, and the model card (README.md).

Every rank calls it (FSDP2-sharded parameters are gathered one at a time, a collective, in the same order on every
rank); rank 0 writes. Rank 0 holds at most one shard being filled plus one gathered tensor, never the whole model.
The directory appears complete or not at all: it is written under a temporary name beside `out`, then renamed (an
older `out` is replaced).
"""

import copy
import json
import os
import shutil
from pathlib import Path

import torch

from ..config import TrainConfig
from .converters import hf_named_weights
from .fsdp import SINGLE, Dist, all_gather_objects

__all__ = ["export_dtype", "export_model", "model_card"]

def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def export_model(model, tok, out, *, dtype: torch.dtype, max_shard_bytes: int, card: str | None = None,
                 stop_ids=(), d: Dist = SINGLE) -> Path:  # fmt: skip
    """Write model (FSDP2-sharded or not, converted or not) and its tokenizer as an HF directory at `out`; every rank
    calls it, rank 0 writes; returns `out`."""
    from safetensors.torch import save_file

    out = Path(out)
    tmp = out.with_name(f".{out.name}.partial")
    problem = _disk_problem(model, out, dtype) if d.is_main else None
    problem = all_gather_objects(problem, d)[0]  # (every rank stops, before any collective gather)
    if problem is not None:
        raise ValueError(problem)
    if d.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    parts, shard, size, total, storages = [], {}, 0, 0, set()

    def flush():
        nonlocal shard, size
        if shard:
            path = tmp / f"part-{len(parts):05d}.safetensors"
            save_file(shard, str(path), metadata={"format": "pt"})
            path.chmod(0o644)  # (readable as save_pretrained's files are: a server may run as another user)
            parts.append((path, sorted(shard)))
        shard, size = {}, 0
        storages.clear()

    for name, tensor in hf_named_weights(model, model.state_dict().items()):
        full = _full(tensor)  # (a collective when sharded: every rank takes part)
        if tied and name == "lm_head.weight":
            continue
        if not d.is_main:
            continue
        value = full.detach().to(device="cpu", dtype=dtype if full.is_floating_point() else full.dtype).contiguous()
        nbytes = value.numel() * value.element_size()
        if size and size + nbytes > max_shard_bytes:
            flush()
        # The shard holds the tensor itself (a parameter of an unsharded model is not copied: nothing changes it
        # before the shard is written), unless it shares memory with one held already (safetensors refuses that).
        storage = value.untyped_storage().data_ptr()
        shard[name] = value.clone() if storage in storages else value
        storages.add(shard[name].untyped_storage().data_ptr())
        size += nbytes
        total += nbytes
    if d.is_main:
        _finish(tmp, out, flush, parts, total, model=model, dtype=dtype, tok=tok, stop_ids=stop_ids, card=card)
    if d.distributed:
        torch.distributed.barrier()
    return out


def _finish(tmp: Path, out: Path, flush, parts: list, total: int, *, model, dtype, tok, stop_ids, card) -> None:
    """Rank 0: the last shard, the shards' final names and index, config, tokenizer, card; then the rename (a failure
    leaves only the hidden partial directory, removed)."""
    try:
        flush()
        names = _shard_names(len(parts))
        weight_map = {}
        for (path, keys), final in zip(parts, names, strict=True):
            path.rename(tmp / final)
            weight_map.update(dict.fromkeys(keys, final))
        if len(parts) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        _write_config(model, tmp, dtype, tok, stop_ids)
        _write_tokenizer(tok, tmp)
        if card is not None:
            (tmp / "README.md").write_text(card)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _replace(tmp, out)


def _disk_problem(model, out: Path, dtype: torch.dtype) -> str | None:
    """A line saying the export cannot fit on out's file system (the weights in dtype plus 5 %), else None."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    need = sum(p.numel() * (itemsize if p.is_floating_point() else p.element_size()) for p in model.parameters())
    existing = out.parent
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if free < need * 1.05:
        return (f"exporting the model to {out} needs about {need / 2**30:.2f} GiB and {existing} has "
                f"{free / 2**30:.2f} GiB free")  # fmt: skip
    return None


def _write_config(model, directory: Path, dtype: torch.dtype, tok, stop_ids) -> None:
    from transformers import GenerationConfig

    config = copy.deepcopy(model.config)
    config.dtype = dtype  # (what from_pretrained loads the weights as by default)
    if not getattr(config, "architectures", None):  # (FSDP2 renames a sharded module's class FSDP<name>)
        config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.save_pretrained(directory)
    eos = list(dict.fromkeys([tok.eos_id, *stop_ids]))
    GenerationConfig(eos_token_id=eos if len(eos) > 1 else eos[0], pad_token_id=tok.pad_id,
                     bos_token_id=getattr(model.config, "bos_token_id", None)).save_pretrained(directory)  # fmt: skip


def _write_tokenizer(tok, directory: Path) -> None:
    """The tokenizer as the run used it: a run's system prompt is written into the chat template, rendered when the
    messages bring no system message of their own (so a user's prompt renders to the ids the run trained on)."""
    hf = getattr(tok, "tokenizer", None)
    if hf is None:  # the built-in CharTokenizer: its HF equivalent
        from .hf import char_tokenizer

        hf = char_tokenizer(tok)
    elif getattr(tok, "chat_template", False) and tok.system_prompt is not None:
        hf = copy.deepcopy(hf)
        hf.chat_template = with_default_system(hf.chat_template, tok.system_prompt)
    hf.save_pretrained(directory)


def with_default_system(template: str, system_prompt: str) -> str:
    """A chat template that puts {"role": "system", "content": system_prompt} first when the messages have no
    system message."""
    message = "{'role': 'system', 'content': " + json.dumps(system_prompt) + "}"
    return ("{%- if not messages or messages[0]['role'] != 'system' %}{%- set messages = [" + message
            + "] + messages %}{%- endif %}" + template)  # fmt: skip


def export_dtype(config: TrainConfig) -> torch.dtype:
    """export.dtype: "auto" is the training compute dtype (model.dtype, resolved for the device)."""
    name = config.export.dtype if config.export.dtype != "auto" else config.model.dtype
    return torch.bfloat16 if name == "bfloat16" else torch.float32


def model_card(config: TrainConfig, summary: dict, *, rewards, tok, command: str, source: str | None = None) -> str:
    """README.md of an exported model: what it was trained from and on, how, and its held-out success. command: the
    one that trained it, or (source: the checkpoint) the one that exported it."""
    m, t, s, o = config.model, config.task, config.sampling, config.optim
    base = "the built-in tiny decoder (random initialization)" if m.name == "tiny" else f"`{m.name}`"
    generated = t.name in ("add", "reverse", "arith")
    task = f"`{t.name}` (difficulty {t.difficulty})" if generated else f"`{t.name}`"
    if t.name == "dataset":
        task += f", dataset `{t.dataset}` (split {t.split}, held out: {t.eval_split or 'from the same split'})"
    elif t.name == "jsonl":
        task += f", file `{t.path}`"
    functions = ", ".join(f"`{n}` x {w:g}" for n, w in zip(rewards.names, rewards.weights, strict=True))
    if getattr(tok, "chat_template", False) == "conversational":
        prompts = ("as trl.GRPOTrainer feeds them: a conversational one through the tokenizer's chat template, plain "
                   "text as the tokenizer encodes text (no template)")  # fmt: skip
    elif not getattr(tok, "chat_template", False):
        prompts = "plain text after the bos token (no chat template)"
    elif t.system_prompt is not None:
        prompts = ("the tokenizer's chat template, with the system prompt " + json.dumps(t.system_prompt) + " (the "
                   "saved template adds it when the messages have no system message)")  # fmt: skip
    else:
        prompts = "the tokenizer's chat template"
    n = summary.get("eval_prompts", 0)

    def rate(key):  # over the answers scored: those the success function returned None for are left out, counted
        value, se = summary.get(f"eval_success{key}"), summary.get(f"eval_success_se{key}")
        scored, left = summary.get(f"eval_scored{key}"), summary.get(f"eval_unscorable{key}", 0)
        if value is None or value != value:
            return f"n/a (none of the {left} answers could be scored)" if left and not scored else "n/a"
        return f"{value:.3f} ± {se:.3f}" + (f" ({left} unscorable answers left out, {scored} scored)" if left else "")

    base_tag = "" if m.name == "tiny" or "/" in m.name or Path(m.name).exists() else f"base_model: {m.name}\n"
    return (f"---\nlibrary_name: transformers\n{base_tag}tags:\n- grpo\n- grpo-kernels\n---\n\n"
            f"# {Path(config.logging.run_dir).name}\n\n"
            f"GRPO ({config.loss.loss_type} loss) from {base} on the task {task}, with grpo-kernels.\n\n"
            f"- Reward functions (weights): {functions}; success is `{rewards.names[rewards.success]}`.\n"
            f"- {summary.get('steps', o.steps)} steps of {s.prompts_per_step} prompts x G = {s.group_size} "
            f"completions (temperature {s.temperature:g}, at most {s.max_new_tokens} new tokens), lr {o.lr:g}.\n"
            f"- Held-out success (one sampled answer on each of {n} held-out prompts, ± one binomial standard error): "
            f"{rate('_start')} before, {rate('_end')} after"
            + (" (the held-out prompts are fresh draws of the task's generator, which training may have drawn too:"
               " success on the task, not on unseen prompts).\n" if generated else
               " (held out of the data: never trained on).\n")
            + f"- Prompts: {prompts}.\n"
            f"- Weights: {str(export_dtype(config)).removeprefix('torch.')} (`export.dtype`).\n\n"
            + (f"Exported from the checkpoint {source} with:" if source else "Trained with:")
            + f"\n\n    {command}\n\n(the run's whole configuration: config.toml in its run directory)\n")


def _replace(tmp: Path, out: Path) -> None:
    """tmp becomes out, an older out removed only once the new one is in place."""
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
