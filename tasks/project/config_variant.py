"""``[[variants]]`` of kiln.toml: what each wheel is built for (backend, archs, platforms, ABI claim, matrix axes).

Part of :class:`kiln.tasks.project.config.KilnConfig`; a variant with matrix axes is expanded at load into one
variant per cell (:mod:`kiln.tasks.project.config_matrix`).
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from kiln.core.errors import InvalidInputError
from kiln.tasks.project.archs import validate_arch
from kiln.tasks.project.config_axes import check_cuda_axis, check_python_axis, check_torch_axis
from kiln.tasks.project.config_build import ArchPolicy, check_build_env, one_of
from kiln.tasks.project.config_matrix import Cell, check_exclusion, check_exclusions
from kiln.tasks.project.config_project import requirement

# Closed sets, each spelled once: argparse choices and run-time checks derive from them (get_args).
Backend = Literal["cuda", "hip", "cpu"]
# A variant's torch ABI claim: "exact" pins the torch it was built against; "stable" promises the LibTorch
# stable ABI only (no at::/c10:: symbols), which the build's audit checks (kiln.tasks.wheel.abi_audit).
TorchAbi = Literal["exact", "stable"]
# The CPUs a variant's wheels are built for: the builder's own (x86_64), and aarch64 (NVIDIA Grace), cross-built
# on it (kiln.tasks.build.cross).
Platform = Literal["x86_64", "aarch64"]
PLATFORMS: tuple[Platform, ...] = get_args(Platform)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def check_platforms(values: tuple[str, ...]) -> tuple[str, ...]:
    """A variant's ``platform`` list: known CPUs, each once, at least one."""
    if not values:
        raise ValueError(f"platform is empty: name at least one of {list(PLATFORMS)}")
    for value in values:
        one_of(value, PLATFORMS, "a platform Kiln builds for")
    if len(set(values)) != len(values):
        raise ValueError(f"duplicate platforms in {list(values)}")
    return values


class Variant(_Model):
    # The variant's name: its local version label (+cu130), index folder and unit ids.
    name: str = Field(pattern=r"^[a-z][a-z0-9]*$")
    backend: Backend  # what its kernels are compiled for: CUDA, ROCm (hip) or none (cpu)
    archs: tuple[str, ...] = ()  # the GPU archs compiled for, e.g. ["8.0", "9.0+PTX"] or ["gfx942"]; empty for cpu
    # Requires-Dist of this variant's wheel beyond [project].dependencies (e.g. a CUDA runtime).
    dependencies: tuple[Annotated[str, AfterValidator(requirement)], ...] = ()
    # The variant's own build environment (e.g. a CUDA build of torch), made once and cached; empty: Kiln's own.
    build_requires: tuple[Annotated[str, AfterValidator(requirement)], ...] = ()
    # Variables exported to the variant's build (a package's own switches); part of the cache key.
    build_env: Annotated[dict[str, str], AfterValidator(check_build_env)] = Field(default_factory=dict)
    arch_policy: ArchPolicy = "exact"  # what a kernel's supported archs do to the list: see the build-matrix guide
    # "stable": one wheel over torch's stable ABI for every torch of the axis (torch>= in its metadata).
    abi: TorchAbi = "exact"
    # abi = "stable" only: the oldest torch (major.minor) its one wheel claims, passed to its build as
    # TORCH_TARGET_VERSION (kiln.tasks.wheel.stable_abi); default: the torch it builds against.
    torch_target: str | None = Field(default=None, pattern=r"^[0-9]+\.[0-9]+$")
    # Matrix axes (kiln.tasks.project.config_matrix): the Pythons and torches this variant is built for, less
    # the cells `exclude` names. Expanded at load into one variant per cell; none: one wheel, as before.
    python: Annotated[tuple[str, ...], AfterValidator(check_python_axis)] = ()
    # The torch axis: one cell per requirement, e.g. ["==2.13.0", "==2.14.1"].
    torch: Annotated[tuple[str, ...], AfterValidator(check_torch_axis)] = ()
    # The CUDA axis: one cell per CUDA release its device code is compiled with (e.g. ["12.8", "13.0"]), for
    # code that needs no torch of that CUDA (ahead-of-time Triton kernels, a plain CUDA library): its ptxas
    # (and nvcc) from NVIDIA's CUDA wheels on PyPI where this machine's toolkit is another release.
    cuda: Annotated[tuple[str, ...], AfterValidator(check_cuda_axis)] = ()
    # Cells of this variant's axes that are not built: tables of axis values ({python = "3.13", torch =
    # "2.13.0"}: every cell matching all the keys given) or shell-style patterns over cell names ("*py313cu128").
    exclude: tuple[Annotated[str | dict[str, str], AfterValidator(check_exclusion)], ...] = ()
    # The cells built, by name: shell-style patterns over the cell names (cu130py312torch2141, cpupy311aarch64); each
    # must match a cell. None: every cell the exclusions leave.
    select: tuple[str, ...] = ()
    # The CPUs its wheels are built for; aarch64 wheels are cross-built on this x86_64 builder
    platform: Annotated[tuple[str, ...], AfterValidator(check_platforms)] = ("x86_64",)
    # Set by Kiln on each expanded cell (never in kiln.toml): the cell it stands for.
    cell: Cell | None = None

    @property
    def label(self) -> str:
        """The wheel's local label: the variant's name, or its cell's (``cu130torch2.14``)."""
        return self.cell.label if self.cell is not None else self.name

    @model_validator(mode="after")
    def _axes(self) -> Variant:
        try:
            check_exclusions(self)
        except ValueError as exc:
            raise ValueError(f"variant {self.name!r}: {exc}") from exc
        return self

    @model_validator(mode="after")
    def _cuda_axis(self) -> Variant:
        if self.cuda and self.backend != "cuda":
            raise ValueError(f"variant {self.name!r}: cuda = {list(self.cuda)} is the CUDA release its device code is"
                             f" compiled with; backend {self.backend!r} compiles none (give it to a cuda variant)")
        return self

    @model_validator(mode="after")
    def _target(self) -> Variant:
        if self.torch_target is not None and self.abi != "stable":
            raise ValueError(f"variant {self.name!r}: torch_target = {self.torch_target!r} needs abi = \"stable\""
                             " (an exact variant's wheel pins the torch it was built against)")
        return self

    @model_validator(mode="after")
    def _archs(self) -> Variant:
        if self.backend == "cpu" and self.archs:
            raise ValueError(f"variant {self.name!r}: backend 'cpu' takes no archs")
        try:
            canonical = tuple(validate_arch(a, self.backend) for a in self.archs)
        except InvalidInputError as exc:
            raise ValueError(f"variant {self.name!r}: {exc}") from exc
        if len(set(canonical)) != len(canonical):
            raise ValueError(f"variant {self.name!r}: duplicate archs in {list(self.archs)}")
        object.__setattr__(self, "archs", canonical)
        return self
