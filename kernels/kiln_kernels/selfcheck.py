"""GPU self-check of the ahead-of-time path, end to end.

    python -m kiln_kernels.selfcheck [--out FILE.json]

Compiles one specialization per Triton kernel for *this* device's arch (as
the build stage would), writes them with a manifest into a scratch
``_aot`` directory, points the loader at it, runs each op, and checks that
the precompiled binary — not the JIT — ran and matches the torch reference.
Needs a CUDA or ROCm GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch

from kiln_kernels import _loader, aot, bench_cases, registry, router
from kiln_kernels.platform import current_platform

# (kernel, entry, specialization, bench-case factory, function to run or None
# for the case's own). The router's Triton path is called directly: on CUDA
# the public op prefers torch.mm(out_dtype=float32).
CHECKS = (
    ("per_token_quant", "per_token_quant_kernel", "bf16_i8_b2048", bench_cases.quant_cases, None),
    ("router_logits", "router_logits_kernel", "bf16_t64_e64_d64", bench_cases.router_cases, router._triton),
    ("gated_delta_decode", "gated_delta_decode_kernel", "bf16_k128_v64", bench_cases.decode_cases, None),
)


def build(root: Path, backend: str, arch: str) -> None:
    """Compile the checked specializations for ``arch`` and write a manifest."""
    entries = []
    for kernel, entry, name, _, _ in CHECKS:
        spec, fn = registry.find_specialization(kernel, entry, name)
        compiled = aot.compile_specialization(fn, spec, aot.target_for(backend, arch))
        binary = aot.write_artifact(compiled, root / arch, f"{kernel}.{entry}.{name}")
        entries.append({
            "kernel": kernel, "entry": entry, "specialization": name, "arch": arch,
            "kind": aot.binary_kind(backend), "path": str(binary.relative_to(root)),
            "sha256": hashlib.sha256(binary.read_bytes()).hexdigest(),
            "signature": dict(spec.signature), "constexprs": dict(spec.constexprs), "aligned": list(spec.aligned),
        })
    (root / "manifest.json").write_text(json.dumps(entries, indent=1))


def run_checks() -> list[dict]:
    plat = current_platform()
    rows = []
    for kernel, entry, name, cases, fn in CHECKS:
        case = cases("large")[0]
        inputs = case.make_inputs("cuda")
        ref_inputs = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in inputs)
        got = (fn or case.fn)(*inputs)
        want = case.reference(*ref_inputs)
        got, want = (r[0] if isinstance(r, tuple) else r for r in (got, want))
        torch.cuda.synchronize()
        err = (got.float() - want.float()).abs().max().item()
        aot_used = _loader.LOADER.loaded(kernel, entry, name, _loader.device(plat))
        rows.append({"kernel": kernel, "specialization": name, "case": case.name,
                     "aot_used": aot_used, "max_abs_err": err, "ok": aot_used and err <= 1.0})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("selfcheck: no GPU visible", file=sys.stderr)
        return 2
    plat = current_platform()
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp), plat.backend, plat.arch)
        _loader.LOADER.use_root(Path(tmp))
        try:
            rows = run_checks()
        finally:
            _loader.LOADER.use_root(_loader.AOT_DIR)
    for r in rows:
        print(f"{r['kernel']:20s} {r['specialization']:20s} aot={r['aot_used']!s:5s} "
              f"max_abs_err={r['max_abs_err']:.3g} {'ok' if r['ok'] else 'FAIL'}")
    if args.out:
        args.out.write_text(json.dumps({"platform": plat.__dict__, "checks": rows}, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
