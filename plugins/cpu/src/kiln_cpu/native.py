"""Builds and loads the plugin's C kernels on first use.

The kernels are plain C with OpenMP, compiled by the system C compiler once per machine
(~12 s on 2 cores, one source per core at a time) and cached under ``$KILN_CACHE_DIR/cpu-kernels`` keyed by the source
hash and the CPU's flags. Without a compiler (or with ``KILN_CPU_NATIVE=0``) the
plugin falls back to torch code, which is correct but slower.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import types
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import torch

from kiln.interfaces.platform import cache_dir

logger = logging.getLogger("kiln.cpu")

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / n
    for n in (
        "paged_attention.c",
        "paged_attention_narrow.c",
        "prefill_attention.c",
        "prefill_attention_f32.c",
        "fused_ops.c",
        "tiled_linear.c",
        "int8_linear.c",
        "decode_layer.c",
        "lora.c",
        "experts.c",
        "bf16_linear.c",
    )
]
FLAGS = ["-O3", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), which ``-march=native`` compiles for: a library built
    on one machine must not be loaded on another with fewer."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def has_amx_bf16() -> bool:
    """Whether the CPU has AMX bf16 tiles, on which oneDNN's bf16 GEMMs run."""
    return "amx_bf16" in _cpu_flags().split()


@cache
def bf16_dots_outrun_fma() -> bool:
    """Whether ``vdpbf16ps`` multiplies more values a second than fp32 FMAs on this CPU
    (``csrc/bf16_linear.c``'s ``bf16_dot_speed``, timed once: 2x on AMD Zen 4 and 5, 0.5x on a
    Xeon whose AMX a VM hides); False without AVX512-BF16 or the kernels."""
    lib = load_kernels()
    return lib is not None and lib.bf16_dot_speed() > 1.0


@cache
def fma_outruns_bf16_dots() -> bool:
    """Whether bf16 weights multiply faster widened to fp32 for FMAs (``csrc/tiled_linear.c``) than
    as oneDNN's bf16 products: no AMX, and vdpbf16ps slower than FMAs
    (a Xeon whose AMX the VM hides) or absent (AVX2); False without the kernels."""
    return load_kernels() is not None and not has_amx_bf16() and not bf16_dots_outrun_fma()


def _compiler_flags() -> list[str]:
    # KILN_CPU_MARCH: compile for an older instruction set than this CPU's (e.g. x86-64-v3,
    # AVX2 without VNNI), to run and test the kernels' other paths here.
    return [*FLAGS, f"-march={os.environ.get('KILN_CPU_MARCH') or 'native'}"]


def _build(compiler: str, flags: list[str], target: Path, csrc: Path = CSRC) -> str | None:
    """Compile ``SOURCES`` (as found in ``csrc``) into ``target``, one compiler per source at a
    time on every core (the first start on a machine waits for this: decode attention's 16
    unrolled kernels, split over two files, take ~17 s of GCC's ~23 s, the others ~6 s
    together), then link; the compiler's errors, or None."""
    sources = [csrc / src.name for src in SOURCES]
    flags = [*flags, f"-I{csrc}"]
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [os.path.join(tmp, f"{src.stem}.o") for src in sources]
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # the slowest (paged_attention*.c) first
            compiled = pool.map(
                lambda src, obj: subprocess.run(
                    [compiler, *flags, "-c", str(src), "-o", obj], capture_output=True, text=True
                ),
                sources,
                objects,
            )
            failed = [r.stderr for r in compiled if r.returncode != 0]
        if failed:
            return failed[0]
        library = os.path.join(tmp, target.name)
        linked = subprocess.run([compiler, *flags, *objects, "-o", library, "-lm"], capture_output=True, text=True)
        if linked.returncode != 0:
            return linked.stderr
        os.replace(library, target)  # whole or not at all; of two racing builds, one wins
    return None


@cache
def load_kernels() -> ctypes.CDLL | None:
    """The compiled library, or None when native kernels are off or cannot be built."""
    if os.environ.get("KILN_CPU_NATIVE", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: CPU attention falls back to torch (slower)")
        return None
    flags = _compiler_flags()
    sources = b"".join(p.read_bytes() for p in [*SOURCES, *sorted(CSRC.glob("*.h"))])
    key = hashlib.sha256(sources + " ".join(flags).encode() + _cpu_flags().encode())
    target = cache_dir() / "cpu-kernels" / f"kiln-cpu-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        error = _build(compiler, flags, target)
        if error is not None:
            logger.warning("building CPU kernels failed, falling back to torch:\n%s", error[-2000:])
            return None
    return _declared(ctypes.CDLL(str(target)))


class _OlderBuild:
    """A library's entry points as ``_declared`` sees them where the library may be an older
    revision's (``build_kernels``), which lacks entry points added since: those are skipped."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def __getattr__(self, name: str):
        return getattr(self._lib, name, None) or types.SimpleNamespace()


def build_kernels(csrc: Path, target: Path) -> ctypes.CDLL:
    """The kernels of another copy of ``csrc`` (e.g. an older revision's), built into ``target``
    as ``load_kernels`` builds this one's and loaded beside it (``bench/kernel_ab.py`` times
    two builds in one process). Raises RuntimeError with the compiler's errors."""
    compiler = _compiler()
    error = "no C compiler found" if compiler is None else _build(compiler, _compiler_flags(), target, csrc)
    if error is not None:
        raise RuntimeError(f"building the CPU kernels of {csrc} failed:\n{error[-2000:]}")
    lib = ctypes.CDLL(str(target))
    _declared(_OlderBuild(lib))
    return lib


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _declared(lib):
    """``lib`` with its entry points' argument and result types set."""
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    for fn in (getattr(lib, f"paged_decode_attention_{suffix}") for suffix in _ATTENTION_KERNELS.values()):
        fn.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, f32, i64, f32]
        fn.restype = ctypes.c_int
    prefill_common = [ptr, i64, ptr, *[i64] * 5, f32, i64, f32]  # block table .. soft cap
    head = [ptr, i64, ptr, i64]  # out, its row stride, q, its row stride
    lib.prefill_attention_bf16.argtypes = [*head, ptr, ptr, *prefill_common]
    lib.prefill_attention_f32.argtypes = [*head, ptr, ptr, i64, i64, ptr, ptr, ctypes.c_int, *prefill_common]
    for fn in (lib.prefill_attention_bf16, lib.prefill_attention_f32):
        fn.restype = ctypes.c_int
    lib.prefill_attention_bf16_available.restype = ctypes.c_int
    for dt in ("f32", "bf16"):
        getattr(lib, f"rms_norm_{dt}").argtypes = [ptr, ptr, ptr, i64, i64, i64, f32]
        getattr(lib, f"add_rms_norm_{dt}").argtypes = [ptr, ptr, ptr, i64, i64, f32]
        getattr(lib, f"rotary_{dt}").argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64]
        for op in ("silu_and_mul", "gelu_tanh_and_mul"):
            getattr(lib, f"{op}_{dt}").argtypes = [ptr, ptr, i64, i64]
        getattr(lib, f"write_kv_{dt}").argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64]
        for op in ("rms_norm", "add_rms_norm", "rotary", "silu_and_mul", "gelu_tanh_and_mul", "write_kv"):
            getattr(lib, f"{op}_{dt}").restype = None
    fmt = ctypes.c_int
    lib.tiled_linear.argtypes = [ptr, ptr, i64, i64, fmt, ptr, ptr, ptr, ptr, i64, i64]
    lib.int8_linear.argtypes = [*lib.tiled_linear.argtypes, ctypes.c_int]
    for fn in (lib.tiled_linear, lib.int8_linear):
        fn.restype = ctypes.c_int
    lib.int8_amx_rows.argtypes = [ctypes.c_int]
    lib.int8_amx_rows.restype = ctypes.c_int
    for fn in (lib.lora_add_f32, lib.lora_add_bf16w):
        fn.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr, ptr]
        fn.restype = ctypes.c_int
    lib.linear_bf16.argtypes = [ptr, ptr, i64, i64, ptr, ptr, i64]
    lib.linear_bf16.restype = ctypes.c_int
    lib.linear_bf16_pairs.argtypes = [ptr, ptr, i64, i64, ptr, ptr, i64]
    lib.linear_bf16_pairs.restype = None
    lib.linear_bf16_amx.restype = ctypes.c_int
    lib.bf16_dot_speed.restype = ctypes.c_double
    lib.argmax_f32.argtypes = [ptr, ptr, i64, i64, i64]
    lib.argmax_f32.restype = None
    lib.decode_layer.argtypes = [ptr, ptr, ptr, ptr, i64]
    lib.decode_layer.restype = ctypes.c_int
    lib.decode_layers.argtypes = [ptr, i64, ptr, ptr, ptr]
    lib.decode_layers.restype = ctypes.c_int
    lib.decode_moe_layer_bf16.argtypes = [ptr, ptr, ptr, ptr, i64]
    lib.decode_moe_layer_bf16.restype = ctypes.c_int
    for dt in ("f32", "bf16"):
        getattr(lib, f"moe_route_{dt}").argtypes = [ptr, ptr, ptr, i64, i64, i64, i64]
        getattr(lib, f"moe_route_{dt}").restype = None
    lib.tiled_unpack.argtypes = [ptr, fmt, ptr, ptr, ptr, i64, i64]
    lib.tiled_unpack.restype = ctypes.c_int
    lib.tiled_gather_rows.argtypes = [ptr, ptr, i64, fmt, ptr, ptr, ptr, i64]
    lib.tiled_gather_rows.restype = None
    lib.fused_experts_bf16.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr, i64, i64, ptr, ptr]
    lib.fused_experts_bf16.restype = ctypes.c_int
    lib.fused_experts_bf16_multiple.restype = ctypes.c_int
    lib.fused_experts_bf16_amx.restype = ctypes.c_int
    lib.fused_experts_tiled.argtypes = [*lib.fused_experts_bf16.argtypes, ctypes.c_int]
    lib.fused_experts_tiled.restype = ctypes.c_int
    return lib


# (query dtype, cache dtype) -> kernel name suffix
_ATTENTION_KERNELS = {
    (torch.float32, torch.float32): "f32",
    (torch.bfloat16, torch.bfloat16): "bf16",
    (torch.float32, torch.bfloat16): "f32_bf16",
    (torch.float32, torch.float8_e5m2): "f32_e5m2",  # read only: K/V are written through torch
}


def paged_decode_attention(
    out: torch.Tensor,  # (reqs, heads, dim), contiguous: written in place
    q: torch.Tensor,  # (reqs, heads, dim); rows may be strided
    k_cache: torch.Tensor,  # (blocks, kv_heads, block_size, dim), q's dtype or bf16, contiguous
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # (reqs, width) int32, contiguous rows
    seq_lens: torch.Tensor,  # (reqs,) int32
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Decode attention into ``out`` over each request's last ``sliding_window`` keys (all
    without one), scores soft-capped to ``softcap * tanh(s / softcap)`` where given (Gemma 2);
    computed in fp32."""
    suffix = _ATTENTION_KERNELS.get((q.dtype, k_cache.dtype))
    num_reqs, num_heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim or not out.is_contiguous() or suffix is None:
        raise ValueError("native decode attention needs (reqs, heads, dim) rows of the cache's dtype, or fp32 ones")
    kernel = getattr(load_kernels(), f"paged_decode_attention_{suffix}")
    status = kernel(
        out.data_ptr(),
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        block_table.stride(0),
        seq_lens.data_ptr(),
        num_reqs,
        num_heads,
        k_cache.shape[1],  # kv heads
        head_dim,
        k_cache.shape[2],  # block size
        scale,
        sliding_window or 0,  # 0: no window
        softcap or 0.0,  # 0: no cap
    )
    if status != 0:
        raise ValueError(f"native decode attention does not support head_dim={head_dim}, heads={num_heads}")


def prefill_attention(
    out: torch.Tensor,  # (tokens, heads, dim) q's dtype, rows may be strided: written in place
    q: torch.Tensor,  # (tokens, heads, dim) bf16 or fp32, rows may be strided
    k: torch.Tensor,  # (tokens, kv_heads, dim) q's dtype, the step's fresh keys (rows may be strided)
    v: torch.Tensor,  # (tokens, kv_heads, dim) likewise
    kv_cache: torch.Tensor,  # (2, blocks, kv_heads, block_size, dim), q's dtype or bf16
    block_table: torch.Tensor,  # (reqs, width) int32, contiguous rows
    seqs: torch.Tensor,  # (prefills, 4) int64: first token row, query length, context length, block-table row
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Causal attention of prefill queries (and chunks on a cached prefix) over the keys up to
    each query's position (its last ``sliding_window`` of them): a cached prefix's from the
    cache; the prompt's own from ``k``/``v`` for fp32 queries (unrounded under a bf16 cache),
    from the cache, which holds them too, for bf16 ones. ``softcap`` as in ``paged_decode_attention``."""
    dtype = q.dtype
    for name, x in (("out", out), ("q", q)):
        if not _head_rows(x) or x.dtype != dtype or dtype not in _PREFILL_KERNELS:
            raise ValueError(f"native prefill attention needs (tokens, heads, dim) bf16 or fp32 rows in {name}")
    cache_ok = kv_cache.dtype in (dtype, torch.bfloat16) and kv_cache.is_contiguous()
    if not cache_ok or kv_cache.shape[-1] != q.shape[2]:
        raise ValueError("native prefill attention needs a contiguous cache of q's head size, in q's dtype or bf16")
    if block_table.dtype != torch.int32 or block_table.stride(1) != 1 or seqs.dtype != torch.int64:
        raise ValueError("native prefill attention needs an int32 block table and int64 sequence rows")
    seqs = seqs.contiguous()
    window = min(sliding_window or 0, 2**31 - 1)  # the kernels compare positions in 32 bits
    common = (block_table.data_ptr(), block_table.stride(0), seqs.data_ptr(), seqs.shape[0], q.shape[1],
              kv_cache.shape[2], q.shape[2], kv_cache.shape[3], scale, window, softcap or 0.0)  # fmt: skip
    head = (out.data_ptr(), out.stride(0), q.data_ptr(), q.stride(0))
    cache = (kv_cache[0].data_ptr(), kv_cache[1].data_ptr())
    lib = load_kernels()
    if dtype == torch.bfloat16:
        status = lib.prefill_attention_bf16(*head, *cache, *common)
    else:
        k, v = (x if _head_rows(x) else x.contiguous() for x in (k, v))
        for name, x in (("k", k), ("v", v)):
            if x.dtype != dtype or x.shape[0] < q.shape[0] or x.shape[1:] != kv_cache.shape[2:5:2]:
                raise ValueError(f"native prefill attention needs (tokens, kv_heads, dim) rows of q's dtype in {name}")
        fresh = (k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0))
        status = lib.prefill_attention_f32(*head, *fresh, *cache, int(kv_cache.dtype == torch.bfloat16), *common)
    if status == -2:
        raise MemoryError("native prefill attention: out of memory for its buffers")
    if status != 0:
        raise ValueError(f"native prefill attention does not support head_dim={q.shape[2]}, heads={q.shape[1]}")


_PREFILL_KERNELS = (torch.bfloat16, torch.float32)


def _head_rows(x: torch.Tensor) -> bool:
    """Whether a (tokens, heads, dim) tensor's heads lie side by side in each token's row, as the
    kernels read them (the rows themselves may be strided)."""
    return x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2])


# Cache dtypes the C code writes K/V into (write_kv_cache, and csrc/decode_layer.c): fp8 caches are
# written through torch's rounding.
KV_WRITERS = {torch.float32: "f32", torch.bfloat16: "bf16"}


def write_kv_cache(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, block_size: int):
    """Copy (tokens, kv_heads, dim) K/V rows (rows may be strided) into their slots; slot -1 is skipped."""
    kernel = getattr(load_kernels(), f"write_kv_{KV_WRITERS[kv_cache.dtype]}")
    slots = slots.to(torch.int64).contiguous()
    tokens, heads, dim = k.shape
    kernel(
        kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), k.data_ptr(), v.data_ptr(), slots.data_ptr(),
        tokens, heads, dim, block_size, k.stride(0), v.stride(0),
    )  # fmt: skip


# Head sizes the C attention kernels take, decode and prefill (96 is Phi-3's, 256 Gemma 2/3's).
HEAD_SIZES = (64, 96, 128, 256)


def supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Shapes and (compute, cache) dtypes the C kernel handles (others use the torch path)."""
    group = num_heads // num_kv_heads
    dtypes_ok = (dtype, cache_dtype) in _ATTENTION_KERNELS
    return dtypes_ok and head_dim in HEAD_SIZES and 1 <= group <= 8 and group * num_kv_heads == num_heads


def supports_prefill(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype):
    """Whether ``prefill_attention`` runs here: fp32 queries (fp32 or bf16 cache), or bf16 ones
    and cache on a CPU with AVX512-BF16 but no AMX (others use torch's flash kernel, which oneDNN
    runs on AMX tiles where there are some: the bf16 kernel has not been measured against that)."""
    shapes_ok = head_dim in HEAD_SIZES and num_heads % num_kv_heads == 0
    lib = load_kernels() if shapes_ok and cache_dtype in (dtype, torch.bfloat16) else None
    if lib is None or dtype not in _PREFILL_KERNELS:
        return False
    return dtype == torch.float32 or (not has_amx_bf16() and bool(lib.prefill_attention_bf16_available()))
