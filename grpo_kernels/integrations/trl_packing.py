"""The padding-free loss forward of the TRL drop-in: TRL's padded micro-batch packed into one row.

TRL hands `_compute_loss` left-padded prompts and right-padded completions ([B, P] and [B, C], with masks). The
packed path strips the padding, packs every sample (its real prompt tokens, then its completion up to its last real
token) with `grpo_kernels.packing.pack_sequences`, runs the decoder body on that one row and takes the hidden states
at `logit_rows`: one per completion token, no padding anywhere. With `shared_prefix=True` the samples whose real prompt
ids are identical (TRL repeats each prompt G times) share one copy of it. Tokens that the loss mask excludes
(mask_truncated_completions, tool masks) are still packed: they exist and are attended to, as in TRL's forward for
tool masks, and only the loss skips them. Per-token tensors of TRL's [B, C] layout travel in and out through
`flat` / `padded`, so masks, TRL's own mask functions and metrics see TRL's shapes; the fused loss gets the flat
tokens with `cu_seqlens`.

The attention switch. A packed row needs varlen attention ("grpo_varlen", `grpo_kernels.attention`), while TRL's
own forwards (HF generate, old / reference log-probs) stay padded. `use_packed_attention` therefore sets the model's
attention implementation to "grpo_varlen|<its own>", a function that routes each call by its arguments: a call that
carries `cu_seq_lens_q` (the packed forward's keyword arguments) goes to grpo_varlen, any other to the model's own
sdpa / eager attention; its mask function builds no mask inside `packed_forward()` and the model's own mask
otherwise. The routing reads the call's keyword arguments, not a flag, because gradient checkpointing runs the
decoder layers again during the backward, after the forward has returned. A model loaded with "grpo_varlen" runs
its padded forwards on sdpa. Other attention implementations (flash attention, flex attention, hub kernels) and
attention that grpo_varlen refuses (checked on a two-sample packed row at construction) raise NotImplementedError.
"""

import contextlib
import contextvars
import sys

import torch

from ..attention import HF_ATTENTION_NAME, register_hf_attention
from ..hf_head import backbone
from ..packing import PackedBatch, pack_sequences

__all__ = ["PackedLayout", "PaddedLayout", "pack_trl_batch", "packed_forward", "use_packed_attention"]

_PREFIX = f"{HF_ATTENTION_NAME}|"
_ROUTABLE = ("sdpa", "eager")  # the padded implementations a routed model keeps for TRL's own forwards
_PACKED = contextvars.ContextVar("grpo_kernels_packed_forward", default=False)


@contextlib.contextmanager
def packed_forward():
    """Inside: the routed models' mask functions build no mask (the packed row is delimited by cu_seqlens)."""
    token = _PACKED.set(True)
    try:
        yield
    finally:
        _PACKED.reset(token)


def _register_route(base: str) -> str:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    register_hf_attention()
    name = _PREFIX + base
    if name in ALL_ATTENTION_FUNCTIONS:
        return name

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if kwargs.get("cu_seq_lens_q") is not None:
            function = ALL_ATTENTION_FUNCTIONS[HF_ATTENTION_NAME]
        elif base == "eager":  # transformers' eager attention is each model module's own function
            function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            if function is None:
                raise NotImplementedError(f"{type(module).__name__}'s module has no eager_attention_forward")
        else:
            function = ALL_ATTENTION_FUNCTIONS[base]
        return function(module, query, key, value, attention_mask, *args, **kwargs)

    AttentionInterface.register(name, attention)
    base_mask = ALL_MASK_ATTENTION_FUNCTIONS[base]
    AttentionMaskInterface.register(name, lambda *args, **kwargs: None if _PACKED.get() else base_mask(*args, **kwargs))
    return name


def use_packed_attention(model, *, shared_prefix: bool = False) -> None:
    """Route `model`'s attention (an HF causal LM; sdpa, eager or grpo_varlen) as the module docstring says, then run
    its decoder body on a tiny packed row without gradients; NotImplementedError (the attention restored) when it is
    not an sdpa / eager model or grpo_varlen refuses its attention."""
    current = model.config._attn_implementation
    base = current.removeprefix(_PREFIX)
    base = "sdpa" if base == HF_ATTENTION_NAME else base
    if base not in _ROUTABLE:
        raise NotImplementedError(
            f"the model runs attn_implementation={current!r}; the packed loss forward routes sdpa and eager models "
            "(load it with attn_implementation='sdpa')"
        )
    name = _register_route(base)
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise NotImplementedError(f"{type(model).__name__} cannot change its attention implementation (it does not "
                                  "use transformers' AttentionInterface)")  # fmt: skip
    device = next(model.parameters()).device
    groups = dict(shared_prefix=True, group_ids=[0, 0]) if shared_prefix else {}
    probe = pack_sequences([[0, 0], [0, 0]], [[0], [0, 0]], device=device, **groups)
    try:
        with torch.no_grad(), packed_forward():
            backbone(model)(**probe.model_kwargs())
    except (NotImplementedError, ValueError) as error:
        model.set_attn_implementation(current)
        raise NotImplementedError(str(error).splitlines()[0]) from error


class PaddedLayout:
    """TRL's own layout: the model runs [prompt, completion] padded with the attention mask; the completion's
    hidden states are positions -C - 1 .. -2. Per-token tensors stay [B, C]."""

    def __init__(self, inputs):
        self.inputs = inputs
        self.ids = inputs["completion_ids"]
        self.loss_kwargs = {}

    def model_kwargs(self) -> dict:
        x = self.inputs
        return dict(input_ids=torch.cat([x["prompt_ids"], x["completion_ids"]], dim=1),
                    attention_mask=torch.cat([x["prompt_mask"], x["completion_mask"]], dim=1))  # fmt: skip

    def forward(self):
        return contextlib.nullcontext()

    def hidden(self, last_hidden_state):
        keep = self.ids.shape[1]
        return last_hidden_state[:, -keep - 1 : -1]

    def flat(self, x):
        return x

    def padded(self, x):
        return x

    def router_mask(self):
        return None  # the model's attention mask


class PackedLayout:
    """One packed row (see the module docstring). `select` [B, C] marks the completion positions that are packed
    (each completion up to its last real token); `flat` turns a [B, C] tensor into those N tokens, sample after
    sample, `padded` puts N per-token values back into [B, C] (zeros elsewhere)."""

    def __init__(self, packed: PackedBatch, select: torch.Tensor, ids: torch.Tensor, completion_mask: torch.Tensor):
        self.packed, self.select, self.ids, self.completion_mask = packed, select, ids, completion_mask
        self.loss_kwargs = dict(cu_seqlens=packed.completion_cu_seqlens,
                                max_seqlen=max(int(packed.completion_lengths.max()), 1))  # fmt: skip

    def model_kwargs(self) -> dict:
        return self.packed.model_kwargs()

    def forward(self):
        return packed_forward()

    def hidden(self, last_hidden_state):
        return last_hidden_state[0].index_select(0, self.packed.logit_rows)

    def flat(self, x):
        return x[self.select] if isinstance(x, torch.Tensor) and x.shape == self.select.shape else x

    def padded(self, x):
        out = x.new_zeros(self.select.shape)
        out[self.select] = x
        return out

    def router_mask(self):
        """[1, T]: the tokens TRL's padded forward attends to (1 for prompts, the completion mask for completions,
        so a row that mask_truncated_completions zeroed is left out), for an MoE load-balancing loss."""
        rows, starts = self.packed.sample_rows, self.packed.prompt_lengths.to(self.select.device)
        columns = (starts[:, None] + torch.arange(self.select.shape[1], device=starts.device)[None])
        rows = rows.gather(1, columns.clamp(max=rows.shape[1] - 1))[self.select]
        mask = torch.ones(self.packed.num_tokens, dtype=torch.float32, device=rows.device)
        mask[rows] = self.completion_mask[self.select].float()
        return mask[None]


def pack_trl_batch(inputs, *, pad_token_id: int | None, shared_prefix: bool = False) -> PackedLayout:
    """TRL's micro-batch (prompt_ids / prompt_mask left-padded, completion_ids / completion_mask right-padded) as
    one packed row. A prompt is its tokens under prompt_mask; a completion runs up to its last token that the
    completion mask keeps or that is not pad_token_id (a row that mask_truncated_completions zeroed keeps its
    tokens). shared_prefix: samples with identical prompt ids share one copy of the prompt."""
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    real = completion_mask != 0
    if pad_token_id is not None:
        real = real | (completion_ids != pad_token_id)
    columns = torch.arange(1, completion_ids.shape[1] + 1, device=completion_ids.device)
    lengths = torch.where(real, columns, 0).amax(dim=1) if completion_ids.shape[1] else real.sum(1)
    select = columns[None] <= lengths[:, None]
    cpu_prompts, cpu_mask = prompt_ids.cpu(), prompt_mask.cpu().bool()
    prompts = [row[keep] for row, keep in zip(cpu_prompts, cpu_mask, strict=True)]
    completions = [row[:n] for row, n in zip(completion_ids.cpu(), lengths.tolist(), strict=True)]
    groups = {}
    if shared_prefix:
        ids = [groups.setdefault(tuple(p.tolist()), len(groups)) for p in prompts]
        groups = dict(shared_prefix=True, group_ids=ids)
    packed = pack_sequences(prompts, completions, device=completion_ids.device, **groups)
    return PackedLayout(packed, select, completion_ids[select], completion_mask)
