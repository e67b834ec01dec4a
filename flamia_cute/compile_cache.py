"""Compile cache for CuTe DSL kernels: in memory, then on disk.

Key: sha256 over (kernel source files' bytes, DSL version, the CUDA version and digest of its compiler
library and its compile-affecting settings, Python version, target arch, config class and fields; the
tvm-ffi version for TVM-FFI builds). Any edit of a kernel source file, a DSL upgrade or a config
change gives a new key, so stale binaries are never loaded. The GPU's name is not in it: a build
depends on the arch alone, so an H100 and an H200 share builds, and a machine without a GPU
(FLAMIA_ARCH) can build them ahead for one that has.

Disk format (nvidia-cutlass-dsl 4.8.1): `JitCompiledFunction.export_to_c(dir, name,
function_prefix)` writes a host object `name.o` that embeds the cubin plus a C header;
`cutlass.cute.runtime.load_module(path)[prefix]` JIT-links the object back into a callable
with the same call signature (~ms instead of ~1 s of tracing, MLIR lowering and ptxas).
This path needs no tvm_ffi. Cache entries are written to a temp file and renamed into
place under an exclusive flock, so concurrent processes never read a partial object.

Fast launches (`compile_launcher`): with apache-tvm-ffi importable, kernels are compiled with
`--enable-tvm-ffi` and called through the raw `tvm_ffi.Function` with plain Python ints (pointer
addresses, int32 scalars, the CUDA stream handle) and floats: the C wrapper decodes them, no
`make_ptr` objects and no JitExecutor argument marshalling. Those are cached on disk too:
`export_to_c(path.o, function_name=prefix)` then `load_module(path, enable_tvm_ffi=True)[prefix]`
(a separate key: the "tvm_ffi" variant). Without tvm_ffi the launcher converts the same raw
arguments to DSL objects and calls the JitExecutor (slow but equivalent).

Environment:
  FLAMIA_CUTE_CACHE_DIR    cache root (default ~/.cache/flamia_cute)
  FLAMIA_CUTE_TVM_FFI=0    launch through the JitExecutor even when tvm_ffi is importable
  FLAMIA_CUTE_DISK_CACHE=0 disable the disk layer (the in-memory layer stays)
  FLAMIA_ARCH              target arch (sm_90a, sm_100a, ...) when compiling without a GPU

Exporting needs the DSL's import-time arch (CUTE_DSL_ARCH, else the detected GPU) to equal the
compile arch; the flamia_cute package sets CUTE_DSL_ARCH from FLAMIA_ARCH before any kernel module imports
cutlass. Otherwise the kernel is cached in memory only (see STATS.export_errors).
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_MEMORY: dict[str, Any] = {}
_FAST: dict[tuple, Any] = {}  # (source paths, config, arch) -> compiled: this process's sources do not change
_MODULES: dict[str, Any] = {}  # loaded ExternalBinaryModules, kept alive with their functions


@dataclass(frozen=True)
class KernelBuild:
    """One kernel this process got from outside its in-memory cache: compiled, or loaded from disk."""

    config: Any  # the kernel's frozen config (FwdConfig, BwdDsBf16Config, MultiQuantizeConfig, ...)
    arch: str
    variant: str  # "" or "tvm_ffi"
    source: str  # "compile" or "disk"


@dataclass
class CacheStats:
    memory_hits: int = 0
    disk_hits: int = 0
    compiles: int = 0
    export_errors: list[str] = field(default_factory=list)
    builds: list[KernelBuild] = field(default_factory=list)  # in order; see kernel_builds()


STATS = CacheStats()


def kernel_builds(since: int = 0) -> list[KernelBuild]:
    """The kernels this process compiled or loaded from disk (each at most once per key while the
    in-memory cache holds it), from the `since`-th on: a long run checks that nothing builds after
    its warm-up (len(kernel_builds()) then, and kernel_builds(that) later, must be empty)."""
    return STATS.builds[since:]


def _record(config: Any, arch: str, variant: str, source: str) -> None:
    if source == "compile":
        STATS.compiles += 1
    else:
        STATS.disk_hits += 1
    STATS.builds.append(KernelBuild(config, arch, variant, source))

# Compute capability -> arch string the DSL accepts; "a" targets use wgmma/tcgen05 features.
_ARCH_BY_CC = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a", (12, 0): "sm_120a"}


def dsl_version() -> str:
    import cutlass

    return str(getattr(cutlass, "__version__", "unknown"))


def target_arch() -> str:
    """FLAMIA_ARCH if set, else the arch of the current CUDA device."""
    env = os.environ.get("FLAMIA_ARCH")
    if env:
        return env
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: set FLAMIA_ARCH (e.g. sm_90a) to compile without a GPU")
    return _device_arch(torch.cuda.current_device())


@functools.cache
def _device_arch(index: int) -> str:
    # every launch asks: the device's properties cost ~15 µs of host time per query
    import torch

    cc = torch.cuda.get_device_capability(index)
    return _ARCH_BY_CC.get(cc, f"sm_{cc[0]}{cc[1]}")


@functools.cache
def dsl_cuda_version() -> str:
    """The CUDA version of the DSL's libraries ("12.9" with nvidia-cutlass-dsl-libs-cu12, "13.4" with
    -cu13): it sets the PTX ISA the DSL emits, and ptxas schedules the same kernel differently under
    each, so a build of one is never loaded for the other."""
    import cutlass  # noqa: F401  (sets the version query up)
    from cutlass.base_dsl.version_info import CUDA_VERSION

    return f"{CUDA_VERSION.major}.{CUDA_VERSION.minor}"


# The DSL's own JIT key holds these too, but also the runtime library's path, which differs between a
# machine that builds ahead and the one that loads; the arch is keyed on its own
_UNKEYED_DSL_SETTINGS = ("arch", "shared_libs")


@functools.cache
def dsl_build() -> str:
    """What else of the DSL changes a build: the digest of the compiler library it loaded (one per CUDA
    flavour and DSL build) and its compile-affecting CUTE_DSL_* settings (optimization level, debug
    info, assertions, ...)."""
    import importlib

    import cutlass  # noqa: F401
    from cutlass.base_dsl.dsl import BaseDSL

    so = Path(sys.modules["cutlass._mlir._mlir_libs._cutlass_ir"].__file__).name  # _cutlass_ir.cuNN.<abi>.so
    digests = importlib.import_module(f"cutlass._mlir._mlir_libs._cutlass_ir_version_{so.split('.')[1]}").DSO_SHA256
    settings = [kv for kv in BaseDSL._get_dsl().envar.cache_key_str().split(";")
                if kv and kv.split("=", 1)[0] not in _UNKEYED_DSL_SETTINGS]
    return f"dso={digests[so][:16]};" + ";".join(settings)


def cache_dir() -> Path:
    root = os.environ.get("FLAMIA_CUTE_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "flamia_cute"


def disk_cache_enabled() -> bool:
    return os.environ.get("FLAMIA_CUTE_DISK_CACHE", "1") != "0"


def _config_fields(config: Any) -> tuple:
    if dataclasses.is_dataclass(config):
        return tuple((f.name, repr(getattr(config, f.name))) for f in dataclasses.fields(config))
    return (repr(config),)


def _hash_files(h, files: Iterable[str | Path]) -> None:
    for path in sorted(Path(p).resolve() for p in files):
        data = path.read_bytes()
        h.update(path.name.encode())
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)


def package_source_hash() -> str:
    """Short hash of every .py file of the package (with quant and schedules): names the code a
    benchmark ran even where the checkout's git metadata is stale (the device copy)."""
    from . import quant, schedules  # installed as sub-packages, laid out as sibling folders

    roots = {Path(m.__file__).resolve().parent for m in (quant, schedules)} | {Path(__file__).resolve().parent}
    files = {p for r in roots for p in r.rglob("*.py") if "__pycache__" not in p.parts}
    h = hashlib.sha256()
    _hash_files(h, files)
    return h.hexdigest()[:12]


def cache_key(kernel_source_files: Iterable[str | Path], config: Any, arch: str, variant: str = "") -> str:
    """variant: a calling-convention tag ("tvm_ffi"); "" keeps the keys of plain DSL builds."""
    h = hashlib.sha256()
    _hash_files(h, kernel_source_files)
    parts = (
        f"dsl={dsl_version()}",
        f"py={sys.version_info.major}.{sys.version_info.minor}",
        f"cuda={dsl_cuda_version()}",
        f"build={dsl_build()}",
        f"arch={arch}",
        f"config={type(config).__module__}.{type(config).__qualname__}",
        repr(_config_fields(config)),
    )
    if variant:
        parts = parts + (f"variant={variant}",)
    if variant == "tvm_ffi":  # the exported object's C wrapper follows the tvm_ffi ABI
        import tvm_ffi

        parts = parts + (f"tvm_ffi={tvm_ffi.__version__}",)
    for p in parts:
        h.update(b"\0" + p.encode())
    return h.hexdigest()


def dsl_default_arch() -> str | None:
    """The arch the DSL fixed at import (CUTE_DSL_ARCH or the detected GPU)."""
    try:
        from cutlass.base_dsl.dsl import BaseDSL

        return BaseDSL._get_dsl().envar.arch
    except Exception:
        return None


def _symbol_prefix(key: str) -> str:
    return f"flamia_{key[:24]}"  # a C identifier, unique per key


class _FileLock:
    def __init__(self, path: Path, exclusive: bool):
        self.path, self.exclusive, self.fd = path, exclusive, -1

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX if self.exclusive else fcntl.LOCK_SH)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _load(obj_path: Path, key: str, tvm_ffi: bool = False):
    import cutlass.cute as cute

    if tvm_ffi:
        module = cute.runtime.load_module(str(obj_path), enable_tvm_ffi=True)
    else:
        module = cute.runtime.load_module(str(obj_path))
    fn = module[_symbol_prefix(key)]
    _MODULES[key] = module
    return fn


def compile_cached(
    kernel_source_files: Iterable[str | Path],
    config: Any,
    arch: str,
    build_fn: Callable[[Any, str], Any],
    tvm_ffi: bool = False,
) -> Any:
    """The compiled kernel for (sources, config, arch): memory, else disk, else build_fn(config, arch).

    build_fn must return a `cute.compile` result for `arch`. A second process with the same key
    loads the exported object instead of compiling.
    tvm_ffi: build_fn compiles with `--enable-tvm-ffi`; the result is then a raw `tvm_ffi.Function`
    (from memory or disk alike) taking plain ints/floats (see `compile_launcher`).
    """
    # Hot path: a launch must not re-hash the kernel sources (that cost ~0.1 ms per call).
    fast_key = (tuple(str(p) for p in kernel_source_files), config, arch) + (("tvm_ffi",) if tvm_ffi else ())
    fn = _FAST.get(fast_key)
    if fn is not None:
        STATS.memory_hits += 1
        return fn
    fn = _compile_cached_slow(kernel_source_files, config, arch, build_fn, tvm_ffi)
    _FAST[fast_key] = fn
    return fn


def _raw_tvm_ffi_function(compiled: Any, key: str) -> Any:
    """The positional-only tvm_ffi.Function inside a `--enable-tvm-ffi` compile result.

    The DSL's wrappers (kwargs wrapper; Python-side pointer-object conversion) are skipped: callers
    pass plain ints for pointers. The compile result is kept alive (it owns the JIT engine).
    """
    import tvm_ffi

    _MODULES[key] = compiled
    inner = getattr(compiled, "_tvm_ffi_function", None)
    if inner is not None:
        return inner
    if isinstance(compiled, tvm_ffi.Function):  # TVMFFIJitCompiledFunction: skip its Python __call__
        call = tvm_ffi.Function.__call__
        return lambda *a: call(compiled, *a)
    raise TypeError(f"not a TVM-FFI compile result: {type(compiled).__name__}")


def _export(fn: Any, tmp: str, key: str, tvm_ffi: bool) -> Path:
    if tvm_ffi:
        path = Path(tmp) / "kernel.o"
        fn.export_to_c(str(path), function_name=_symbol_prefix(key))
        return path
    fn.export_to_c(tmp, "kernel", function_prefix=_symbol_prefix(key))
    return Path(tmp) / "kernel.o"


def _compile_cached_slow(kernel_source_files, config, arch, build_fn, tvm_ffi=False):
    variant = "tvm_ffi" if tvm_ffi else ""
    key = cache_key(kernel_source_files, config, arch, variant)
    finish = (lambda f: _raw_tvm_ffi_function(f, key)) if tvm_ffi else (lambda f: f)
    fn = _MEMORY.get(key)
    if fn is not None:
        STATS.memory_hits += 1
        return fn
    if not disk_cache_enabled():
        fn = finish(build_fn(config, arch))
        _record(config, arch, variant, "compile")
        _MEMORY[key] = fn
        return fn

    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    obj = root / f"{key}.o"
    lock = root / f"{key}.lock"
    with _FileLock(lock, exclusive=True):
        if obj.exists():
            try:
                fn = _load(obj, key, tvm_ffi)
                _record(config, arch, variant, "disk")
            except Exception:  # truncated or foreign object: rebuild it
                obj.unlink(missing_ok=True)
                fn = None
        if fn is None:
            fn = build_fn(config, arch)
            _record(config, arch, variant, "compile")
            default = dsl_default_arch()
            if default is not None and default != arch:
                # export_to_c of a kernel built for another arch than the DSL's import-time
                # default fails in 4.8.1 (unresolved cudart symbols in the PIC dump)
                STATS.export_errors.append(f"not exported: DSL default arch {default} != {arch}")
                fn = finish(fn)
                _MEMORY[key] = fn
                return fn
            try:
                with tempfile.TemporaryDirectory(dir=root) as tmp:
                    os.replace(_export(fn, tmp, key, tvm_ffi), obj)
            except Exception as e:  # keep the in-memory kernel; the next process recompiles
                STATS.export_errors.append(f"{type(e).__name__}: {e}")
            fn = finish(fn)
    _MEMORY[key] = fn
    return fn


# ----------------------------------------------------------------------------------------------
# Fast launch: raw Python arguments, TVM-FFI when available
# ----------------------------------------------------------------------------------------------

# Argument kinds of a launcher, in the kernel's parameter order:
#   ("ptr", dtype, align)  a global-memory pointer, passed as an int address (0 = null)
#   ("i32",) / ("f32",)    a dynamic scalar, passed as a Python int / float
#   ("stream",)            the CUDA stream, passed as an int handle (cudaStream_t)
_LAUNCHERS: dict[tuple, Callable[..., Any]] = {}


def current_raw_stream(device_index: int) -> int:
    """The current CUDA stream's raw handle without building a torch.cuda.Stream (inductor's call)."""
    import torch

    try:
        return torch._C._cuda_getCurrentRawStream(device_index)
    except AttributeError:  # pragma: no cover
        return torch.cuda.current_stream(device_index).cuda_stream


def tvm_ffi_enabled() -> bool:
    """TVM-FFI launches: apache-tvm-ffi importable and not disabled by FLAMIA_CUTE_TVM_FFI=0."""
    if os.environ.get("FLAMIA_CUTE_TVM_FFI", "1") == "0":
        return False
    return _tvm_ffi_importable()


@functools.cache
def _tvm_ffi_importable() -> bool:
    return importlib.util.find_spec("tvm_ffi") is not None


def fake_args(arg_kinds: tuple) -> tuple:
    """cute.compile arguments for `arg_kinds` (null pointers, zero scalars, a fake stream)."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    out = []
    for kind in arg_kinds:
        if kind[0] == "ptr":
            out.append(cute.runtime.make_ptr(kind[1], 0, cute.AddressSpace.gmem, assumed_align=kind[2]))
        elif kind[0] == "i32":
            out.append(Int32(0))
        elif kind[0] == "f32":
            out.append(Float32(0.0))
        elif kind[0] == "stream":
            out.append(cute.runtime.make_fake_stream())
        else:
            raise ValueError(f"unknown argument kind {kind!r}")
    return tuple(out)


def compile_entry(op: Any, arg_kinds: tuple, arch: str, extra_options: str = "", tvm_ffi: bool = False) -> Any:
    """cute.compile a kernel's runtime entry `op` for `arch` from fake arguments of `arg_kinds`
    (no tensors, no GPU); tvm_ffi: for TVM-FFI calls (raw int/float arguments, explicit stream)."""
    import cutlass.cute as cute

    options = f"--gpu-arch {arch} {extra_options}".strip()
    if tvm_ffi:
        options += " --enable-tvm-ffi"
    return cute.compile(op, *fake_args(arg_kinds), options=options)


@functools.cache
def _sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (cached): the persistent kernels' CTA count."""
    import torch

    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def launch_on_device(launch: Callable[..., Any], device, *args) -> None:
    """launch(*args, raw stream) on `device`'s current stream, in that device's context (a kernel
    module is loaded into, and launched on, the current device's context)."""
    import torch

    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx == torch.cuda.current_device():
        launch(*args, current_raw_stream(idx))
    else:
        with torch.cuda.device(idx):
            launch(*args, current_raw_stream(idx))


def _dsl_launcher(fn: Any, arg_kinds: tuple) -> Callable[..., Any]:
    """The JitExecutor path behind the raw-argument interface (no tvm_ffi)."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    gmem = cute.AddressSpace.gmem
    conv = []
    for kind in arg_kinds:
        if kind[0] == "ptr":
            conv.append(lambda v, dt=kind[1], al=kind[2]: cute.runtime.make_ptr(dt, v, gmem, assumed_align=al))
        elif kind[0] == "i32":
            conv.append(Int32)
        elif kind[0] == "f32":
            conv.append(Float32)
        else:
            conv.append(cuda.CUstream)

    def launch(*args):
        if len(args) != len(conv):
            raise TypeError(f"expected {len(conv)} arguments, got {len(args)}")
        return fn(*[c(a) for c, a in zip(conv, args, strict=True)])

    return launch


def compile_launcher(
    kernel_source_files: Iterable[str | Path],
    config: Any,
    arch: str,
    build_fn: Callable[[Any, str, bool], Any],
    arg_kinds: tuple,
    use_tvm_ffi: bool | None = None,
) -> Callable[..., Any]:
    """launch(*raw) for the kernel: raw = ints for pointers/int32/stream, floats for f32 (`arg_kinds`).

    build_fn(config, arch, tvm_ffi) -> cute.compile result, compiled with `--enable-tvm-ffi` and an
    explicit (non-env) fake stream when tvm_ffi. use_tvm_ffi None: `tvm_ffi_enabled()`. Memoized per
    (sources, config, arch, mode); compile results go through `compile_cached` (memory, disk).
    Raw pointer arguments are not checked here: the caller validates its tensors.
    """
    if use_tvm_ffi is None:
        use_tvm_ffi = tvm_ffi_enabled()
    # the source paths themselves (hashable; tuple() of a module's SOURCE_FILES tuple is that tuple, so no
    # string building per launch)
    lkey = (tuple(kernel_source_files), config, arch, use_tvm_ffi, arg_kinds)
    launch = _LAUNCHERS.get(lkey)
    if launch is not None:
        return launch
    fn = compile_cached(kernel_source_files, config, arch, lambda c, a: build_fn(c, a, use_tvm_ffi), tvm_ffi=use_tvm_ffi)
    launch = fn if use_tvm_ffi else _dsl_launcher(fn, arg_kinds)
    _LAUNCHERS[lkey] = launch
    return launch


def clear_memory_cache() -> None:
    _MEMORY.clear()
    _FAST.clear()
    _MODULES.clear()
    _LAUNCHERS.clear()


# ----------------------------------------------------------------------------------------------
# Artifacts for tests and `flamia-cute ptx`
# ----------------------------------------------------------------------------------------------


@dataclass
class KernelArtifacts:
    arch: str
    ptx: str
    cubin: bytes | None
    sass: str | None  # None when no nvdisasm is available
    registers: int | None
    frame_bytes: int | None  # per-thread local memory (stack); > 0 usually means spills


def find_nvdisasm() -> str | None:
    try:
        from cutlass.base_dsl.env_manager import _find_nvdisasm_binary

        path = _find_nvdisasm_binary()
        if path:
            return path
    except Exception:
        pass
    return shutil.which("nvdisasm")


def disassemble(cubin: bytes) -> str | None:
    tool = find_nvdisasm()
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([tool, "-c", f.name], capture_output=True, text=True)
    return res.stdout if res.returncode == 0 else None


def cubin_resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, frame bytes) of the (single) kernel, read from the cubin's .nv.info attributes."""
    import struct

    regs = frame = None
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    stroff = headers[shstrndx][4]
    for hdr in headers:
        name = cubin[stroff + hdr[0] : cubin.index(b"\0", stroff + hdr[0])]
        if not name.startswith(b".nv.info"):
            continue
        p, end = hdr[4], hdr[4] + hdr[5]
        while p < end:
            fmt, attr = cubin[p], cubin[p + 1]
            if fmt == 0x04:  # EIFMT_SVAL: u16 size + payload
                size = struct.unpack_from("<H", cubin, p + 2)[0]
                if size == 8 and attr == 0x2F:  # EIATTR_REGCOUNT (symbol, value)
                    regs = struct.unpack_from("<II", cubin, p + 4)[1]
                elif size == 8 and attr == 0x12:  # EIATTR_FRAME_SIZE
                    frame = struct.unpack_from("<II", cubin, p + 4)[1]
                p += 4 + size
            elif fmt == 0x03:  # EIFMT_HVAL
                p += 4
            elif fmt == 0x02:  # EIFMT_BVAL
                p += 4
            elif fmt == 0x01:  # EIFMT_NVAL
                p += 2
            else:
                break
    return regs, frame


def compile_artifacts(build_fn: Callable[[Any, str, str], Any], config: Any, arch: str) -> KernelArtifacts:
    """Compile for `arch` (no GPU needed) keeping PTX and cubin; disassemble when nvdisasm exists.

    build_fn(config, arch, extra_options) -> cute.compile result. The DSL names the kept files after the
    entry and its argument kinds only, not the config: each compile gets its own dump directory, so
    compiles running side by side (two test runs in one checkout) cannot read each other's PTX.
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="flamia-keep-") as dump_dir:
        compiled = build_fn(config, arch, f"--keep-ptx --keep-cubin --dump-dir {dump_dir}")
        ptx = compiled.__ptx__
        cubin = compiled.__cubin__
    if isinstance(cubin, str):
        cubin = cubin.encode("latin-1")
    regs, frame = cubin_resource_usage(cubin) if cubin else (None, None)
    sass = disassemble(cubin) if cubin else None
    return KernelArtifacts(arch, ptx, cubin, sass, regs, frame)
