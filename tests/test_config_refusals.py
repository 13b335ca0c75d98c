"""Config values a new user tried that were accepted silently: each refused with a line naming the option (at load,
or for what depends on the host, by preflight.check before the run starts), or warned about (log and checkpoint
intervals past the run's steps)."""

import warnings

import pytest
import torch

from grpo_kernels.train import preflight
from grpo_kernels.train.config.io import load_config

DECOUPLED = ["--sampling.placement=decoupled", "--sampling.sampler=vllm"]


@pytest.mark.parametrize("overrides, message", [
    (DECOUPLED + ["--sampling.server_urls=http://a:8000,http://A:8000/"],
     "'http://A:8000/' names the same server as item 0"),
    (DECOUPLED + ["--sampling.server_urls=http://a:8000", "--sampling.max_staleness=1000000000"],
     r"sampling.max_staleness must be below optim.steps \(50\)"),
    (["--sampling.temperature=1e-30"], r"sampling.temperature must be >= 0.001"),
    (["--loss.delta=0.5"], r"loss.delta must be above 1 \+ loss.epsilon_high = 1.2"),
    (["--loss.delta=1.2"], r"loss.delta must be above 1 \+ loss.epsilon_high = 1.2"),
    (["--optim.warmup_steps=1000000000"], "optim.warmup_steps = 1000000000 is more than the run's optim.steps = 50"),
])  # fmt: skip
def test_nonsense_values_are_refused_at_load_naming_the_option(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(overrides=overrides)


@pytest.mark.parametrize("overrides, message", [
    (["--sampling.server_devices=abc"], "'abc' is not a list of CPU cores like 0-3,8"),
    (["--sampling.server_devices=0-99"], r"cores \[2, .*99\] are not this process's \(\[0, 1\]\)"),
    (["--sampling.server_devices=0-1"], "leaves the trainer no CPU core of"),
    (["--sampling.server_tensor_parallel_size=4"], "vLLM CPU servers run on one device each"),
])  # fmt: skip
def test_server_devices_on_a_cpu_host_are_its_cores_checked_before_the_run(overrides, message, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})  # the same answer on any machine
    with pytest.raises(ValueError, match=message):
        preflight.check(load_config(overrides=DECOUPLED + overrides), "cpu")
    ok = preflight.check(load_config(overrides=DECOUPLED + ["--sampling.server_devices=1"]), "cpu")
    assert ok.sampling.server_devices == "1"


@pytest.mark.parametrize("overrides, message", [
    (["--sampling.server_devices=0-1"], "server 0's devices '0-1' are not device indices like \"0,1\""),
    (["--sampling.servers=2", "--sampling.server_devices=1;1"], "device 1 is given twice in '1;1'"),
    (["--sampling.server_tensor_parallel_size=2", "--sampling.server_devices=0"], "server 0 lists 1 device"),
    (["--sampling.server_devices=7"], "device 7 does not exist, this node has 4 GPU"),
])  # fmt: skip
def test_server_devices_on_a_gpu_node_are_gpus_checked_before_the_run(overrides, message, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a 4-GPU node, as far as the check can tell
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(ValueError, match=message):
        preflight.check(load_config(overrides=DECOUPLED + overrides), "cuda")
    assert preflight.check(load_config(overrides=DECOUPLED + ["--sampling.servers=2", "--sampling.server_devices=1;3"]),
                           "cuda")  # fmt: skip


def test_sane_values_next_to_the_refused_ones_load():
    config = load_config(overrides=["--sampling.temperature=0.001", "--loss.delta=1.5", "--optim.warmup_steps=50",
                                    "--optim.steps=50"])  # fmt: skip
    assert config.loss.delta == 1.5 and config.optim.warmup_steps == 50


@pytest.mark.parametrize("override, message", [
    ("--logging.log_every=100", "logging.log_every = 100 is more than optim.steps = 50: only the first and the last"),
    ("--checkpoint.every=100", "checkpoint.every = 100 is more than optim.steps = 50: only the final checkpoint"),
    ("--group_size.max_resample_rounds=1000000000", "max_resample_rounds = 1000000000 has no effect: group_size.dyn"),
])  # fmt: skip
def test_intervals_past_the_run_warn(override, message):
    with pytest.warns(UserWarning, match=message):
        load_config(overrides=[override])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(overrides=[override.split("=")[0] + "=50"] + ["--group_size.dynamic_sampling=true"] *
                    ("resample" in override))  # at the run's length (resampling: when it is on): no warning
