"""Every private PyTorch name cupykern uses, bound once, each with why it is needed.

The rest of cupykern imports these from here and names nothing private of torch
(tests/test_compat.py checks that, and checks each name below on the installed torch, so
that a torch release that renames or removes one fails loudly in the CPU tests rather
than at a user's call). Public API is used wherever one exists and is not slower on a
hot path (e.g. ``torch.compiler.is_compiling``, ``torch.is_autocast_enabled``); where a
public API exists but costs more, the comment says so.

Binding a C function once (``x = torch._C._x``) keeps the very same object, so
torch.compile, which recognises these functions by identity, traces them as before.

Attributes read on instances, which cannot be bound once (tests/test_compat.py checks
them too):

* ``Tensor._version`` (the version counter that in-place ops bump): a cached plan of
  weights is valid while their version is unchanged (cupykern.torch.matmul_sum_max_mean_logsumexp);
  no public API exposes it.
* ``nn.Module``'s ``_parameters`` / ``_buffers`` / ``_modules`` dicts
  (:data:`MODULE_STORES`), read directly on a module of exact type (no property can
  intervene): ``nn.Module.__getattr__`` costs about 0.5 us a name.
* ``nn.Module``'s ``_forward_hooks`` / ``_forward_pre_hooks`` / ``_backward_hooks`` /
  ``_backward_pre_hooks`` (:data:`MODULE_HOOKS`): whether a submodule has hooks that a
  fused forward, which never calls it, would skip; no public API says whether any hook is
  registered.
"""
from __future__ import annotations

import torch
import torch.nn.modules.module
import torch.utils._pytree
from torch._C._functorch import TransformType, maybe_get_level
from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter
from torch._library.utils import is_functional_schema
from torch.autograd import forward_ad as _forward_ad

# ---------------------------------------------------------------- the eager-mode test
# What an eager call must rule out before it skips the dispatcher (see eager()). Each is a
# C query of torch's thread-local state; the public forms cost more per call or do not
# exist: torch.jit.is_tracing() is a Python function around _is_tracing; autocast has
# only the per-device torch.is_autocast_enabled(device_type); dispatch modes, torch-function
# modes and functorch transforms have no public query.

# Whether any autocast region (any device) is active.
is_any_autocast_enabled = torch._C._is_any_autocast_enabled
# The torch.jit.trace state (None when not tracing).
get_tracing_state = torch._C._get_tracing_state
# How many TorchDispatchMode are on the stack (fake tensor, functionalization, user modes).
len_torch_dispatch_stack = torch._C._len_torch_dispatch_stack
# Whether a TorchFunctionMode is active.
is_torch_function_mode_enabled = torch._C._is_torch_function_mode_enabled
# Whether a torch.func transform (grad, vjp, jvp, vmap...) is active: its wrapped tensors
# have no data pointer, and the op must run in the form transforms take.
are_functorch_transforms_active = torch._C._are_functorch_transforms_active


def eager(autocast_ok: bool = False) -> bool:
    """Nothing is tracing or watching: no torch.compile/export, jit.trace, dispatch or
    torch-function mode, functorch transform, forward-AD level or, unless
    ``autocast_ok`` (an op that computes alike in an autocast region: no autocast
    policy), autocast region.

    It lives here because all but its first test are torch internals; the forward-AD
    level (``torch.autograd.forward_ad._current_level``: -1 outside ``dual_level()``) is
    a module global that torch rebinds, so it cannot be bound once, and no public API
    says whether a dual level is open. (A getter function would add a call to every
    eager call.)"""
    return (not torch.compiler.is_compiling()
            and (autocast_ok or not is_any_autocast_enabled())
            and not get_tracing_state()
            and not len_torch_dispatch_stack()
            and not is_torch_function_mode_enabled()
            and not are_functorch_transforms_active()
            and _forward_ad._current_level < 0)


def transforming() -> bool:
    """torch.func transforms, or forward-mode AD (``forward_ad.dual_level``: dual tensors
    whose tangents a plain call would drop); see :func:`eager` for the level."""
    return are_functorch_transforms_active() or _forward_ad._current_level >= 0


# ---------------------------------------------------------------- autograd
# autograd.Function.apply without what only functorch transforms need (a pytree pass over
# the arguments to unwrap dead wrappers), which eager() rules out: ~0.3 us an argument.
# The public autograd.Function.apply adds that pass.
FUNCTION_APPLY = torch._C._FunctionBase.__dict__["apply"]

# The innermost saved-tensor hooks in force (torch.autograd.graph.saved_tensors_hooks,
# save_on_cpu: None where none is), read when a planned forward would keep what it saved
# for its backward (cupykern.torch.gemm_scale_batchnorm): under hooks that move the saved
# tensors off the GPU, a second reference would hold them there. No public query; torch
# 2.8 added this one (None before: such a forward keeps nothing).
top_saved_tensors_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)

# The op's out_dims in a torch.func vmap rule: a pytree of the output's structure. torch
# has no public pytree module in every version cupykern supports (torch >= 2.4).
tree_map = torch.utils._pytree.tree_map

# A grad/jvp transform's interpreter (its kind and level) and a tensor's functorch level:
# how an op tells that a tensor it updates in place was captured from outside the
# transform, where PyTorch's own in-place ops raise (torch.func has no public query).
#   retrieve_current_functorch_interpreter, TransformType, maybe_get_level (imported above)

# ---------------------------------------------------------------- the dispatcher
# An op's parsed schema (argument names, which arguments it writes, how many it returns):
# OpOverload exposes it as ``_schema`` only.


def op_schema(op) -> torch.FunctionSchema:
    """The ``torch.FunctionSchema`` of an ``OpOverload`` (definition time only)."""
    return op._schema


# Whether a schema is functional (writes no argument, returns no alias):
# torch.library.register_autograd takes only those, and says so only by raising.
#   is_functional_schema (imported above)

# The Autograd kernel of an op that writes its arguments (register_autograd refuses those)
# redispatches below autograd, as PyTorch's generated kernels do: the guard that keeps
# autograd off for the nested call and the keyset past autograd. No public form.
AutoDispatchBelowAutograd = torch._C._AutoDispatchBelowAutograd
AFTER_AUTOGRAD_KEYSET = torch._C._after_autograd_keyset

# The op's Autocast kernel calls the op with its own Autocast key excluded, as PyTorch's
# ops do (torch.autocast(enabled=False) would turn off autocast for every device, and
# costs a context manager's Python frames).
DispatchKey = torch._C.DispatchKey
DispatchKeySet = torch._C.DispatchKeySet
ExcludeDispatchKeyGuard = torch._C._ExcludeDispatchKeyGuard

# ---------------------------------------------------------------- CUDA state
# Whether cuBLAS may use TF32 for float32 matmuls: the public
# torch.backends.cuda.matmul.allow_tf32 reads it through a Python __getattr__; this C
# function is what torch.compile folds and guards on.
get_cublas_allow_tf32 = torch._C._get_cublas_allow_tf32
# torch.get_float32_matmul_precision() without its Python frame: read on every eager
# float32 linear / matmul call (the shape-keyed plans' key).
get_float32_matmul_precision = torch._C._get_float32_matmul_precision

# torch's current CUDA stream on a device as a raw handle (int), what our launches go on:
# torch.cuda.current_stream(device).cuda_stream builds a Stream object first (several
# times the host time). None in a torch built without CUDA (no torch tensor is then on a
# GPU). cupykern.torch hands it to the array layer (_array.register_torch_stream).
current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

# PyTorch's caching allocator's raw calls, for CuPy allocations served from it: the
# public torch.cuda.caching_allocator_alloc / caching_allocator_delete wrap these in
# Python (device and stream arguments resolved on every call); torch's current device
# (torch.cuda.current_device() adds a lazy-init check). None without CUDA.
cuda_raw_alloc = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc", None)
cuda_raw_delete = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_delete", None)
cuda_get_device = getattr(torch._C, "_cuda_getDevice", None)

# ---------------------------------------------------------------- nn.Module
# The global module hooks (register_module_forward_hook & co.): a fused forward that does
# not call its submodules must defer to them when any is registered; no public query.
# torch fills and empties these dicts in place and never rebinds them.
_module = torch.nn.modules.module
GLOBAL_MODULE_HOOKS = (_module._global_forward_hooks, _module._global_forward_pre_hooks,
                       _module._global_backward_hooks, _module._global_backward_pre_hooks)
del _module

# The per-instance dicts read directly (see the module docstring).
MODULE_STORES = ("_parameters", "_buffers", "_modules")
MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")

__all__ = ["is_any_autocast_enabled", "get_tracing_state", "len_torch_dispatch_stack",
           "is_torch_function_mode_enabled", "are_functorch_transforms_active", "eager",
           "transforming", "FUNCTION_APPLY", "top_saved_tensors_hooks", "tree_map",
           "retrieve_current_functorch_interpreter",
           "TransformType", "maybe_get_level", "op_schema", "is_functional_schema",
           "AutoDispatchBelowAutograd", "AFTER_AUTOGRAD_KEYSET", "DispatchKey",
           "DispatchKeySet", "ExcludeDispatchKeyGuard", "get_cublas_allow_tf32",
           "get_float32_matmul_precision",
           "current_raw_stream", "cuda_raw_alloc", "cuda_raw_delete", "cuda_get_device",
           "GLOBAL_MODULE_HOOKS", "MODULE_STORES", "MODULE_HOOKS"]
