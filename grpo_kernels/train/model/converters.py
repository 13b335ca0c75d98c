"""Model converters: the steps that change a run's model after it is loaded (and warm-started) and before anything
copies, checkpoints or shards it: a LoRA adapter, a quantizer, a tied-weight fix.

    [model]
    converters = ["my_package.lora:LoraConverter"]     # applied in this order; a registered name or "module:factory"

A converter is an object with two methods (`ModelConverter`):

    convert(model, config) -> model     # in place or a new module; may rename parameters and freeze some
    hf_weights(named) -> named          # (name, tensor) pairs of the converted model -> the HF checkpoint's
    init_weights(model)                 # optional: sets the parameters it made, after a sharded load (sharded_load)

Everything after the conversion asks the converted model, never assuming a plain HF decoder: the reference policy is
a copy of it, the optimizer gets its `trainable_parameters`, `decoder_blocks` (activation memory, sharding) may be
given by a converter, the checkpoint saves its state, and what leaves the trainer as an HF model (the vLLM
engines' weights, the rollout servers' weight stream, the exported model) goes through `hf_state_dict` /
`hf_named_weights`: the converters' `hf_weights` in reverse order, so the sampler receives the HF names.
"""

import importlib
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, runtime_checkable

import torch

__all__ = ["ModelConverter", "apply_converters", "converters_of", "hf_named_weights", "hf_state_dict",
           "make_converter", "register_converter", "registered_converters", "trainable_parameters"]  # fmt: skip

CONVERTERS_ATTRIBUTE = "grpo_converters"
"""The attribute of a converted model that lists its converters, in the order they were applied (copies keep it)."""


@runtime_checkable
class ModelConverter(Protocol):
    def convert(self, model: torch.nn.Module, config) -> torch.nn.Module:
        """The converted model (config: the run's TrainConfig)."""

    def hf_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The converted model's (name, tensor) pairs as the model before this conversion names (and holds) them.
        Lazy: the weight stream gathers sharded tensors one at a time, in order, on every rank."""


_REGISTRY: dict[str, Callable[[], ModelConverter]] = {}


def register_converter(name: str, factory: Callable[[], ModelConverter]) -> None:
    """Make `model.converters = ["name"]` mean factory(); a name registered twice is an error."""
    if not isinstance(name, str) or not name.strip() or ":" in name:
        raise ValueError(f"a converter's name is a non-empty string without ':', got {name!r}")
    if name in _REGISTRY and _REGISTRY[name] is not factory:
        raise ValueError(f"a model converter named {name!r} is registered already")
    _REGISTRY[name] = factory


def registered_converters() -> list[str]:
    return sorted(_REGISTRY)


def make_converter(spec: str) -> ModelConverter:
    """The converter a spec names: a registered name, or "module:factory" (a class or a function of no arguments)."""
    if spec in _REGISTRY:
        factory = _REGISTRY[spec]
    elif ":" in spec:
        module_name, attribute = spec.rsplit(":", 1)
        try:
            factory = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"model.converters: {spec!r} does not load: {type(exc).__name__}: {exc}") from exc
    else:
        known = ", ".join(registered_converters()) or "none registered"
        raise ValueError(f"model.converters: {spec!r} is neither a registered converter ({known}) nor "
                         "'module:factory'")  # fmt: skip
    converter = factory()
    if not isinstance(converter, ModelConverter):
        raise ValueError(f"model.converters: {spec!r} made a {type(converter).__name__}, which has no convert(model, "
                         "config) and hf_weights(named) methods")  # fmt: skip
    return converter


def apply_converters(model: torch.nn.Module, config, converters: list[ModelConverter]) -> torch.nn.Module:
    """The model after each converter in order, listing them on it (`converters_of`)."""
    for converter in converters:
        done = converters_of(model)
        model = converter.convert(model, config)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{type(converter).__name__}.convert returned a {type(model).__name__}, not a module")
        setattr(model, CONVERTERS_ATTRIBUTE, (*done, converter))
    return model


def converters_of(model: torch.nn.Module) -> tuple:
    return getattr(model, CONVERTERS_ATTRIBUTE, ())


def hf_named_weights(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]):
    """(name, tensor) pairs of `model` (its named parameters or state) as the HF model it was converted from."""
    for converter in reversed(converters_of(model)):
        named = converter.hf_weights(named)
    return named


def hf_state_dict(model: torch.nn.Module, state: dict | None = None) -> dict:
    """The HF checkpoint's {name: tensor} of a (converted) model; state: its state dict if taken already (a full
    one, gathered from the shards)."""
    state = model.state_dict() if state is None else state
    if not converters_of(model):
        return state
    return dict(hf_named_weights(model, state.items()))


def trainable_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer updates: those that require a gradient (a converter may freeze some)."""
    return [p for p in module.parameters() if p.requires_grad]
