"""The loop state has one writer: only ``LoopState``'s own methods (training/state.py) change its fields.

The check reads the source of the package: an assignment to a LoopState field (``state.step += 1``,
``self.state.running = ...``), an item assignment into one (``state.running["x"] = ...``), or a mutating
call on one (``state.history.setdefault(k, []).append(v)``) anywhere else is reported with its place.
A receiver counts as the loop state when it is named ``state``, ends in ``.state``, or is a local name
bound to one of those.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from mlx_train.training.state import LoopState

SOURCE = Path(__file__).resolve().parents[1] / "src" / "mlx_train"
OWNER = SOURCE / "training" / "state.py"
FIELDS = {f.name for f in dataclasses.fields(LoopState)}
MUTATORS = {"append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault",
            "__setitem__", "__delitem__", "sort", "reverse"}


def _is_state(node: ast.AST, aliases: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id == "state" or node.id in aliases
    return isinstance(node, ast.Attribute) and node.attr == "state"


def _field_of_state(node: ast.AST, aliases: set[str]) -> bool:
    """``node`` is ``<state>.<field>``, possibly under item access or calls (``state.history[k]``)."""
    while isinstance(node, (ast.Subscript, ast.Call)):
        node = node.value if isinstance(node, ast.Subscript) else node.func
        if isinstance(node, ast.Attribute) and node.attr in MUTATORS | {"get"}:
            node = node.value
    return isinstance(node, ast.Attribute) and node.attr in FIELDS and _is_state(node.value, aliases)


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        found = []
        for target in node.targets:
            found += list(target.elts) if isinstance(target, (ast.Tuple, ast.List)) else [target]
        return found
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if isinstance(node, ast.Delete):
        return list(node.targets)
    return []


def _aliases(function: ast.AST) -> set[str]:
    """Local names bound to the loop state: ``state = self.state``, ``cfg, state = self.config, self.state``."""
    names: set[str] = set()
    for node in ast.walk(function):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = (zip(target.elts, node.value.elts, strict=False)
                     if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) else [(target, node.value)])
            for name, value in pairs:
                if isinstance(name, ast.Name) and (_is_state(value, set()) or (
                        isinstance(value, ast.Call) and getattr(value.func, "id", None) == "LoopState")):
                    names.add(name.id)
    return names


def writes_to_loop_state(source: str, filename: str = "<source>") -> list[str]:
    """Every place in ``source`` that changes a LoopState field from outside its methods."""
    tree = ast.parse(source, filename)
    found = []
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    for scope in [tree, *scopes]:
        aliases = _aliases(scope) if scope is not tree else set()
        for node in ast.walk(scope):
            for target in _targets(node):
                if isinstance(target, ast.Attribute) and target.attr in FIELDS and _is_state(target.value, aliases):
                    found.append(f"{filename}:{node.lineno}: assigns {ast.unparse(target)}")
                elif isinstance(target, ast.Subscript) and _field_of_state(target.value, aliases):
                    found.append(f"{filename}:{node.lineno}: assigns into {ast.unparse(target)}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
                    and _field_of_state(node.func.value, aliases)):
                found.append(f"{filename}:{node.lineno}: mutates {ast.unparse(node.func.value)}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args and \
                    _is_state(node.args[0], aliases):
                found.append(f"{filename}:{node.lineno}: setattr on {ast.unparse(node.args[0])}")
    return sorted(set(found))


def test_only_the_loop_state_writes_its_fields():
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        if path != OWNER:
            found += writes_to_loop_state(path.read_text(), str(path.relative_to(SOURCE)))
    assert found == [], "the loop state is changed outside training/state.py; add a LoopState method:\n" + \
        "\n".join(found)


def test_the_check_finds_each_kind_of_write():
    source = '''
def loop(self, trainer):
    cfg, st = self.config, self.state
    st.step += 1
    self.state.running = {}
    trainer.state.running["nonfinite"] = 0
    state.history.setdefault("loss", []).append(1.0)
    state.micro_batch.update({})
    setattr(state, "epoch", 2)
    self.optimizer.state["step"] = 0      # not the loop state
    self.step = 3                          # not the loop state
    state.advance({}, 1)                   # a verb
'''
    found = {line.split(": ", 1)[1] for line in writes_to_loop_state(source)}
    assert found == {"assigns st.step", "assigns self.state.running", "assigns into trainer.state.running['nonfinite']",
                     "mutates state.history", "mutates state.history.setdefault('loss', [])",
                     "mutates state.micro_batch", "setattr on state"}
