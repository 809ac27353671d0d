"""The private PyTorch names cupykern relies on (cupykern/torch/_compat.py), each checked
on the installed torch for what cupykern relies on it for, so that a torch release that
renames, removes or changes one fails here; and the layering rules, checked statically:
no private torch name outside _compat, no string imports in the array layer, no import
of the package from the kernel loader. CPU only."""
import ast
import io
import pathlib
import re
import subprocess
import sys
import tokenize

import pytest
import torch
from torch import nn
from torch.autograd import forward_ad

from cupykern import _array
from cupykern.torch import _compat, _op

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "cupykern"
COMPAT = PACKAGE / "torch" / "_compat.py"

TESTED = set()  # the _compat names the tests below check


def checks(*names):
    """Record that the decorated test checks these _compat names."""
    TESTED.update(names)
    return lambda f: f


# ---------------------------------------------------------------- the eager-mode test

class _DispatchMode(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _FunctionMode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _inside(mode):
    """``(f() for each state f)`` read inside ``mode`` (a callable running a thunk)."""
    seen = {}

    def read():
        seen.update(autocast=_compat.is_any_autocast_enabled(),
                    tracing=_compat.get_tracing_state() is not None,
                    dispatch=_compat.len_torch_dispatch_stack(),
                    function=_compat.is_torch_function_mode_enabled(),
                    functorch=_compat.are_functorch_transforms_active(),
                    eager=_compat.eager(), eager_autocast_ok=_compat.eager(True),
                    transforming=_compat.transforming())
    mode(read)
    return seen


def _plain(read):
    read()


def _autocast(read):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        read()


def _jit_trace(read):
    def f(x):
        read()
        return x * 2
    torch.jit.trace(f, torch.ones(2), check_trace=False)


def _dispatch_mode(read):
    with _DispatchMode():
        read()


def _function_mode(read):
    with _FunctionMode():
        read()


def _grad(read):
    def f(x):
        read()
        return x.sum()
    torch.func.grad(f)(torch.ones(2))


def _vmap(read):
    def f(x):
        read()
        return x
    torch.func.vmap(f)(torch.ones(2, 3))


def _dual_level(read):
    with forward_ad.dual_level():
        read()


OFF = dict(autocast=False, tracing=False, dispatch=0, function=False, functorch=False,
           eager=True, eager_autocast_ok=True, transforming=False)


@checks("is_any_autocast_enabled", "get_tracing_state", "len_torch_dispatch_stack",
        "is_torch_function_mode_enabled", "are_functorch_transforms_active", "eager",
        "transforming")
@pytest.mark.parametrize("mode, changed", [
    (_plain, {}),
    (_autocast, dict(autocast=True, eager=False)),
    (_jit_trace, dict(tracing=True, eager=False, eager_autocast_ok=False)),
    (_dispatch_mode, dict(dispatch=1, eager=False, eager_autocast_ok=False)),
    (_function_mode, dict(function=True, eager=False, eager_autocast_ok=False)),
    (_grad, dict(functorch=True, eager=False, eager_autocast_ok=False, transforming=True)),
    (_vmap, dict(functorch=True, eager=False, eager_autocast_ok=False, transforming=True)),
    (_dual_level, dict(eager=False, eager_autocast_ok=False, transforming=True)),
], ids=lambda v: getattr(v, "__name__", "")[1:] or None)
def test_mode_queries(mode, changed):
    """Each query answers for its own mode only, and eager() / transforming() combine them."""
    assert _inside(mode) == {**OFF, **changed}


@checks("eager")
def test_forward_ad_level_is_a_module_global():
    """eager() reads forward_ad._current_level: -1 outside dual_level, the level inside."""
    assert forward_ad._current_level == -1
    with forward_ad.dual_level():
        assert forward_ad._current_level == 0
    assert forward_ad._current_level == -1


@checks("eager")
def test_eager_is_false_under_torch_compile():
    @torch.compile(backend="eager", fullgraph=True)
    def f(x):
        return x + 1 if _compat.eager() else x - 1

    assert f(torch.zeros(1)).item() == -1 and _compat.eager()


# ---------------------------------------------------------------- autograd

@checks("FUNCTION_APPLY")
def test_function_apply_records_the_function():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 3  # (not the true gradient: shows that this backward ran)

    apply = _compat.FUNCTION_APPLY.__get__(None, Double)
    x = torch.ones(2, requires_grad=True)
    y = apply(x)
    assert torch.equal(y, torch.full((2,), 2.0)) and type(y.grad_fn).__name__ == "DoubleBackward"
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((2,), 3.0))
    assert _compat.FUNCTION_APPLY is torch._C._FunctionBase.__dict__["apply"]


@checks("top_saved_tensors_hooks")
def test_top_saved_tensors_hooks_names_the_hooks_in_force():
    if _compat.top_saved_tensors_hooks is None:  # (torch before 2.8 has no such query)
        assert not hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks")
        return
    assert _compat.top_saved_tensors_hooks(False) is None
    pack, unpack = (lambda t: t), (lambda t: t)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert _compat.top_saved_tensors_hooks(False) == (pack, unpack)
    with torch.autograd.graph.save_on_cpu():
        assert _compat.top_saved_tensors_hooks(False) is not None
    assert _compat.top_saved_tensors_hooks(False) is None


@checks("tree_map")
def test_tree_map_keeps_the_structure():
    t = torch.ones(1)
    assert _compat.tree_map(lambda _: 0, t) == 0
    assert _compat.tree_map(lambda _: 0, (t, t)) == (0, 0)


@checks("retrieve_current_functorch_interpreter", "TransformType", "maybe_get_level")
@pytest.mark.parametrize("transform, kind", [("grad", "Grad"), ("jvp", "Jvp"), ("vmap", "Vmap")])
def test_functorch_interpreter_and_levels(transform, kind):
    """What Op tells a tensor captured from outside a grad/jvp transform by."""
    captured, seen = torch.ones(3), {}

    def f(x):
        interpreter = _compat.retrieve_current_functorch_interpreter()
        seen.update(key=interpreter.key(), level=interpreter.level(),
                    input=_compat.maybe_get_level(x), captured=_compat.maybe_get_level(captured))
        return (x * captured).sum()

    x = torch.ones(3)
    if transform == "grad":
        torch.func.grad(f)(x)
    elif transform == "jvp":
        torch.func.jvp(f, (x,), (torch.ones(3),))
    else:
        torch.func.vmap(f)(torch.ones(2, 3))
    assert seen["key"] == getattr(_compat.TransformType, kind)
    assert seen["input"] == seen["level"] and seen["captured"] < seen["level"]


# ---------------------------------------------------------------- the dispatcher

@checks("op_schema", "is_functional_schema")
def test_op_schema_and_functional():
    schema = _compat.op_schema(torch.ops.aten.add_.Tensor)
    assert isinstance(schema, torch.FunctionSchema) and len(schema.returns) == 1
    assert [a.name for a in schema.arguments][:2] == ["self", "other"]
    writes = [a.alias_info is not None and a.alias_info.is_write for a in schema.arguments]
    assert writes == [True, False, False]
    assert not _compat.is_functional_schema(schema)
    assert _compat.is_functional_schema(_compat.op_schema(torch.ops.aten.add.Tensor))


@checks("AutoDispatchBelowAutograd", "AFTER_AUTOGRAD_KEYSET")
def test_below_autograd():
    x = torch.ones(2, requires_grad=True)
    with _compat.AutoDispatchBelowAutograd():
        y = x * 2
    assert y.grad_fn is None and (x * 2).grad_fn is not None
    keys = _compat.AFTER_AUTOGRAD_KEYSET
    assert isinstance(keys, _compat.DispatchKeySet)
    assert keys.has(_compat.DispatchKey.CPU) and keys.has(_compat.DispatchKey.CUDA)
    assert not keys.has(_compat.DispatchKey.AutogradCPU)


@checks("DispatchKey", "DispatchKeySet", "ExcludeDispatchKeyGuard")
def test_autocast_key_excluded():
    """An Autocast kernel calls its op with its own Autocast key excluded: no cast."""
    a = torch.ones(2, 2)
    key = _compat.DispatchKeySet(getattr(_compat.DispatchKey, _op._autocast_key("cpu")))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.mm(a, a).dtype == torch.bfloat16
        with _compat.ExcludeDispatchKeyGuard(key):
            assert torch.mm(a, a).dtype == torch.float32
    for device_type in ("cpu", "cuda"):  # (the key's name, as torch names it)
        assert _op._autocast_key(device_type) == "Autocast" + torch._C._dispatch_key_for_device(
            device_type)
        assert hasattr(_compat.DispatchKey, _op._autocast_key(device_type))


# ---------------------------------------------------------------- CUDA state

@checks("get_cublas_allow_tf32")
def test_cublas_allow_tf32_is_the_public_flag():
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        for flag in (True, False):
            torch.backends.cuda.matmul.allow_tf32 = flag
            assert _compat.get_cublas_allow_tf32() is flag
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@checks("get_float32_matmul_precision")
def test_float32_matmul_precision_is_the_public_one():
    before = torch.get_float32_matmul_precision()
    try:
        for setting in ("highest", "high", "medium"):
            torch.set_float32_matmul_precision(setting)
            assert _compat.get_float32_matmul_precision() == setting
    finally:
        torch.set_float32_matmul_precision(before)


@checks("current_raw_stream")
def test_current_raw_stream():
    """Present in every CUDA build of torch; the current stream's handle."""
    assert (_compat.current_raw_stream is not None) == torch.backends.cuda.is_built()
    if torch.cuda.is_available():
        assert _compat.current_raw_stream(0) == torch.cuda.current_stream(0).cuda_stream
    assert _array._torch_stream is _compat.current_raw_stream  # (the torch layer handed it over)


@checks("cuda_raw_alloc", "cuda_raw_delete", "cuda_get_device")
def test_caching_allocator_raw_calls():
    """Present in every CUDA build of torch; a block allocated and freed on the device."""
    raw = (_compat.cuda_raw_alloc, _compat.cuda_raw_delete, _compat.cuda_get_device)
    assert all((f is not None) == torch.backends.cuda.is_built() for f in raw)
    if torch.cuda.is_available():
        torch.cuda.init()
        assert _compat.cuda_get_device() == torch.cuda.current_device()
        before = torch.cuda.memory_allocated()
        ptr = _compat.cuda_raw_alloc(1 << 20, torch.cuda.current_stream().cuda_stream)
        assert ptr and torch.cuda.memory_allocated() >= before + (1 << 20)
        _compat.cuda_raw_delete(ptr)
        assert torch.cuda.memory_allocated() == before


# ---------------------------------------------------------------- nn.Module

@checks("GLOBAL_MODULE_HOOKS")
def test_global_module_hooks_are_the_registered_ones():
    reg = nn.modules.module
    registrations = (reg.register_module_forward_hook(lambda m, i, o: None),
                     reg.register_module_forward_pre_hook(lambda m, i: None),
                     reg.register_module_full_backward_hook(lambda m, gi, go: None),
                     reg.register_module_full_backward_pre_hook(lambda m, go: None))
    try:
        for handle, hooks in zip(registrations, _compat.GLOBAL_MODULE_HOOKS):
            assert handle.id in hooks
    finally:
        for handle in registrations:
            handle.remove()
    assert not any(_compat.GLOBAL_MODULE_HOOKS)


@checks("MODULE_STORES", "MODULE_HOOKS")
def test_module_instance_dicts():
    m = nn.BatchNorm1d(3)
    m.sub = nn.Identity()
    params, buffers, modules = (m.__dict__[n] for n in _compat.MODULE_STORES)
    assert params["weight"] is m.weight and buffers["running_mean"] is m.running_mean
    assert modules["sub"] is m.sub
    handles = (m.register_forward_hook(lambda *a: None), m.register_forward_pre_hook(lambda *a: None),
               m.register_full_backward_hook(lambda *a: None),
               m.register_full_backward_pre_hook(lambda *a: None))
    for handle, name in zip(handles, _compat.MODULE_HOOKS):
        assert handle.id in getattr(m, name)
        handle.remove()
        assert not getattr(m, name)


def test_tensor_version_counts_in_place_writes():
    """Cached plans of weights (matmul_sum_max_mean_logsumexp) key on Tensor._version."""
    w = torch.ones(2)
    v = w._version
    w.add_(1)
    assert w._version > v
    with torch.no_grad():
        w.mul_(2)
    assert w._version > v + 1


def test_every_compat_name_is_checked():
    """(The decorators above record what each test checks when the module is imported.)"""
    assert set(_compat.__all__) == TESTED
    assert all(hasattr(_compat, n) for n in _compat.__all__)


# ---------------------------------------------------------------- the torch layer's registration

def test_the_torch_layer_registers_with_the_array_layer():
    import cupykern.torch as layer

    for stem in ("gemm", "gemm_scale_batchnorm", "matmul_sum_max_mean_logsumexp", "normalize"):
        assert _array.torch_layer(stem) is getattr(layer, stem)


def test_torch_imported_after_cupykern():
    """A torch tensor meeting a torch layer not yet imported imports it (the package's hook)."""
    code = ("import sys, cupykern; assert 'torch' not in sys.modules\n"
            "import torch; assert 'cupykern.torch' not in sys.modules\n"
            "y = cupykern.l2_normalize(torch.ones(2, 4))\n"
            "assert 'cupykern.torch' in sys.modules and torch.allclose(y, torch.full((2, 4), 0.5))\n"
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.split() == ["ok"], r.stderr


# ---------------------------------------------------------------- static checks

def _code(path: pathlib.Path) -> str:
    """A file's source without comments and docstrings (other strings kept)."""
    text = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.add((body[0].lineno, body[0].col_offset))
    kept = [t for t in tokenize.generate_tokens(io.StringIO(text).readline)
            if t.type != tokenize.COMMENT
            and not (t.type == tokenize.STRING and t.start in docstrings)]
    return tokenize.untokenize(kept)


def _array_layer():
    skip = {"__init__.py", "__main__.py", "benchmark.py"}
    return sorted(p for p in PACKAGE.glob("*.py") if p.name not in skip)


@pytest.mark.parametrize("path", _array_layer(), ids=lambda p: p.name)
def test_array_layer_imports_no_module_by_name(path):
    """The array layer never imports the torch layer (which registers itself), nor any
    module by a string."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
            assert not any(n == "importlib" or n.startswith(("importlib.", "cupykern.torch"))
                           for n in names), (path.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            assert not module.startswith("importlib"), (path.name, node.lineno)
            upward = (module.startswith("cupykern.torch") or (node.level and module.startswith("torch"))
                      or (node.level and not module and any(a.name == "torch" for a in node.names)))
            assert not upward, (path.name, node.lineno)
        elif isinstance(node, ast.Name):
            assert node.id not in ("__import__", "importlib", "import_module"), (path.name, node.lineno)
        elif isinstance(node, ast.Attribute):
            assert node.attr not in ("__import__", "import_module"), (path.name, node.lineno)


def test_the_loader_imports_no_cupykern_module():
    tree = ast.parse((PACKAGE / "_loader.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not any(a.name.split(".")[0] == "cupykern" for a in node.names), node.lineno
        elif isinstance(node, ast.ImportFrom):
            assert not node.level and (node.module or "").split(".")[0] != "cupykern", node.lineno


# A private torch name: a dotted path from torch with an _-prefixed part (not a dunder;
# not cupykern.torch._op), or torch's C module.
_PRIVATE = re.compile(r"(?<![\w.])torch(?:\.\w+)*?\._(?!_)\w*|\._C\b")


def _compat_private_attributes() -> set:
    """The private attributes _compat reads (``x._name`` or ``getattr(x, "_name")`` in its
    code), but for the module dicts read on instances elsewhere (MODULE_STORES,
    MODULE_HOOKS)."""
    found = {a or b for a, b in re.findall(r'\.(_[A-Za-z]\w*)|"(_[A-Za-z]\w*)"', _code(COMPAT))}
    return found - set(_compat.MODULE_STORES) - set(_compat.MODULE_HOOKS)


# Uses still to move to _compat (which binds each of them already): file -> the names
# matched there; delete an entry once its file imports from _compat.
NOT_YET_MOVED: dict = {}  # file -> private names still to move into _compat (none)


def test_no_private_torch_name_outside_compat():
    names = _compat_private_attributes()
    assert {"_C", "_current_level", "_schema", "_FunctionBase", "_cuda_getCurrentRawStream",
            "_global_forward_hooks"} <= names
    also = re.compile(r"\b(?:%s)\b" % "|".join(sorted(names)))
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == COMPAT:
            continue
        name, text = str(path.relative_to(PACKAGE)), path.read_text()
        for pattern in (_PRIVATE, also):
            for m in pattern.finditer(text):
                if m.group(0) not in NOT_YET_MOVED.get(name, ()):
                    found.add(f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}")
    assert not found, ("private torch names outside cupykern/torch/_compat.py:\n"
                       + "\n".join(sorted(found)))
