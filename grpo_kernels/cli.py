"""Command line: `grpo-kernels demo` (also `python -m grpo_kernels.cli demo`, what `make demo` runs),
`grpo-kernels train [--config FILE | --resume RUN_DIR] [--section.field=value ...]` (grpo_kernels.train.trainer) and
`grpo-kernels prepare-model NAME [--out DIR]` (grpo_kernels.train.model.known) and
`grpo-kernels serve-rollout MODEL_DIR` (a rollout server for `sampling.placement = "decoupled"` with
`sampling.server_urls`).

The demo scores a simulated GRPO batch (prompts of varying difficulty, G completions each, a correctness
reward and a format reward), computes the advantages with the compiled kernel, checks them against the
fp64 reference, and compares the measured invalid-group rate with p^G + (1 - p)^G.
"""

import argparse
import json
import shlex
import sys
import time
import warnings

import torch

from . import reference, theory
from .advantages import group_advantages


def simulated_rewards(num_prompts: int, group_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, 2] rewards (correct in {0, 1}, format in {0, 0.5}) and the per-prompt solve rate p."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(num_prompts, generator=gen) ** 2  # most prompts hard, a few easy
    correct = torch.bernoulli(p.repeat_interleave(group_size), generator=gen)
    formatted = 0.5 * torch.bernoulli(torch.full_like(correct, 0.9), generator=gen)
    return torch.stack([correct, formatted], dim=1), p


def demo(args: argparse.Namespace) -> None:
    g = args.group_size
    rewards, p = simulated_rewards(args.prompts, g, args.seed)
    weights = [1.0, args.format_weight]
    print(f"batch: {args.prompts} prompts x G={g} completions, rewards [N={rewards.shape[0]}, K=2], weights {weights}")

    out = group_advantages(rewards, group_size=g, reward_weights=weights)  # first call sets up the dispatcher
    times = []
    for _ in range(10):
        start = time.perf_counter()
        out = group_advantages(rewards, group_size=g, reward_weights=weights)
        times.append(time.perf_counter() - start)
    elapsed = sorted(times)[len(times) // 2]
    ref = reference.group_advantages(rewards.double(), group_size=g, reward_weights=torch.tensor(weights).double())
    err = (out.advantages.double() - ref.advantages).abs().max().item()
    same_valid = bool(torch.equal(out.valid, ref.valid))
    print(f"C++ kernel: {elapsed * 1e3:.2f} ms (median of 10); max |A - A_fp64| = {err:.2e}; ", end="")
    print(f"valid mask identical: {same_valid}")

    correct_only = group_advantages(rewards[:, 0], group_size=g)
    expected = sum(theory.invalid_group_rate(g, float(q)) for q in p) / len(p)
    print(
        f"invalid groups (correctness reward only): measured {float(correct_only.invalid_fraction):.1%}, "
        f"theory mean_p(p^G + (1-p)^G) = {expected:.1%}; with the format reward: {float(out.invalid_fraction):.1%}"
    )
    print("\ninvalid-group rate p^G + (1-p)^G:")
    sizes = (2, 4, 8, 16, 32, 64)
    print("   p  " + "".join(f"{f'G={s}':>9}" for s in sizes))
    for q in (0.05, 0.1, 0.2, 0.5, 0.8):
        print(f"{q:5.2f} " + "".join(f"{theory.invalid_group_rate(s, q):9.2%}" for s in sizes))
    if err > 1e-4 or not same_valid:
        raise SystemExit("demo: the kernel disagrees with the reference")


def _parser() -> argparse.ArgumentParser:
    """The command line's parser: one sub-command each."""
    parser = argparse.ArgumentParser(prog="grpo-kernels", description="Fused kernels for GRPO training.")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="advantages of a simulated GRPO batch, checked against the reference")
    d.add_argument("--prompts", type=int, default=4096, help="number of prompts (groups)")
    d.add_argument("--group-size", type=int, default=16, help="completions per prompt (G)")
    d.add_argument("--format-weight", type=float, default=0.1, help="weight of the format reward")
    d.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("train", help="GRPO training (grpo_kernels.train); extra --section.field=value override")
    t.add_argument("--config", help="a TOML file (see grpo_kernels/train/config/__init__.py)")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest checkpoint (its config.toml; "
                   "--checkpoint.resume_step=N resumes from step_N instead)")  # fmt: skip
    t.add_argument("--help-config", nargs="?", const="", metavar="SECTION",
                   help="print every --section.field option (or one section's) with its type, default and meaning")
    pm = sub.add_parser("prepare-model", help="convert a known model (smollm2-135m) once into an HF directory")
    pm.add_argument("name", help="a known model: " + ", ".join(_known_models()))
    pm.add_argument("--out", metavar="DIR", help="where to write it (default: the cache, $GRPO_KERNELS_CACHE or "
                    "~/.cache/grpo-kernels)")  # fmt: skip
    sr = sub.add_parser("serve-rollout", help="run a rollout server for sampling.server_urls (a vLLM server with "
                        "the RL routes and the weight-transfer engine); stays in the foreground")  # fmt: skip
    sr.add_argument("model", nargs="?", help="an HF model directory; or give --config")
    sr.add_argument("--config", help="the training config: its model's own directory is served (the trainer sends "
                    "its weights first), in the config's model.dtype and sampling.vllm_enforce_eager")  # fmt: skip
    sr.add_argument("--model-dir", default="rollout-model", help="where --config's model is written when it has no "
                    "directory of its own (the built-in tiny model)")  # fmt: skip
    sr.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this machine "
                    "only); any other needs a key")  # fmt: skip
    sr.add_argument("--api-key-file", metavar="PATH", help="a file holding the key every request must send "
                    "(Authorization: Bearer KEY; the trainer: sampling.server_api_key_env); or set the environment "
                    "variable GRPO_KERNELS_API_KEY. Never on the command line, which other users see")  # fmt: skip
    sr.add_argument("--port", type=int, default=8000)
    sr.add_argument("--tensor-parallel-size", type=int, default=1)
    sr.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    sr.add_argument("--weight-transfer", default="auto", choices=["auto", "gloo", "nccl"])
    sr.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    sr.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None, help="without CUDA graphs "
                    "(default: --config's sampling.vllm_enforce_eager, else eager on CPU only)")  # fmt: skip
    sr.add_argument("--print-command", action="store_true", help="print the server's command and exit")
    ex = sub.add_parser("export", help="a run's checkpoint as a Hugging Face directory (transformers, vllm serve)")
    ex.add_argument("source", help="a run directory (its latest checkpoint) or a checkpoint directory")
    ex.add_argument("out", help="the directory to write (replaced if it exists)")
    ex.add_argument("--step", type=int, default=None, help="checkpoints/step_<N> of the run directory instead")
    ex.add_argument("--overwrite", action="store_true", help="replace OUT if it exists and is not empty")
    ex.add_argument("--base-model", default=None, help="the base model's directory, where the one the checkpoint's "
                    "config names has moved (the architecture and tokenizer; the weights are the checkpoint's)")
    ev = sub.add_parser("eval", help="score a model directory on a run's held-out prompts with its reward functions; "
                        "extra --section.field=value override the run's config")  # fmt: skip
    ev.add_argument("model", help="a Hugging Face model directory (a run's model/, an export, the base model)")
    where = ev.add_mutually_exclusive_group(required=True)
    where.add_argument("--run", help="the run directory whose config.toml sets the task, rewards and sampling")
    where.add_argument("--config", help="a config file instead")
    ev.add_argument("--samples", type=int, default=1, help="answers per prompt (pass@k up to it); default 1")
    ev.add_argument("--out", default=None, help="write completions.jsonl and summary.json to this directory")
    pl = sub.add_parser("plot", help="PNGs of a training run (reward, invalid groups vs theory, throughput)")
    pl.add_argument("run_dir")
    sub.add_parser("group-size-study", add_help=False, help="invalid groups, gradient noise and reward vs G "
                   "(benchmarks/group_size/study.py; its options: group-size-study --help)")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args, overrides = parser.parse_known_args(argv)
    if args.command == "demo":
        if overrides:
            parser.error(f"unrecognized arguments: {' '.join(overrides)}")
        demo(args)
    elif args.command == "train":
        from .train.config.io import load_config

        if args.help_config is not None:
            from .train.config.io import describe

            try:
                print(describe(args.help_config or None), end="")
            except ValueError as exc:
                raise SystemExit(f"grpo-kernels train: error: {exc}") from None
            return
        try:
            if args.resume:
                if args.config:
                    raise ValueError("--resume takes the run's own config.toml; do not also give --config")
                config = load_config(f"{args.resume}/config.toml", [*overrides, f"--checkpoint.resume={args.resume}"])
            else:
                config = load_config(args.config, overrides)
        except (ValueError, NotImplementedError) as exc:  # one clear line, non-zero exit, before the heavy imports
            raise SystemExit(f"grpo-kernels train: error: {exc}") from None
        from .train.rollout.server import RolloutServerError
        from .train.trainer import train

        try:
            train(config)
        except (ValueError, NotImplementedError, RolloutServerError) as exc:
            raise SystemExit(f"grpo-kernels train: error: {exc}") from None
    elif args.command == "serve-rollout":
        if overrides:
            parser.error(f"unrecognized arguments: {' '.join(overrides)}")
        try:
            serve_rollout(args)
        except ValueError as exc:
            raise SystemExit(f"grpo-kernels serve-rollout: error: {exc}") from None
    elif args.command == "prepare-model":
        from .train.model.known import prepare_model

        try:
            print(prepare_model(args.name, out=args.out))
        except ValueError as exc:
            raise SystemExit(f"grpo-kernels prepare-model: error: {exc}") from None
    elif args.command == "export":
        if overrides:
            parser.error(f"unrecognized arguments: {' '.join(overrides)}")
        from .train.checkpoint_export import export_checkpoint

        command = shlex.join(["grpo-kernels", *(argv if argv is not None else sys.argv[1:])])
        try:
            print(export_checkpoint(args.source, args.out, step=args.step, command=command, overwrite=args.overwrite,
                                    base_model=args.base_model))  # fmt: skip
        except ValueError as exc:  # (a damaged checkpoint's CheckpointError too)
            raise SystemExit(f"grpo-kernels export: error: {exc}") from None
    elif args.command == "eval":
        from .train.config.io import load_config

        try:
            with warnings.catch_warnings():  # (the run's own warnings about its logging and checkpoints)
                warnings.simplefilter("ignore")
                config = load_config(args.config or f"{args.run}/config.toml", overrides)
            from .train.evaluate import evaluate_model

            summary = evaluate_model(args.model, config, samples=args.samples, out=args.out)
        except (ValueError, NotImplementedError) as exc:
            raise SystemExit(f"grpo-kernels eval: error: {exc}") from None
        print(json.dumps(summary, indent=1))
    elif args.command == "plot":
        from .train.plot import plot_run

        try:
            for path in plot_run(args.run_dir):
                print(f"wrote {path}")
        except ValueError as exc:
            raise SystemExit(f"grpo-kernels plot: error: {exc}") from None
    elif args.command == "group-size-study":
        _load_benchmark("group_size/study").main(overrides)


def serve_rollout(args: argparse.Namespace) -> None:
    """Replace this process with a rollout server (the command the trainer runs for the servers it starts). It
    listens on 127.0.0.1 unless --host says otherwise; a key (--api-key-file or GRPO_KERNELS_API_KEY, in the
    server's environment) guards every route (grpo_kernels.train.rollout.auth), and a non-loopback host without one
    is refused. The user's VLLM_API_KEY is passed on (vLLM's own check of /v1 and /inference)."""
    import os

    from .train.rollout.auth import KEY_ENV, serve_key
    from .train.rollout.server import RolloutServer

    if (args.model is None) == (args.config is None):
        raise ValueError("give a model directory or --config (not both)")
    key = serve_key(args.api_key_file, args.host, warn=lambda m: print(f"grpo-kernels serve-rollout: {m}",
                                                                      file=sys.stderr))  # fmt: skip
    if not args.print_command:  # before anything is written: a port in use was a traceback from inside vLLM
        from .train.preflight import check_port_free

        check_port_free(args.host, args.port)
    model_dir, max_model_len, eager = args.model, None, args.enforce_eager
    if args.config:
        model_dir, max_model_len, config_eager = _config_model(args)
        eager = config_eager if eager is None else eager
    from .train.rollout.vllm_sampler import engine_enforce_eager

    backend = args.weight_transfer
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    server = RolloutServer(model_dir, host=args.host, port=args.port, tensor_parallel_size=args.tensor_parallel_size,
                           dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization, backend=backend,
                           max_model_len=max_model_len, api_key=key, inherit_vllm_api_key=True,
                           enforce_eager=engine_enforce_eager(eager, cuda=torch.cuda.is_available()))  # fmt: skip
    command = server.command()
    if args.print_command:
        source = ""  # where the key comes from, never the key
        if args.api_key_file:
            source = f'{KEY_ENV}="$(cat {shlex.quote(args.api_key_file)})" '
        elif key:
            source = f"{KEY_ENV}=${KEY_ENV} "
        print(f"{source}VLLM_SERVER_DEV_MODE=1 " + shlex.join(command))
        return
    os.execvpe(command[0], command, server.environment())


def _config_model(args: argparse.Namespace) -> tuple:
    """serve-rollout --config: (the model directory to serve, the run's max_model_len, its vllm_enforce_eager);
    args.dtype set to the run's. The model's own directory is served as it is (the trainer sends its weights before
    the first request, a warm-started or converted model's included), and its weights are not read here (the model
    is built on the meta device: a rollout node need not hold it twice); only the built-in tiny model, which has
    none, is written, once, to --model-dir (grpo_kernels.train.model.export)."""
    from .train.build import load
    from .train.config import for_device
    from .train.config.io import load_config
    from .train.rollout.vllm_sampler import model_directory

    config = for_device(load_config(args.config), "cuda" if torch.cuda.is_available() else "cpu")
    source = model_directory(config.model.name)
    inputs = load(config, weights=source is None)
    max_model_len = inputs.model.generation_config.max_length  # the run's longest prompt + completion (build)
    args.dtype = "bfloat16" if config.model.dtype == "bfloat16" else "float32"
    if source is None:
        from .train.model.export import export_model

        source = export_model(inputs.model, inputs.tok, args.model_dir, dtype=getattr(torch, args.dtype),
                              max_shard_bytes=5 << 30, stop_ids=inputs.tok.stop_ids)  # fmt: skip
    return str(source), max_model_len, config.sampling.vllm_enforce_eager


def _known_models() -> list:
    from .train.model.known import KNOWN_MODELS

    return list(KNOWN_MODELS)


def _load_benchmark(name: str):
    """benchmarks/<name>.py (name: "package/module") of the source checkout (the benchmarks are not part of the
    installed package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    if not path.exists():
        raise SystemExit(f"grpo-kernels: {path} not found: this command needs a source checkout of grpo_kernels")
    spec = importlib.util.spec_from_file_location(f"_grpo_benchmark_{name.replace('/', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    main()
