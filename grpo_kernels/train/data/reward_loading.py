"""Loading a reward function from its spec (the built-in names, "module:function", "file.py:function"; see
grpo_kernels.train.data.rewards for the forms and the calling conventions), and the error every reward problem is.
A file's folder is on sys.path only while the file runs: its top-level imports may name its neighbours, and a
neighbour named like a package (a safetensors.py) never shadows that package for the rest of the process.

A function that raises is reported with the user's own frame first and the user's part of the traceback after it
(`raised_error`), the same whether it ran in the trainer or in a worker process (`user_frames` there, sent back as
plain tuples):

    reward function 'f' (rewards/my.py:12) raised ZeroDivisionError: division by zero in training step 3
      Traceback of the reward function (most recent call last):
        File "rewards/my.py", line 12, in f
          scale = 1 / len(answer[0])
"""

import asyncio
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from ..config.task import is_file_spec
from .rewards_builtin import BUILTIN

__all__ = ["HELD_OUT", "RewardError", "RewardFunction", "load_reward_function", "raised_error", "user_frames"]

HELD_OUT = "in a held-out evaluation"
"""The phase of a scoring error outside a training step (the trainer names which evaluation: `RewardError.in_phase`)."""


class RewardError(ValueError):
    """A reward function that cannot be loaded, or that did something wrong during a run. A scoring error's text
    names when it happened, its `phase` ("in training step 3", HELD_OUT), between `message` and `rest` (the row, the
    user's traceback, ...)."""

    def __init__(self, message: str, *, phase: str | None = None, rest: str = ""):
        self.message, self.phase, self.rest = message, phase, rest
        super().__init__(message + (f" {phase}" if phase else "") + rest)

    def in_phase(self, phase: str) -> "RewardError":
        """The same error, said to have happened in phase ("in the held-out evaluation before training", ...)."""
        return RewardError(self.message, phase=phase, rest=self.rest)


_CALLERS = (str(Path(__file__).with_name("rewards.py")), os.path.dirname(asyncio.__file__))


def user_frames(exc: BaseException) -> list:
    """The user's part of exc's traceback, outermost first: [(file, line, function, source line)] of every frame
    but this package's calling ones (grpo_kernels.train.data.rewards) and asyncio's."""
    return [(frame.filename, frame.lineno, frame.name, (frame.line or "").strip())
            for frame in traceback.extract_tb(exc.__traceback__)
            if frame.filename != _CALLERS[0] and not frame.filename.startswith(_CALLERS[1] + os.sep)]


def raised_error(f: "RewardFunction", kind: str, text: str, frames: list, phase: str) -> RewardError:
    """The RewardError of f raising kind(text) with the traceback frames (`user_frames`): one line naming the user's
    file and line (the deepest frame in the file the function is in), the user's part of the traceback after it."""
    where = f.spec
    if frames:
        own = [fr for fr in frames if fr[0] == frames[0][0]]
        where = f"{_shown(own[-1][0])}:{own[-1][1]}"
    lines = text.splitlines() or [""]
    head = f"reward function {f.name!r} ({where}) raised {kind}" + (f": {lines[0]}" if lines[0] else "")
    rest = "".join(f'\n    File "{_shown(file)}", line {line}, in {function}' + (f"\n      {source}" if source else "")
                   for file, line, function, source in frames)  # fmt: skip
    if rest:
        rest = "\n  Traceback of the reward function (most recent call last):" + rest
    if len(lines) > 1:  # the whole message, where the first line is not all of it
        rest += "\n  " + f"{kind}: {text}".replace("\n", "\n  ")
    return RewardError(head + (" ..." if len(lines) > 1 else ""), phase=phase, rest=rest)


def _shown(filename: str) -> str:
    """A file as the error shows it: relative to the working directory when it is inside it."""
    try:
        return os.path.relpath(filename) if Path(filename).resolve().is_relative_to(Path.cwd()) else filename
    except (OSError, ValueError):
        return filename


@dataclass(frozen=True)
class RewardFunction:
    """One reward function: its name (metrics: `rewards/<name>/mean`), the callable, how it is called."""

    name: str
    func: object
    spec: str
    verl: bool = False
    """verl's compute_score(data_source, solution_str, ground_truth, extra_info): called once per completion."""

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.func)


# --------------------------------------------------------------------------------------------------------------
# Loading a spec.


_FILE_MODULES: dict = {}


def load_reward_function(spec: str) -> RewardFunction:
    """The reward function a spec names; RewardError (naming the spec) when it does not import or names no
    callable."""
    if not isinstance(spec, str) or not spec.strip():
        raise RewardError(f"task.reward_funcs: a spec is 'module:function' or 'file.py:function', got {spec!r}")
    if spec in BUILTIN:
        if spec == "math_verify" and importlib.util.find_spec("math_verify") is None:
            raise RewardError("task.reward_funcs: the built-in 'math_verify' needs the math-verify package: pip "
                              "install 'grpo-kernels[math]'")  # fmt: skip
        return RewardFunction(spec, BUILTIN[spec], spec)
    if is_file_spec(spec):
        path, name = (spec, "compute_score") if spec.endswith(".py") else spec.rsplit(":", 1)
        module = _import_file(Path(path), spec)
    elif ":" in spec:
        module_name, name = spec.rsplit(":", 1)
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001  whatever importing it raised is the user's to see
            raise RewardError(f"task.reward_funcs: {spec!r}: importing {module_name} failed: "
                              f"{type(exc).__name__}: {exc}") from exc  # fmt: skip
    else:
        raise RewardError(f"task.reward_funcs: {spec!r} is neither a built-in reward ({', '.join(BUILTIN)}) nor "
                          "'module:function' / 'file.py:function'")  # fmt: skip
    func = getattr(module, name, None)
    if func is None or not callable(func):
        found = "nothing" if func is None else f"a {type(func).__name__}, not a function"
        where = getattr(module, "__file__", None) if is_file_spec(spec) else module.__name__
        functions = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_")
                           and getattr(v, "__module__", None) == module.__name__)  # fmt: skip
        raise RewardError(f"task.reward_funcs: {spec!r}: {name} in {where} is {found} (its functions: "
                          f"{', '.join(functions) or 'none'})")  # fmt: skip
    params = inspect.signature(func).parameters
    verl = "solution_str" in params and "ground_truth" in params
    return RewardFunction(getattr(func, "__name__", name), func, spec, verl=verl)


def _import_file(path: Path, spec: str):
    """The file run as a module, once per version of it (a file edited since is run again: a fixed reward file
    for a resumed run in the same process)."""
    path = path.resolve()
    if not path.is_file():
        raise RewardError(f"task.reward_funcs: {spec!r}: no file {path}")
    stat = path.stat()
    key = (path, stat.st_mtime_ns, stat.st_size)
    if key in _FILE_MODULES:
        return _FILE_MODULES[key]
    module_spec = importlib.util.spec_from_file_location(f"grpo_rewards_{path.stem}_{len(_FILE_MODULES)}", path)
    module = importlib.util.module_from_spec(module_spec)
    folder = str(path.parent)
    added = folder not in sys.path
    if added:  # the file may import its neighbours at its top level, and only there: a neighbour named like a
        sys.path.insert(0, folder)  # package (a safetensors.py) must not shadow it for the rest of the process
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001
        raise RewardError(f"task.reward_funcs: {spec!r}: running {path} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)
    _FILE_MODULES[key] = module
    return module
