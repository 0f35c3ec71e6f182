"""A specialization: everything that decides the code compiled for one launch
signature of a kernel, and the disk cache key that names it."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from . import cache


@dataclass(frozen=True)
class Specialization:
    """Everything that decides the generated code for one launch signature."""
    name: str
    source: str
    filename: str
    args: tuple            # per runtime argument: ("gl", dtype, static shape), ("pgl", dtype,
    #                        static shape, world size) or ("i32",)/("f32",)
    arg_names: tuple[str, ...]
    constexprs: tuple      # ((name, value), ...)
    num_warps: int
    globals_key: str       # the module-level values the kernel reads, as text
    first_line: int = 0    # where the source sits (the stages' locations name it)
    fp_contract: bool = True   # tile a*b+c may contract to fma (@tk.kernel(fp_contract=))
    arch: str = "sm_90a"       # the target (target.TARGETS; @tk.kernel(target=))

    def dump_name(self) -> str:
        """TK_MLIR_DUMP_DIR's folder for this specialization: the kernel's name
        and a short hash, so specializations do not overwrite each other."""
        return f"{self.name}-{self.cache_key()[:8]}"

    def identity(self) -> dict:
        """The kernel a disk cache entry for this specialization holds: its
        name and source, checked when the entry is read."""
        return {"name": self.name,
                "source_sha256": hashlib.sha256(self.source.encode()).hexdigest()}

    def cache_key(self) -> str:
        return cache.make_key(kind="tk-kernel", name=self.name, source=self.source,
                              where=[self.filename, self.first_line],
                              args=[list(map(cache.jsonable, a)) for a in self.args],
                              constexprs=[[k, cache.jsonable(v)] for k, v in self.constexprs],
                              num_warps=self.num_warps, globals=self.globals_key,
                              fp_contract=self.fp_contract, arch=self.arch)
