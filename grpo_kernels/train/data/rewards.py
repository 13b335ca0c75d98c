"""Reward functions the way TRL and verl users write them, and the built-in rewards in the same form.

    task.reward_funcs = ["my_pkg.rewards:correct", "rewards.py:format_ok"]     # module or file, then the function
    task.reward_weights = [1.0, 0.2]                                           # default: 1 each

A spec is "module.path:function" or "path/to/file.py:function" (a file's folder is on sys.path while the file runs,
so its top-level imports may name its neighbours; an import inside a function cannot, so that a neighbour named like
a package never shadows it for the rest of the process; a relative path was resolved when the config loaded:
against the config file's folder, or the working directory for a command-line override). A file without ":function"
means verl's default, `compute_score`.
The names of the built-in rewards ("exact", "numeric", "math_verify", "arith_correct", "arith_format":
grpo_kernels.train.data.rewards_builtin) are specs too.

TRL's calling convention: keyword arguments `prompts`, `completions`, `completion_ids` (one entry per completion),
every other column of the examples as a list (the built-in tasks have one, `answer`), `trainer_state` (its
`global_step`: optimizer steps done) and `log_metric(name, value)` (the step's metrics line gets the mean under
that name). A conversational prompt is its list of messages and its completion `[{"role": "assistant", "content":
text}]`, as TRL passes them. The function returns one number or None per completion (a number: what TRL's
`torch.tensor(values, dtype=torch.float32)` takes, a bool, int or float, numpy's scalars such as np.isclose's
numpy.bool_ too; a list, tuple, tensor or numpy array of them). A function with verl's
signature, `compute_score(data_source, solution_str, ground_truth, extra_info=None)`, is called once per completion
with the completion's text, the columns `data_source` (default: the task's name), `ground_truth` (or
`reward_model["ground_truth"]`, or `answer`) and `extra_info`; it returns a number, or a dict with a "score".

None means "does not apply": it becomes NaN, which the weighted sum skips (TRL's nansum); a completion that every
function returns None for is unscorable: NaN in the rollout, left out of its group's statistics with advantage 0,
and counted in the step's `reward_unscorable_fraction`. `async def` functions run concurrently (asyncio.gather);
plain ones run in the calling thread (signal-based timeouts such as math_verify's work in the main thread only), or
in `task.reward_processes` worker processes, each taking a contiguous slice of the rows. `task.reward_timeout_s`
bounds every call where a hung one can be stopped: a plain function in the main thread (the call is interrupted),
an async one that awaits, and the worker processes (they are stopped); a plain function in another thread (the
decoupled sampler's) cannot be, and the trainer says so when the run starts.

A NaN is taken as None, as TRL takes it (its tensor of the values keeps the NaN and its nansum skips it), with a
warning the first time each function returns one. Anything else a function does wrong is a `RewardError` naming the
function, when ("in training step 3", or which held-out evaluation: the trainer says) and the row: it returns the
wrong number of values, a value that is not a number, or an infinity; or it raises: then the user's file and line
and the user's part of the traceback, from a worker process too (grpo_kernels.train.data.reward_loading).
"""

import asyncio
import math
import numbers
import threading
import time
import warnings
from types import SimpleNamespace

import numpy as np
import torch

from ..config.task import resolve_spec
from .reward_loading import HELD_OUT, RewardError, RewardFunction, load_reward_function, raised_error, user_frames
from .rewards_builtin import BUILTIN, completion_text

__all__ = ["BUILTIN", "RewardError", "RewardFunction", "Rewards", "load_reward_function", "resolve_spec"]


# --------------------------------------------------------------------------------------------------------------
# Scoring a batch.


class Rewards:
    """A run's reward functions with their weights: `score` gives the [N, K] rewards of N completions (NaN where a
    function returned None), `combine` their weighted sum (NaN for an unscorable completion)."""

    def __init__(self, functions: list, weights=None, *, success: str | None = None, timeout_s: float | None = None,
                 processes: int = 0, task_name: str = "task"):  # fmt: skip
        if not functions:
            raise RewardError("task.reward_funcs: at least one reward function")
        names = [f.name for f in functions]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise RewardError(f"task.reward_funcs: two functions are named {twice[0]!r} (the metrics name each one)")
        weights = [1.0] * len(functions) if weights is None else list(weights)
        if len(weights) != len(functions):
            raise RewardError(f"task.reward_weights: {len(weights)} weights for {len(functions)} reward functions")
        if not all(isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w) for w in weights):
            raise RewardError(f"task.reward_weights: finite numbers, got {weights}")
        weights = [float(w) for w in weights]
        if timeout_s is not None and not (isinstance(timeout_s, numbers.Real) and timeout_s > 0):
            raise RewardError(f"task.reward_timeout_s: a number > 0 or None, got {timeout_s!r}")
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 0:
            raise RewardError(f"task.reward_processes: an int >= 0, got {processes!r}")
        if success is not None and success not in names:
            raise RewardError(f"task.success_reward: {success!r} is none of the reward functions ({', '.join(names)})")
        self.functions, self.names, self.weights = list(functions), names, weights
        self.success = names.index(success) if success is not None else 0
        self.timeout_s, self.processes, self.task_name = timeout_s, processes, task_name
        self.logged: dict = {}  # log_metric's values since the last `take_logged`
        self.seconds = 0.0  # spent scoring since the last `take_logged`
        self._pool = None
        self._warned_nan: set = set()  # the functions that returned a NaN (warned once each)

    def score(self, examples, completions, completion_ids, *, step: int, max_steps: int = 0,
              record: bool = True) -> torch.Tensor:  # fmt: skip
        """[N, K] float64: function k's reward of completion i (examples[i] its example: prompt and columns).
        record: count the seconds and log_metric's values for the step (False: a held-out evaluation's)."""
        start = time.perf_counter()
        try:
            return self._score(examples, completions, completion_ids, step=step, max_steps=max_steps, record=record)
        finally:
            if record:
                self.seconds += time.perf_counter() - start

    def _score(self, examples, completions, completion_ids, *, step: int, max_steps: int,
               record: bool) -> torch.Tensor:  # fmt: skip
        n = len(completions)
        if len(examples) != n or len(completion_ids) != n:
            raise ValueError(f"Rewards.score: one example and one completion_ids entry per completion ({n}), got "
                             f"{len(examples)} and {len(completion_ids)}")  # fmt: skip
        columns = _columns(examples)
        kwargs = {"prompts": [e.prompt if isinstance(e.prompt, str) else list(e.prompt) for e in examples],
                  "completions": completions, "completion_ids": completion_ids, **columns,
                  "trainer_state": SimpleNamespace(global_step=step, max_steps=max_steps),
                  "log_metric": self._log_metric if record else _ignore}  # fmt: skip
        out = torch.full((n, len(self.functions)), float("nan"), dtype=torch.float64)
        if n == 0:
            return out
        phase = f"in training step {step}" if record else HELD_OUT  # (what an error says)
        waiting = []
        for k, f in enumerate(self.functions):
            if f.is_async:
                waiting.append(k)
            else:
                out[:, k] = self._checked(f, self._call(f, kwargs, phase), n, phase, kwargs)
        if waiting:
            results = _run_async([self._call_async(self.functions[k], kwargs, phase) for k in waiting])
            for k, values in zip(waiting, results, strict=True):
                out[:, k] = self._checked(self.functions[k], values, n, phase, kwargs)
        return out

    def combine(self, per_func: torch.Tensor) -> torch.Tensor:
        """[N] float64: the weighted sum over the functions, NaN (a function's None) skipped; NaN where every
        function returned None (an unscorable completion)."""
        weights = torch.tensor(self.weights, dtype=torch.float64)
        total = (per_func * weights).nansum(dim=1)
        return total.masked_fill(per_func.isnan().all(dim=1), float("nan"))

    def reward(self, completion: str, example) -> float:
        """The weighted sum of the functions on one (text) completion of example."""
        return float(self.combine(self.score([example], [completion], [[]], step=0, record=False))[0])

    def correct(self, completion: str, example) -> float:
        """The success function's value on one (text) completion of example (what held-out success counts)."""
        return float(self.score([example], [completion], [[]], step=0, record=False)[0, self.success])

    def metrics(self, per_func: torch.Tensor) -> dict:
        """TRL's per-function metrics of [..., K] values: rewards/<name>/mean and /std (unbiased) over the
        completions the function applied to (NaN where it applied to none)."""
        flat, out = per_func.reshape(-1, len(self.names)), {}
        for k, name in enumerate(self.names):
            values = flat[:, k][~flat[:, k].isnan()]
            out[f"rewards/{name}/mean"] = float(values.mean()) if len(values) else float("nan")
            out[f"rewards/{name}/std"] = float(values.std()) if len(values) > 1 else float("nan")
        return out

    def take_logged(self) -> dict:
        """The mean of every log_metric name and the seconds spent scoring (reward_s) since the last call; both
        start again from nothing."""
        out = {name: sum(values) / len(values) for name, values in self.logged.items() if values}
        out["reward_s"] = self.seconds
        self.logged, self.seconds = {}, 0.0
        return out

    def close(self) -> None:
        """Stop the worker processes and whatever they started (each worker leads its own session and group)."""
        if self._pool is not None:
            import os
            import signal

            groups = [w.pid for w in getattr(self._pool, "_pool", ())]  # (multiprocessing.Pool's worker processes)
            self._pool.terminate()  # first: a worker killed while it holds the task queue's lock would hang this
            self._pool.join()
            self._pool = None
            for group in groups:  # what a worker started lives on in its group after it
                try:
                    os.killpg(group, signal.SIGKILL)
                except (ProcessLookupError, PermissionError, TypeError):  # nothing left, or never started
                    pass

    # ---- calls -------------------------------------------------------------------------------------------------

    def _log_metric(self, name: str, value) -> None:
        self.logged.setdefault(str(name), []).append(float(value))

    def _call(self, f: RewardFunction, kwargs: dict, phase: str):
        if self.processes:
            return self._call_in_processes(f, kwargs, phase)
        with _Deadline(self.timeout_s, f, phase):
            try:
                if f.verl:
                    return [_verl_score(f, kwargs, i, self.task_name) for i in range(len(kwargs["completions"]))]
                return f.func(**kwargs)
            except RewardError:
                raise
            except Exception as exc:  # noqa: BLE001  the user's function: its error, with the user's file and line
                raise raised_error(f, type(exc).__name__, str(exc), user_frames(exc), phase) from exc

    async def _call_async(self, f: RewardFunction, kwargs: dict, phase: str):
        try:
            call = f.func(**kwargs)
            return await (asyncio.wait_for(call, self.timeout_s) if self.timeout_s else call)
        except TimeoutError:
            raise RewardError(f"reward function {f.name!r} ({f.spec}) did not return within task.reward_timeout_s "
                              f"= {self.timeout_s} s", phase=phase) from None  # fmt: skip
        except RewardError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise raised_error(f, type(exc).__name__, str(exc), user_frames(exc), phase) from exc

    def _call_in_processes(self, f: RewardFunction, kwargs: dict, phase: str):
        import multiprocessing

        if self._pool is None:  # started (the workers import the functions) before any call's timeout runs
            specs = [g.spec for g in self.functions if not g.is_async]
            self._pool = multiprocessing.get_context("spawn").Pool(self.processes, _start_child, (specs,))
            self._pool.map(_load_in_child, [specs] * (2 * self.processes), chunksize=1)
        n = len(kwargs["completions"])
        bounds = [round(i * n / self.processes) for i in range(self.processes + 1)]
        plain = {k: v for k, v in kwargs.items() if k not in ("trainer_state", "log_metric")}
        state = {"global_step": kwargs["trainer_state"].global_step, "max_steps": kwargs["trainer_state"].max_steps}
        jobs = []
        for a, b in zip(bounds, bounds[1:], strict=False):
            if b > a:
                part = {k: v[a:b] if isinstance(v, list) else v for k, v in plain.items()}
                jobs.append(self._pool.apply_async(_call_in_child, (f.spec, part, state, self.task_name)))
        values = []
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s  # one for the whole batch
        for job in jobs:
            try:
                part, logged, error = job.get(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except multiprocessing.TimeoutError:
                self.close()
                raise RewardError(f"reward function {f.name!r} ({f.spec}) did not return within "
                                  f"task.reward_timeout_s = {self.timeout_s} s", phase=phase,
                                  rest=" (its worker processes were stopped)") from None  # fmt: skip
            if error is not None:  # (the exception's type, its text, the user's frames: as the trainer's own call's)
                raise raised_error(f, *error, phase)
            for name, items in logged.items():
                for value in items:
                    kwargs["log_metric"](name, value)
            if not isinstance(part, list | tuple):  # not one value per row: _checked names what it was
                return part
            values.extend(part)
        return values

    def _checked(self, f: RewardFunction, values, n: int, phase: str, kwargs: dict) -> torch.Tensor:
        """The function's values as [n] float64 (None -> NaN); RewardError naming the function, phase and row."""
        name = f"reward function {f.name!r} ({f.spec})"
        if isinstance(values, torch.Tensor | np.ndarray):
            values = values.tolist()
        if isinstance(values, str | bytes) or not hasattr(values, "__len__"):
            raise RewardError(name, phase=phase, rest=f" returned {type(values).__name__}, not one value per "
                              f"completion ({n})")  # fmt: skip
        if len(values) != n:
            raise RewardError(name, phase=phase, rest=f" returned {len(values)} values for {n} completions (one "
                              "per completion)")  # fmt: skip
        out = []
        for i, v in enumerate(values):
            row = f", row {i} (prompt {_short(kwargs['prompts'][i])})"
            if v is None:
                out.append(float("nan"))
                continue
            number = _number(v)
            if number is None:
                raise RewardError(name, phase=phase, rest=f"{row} returned {type(v).__name__} {_short(v)}: a reward "
                                  "is a number or None")  # fmt: skip
            v = number
            if math.isnan(v):  # TRL's tensor of the values keeps a NaN, and its nansum skips it: as None
                if f.name not in self._warned_nan:
                    self._warned_nan.add(f.name)
                    warnings.warn(f"{name} {phase}{row} returned NaN: taken as None (the function does not apply), "
                                  "as TRL takes it; return None to say so (warned once per function)",
                                  stacklevel=2)  # fmt: skip
                out.append(float("nan"))
                continue
            if math.isinf(v):
                raise RewardError(name, phase=phase, rest=f"{row} returned {v}: a reward is finite")
            out.append(v)
        return torch.tensor(out, dtype=torch.float64)


def _number(v) -> float | None:
    """v as a float when it is a number as TRL's torch.tensor(values, dtype=float32) takes one: a bool, int or float,
    numpy's bool, integer and floating scalars (np.isclose gives a numpy.bool_), a one-element tensor or array;
    None for anything else (a string, a complex number, a date)."""
    if (isinstance(v, torch.Tensor) and v.numel() == 1) or (isinstance(v, np.ndarray) and v.size == 1):
        v = v.item()
    if isinstance(v, np.generic):
        v = v.item()  # numpy.bool_ -> bool, numpy.int64 -> int, numpy.float32 -> float (a longdouble stays one)
    return float(v) if isinstance(v, numbers.Real) else None


def _ignore(name, value) -> None:
    """log_metric during a held-out evaluation: its values are not a training step's."""


def _columns(examples) -> dict:
    """{column: [value per completion]}: every column the examples carry (the built-in ones: answer)."""
    rows = [e.reward_columns() for e in examples]
    keys = list(dict.fromkeys(key for row in rows for key in row))  # every row's, in order (None where absent)
    return {key: [row.get(key) for row in rows] for key in keys}


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _verl_score(f: RewardFunction, kwargs: dict, i: int, task_name: str):
    """verl's compute_score on completion i: a number, or the "score" of the dict it returns."""
    col = lambda key: kwargs[key][i] if key in kwargs else None  # noqa: E731
    truth = col("ground_truth")
    if truth is None and isinstance(col("reward_model"), dict):
        truth = col("reward_model").get("ground_truth")
    if truth is None:
        truth = col("answer")
    result = f.func(data_source=col("data_source") or task_name, solution_str=completion_text(kwargs["completions"][i]),
                    ground_truth=truth, extra_info=col("extra_info"))  # fmt: skip
    return result.get("score") if isinstance(result, dict) else result


def _run_async(coroutines: list) -> list:
    async def gather():
        return await asyncio.gather(*coroutines)

    return asyncio.run(gather())


_CHILD_FUNCTIONS: dict = {}


def _start_child(specs: list) -> None:
    """A worker's start: a session of its own (stopping its group stops what a function started too), a watch on
    the trainer, then the reward functions imported."""
    import os

    os.setsid()  # (a session, not only a group: a background group that writes to a terminal is stopped)
    threading.Thread(target=_end_with_parent, args=(os.getppid(),), daemon=True, name="parent-watch").start()
    _load_in_child(specs)


def _end_with_parent(parent: int) -> None:
    """In a worker: once the trainer is gone (killed: it never closed the pool), end the worker's whole group, what
    a hung function started included. The trainer's own group no longer reaches the worker, and a worker holds its
    task queue's write end, so it would not see the queue close."""
    import os
    import signal

    while os.getppid() == parent:
        time.sleep(0.5)
    os.killpg(0, signal.SIGKILL)


def _load_in_child(specs: list) -> None:
    """The reward functions imported once (a spec that fails is reported by the call)."""
    for spec in specs:
        if spec not in _CHILD_FUNCTIONS:
            try:
                _CHILD_FUNCTIONS[spec] = load_reward_function(spec)
            except RewardError:
                pass


def _call_in_child(spec: str, kwargs: dict, state: dict, task_name: str):
    """In a worker process: (values, log_metric's values, None) or (None, {}, the error: (its type's name, its
    text, the user's frames))."""
    logged: dict = {}
    try:
        if spec not in _CHILD_FUNCTIONS:
            _CHILD_FUNCTIONS[spec] = load_reward_function(spec)
        f = _CHILD_FUNCTIONS[spec]
        kwargs = {**kwargs, "trainer_state": SimpleNamespace(**state)}
        if f.verl:
            return [_verl_score(f, kwargs, i, task_name) for i in range(len(kwargs["completions"]))], logged, None
        log_metric = lambda name, value: logged.setdefault(str(name), []).append(float(value))  # noqa: E731
        if f.is_async:
            return asyncio.run(f.func(**kwargs, log_metric=log_metric)), logged, None
        return f.func(**kwargs, log_metric=log_metric), logged, None
    except Exception as exc:  # noqa: BLE001  sent back as plain data: the parent raises the RewardError
        return None, {}, (type(exc).__name__, str(exc), user_frames(exc))


class _Deadline:
    """task.reward_timeout_s for a plain call in the main thread: a timer sends the main thread SIGINT when the call
    runs past it (KeyboardInterrupt, under Python's default handler), and again every REPEAT_S until the call ends
    (a grader whose bare `except:` swallows one interrupt per item is cut short at each); a call that ran past it is
    a RewardError however it ended, a value returned after swallowing the interrupts included. Where SIGINT is
    ignored (a process a shell started in the background inherits that), Python's handler is put back for the call
    and the ignoring after it: else a hung call would hang the run. Elsewhere: nothing."""

    REPEAT_S = 0.2

    def __init__(self, timeout_s, f: RewardFunction, phase: str):
        self.timeout_s, self.f, self.phase = timeout_s, f, phase
        self.active = bool(timeout_s) and threading.current_thread() is threading.main_thread()
        self.fired = threading.Event()
        self.timer = None

    def __enter__(self):
        self.restore = None
        if self.active:
            import signal

            if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # as a shell leaves a job it starts in the background
                self.restore = signal.signal(signal.SIGINT, signal.default_int_handler)  # for this call only
            target, self.done = threading.main_thread().ident, threading.Event()

            def fire():  # a real SIGINT to the main thread: it also ends a blocking call (a sleep, a socket read)
                if self.done.wait(self.timeout_s):
                    return
                self.fired.set()
                while True:
                    signal.pthread_kill(target, signal.SIGINT)
                    if self.done.wait(self.REPEAT_S):
                        return

            self.start = time.monotonic()
            self.timer = threading.Thread(target=fire, daemon=True, name="reward-deadline")
            self.timer.start()
        return self

    def __exit__(self, kind, value, tb):
        try:
            if self.timer is not None:
                self.done.set()
                self.timer.join()
            if self.fired.is_set():
                took = time.monotonic() - self.start
                try:  # an interrupt sent before the timer stopped may still be pending: it lands here, not later
                    threading.Event().wait(0.05)
                except KeyboardInterrupt:
                    pass
                how = "interrupted" if kind is KeyboardInterrupt else (
                    f"it caught the interrupt and {'returned' if kind is None else 'raised'} after {took:.1f} s")
                raise RewardError(f"reward function {self.f.name!r} ({self.f.spec}) did not return within task."
                                  f"reward_timeout_s = {self.timeout_s} s", phase=self.phase,
                                  rest=f" ({how})") from None  # fmt: skip
            return False
        finally:
            if self.restore is not None:
                import signal

                signal.signal(signal.SIGINT, self.restore)
