"""The kernel registry: the only way the pipeline learns about kernels.

Kiln's build and benchmark stages read ``kiln.toml``'s ``project.registry``
(``"module:attribute"``), call it, and get a list of :class:`KernelSpec`.
Another kernel package provides its own registry with objects of the same
shape (these dataclasses, or anything with the same attributes).

Arch names: CUDA archs are ``"major.minor"`` strings, optionally suffixed
``a``/``f`` (``"9.0a"``, ``"10.0f"``); ROCm archs are ``gfx`` names
(``"gfx942"``). ``supported`` maps a backend (``"cuda"``/``"hip"``) to the
archs the kernel can run on.
"""

from __future__ import annotations

from typing import Any

from kiln.runtime.archs import at_least
from kiln.runtime.spec import BenchCase, CudaSource, KernelSpec, Specialization, TritonEntry

__all__ = ["BenchCase", "CudaSource", "KernelSpec", "Specialization", "TritonEntry", "registry"]


# --- this package's registry ----------------------------------------------------
#
# The specializations below are exactly the launch configurations the op
# wrappers pick (``kiln_kernels.quant.BLOCKS``, ``kiln_kernels.router.CONFIGS``,
# ``kiln_kernels.decode.CONFIGS``), named the way the wrappers name them, so a
# shipped artifact is found at run time. Building them imports Triton and the
# kernel modules, so it happens on the first call, not at import.

CUDA_ARCHS: tuple[str, ...] = ("8.0", "8.6", "8.9", "9.0", "10.0", "12.0")
HIP_ARCHS: tuple[str, ...] = ("gfx90a", "gfx942", "gfx950")
_TL = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16"}


def _quant_specs() -> tuple[Specialization, ...]:
    from kiln_kernels import quant

    specs = []
    for dt, ptr in _TL.items():
        for out, qmax in (("i8", 127.0), ("fp8", 448.0)):
            for block in quant.BLOCKS:
                fp8 = out == "fp8"
                specs.append(Specialization(
                    name=f"{dt}_{out}_b{block}",
                    signature={"x_ptr": ptr, "q_ptr": "*fp8e4nv" if fp8 else "*i8", "scale_ptr": "*fp32",
                               "N": "i32", "stride_xm": "i32", "stride_qm": "i32", "BLOCK": "constexpr",
                               "EPS": "constexpr", "QMAX": "constexpr", "IS_INT": "constexpr"},
                    constexprs={"BLOCK": block, "EPS": quant.EPS, "QMAX": qmax, "IS_INT": not fp8},
                    min_arch={"cuda": "8.9", "hip": "gfx942"} if fp8 else {},
                    options={"num_warps": 4 if block == quant.BLOCKS[0] else 8},
                    aligned=("x_ptr", "q_ptr", "N", "stride_xm", "stride_qm"),
                ))
    return tuple(specs)


def _router_specs() -> tuple[Specialization, ...]:
    from kiln_kernels import router

    sig = {"h_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32", "T": "i32", "E": "i32", "D": "i32"}
    sig |= {s: "i32" for s in ("stride_ht", "stride_hd", "stride_we", "stride_wd", "stride_ot", "stride_oe")}
    sig |= {c: "constexpr" for c in ("BLOCK_T", "BLOCK_E", "BLOCK_D", "DOT_F32")}
    return tuple(
        Specialization(
            name=router.spec_name(cfg), signature=sig,
            constexprs={"BLOCK_T": cfg[0], "BLOCK_E": cfg[1], "BLOCK_D": cfg[2], "DOT_F32": False},
            options={"num_warps": cfg[3]},
            aligned=("h_ptr", "w_ptr", "out_ptr", "D", "stride_ht", "stride_we", "stride_ot"),
        )
        for cfg in router.CONFIGS
    )


def _decode_specs() -> tuple[Specialization, ...]:
    from kiln_kernels import decode

    strides = ("sq_b", "sq_h", "sk_b", "sk_h", "sv_b", "sv_h", "sg_b", "sg_h", "sbeta_b", "sbeta_h")
    specs = []
    for dt, ptr in _TL.items():
        sig = {p: ptr for p in ("q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr")}
        sig |= {"state_ptr": "*fp32", "slot_ptr": "*i32", "out_ptr": ptr}
        sig |= {"S": "i32", "H": "i32", "K": "i32", "V": "i32", "scale": "fp32"}
        sig |= {s: "i32" for s in strides} | {"BLOCK_K": "constexpr", "BLOCK_V": "constexpr"}
        for cfg in decode.CONFIGS:
            specs.append(Specialization(
                name=f"{dt}_k{cfg[0]}_v{cfg[1]}", signature=sig,
                constexprs={"BLOCK_K": cfg[0], "BLOCK_V": cfg[1]}, options={"num_warps": cfg[2]},
                aligned=("q_ptr", "k_ptr", "v_ptr", "g_ptr", "state_ptr", "out_ptr", "K", "V", *strides[:8]),
            ))
    return tuple(specs)


def _build() -> tuple[KernelSpec, ...]:
    from kiln_kernels import _decode_tl, _quant_tl, _router_tl, activation, bench_cases
    from kiln_kernels.aot import jit_function as jit  # always a compilable JITFunction

    gpus = {"cuda": CUDA_ARCHS, "hip": HIP_ARCHS}
    return (
        KernelSpec(
            name="per_token_quant", module="kiln_kernels.quant", supported=gpus,
            triton=(TritonEntry("per_token_quant_kernel", jit(_quant_tl.per_token_quant_kernel), _quant_specs()),),
            bench_cases=bench_cases.quant_cases,
            description="row-wise dynamic quantization to int8 / fp8 e4m3",
        ),
        KernelSpec(
            name="router_logits", module="kiln_kernels.router", supported=gpus,
            triton=(TritonEntry("router_logits_kernel", jit(_router_tl.router_logits_kernel), _router_specs()),),
            bench_cases=bench_cases.router_cases,
            description="MoE router GEMM, bf16 in, float32 out",
        ),
        KernelSpec(
            name="gated_delta_decode", module="kiln_kernels.decode", supported=gpus,
            triton=(TritonEntry("gated_delta_decode_kernel", jit(_decode_tl.gated_delta_decode_kernel),
                                _decode_specs()),),
            bench_cases=bench_cases.decode_cases,
            description="gated delta-rule decode step over a slot pool",
        ),
        KernelSpec(
            name="silu_and_mul", module="kiln_kernels.activation",
            supported={"cuda": activation.SUPPORTED_CUDA},
            csrc=CudaSource("kiln_csrc", activation.SOURCES, activation.SUPPORTED_CUDA, activation.LIBRARY),
            bench_cases=bench_cases.activation_cases,
            description="fused SiLU-and-mul, CUDA C++ through a C ABI",
        ),
    )


_cache: tuple[KernelSpec, ...] = ()


def registry() -> list[KernelSpec]:
    """Every kernel of this package, for ``kiln.toml``'s ``project.registry``."""
    global _cache
    if not _cache:
        _cache = _build()
    return list(_cache)


def find_specialization(kernel: str, entry: str, name: str) -> tuple[Specialization, Any]:
    """The specialization ``name`` of ``kernel``'s ``entry`` and its jit function."""
    for spec in registry():
        for tentry in spec.triton:
            if (spec.name, tentry.name) == (kernel, entry):
                for s in tentry.specializations:
                    if s.name == name:
                        return s, tentry.fn
    raise KeyError(f"no specialization {kernel}/{entry}/{name} in the registry")


def targets_for(spec: Specialization, backend: str, arch: str) -> bool:
    """Whether ``spec`` is compiled for ``backend``/``arch`` (backends, min_arch)."""
    if backend not in spec.backends:
        return False
    low = spec.min_arch.get(backend)
    return low is None or at_least(backend, arch, low)
