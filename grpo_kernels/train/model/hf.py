"""Real HF causal LMs from a local directory, for the trainer: the policy, its tokenizer behind CharTokenizer's
interface, and a writer of the built-in tiny model as such a directory.

    model, tok = load_policy("/models/Qwen2.5-0.5B", dtype="bfloat16")
    ids = tok.encode("12+30=", bos=True)          # as CharTokenizer: encode/decode, eos_id, pad_id, bos_id, vocab_size
    ids = tok.encode_prompt("What is 12+30?")     # the chat template's ids when tok.chat_template is on

Design:
- Local only. The path must be an existing directory and every transformers call passes local_files_only=True, so
  nothing is looked up on a hub (no HF_HUB_OFFLINE needed) and a typo is an error, not a download.
- Errors are ValueErrors of one line that name the problem (the CLI prints them as `grpo-kernels train: error: ...`);
  the exception transformers raised, often many lines long, stays attached as __cause__. A checkpoint that lacks
  some of the model's weights is an error too, where transformers would initialise them at random and go on.
- `encode` adds none of the tokenizer's automatic special tokens: text is encoded exactly as given, with a bos/eos
  only when asked for (and bos only when the tokenizer has one: Qwen's has none). Prompts go through `encode_prompt`:
  with `chat_template=True` (the trainer's default for a tokenizer that has one) a prompt, plain text or a list of
  {"role", "content"} messages (TRL's conversational form), becomes the tokenizer's own
  `apply_chat_template(messages, add_generation_prompt=True)` ids, after an optional system message; without it, a
  plain-text prompt is encoded as is after a bos; with `chat_template="conversational"` (a dataset's default: TRL's
  rule) only a list of messages goes through the template, plain text as `tokenizer(text)` encodes it.
- Completions end at any of `stop_ids`: the tokenizer's eos and every eos id the model's generation config names
  (instruction-tuned models often end a turn with a token that is not the tokenizer's eos).
- `write_tiny_checkpoint` saves `tasks.tiny_model` with a `tokenizers` tokenizer that gives CharTokenizer's ids, so
  the HF path loads the same model and tokenizer as model.name = "tiny": tests and examples use it with no download.
"""

import json
from pathlib import Path

import torch

from ...attention import HF_ATTENTION_NAME, check_packed_attention, check_packed_config, register_hf_attention
from ..data.tasks import CharTokenizer, tiny_model
from .converters import hf_state_dict

__all__ = ["HFTokenizer", "char_tokenizer", "checkpoint_weight_names", "load_policy", "save_hf_model",
           "write_tiny_checkpoint"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Files that hold a tokenizer's vocabulary (fast, sentencepiece, BPE, WordPiece). Without any of them, transformers 5
# builds an empty tokenizer for the config's model type instead of failing, so their presence is checked first.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
# A tokenizer_class that means "the pipeline in tokenizer.json, as is" (4.x name, 5.x name). transformers 5's
# AutoTokenizer swaps it for the model type's own class for some types (qwen2, ...), which rebuilds a byte-level BPE
# pipeline around the vocabulary: write_tiny_checkpoint's character tokenizer would lose its spaces. 4.x honours it.
GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _first_line(exc: BaseException) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


class HFTokenizer:
    """A transformers tokenizer with CharTokenizer's interface, plus chat templates.

    `encode` adds no special tokens of its own and applies no chat template; `encode_prompt` applies the chat template
    when `chat_template` is true; `decode` stops at the first stop id and skips special tokens. `pad_id` is the eos id
    when the tokenizer has no pad token; `bos_id` may be None. `vocab_size` is len(tokenizer): the rows the model's
    embedding must have at least (models often have more). `stop_ids`: eos first, then `extra_stop_ids`.
    """

    def __init__(self, tokenizer, *, chat_template: bool = False, system_prompt: str | None = None,
                 extra_stop_ids=()):  # fmt: skip
        if tokenizer.eos_token_id is None:
            raise ValueError(f"the tokenizer of {tokenizer.name_or_path} has no eos token (completions end with one)")
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.bos_id = tokenizer.bos_token_id
        self.pad_id = self.eos_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
        self.stop_ids = tuple(dict.fromkeys([self.eos_id, *(int(i) for i in extra_stop_ids)]))
        self.chat_template, self.system_prompt = False, None
        self.set_prompt_format(chat_template=chat_template, system_prompt=system_prompt)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def set_prompt_format(self, *, chat_template: bool | str, system_prompt: str | None = None) -> None:
        """Use the chat template for prompts (True; ValueError when the tokenizer has none), with an optional system
        message; a system prompt needs the chat template. chat_template="conversational": TRL's rule, the template
        for conversational prompts only (`encode_prompt`)."""
        if chat_template == "conversational":
            if system_prompt is not None:
                raise ValueError("a system prompt needs every prompt through the chat template")
            self.chat_template, self.system_prompt = "conversational", None
            return
        if chat_template and not self.has_chat_template:
            raise ValueError(f"the tokenizer of {self.tokenizer.name_or_path} has no chat template")
        if system_prompt is not None and not chat_template:
            raise ValueError("a system prompt needs the chat template")
        self.chat_template, self.system_prompt = bool(chat_template), system_prompt

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of text as given; bos prepends the bos token if the tokenizer has one, eos appends eos."""
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        except Exception as exc:  # the tokenizers library raises plain Exceptions (e.g. an unknown character)
            raise ValueError(f"the tokenizer cannot encode {text[:40]!r}: {_first_line(exc)}") from exc
        head = [self.bos_id] if bos and self.bos_id is not None else []
        return head + ids + [self.eos_id] * eos

    def encode_prompt(self, prompt) -> list[int]:
        """Token ids of a prompt: plain text, or a list of {"role", "content"} messages (needs the chat template).

        With the chat template: [system message] + (the messages, or one user message holding the text), rendered
        with add_generation_prompt=True, exactly the ids of the tokenizer's `apply_chat_template`. Without it: bos +
        the text. "conversational" (TRL's rule): a list of messages as with the template, plain text as the
        tokenizer encodes text (`tokenizer(text)`: its own special tokens, a bos only where it adds one), the ids
        trl.GRPOTrainer feeds."""
        if self.chat_template == "conversational" and isinstance(prompt, str):
            try:
                return [int(i) for i in self.tokenizer(prompt)["input_ids"]]
            except Exception as exc:  # (as `encode`'s)
                raise ValueError(f"the tokenizer cannot encode {prompt[:40]!r}: {_first_line(exc)}") from exc
        if self.chat_template == "conversational" and not self.has_chat_template:
            raise ValueError("a conversational prompt (a list of messages) needs a chat template; the tokenizer of "
                             f"{self.tokenizer.name_or_path} has none")  # fmt: skip
        if not self.chat_template:
            if not isinstance(prompt, str):
                raise ValueError("a conversational prompt (a list of messages) needs the chat template; the tokenizer "
                                 f"of {self.tokenizer.name_or_path} is set to plain text")  # fmt: skip
            return self.encode(prompt, bos=True)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.system_prompt is not None:
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        try:
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # jinja errors (a role the template rejects, ...)
            raise ValueError(f"the chat template cannot render {messages!r:.80}: {_first_line(exc)}") from exc
        ids = out["input_ids"] if hasattr(out, "keys") else out  # transformers 5 returns a BatchEncoding
        return [int(i) for i in ids]

    def decode(self, ids) -> str:
        """Text of ids up to the first stop id, special tokens skipped, spaces left exactly as tokenized."""
        ids = [int(i) for i in ids]
        ends = [k for k, i in enumerate(ids) if i in self.stop_ids]
        if ends:
            ids = ids[: ends[0]]
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def load_policy(path, *, dtype="float32", attn_implementation: str = HF_ATTENTION_NAME, weights: bool = True):
    """(model, HFTokenizer) of the HF causal LM in the local directory `path`; the model in eval mode, as loaded.
    The tokenizer's stop_ids are its eos and the eos ids of the model's generation config; it encodes prompts as
    plain text until `set_prompt_format(chat_template=True)`.

    Args:
        dtype: parameter dtype, "float32", "bfloat16" or "float16" (or the torch dtype).
        attn_implementation: "grpo_varlen" (packed, padding-free: registered here), "sdpa", "eager", or any other
            name transformers knows.
        weights: False: the model's parameters on the meta device, its buffers computed, the checkpoint's names and
            shapes checked (a tensor of another shape is named); each rank reads its shard later
            (grpo_kernels.train.model.sharded_load).

    Raises:
        ValueError (one line) when the path is not a directory, has no config.json or one that is not a causal LM's,
        has no tokenizer, has weights that cannot be read or miss some of the model's, or when the tokenizer has more
        tokens than the model's embedding has rows, or with "grpo_varlen" when the model's attention has a feature
        packed attention cannot honour (see grpo_kernels.attention.check_packed_attention).
    """
    torch_dtype = _torch_dtype(dtype)
    directory = Path(path)
    if not directory.exists():
        raise ValueError(f"model path {directory} does not exist")
    if not directory.is_dir():
        raise ValueError(f"model path {directory} is not a directory (an HF model directory is expected)")
    config = _check_causal_lm_config(directory)
    if attn_implementation == HF_ATTENTION_NAME:
        try:
            check_packed_config(config)
        except NotImplementedError as exc:
            raise ValueError(f"the model in {directory} cannot run packed: {exc}") from exc
    tokenizer = _load_tokenizer(directory)
    if attn_implementation == HF_ATTENTION_NAME:
        register_hf_attention()
    if weights:
        model = _from_pretrained(directory, torch_dtype, attn_implementation)
    else:
        from .sharded_load import meta_model

        model = meta_model(directory, config, dtype=torch_dtype, attn_implementation=attn_implementation,
                           dtype_kwarg=_dtype_kwarg(torch_dtype))  # fmt: skip
    rows = model.get_input_embeddings().num_embeddings
    if tokenizer.vocab_size > rows:
        raise ValueError(f"the tokenizer in {directory} has {tokenizer.vocab_size} tokens but the model's embedding "
                         f"only {rows} rows")  # fmt: skip
    if attn_implementation == HF_ATTENTION_NAME and weights:  # (a meta model's: once loaded, `load_shards`)
        try:
            check_packed_attention(model)
        except NotImplementedError as exc:
            raise ValueError(f"the model in {directory} cannot run packed: {exc}") from exc
    tokenizer.stop_ids = tuple(dict.fromkeys([tokenizer.eos_id, *_generation_eos_ids(model)]))
    return model, tokenizer


def _from_pretrained(directory: Path, torch_dtype: torch.dtype, attn_implementation: str):
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            directory, local_files_only=True, attn_implementation=attn_implementation, output_loading_info=True,
            **_dtype_kwarg(torch_dtype),
        )  # fmt: skip
    except Exception as exc:
        raise ValueError(f"cannot load the model in {directory}: {_first_line(exc)}") from exc
    missing = sorted(info["missing_keys"])
    if missing:
        raise ValueError(f"the weights in {directory} lack {len(missing)} of the model's tensors, e.g. {missing[:3]}")
    return model


def _generation_eos_ids(model) -> list[int]:
    """The eos ids of the model's generation config (an int, a list, or None)."""
    config = getattr(model, "generation_config", None)
    ids = getattr(config, "eos_token_id", None)
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]


def _torch_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


def _dtype_kwarg(dtype: torch.dtype) -> dict:
    """from_pretrained's dtype keyword: `dtype` since transformers 4.56, `torch_dtype` before (now deprecated)."""
    import transformers
    from packaging.version import Version

    return {"dtype" if Version(transformers.__version__).release >= (4, 56) else "torch_dtype": dtype}


def _check_causal_lm_config(directory: Path):
    """The directory's transformers config, checked to be a causal LM's (ValueError, one line)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if not (directory / "config.json").is_file():
        raise ValueError(f"no config.json in {directory}: not an HF model directory")
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as exc:
        raise ValueError(f"cannot read {directory / 'config.json'}: {_first_line(exc)}") from exc
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"the model in {directory} (model_type {config.model_type!r}) is not a causal LM: "
                         "AutoModelForCausalLM has no class for it")  # fmt: skip
    return config


def _load_tokenizer(directory: Path) -> HFTokenizer:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"no tokenizer files in {directory} (none of {', '.join(TOKENIZER_FILES)})")
    generic = _declared_tokenizer_class(directory) in GENERIC_TOKENIZER_CLASSES
    loader = PreTrainedTokenizerFast if generic and (directory / "tokenizer.json").is_file() else AutoTokenizer
    try:
        tokenizer = loader.from_pretrained(directory, local_files_only=True)
    except Exception as exc:
        raise ValueError(f"cannot load the tokenizer in {directory}: {_first_line(exc)}") from exc
    return HFTokenizer(tokenizer)


def _declared_tokenizer_class(directory: Path):
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):  # none, or broken: AutoTokenizer decides (and reports)
        return None
    return config.get("tokenizer_class") if isinstance(config, dict) else None


def write_tiny_checkpoint(directory, *, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                          seed=0) -> Path:  # fmt: skip
    """Save `tasks.tiny_model` (these sizes, this seed) and a CharTokenizer-equivalent HF tokenizer to `directory`.

    `load_policy(directory)` then gives tiny_model(CharTokenizer().vocab_size, ..., seed=seed)'s weights and a
    tokenizer whose encode/decode equal CharTokenizer's. The global torch RNG is left as it was. Returns the directory.
    """
    directory = Path(directory)
    chars = CharTokenizer()
    with torch.random.fork_rng(devices=[]):
        model = tiny_model(chars.vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                           num_kv_heads=num_kv_heads, head_dim=head_dim, attn_implementation="sdpa",
                           seed=seed)  # fmt: skip
    model.save_pretrained(directory)
    char_tokenizer(chars).save_pretrained(directory)
    return directory


def char_tokenizer(chars: CharTokenizer):
    """A PreTrainedTokenizerFast with CharTokenizer's ids: one WordLevel token per character, spaces included."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(chars.SPECIALS)} | {c: chars.encode(c)[0] for c in chars.ALPHABET}
    backend = Tokenizer(models.WordLevel(vocab))  # no unk token: like CharTokenizer, an unknown character is an error
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()  # tokens joined with nothing between them
    pad, bos, eos = chars.SPECIALS
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=pad, bos_token=bos, eos_token=eos,
                                   clean_up_tokenization_spaces=False)  # fmt: skip


def save_hf_model(model, directory) -> Path:
    """Write a transformers model as a directory vLLM loads (config.json + model.safetensors); returns its path.

    Written here rather than by `save_pretrained`, which writes nothing on ranks other than 0 under torch.distributed,
    while every rank starts its own sampler. An FSDP2-sharded model's tensors are gathered (a collective: every rank
    calls it)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    state = {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().contiguous()
             for name, t in hf_state_dict(model).items()}  # (a converted model's too)
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the checkpoint convention: one copy of a tied matrix
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def checkpoint_weight_names(directory) -> set:
    """Tensor names of the safetensors checkpoint in a directory (single file or sharded with an index)."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    single = directory / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"{directory} has no model.safetensors (nor an index of shards): save_hf_model writes one")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return set(f.keys())
