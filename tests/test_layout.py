"""The house's rules that code can check (docs/layout.md): no import circle in grpo_kernels/ or benchmarks/, imports
inside functions counted; the trainer's config modules on the ground floor, importing nothing else of train/."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    out = {}
    for package in ("grpo_kernels", "benchmarks"):
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """{module: the modules of these packages it imports}, at any depth of its code (functions too). `from P import
    name` depends on P.name where that is a module, else on P itself, except a module's import of a name of its
    own parent package (the compiled `_C` beside it, say), which runs no code of the package it is not part of."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package[: len(package) - (node.level - 1)]
                    base = ".".join(parent + ([base] if base else []))
                subs = {f"{base}.{a.name}" for a in node.names} & modules.keys()
                deps.update(subs)
                own_parent = name.startswith(base + ".") and modules.get(base, ROOT).name == "__init__.py"
                if len(subs) < len(node.names) and base in modules and not own_parent:
                    deps.add(base)
        graph[name] = deps - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(root):
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_the_package_or_the_benchmarks():
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_a_circle_through_an_import_inside_a_function():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_config_modules_import_nothing_else_of_the_trainer():
    graph = import_graph()
    config_modules = [m for m in graph if m.startswith("grpo_kernels.train.config")]
    assert {"grpo_kernels.train.config", "grpo_kernels.train.config.io"} <= set(config_modules)
    for module in config_modules:
        others = {d for d in graph[module] if d.startswith("grpo_kernels.train") and d not in config_modules}
        assert not others, f"{module} imports {sorted(others)}"


FLOORS = ("kernel", "integrations", "train.config", "train.data", "train.model", "train.rollout", "train", "cli")
"""The floors, ground up: a module imports from its own floor and the floors below, never above. The kernel side
(grpo_kernels/*.py, ops/), the drop-ins for other trainers (integrations/), then the trainer's sub-packages along the
data's way (config, data, model, rollout), the trainer's top (train/*.py: the loop, the step, the build, checkpoints,
run files) and the CLI. integrations/ and the trainer stand side by side: neither imports the other."""


def floor(module: str) -> str:
    parts = module.split(".")
    if module == "grpo_kernels.cli":
        return "cli"
    if parts[1:2] == ["integrations"]:
        return "integrations"
    if parts[1:2] == ["train"]:
        return f"train.{parts[2]}" if len(parts) > 3 or f"train.{parts[2]}" in FLOORS else "train"
    return "kernel"


def floors_broken(graph: dict) -> list:
    broken = []
    for module, deps in graph.items():
        if not module.startswith("grpo_kernels."):  # (the benchmarks stand above every floor)
            continue
        for dep in (d for d in deps if d.startswith("grpo_kernels.")):
            a, b = FLOORS.index(floor(module)), FLOORS.index(floor(dep))
            sideways = {floor(module), floor(dep)} == {"integrations", "train"} or (
                floor(module).startswith("train") and floor(dep) == "integrations")
            if b > a or sideways:
                broken.append((module, dep))
    return broken


def test_the_floors_hold():
    assert floors_broken(import_graph()) == [], FLOORS


def test_the_floor_check_sees_an_upward_import():
    graph = {"grpo_kernels.train.model.hf": {"grpo_kernels.train.rollout.batch", "grpo_kernels.train.data.tasks"},
             "grpo_kernels.train.step": {"grpo_kernels.integrations.hf"}, "grpo_kernels.loss": set(),
             "benchmarks.run": {"grpo_kernels.cli"}}
    assert sorted(floors_broken(graph)) == [("grpo_kernels.train.model.hf", "grpo_kernels.train.rollout.batch"),
                                            ("grpo_kernels.train.step", "grpo_kernels.integrations.hf")]


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 120


def _is_kernel(node) -> bool:
    return any(ast.unparse(d).split("(")[0] in ("triton.jit", "jit") for d in node.decorator_list)


def long_code(path: Path) -> list[str]:
    """What in one file breaks the size rules: the file over MAX_MODULE_LINES, a function (method, nested function)
    over MAX_FUNCTION_LINES; Triton kernels are exempt (one launch is one function)."""
    text = path.read_text()
    out = [f"{path.name}: {len(text.splitlines())} lines"] if len(text.splitlines()) > MAX_MODULE_LINES else []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_kernel(node):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                out.append(f"{path.name}:{node.lineno} {node.name}: {lines} lines")
    return out


def test_no_module_of_the_package_over_500_lines_and_no_function_over_120():
    broken = [b for path in sorted((ROOT / "grpo_kernels").rglob("*.py")) for b in long_code(path)]
    assert not broken, broken


def test_the_size_rule_finds_a_long_function_but_not_a_long_kernel(tmp_path):
    body = "".join(f"    x = {i}\n" for i in range(MAX_FUNCTION_LINES))
    path = tmp_path / "m.py"
    path.write_text(f"import triton\n\n@triton.jit\ndef kernel():\n{body}\n\ndef host():\n{body}")
    assert long_code(path) == [f"m.py:{MAX_FUNCTION_LINES + 7} host: {MAX_FUNCTION_LINES + 1} lines"]


def private_reaches(path: Path) -> list[str]:
    """Where a file imports a private name or module of grpo_kernels, or reaches one (`module._name`) through a name
    it imported from the package."""
    tree, bound, out = ast.parse(path.read_text()), set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "grpo_kernels":
                    bound.add(a.asname or a.name.split(".")[0])
                    out += [f"{path.name}:{node.lineno} import {a.name}"] if "._" in a.name else []
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "grpo_kernels":
            for a in node.names:
                bound.add(a.asname or a.name)
                if "._" in node.module or a.name.startswith("_"):
                    out.append(f"{path.name}:{node.lineno} from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in bound):  # fmt: skip
            out.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    return out


def test_no_benchmark_imports_or_reaches_a_private_name_of_the_package():
    broken = [b for path in sorted((ROOT / "benchmarks").rglob("*.py")) for b in private_reaches(path)]
    assert not broken, broken


def test_the_private_name_finder_finds_each_kind(tmp_path):
    path = tmp_path / "b.py"
    path.write_text("import grpo_kernels._C as C\nfrom grpo_kernels.train import trainer\n"
                    "from grpo_kernels.train.trainer import _run, train\ntrainer._progress(1)\ntrain.__doc__\n")
    assert private_reaches(path) == ["b.py:1 import grpo_kernels._C", "b.py:3 from grpo_kernels.train.trainer import "
                                     "_run", "b.py:4 trainer._progress"]  # fmt: skip


def private_imports(root: Path) -> list[str]:
    """`from <a grpo_kernels module> import _name` lines under root: a private name used by another file (the compiled
    extension, the module `_C`, is the one private name other files import)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("grpo_kernels")):
                found += [f"{path.relative_to(root)}:{node.lineno} {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__") and a.name != "_C"]  # fmt: skip
    return found


def test_no_private_name_is_imported_from_another_file(tmp_path):
    assert private_imports(ROOT / "grpo_kernels") == []
    (tmp_path / "a.py").write_text("from .b import _helper, shared\nfrom . import _C\n")
    assert [line.split(" ")[1] for line in private_imports(tmp_path)] == ["_helper"]
