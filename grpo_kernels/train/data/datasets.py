"""The examples a run trains on, and reading them: a JSONL file of {"prompt", "answer"} lines (task.name = "jsonl"),
or any dataset (task.name = "dataset"): a local JSON / JSONL / CSV / Parquet file or folder, or a dataset in the local
Hugging Face cache through `datasets.load_dataset` (an extra: the built-in tasks never import it). A prompt is text
or TRL's conversational form, a list of {"role": "system" | "user" | "assistant", "content": text} messages (rendered
by the chat template; a dataset's plain text goes in raw, as TRL feeds it: TaskConfig.prompt_format). A dataset's
other columns go to the reward functions under their own names.

Every bad row is a ValueError naming the file (or split) and the row: no such column, a value of the wrong type, an
empty text, a NUL or a lone surrogate, a key given twice (JSONL), no rows at all.

No request leaves unless asked: `datasets` and `huggingface_hub` run in their offline mode around every load (local
files need no network; `datasets` would otherwise send a download-count request even for a local CSV), and a dataset
name resolves in the local caches only: the one `datasets.load_dataset` fills (what an earlier online load left), then
huggingface_hub's (what `hf download NAME --repo-type dataset` fetched). `download=True` (task.dataset_download) lets
a name go to the Hub.
"""

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Example", "examples_from_rows", "load_jsonl", "load_rows", "read_jsonl"]


@dataclass(frozen=True, slots=True)
class Example:
    """One prompt with its reference answer."""

    prompt: str | tuple
    """Plain text, or a conversation: a tuple of {"role", "content"} dicts (rendered by the chat template)."""
    answer: str | None
    """The reference answer (the SFT warm start's target; None: a dataset without one)."""
    columns: dict = field(default_factory=dict, hash=False)
    """The columns the reward functions get, by name (a dataset's other columns); empty: {"answer": answer}."""

    def reward_columns(self) -> dict:
        return self.columns or {"answer": self.answer}


def load_jsonl(path) -> list[Example]:
    """Examples from a JSONL file of {"prompt", "answer"} objects; a clear ValueError for an unreadable file, bad
    JSON or missing keys."""
    return examples_from_rows(read_jsonl(path), prompt_column="prompt", answer_column="answer", answer_required=True,
                              source=str(path), columns=False)  # fmt: skip


def read_jsonl(path) -> list:
    """[(where, row)] of a JSONL file ("file:line", the object), blank lines skipped; ValueError naming the line for
    an unreadable file, a line that is not one JSON object, or a key given twice."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from exc
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line, object_pairs_hook=_no_duplicate_keys)
        except _DuplicateKey as exc:
            raise ValueError(f"{path}:{number}: key {json.dumps(str(exc))} appears twice in the row (which one is "
                             "meant?)") from None  # fmt: skip
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from exc
        except RecursionError:
            raise ValueError(f"{path}:{number}: not JSON this reader accepts (nested too deeply)") from None
        out.append((f"{path}:{number}", row))
    return out


def load_rows(source: str, split: str, *, download: bool = False) -> list:
    """[(where, row)] of one split of a dataset: a local JSONL file (read here, its errors naming the line), a JSON,
    CSV or Parquet file or a folder of them (the file is the "train" split), or a dataset by name, through
    `datasets.load_dataset`: from the local caches only unless `download` (the module docstring). ValueError for a
    missing path, an unknown format or split, a name no cache holds (with how to fetch it)."""
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".jsonl":
        _only_train(split, source)
        return read_jsonl(path)
    try:
        import datasets
    except ImportError as exc:
        raise ValueError(f"task.dataset {source}: reading it needs the datasets package: pip install "
                         "'grpo-kernels[datasets]'") from exc  # fmt: skip
    if path.is_file():
        builder = _FORMATS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(f"task.dataset {source}: unknown file format {path.suffix!r} (one of "
                             f"{', '.join(sorted(_FORMATS))}, or .jsonl)")  # fmt: skip
        _only_train(split, source)
        if _holds_no_rows(path):
            raise ValueError(f"task.dataset {source}: no examples (the file holds no rows)")
        loaded = _load(datasets, source, split, builder, data_files=str(path), split="train")
    elif path.exists() or source.startswith((".", "/", "~")):
        if not path.exists():
            raise ValueError(f"task.dataset {source}: no such file or folder")
        loaded = _load(datasets, source, split, str(path), split=split)
    elif download:
        loaded = _load(datasets, source, split, source, split=split, offline=False)
    else:
        loaded = _load_cached(datasets, source, split)
    return [(f"{source} [{split}] row {i}", row) for i, row in enumerate(loaded.to_list())]


_FORMATS = {".json": "json", ".csv": "csv", ".parquet": "parquet"}


def _only_train(split: str, source: str) -> None:
    if split != "train":
        raise ValueError(f"task.split / task.eval_split {split!r}: the file {source} is one split, \"train\" (hold "
                         "prompts out with task.num_eval_prompts, or give a folder with a file per split)")


def _holds_no_rows(path: Path) -> bool:
    """An empty file, or a Parquet file of no rows (the datasets library fails on both with a traceback)."""
    if path.stat().st_size == 0:
        return True
    if path.suffix.lower() != ".parquet":
        return False
    try:
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows == 0
    except Exception:  # noqa: BLE001  not a Parquet file pyarrow reads: the loader says why
        return False


@contextmanager
def _offline(datasets):
    """`datasets` and `huggingface_hub` in their offline mode for the block (every request they would make refused
    before it leaves). Both read HF_HUB_OFFLINE / HF_DATASETS_OFFLINE from the environment once, when imported, and
    consult these module constants at each request, so setting the environment here would be too late once either
    is imported (transformers imports huggingface_hub). Process-wide while it lasts: the data is read before the
    run starts anything else."""
    import huggingface_hub.constants as hub

    config = datasets.config
    saved = config.HF_HUB_OFFLINE, config.HF_DATASETS_OFFLINE, hub.HF_HUB_OFFLINE
    config.HF_HUB_OFFLINE = config.HF_DATASETS_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        config.HF_HUB_OFFLINE, config.HF_DATASETS_OFFLINE, hub.HF_HUB_OFFLINE = saved


def _load_cached(datasets, source: str, split: str):
    """A dataset name from the local caches (the module docstring), offline; ValueError saying how to fetch it when
    neither holds it."""
    try:
        return _load(datasets, source, split, source, split=split, missing=(ConnectionError, FileNotFoundError))
    except (ConnectionError, FileNotFoundError):
        pass
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        with _offline(datasets):
            folder = snapshot_download(source, repo_type="dataset", local_files_only=True)
    except (LocalEntryNotFoundError, ValueError, OSError):
        raise ValueError(f"task.dataset {source}: not a local file or folder, and no local Hugging Face cache holds "
                         f"a dataset of that name (no download was tried); fetch it with `hf download {source} "
                         "--repo-type dataset`, or set task.dataset_download = true to let the run fetch "
                         "it") from None  # fmt: skip
    return _load(datasets, source, split, folder, split=split)


def _load(datasets, source: str, wanted: str, *args, offline: bool = True, missing: tuple = (), **kwargs):
    """datasets.load_dataset(*args, **kwargs), offline unless said otherwise; its errors as one ValueError naming
    task.dataset, except those of the types in `missing` (re-raised as they are)."""
    try:
        if not offline:
            return datasets.load_dataset(*args, **kwargs)
        with _offline(datasets):
            return datasets.load_dataset(*args, **kwargs)
    except missing:
        raise
    except ValueError as exc:
        if "corresponds to no data" in str(exc):  # a CSV of a header alone
            raise ValueError(f"task.dataset {source}: no examples (no rows in split {wanted!r})") from exc
        if "split" in str(exc).lower() or "Unknown split" in str(exc):
            raise ValueError(f"task.dataset {source}: no split {wanted!r} ({exc})") from exc
        raise ValueError(f"task.dataset {source}: {exc}") from exc
    except (FileNotFoundError, ConnectionError, OSError) as exc:
        where = "not in the local Hugging Face cache" if offline else "the Hugging Face Hub has no dataset of that name"
        raise ValueError(f"task.dataset {source}: not a local file or folder, and {where} ({type(exc).__name__}: "
                         f"{exc})") from exc  # fmt: skip


def examples_from_rows(rows: list, *, prompt_column: str = "prompt", answer_column: str | None = None,
                       answer_required: bool = False, source: str = "", columns: bool = True) -> list:  # fmt: skip
    """Examples of [(where, row)] rows: the prompt column (text, or a list of {"role", "content"} messages), the
    answer column when named, and (columns=True) every column but the prompt for the reward functions. ValueError
    naming the row for a missing column or a value of the wrong type; for no rows at all."""
    out = []
    for where, row in rows:
        needed = [prompt_column] + ([answer_column] if answer_column is not None and answer_required else [])
        if not isinstance(row, dict):
            raise ValueError(f"{where}: missing key(s) {needed} (a row is an object of columns, got {_shown(row)})")
        missing = [k for k in needed if k not in row]
        if missing:
            have = f" (columns: {', '.join(map(str, row))})" if columns else ""
            raise ValueError(f"{where}: missing key(s) {missing}{have}")
        answer = None
        if answer_column is not None and (answer_required or row.get(answer_column) is not None):
            answer = _answer(row[answer_column], where, answer_column)
        extra = {k: v for k, v in row.items() if k != prompt_column} if columns else {}
        out.append(Example(prompt=_prompt(row[prompt_column], where, prompt_column), answer=answer, columns=extra))
    if not out:
        raise ValueError(f"{source}: no examples")
    return out


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    for k in keys:
        if keys.count(k) > 1:
            raise _DuplicateKey(k)
    return dict(pairs)


def _text(value: str, where: str, what: str) -> str:
    """A JSONL text field: not blank, no NUL and no lone surrogate (neither survives tokenization as written)."""
    if not value.strip():
        raise ValueError(f"{where}: {what} is empty" + (" (only whitespace)" if value else ""))
    if "\x00" in value:
        raise ValueError(f"{where}: {what} contains a NUL character (\\u0000)")
    bad = next((c for c in value if 0xD800 <= ord(c) <= 0xDFFF), None)
    if bad is not None:
        raise ValueError(f"{where}: {what} contains a lone surrogate (\\u{ord(bad):04x}): not encodable text")
    return value


def _answer(value, where: str, column: str = "answer") -> str:
    """An answer: a non-blank string, or a finite number (kept as its JSON text: 4 -> "4", 0.5 -> "0.5")."""
    if isinstance(value, str):
        return _text(value, where, f'"{column}"')
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return str(value)
    raise ValueError(f'{where}: "{column}" must be a string or a finite number, got {_shown(value)}')


def _shown(value) -> str:
    """A JSON value as an error message shows it (NaN and infinities as JSON's readers write them)."""
    try:
        return json.dumps(value)[:80]
    except (ValueError, RecursionError):
        return repr(value)[:80]


CHAT_ROLES = ("system", "user", "assistant")


def _prompt(value, where: str, column: str = "prompt"):
    """A prompt: text, or TRL's conversational form (a non-empty list of {"role", "content"} strings)."""
    if isinstance(value, str):
        return _text(value, where, f'"{column}"')
    if isinstance(value, list) and value and all(
        isinstance(m, dict) and set(m) == {"role", "content"} and all(isinstance(v, str) for v in m.values())
        for m in value
    ):
        for i, m in enumerate(value):
            if m["role"] not in CHAT_ROLES:
                raise ValueError(f'{where}: "{column}" message {i} has role {json.dumps(m["role"])}; a role is one of '
                                 f"{', '.join(CHAT_ROLES)}")  # fmt: skip
            _text(m["content"], where, f'"{column}" message {i}\'s content')
        if not any(m["role"] == "user" for m in value):
            raise ValueError(f'{where}: "{column}" has no user message (roles: '
                             f"{', '.join(m['role'] for m in value)})")  # fmt: skip
        if value[-1]["role"] == "assistant":
            raise ValueError(f'{where}: "{column}" ends with an assistant message: the completion is sampled as the '
                             "assistant's answer to the last user message, so a prompt ends with one")  # fmt: skip
        return tuple({"role": m["role"], "content": m["content"]} for m in value)
    raise ValueError(f'{where}: "{column}" must be a string or a non-empty list of {{"role": str, "content": str}} '
                     f"messages, got {_shown(value)}")  # fmt: skip
