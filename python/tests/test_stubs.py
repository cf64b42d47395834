"""The type stub lockstep/_native.pyi (PEP 561, with py.typed beside it) matches the built
extension lockstep._native: the same names, of the same kinds, the same class members, and the
same parameter names, kinds and defaults wherever the extension reports a signature.

The stub is read with `ast`, not imported: it is never executed (type checkers read it)."""

import ast
import inspect
from pathlib import Path

import pytest

import lockstep
from lockstep import _native

PKG = Path(lockstep.__file__).resolve().parent
STUB = PKG / "_native.pyi"

# What every extension module has and a stub does not declare.
MODULE_MACHINERY = {"__builtins__", "__cached__", "__doc__", "__file__", "__loader__", "__name__", "__package__", "__path__", "__spec__"}
# What every class has and a stub does not declare as a member (the constructor is checked apart).
CLASS_MACHINERY = {"__dict__", "__doc__", "__init__", "__module__", "__new__", "__qualname__", "__slots__", "__text_signature__", "__weakref__"}
CONSTRUCTORS = ("__new__", "__init__")


# ---- the stub, read with ast ---------------------------------------------------------------


def _is_type_expression(node):
    """Whether an assigned value is a type (`X = Any`, `X = int | None`, `X = list[int]`): the
    assignment is then a stub-only type alias, not a module attribute."""
    return isinstance(node, (ast.Name, ast.Attribute, ast.Subscript, ast.BinOp))


def _assigned_names(node):
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    names = [t.id for t in targets if isinstance(t, ast.Name)]
    assert len(names) == len(targets), f"{STUB.name}:{node.lineno}: only plain names can be assigned in the stub"
    return names


def _decorators(node):
    out = set()
    for d in node.decorator_list:
        if isinstance(d, ast.Name):
            out.add(d.id)
        elif isinstance(d, ast.Attribute):
            out.add(d.attr)
    return out


def _class_members(cls):
    """{name: kind} of a stub class body ("method", "property", "attribute"), its instance
    attributes (annotations without a value: set on instances, not on the class), and its
    constructor's FunctionDef (or None)."""
    members, instance, ctor = {}, set(), None
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name in CONSTRUCTORS:
                assert ctor is None, f"{STUB.name}:{node.lineno}: {cls.name} declares both __new__ and __init__"
                ctor = node
            else:
                # `@x.setter` completes the property `x` declared above it.
                decorators = _decorators(node)
                members[node.name] = "property" if decorators & {"property", "setter"} else "method"
        elif isinstance(node, ast.AnnAssign) and node.value is None:
            instance.update(_assigned_names(node))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            members.update(dict.fromkeys(_assigned_names(node), "attribute"))
        elif isinstance(node, ast.Pass) or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            continue
        else:
            raise AssertionError(f"{STUB.name}:{node.lineno}: unexpected {type(node).__name__} in class {cls.name}")
    return members, instance, ctor


class Stub:
    """The module-level declarations of the stub."""

    def __init__(self, path):
        self.tree = ast.parse(path.read_text(), filename=str(path))
        self.names = {}  # name -> "class" | "function" | "constant"
        self.aliases = set()  # stub-only type aliases
        self.classes = {}  # name -> ast.ClassDef
        self.functions = {}  # name -> ast.FunctionDef
        self.all = None
        for node in self.tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom, ast.Pass)):
                continue
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                continue  # the module docstring
            if isinstance(node, ast.ClassDef):
                self.names[node.name] = "class"
                self.classes[node.name] = node
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.names[node.name] = "function"
                self.functions[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                alias = node.value is not None and _is_type_expression(node.value)
                for name in _assigned_names(node):
                    if alias:
                        self.aliases.add(name)
                    else:
                        self.names[name] = "constant"
                    if name == "__all__":
                        self.all = ast.literal_eval(node.value)
            else:
                raise AssertionError(f"{STUB.name}:{node.lineno}: unexpected {type(node).__name__} at module level")


@pytest.fixture(scope="module")
def stub():
    assert STUB.is_file(), f"{STUB} is missing (the package's type stub for lockstep._native)"
    return Stub(STUB)


# ---- the extension, inspected -------------------------------------------------------------


def _runtime_kind(obj):
    if isinstance(obj, type):
        return "class"
    return "function" if callable(obj) else "constant"


def _runtime_names():
    return {n: _runtime_kind(getattr(_native, n)) for n in dir(_native) if n not in MODULE_MACHINERY}


def _runtime_members(cls):
    """{name: kind} of what `cls` itself defines (not what it inherits)."""
    out = {}
    for name, value in vars(cls).items():
        if name in CLASS_MACHINERY:
            continue
        if isinstance(value, property) or inspect.isgetsetdescriptor(value) or inspect.ismemberdescriptor(value):
            out[name] = "property"
        elif callable(value) or isinstance(value, (staticmethod, classmethod)):
            out[name] = "method"
        else:
            out[name] = "attribute"
    return out


# ---- signatures ---------------------------------------------------------------------------

_EMPTY = object()


def _stub_params(fn, drop_first):
    """[(name, kind, default)] of a stub function, its first parameter (self, cls) dropped for
    methods and constructors."""
    a, P = fn.args, inspect.Parameter
    defaults = [_EMPTY] * (len(a.posonlyargs) + len(a.args) - len(a.defaults)) + [ast.literal_eval(d) for d in a.defaults]
    out = []
    for i, p in enumerate(a.posonlyargs + a.args):
        kind = P.POSITIONAL_ONLY if i < len(a.posonlyargs) else P.POSITIONAL_OR_KEYWORD
        out.append((p.arg, kind, defaults[i]))
    if a.vararg:
        out.append((a.vararg.arg, P.VAR_POSITIONAL, _EMPTY))
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((p.arg, P.KEYWORD_ONLY, _EMPTY if d is None else ast.literal_eval(d)))
    if a.kwarg:
        out.append((a.kwarg.arg, P.VAR_KEYWORD, _EMPTY))
    return out[1:] if drop_first else out


def _runtime_params(obj, drop_first):
    """Like `_stub_params` from the extension's text signature, or None when it gives none (or
    only `(*args, **kwargs)`, as PyO3 reports for slots such as `__call__`)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None
    out = [(p.name, p.kind, _EMPTY if p.default is p.empty else p.default) for p in params]
    # The extension's `self` is positional-only (`(self, /, ...)`), the stub's need not be.
    return out[1:] if drop_first else out


def _signature_problem(what, stub_fn, runtime_obj, drop_first, runtime_drop_first):
    want = _runtime_params(runtime_obj, runtime_drop_first)
    if want is None:
        return None
    got = _stub_params(stub_fn, drop_first)
    if got == want:
        return None

    def fmt(params):
        shown = []
        for name, kind, default in params:
            default = "" if default is _EMPTY else f"={default!r}"
            kind = "" if kind == inspect.Parameter.POSITIONAL_OR_KEYWORD else f" [{kind.name}]"
            shown.append(name + default + kind)
        return ", ".join(shown)

    return f"{what}: the stub has ({fmt(got)}), the extension ({fmt(want)})"


# ---- the tests ----------------------------------------------------------------------------


def test_py_typed_marker():
    assert (PKG / "py.typed").is_file(), f"PEP 561 marker {PKG / 'py.typed'} is missing"
    assert STUB.is_file() and STUB.parent == Path(_native.__file__).resolve().parent, "the stub must sit beside the extension"


def test_stub_names_exist_with_their_kind(stub):
    """Every name the stub declares is in the extension, as a class, a function or a constant."""
    runtime = _runtime_names()
    problems = []
    for name, kind in sorted(stub.names.items()):
        if name not in runtime:
            problems.append(f"{name}: declared in the stub ({kind}) but not in lockstep._native")
        elif runtime[name] != kind:
            problems.append(f"{name}: a {kind} in the stub but a {runtime[name]} in lockstep._native")
    assert not problems, "\n".join(problems)


def test_extension_names_are_in_the_stub(stub):
    """Every name of the extension (private ones such as _register_torch included) is declared."""
    missing = sorted(set(_runtime_names()) - set(stub.names))
    assert not missing, f"lockstep._native has {missing}, which {STUB.name} does not declare"


def test_stub_only_aliases_are_private(stub):
    """Type aliases exist only in the stub, so they must not look like part of the module's API."""
    public = sorted(a for a in stub.aliases if not a.startswith("_"))
    assert not public, f"stub-only type aliases {public} are public names that lockstep._native does not have; prefix them with _"
    clash = sorted(stub.aliases & set(_runtime_names()))
    assert not clash, f"{clash} are type aliases in the stub but attributes of lockstep._native"


def test_dunder_all(stub):
    assert stub.all is not None, f"{STUB.name} declares no __all__ (PyO3 gives the module one)"
    extra, missing = sorted(set(stub.all) - set(_native.__all__)), sorted(set(_native.__all__) - set(stub.all))
    assert not extra and not missing, f"__all__ of the stub has {extra} too many and {missing} too few"


def test_class_members(stub):
    """Each class's methods and properties are the same in the stub and in the extension, and the
    stub declares a constructor exactly for the classes that have one."""
    problems = []
    for name, node in sorted(stub.classes.items()):
        cls = getattr(_native, name, None)
        if not isinstance(cls, type):
            continue  # reported by test_stub_names_exist_with_their_kind
        declared, instance, ctor = _class_members(node)
        runtime = _runtime_members(cls)
        for m in sorted(set(declared) | set(runtime)):
            if m not in runtime:
                problems.append(f"{name}.{m}: a {declared[m]} in the stub, absent from the extension")
            elif m not in declared:
                problems.append(f"{name}.{m}: a {runtime[m]} of the extension, not declared in the stub")
            elif declared[m] != runtime[m]:
                problems.append(f"{name}.{m}: a {declared[m]} in the stub but a {runtime[m]} in the extension")
        for m in sorted(instance & set(runtime)):
            problems.append(f"{name}.{m}: declared as an instance attribute but defined on the class")
        if issubclass(cls, BaseException):
            # An exception's constructor is BaseException's; its attributes are set per instance.
            continue
        if instance:
            problems.append(f"{name}: instance attributes {sorted(instance)} in the stub; only exceptions have any")
        # PyO3 gives a class a __text_signature__ exactly when it has a #[new]; without one,
        # calling the class raises TypeError ("No constructor defined").
        has_new = getattr(cls, "__text_signature__", None) is not None
        if has_new and ctor is None:
            problems.append(f"{name}: the extension has a constructor {cls.__text_signature__}, the stub declares none")
        if ctor is not None and not has_new:
            problems.append(f"{name}: the stub declares {ctor.name} but the extension's class has no constructor")
    assert not problems, "\n".join(problems)


def test_signatures(stub):
    """Parameter names, kinds and defaults match the extension's text signatures (functions,
    methods, constructors), wherever the extension gives one."""
    problems = []
    for name, fn in sorted(stub.functions.items()):
        if callable(getattr(_native, name, None)):
            problems.append(_signature_problem(name, fn, getattr(_native, name), False, False))
    for name, node in sorted(stub.classes.items()):
        cls = getattr(_native, name, None)
        if not isinstance(cls, type) or issubclass(cls, BaseException):
            continue
        for item in node.body:
            if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) or "property" in _decorators(item):
                continue
            if item.name in CONSTRUCTORS:
                if getattr(cls, "__text_signature__", None) is not None:
                    problems.append(_signature_problem(f"{name}()", item, cls, True, False))
            elif callable(vars(cls).get(item.name)):
                problems.append(_signature_problem(f"{name}.{item.name}", item, getattr(cls, item.name), True, True))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)
