"""Peer tensors: one tensor on every rank of a process group, each rank's copy
addressable from every GPU (ThunderKittens' `pgl`), for `tk.pgl` kernel
parameters.

A `PeerTensor` is this rank's view: its own copy (`local`), a tensor on this
GPU for each rank's copy (`peers[r]`, mapped over NVLink; `peers[rank]` is
`local`'s memory), its `rank` and `world_size`. `peer_tensor(shape, dtype,
group)` allocates one on PyTorch's symmetric memory
(`torch.distributed._symmetric_memory`: `empty` + `rendezvous`), which maps
the peers' buffers with plain peer access, never multicast.
`PeerTensor.from_tensors` groups tensors one process already reaches (one
GPU's buffers standing for ranks, or other GPUs' memory with peer access
enabled; the kernel runs on the local copy's device): that is how one
process runs every rank's kernel, e.g. on one GPU in tests.

A kernel sees a tk.pgl argument as its local copy plus one copy per rank and
the rank (params.py expands it), so the host checks here that the copies
agree in shape, strides and dtype: the kernel reads one set of extents.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import ArgumentError


@dataclass(frozen=True, eq=False)     # (equal only to itself: == would compare tensors)
class PeerTensor:
    """This rank's view of a tensor that every rank of a group holds. Its
    tensors must keep their memory while kernels use it (no resize_ or set_):
    a launch plan reads their addresses once, for this object."""
    local: Any                     # this rank's copy (a torch tensor)
    peers: tuple                   # every rank's copy, as tensors this GPU addresses
    rank: int
    handle: Any = None             # the symmetric-memory handle, kept alive with the views

    def __post_init__(self):
        object.__setattr__(self, "peers", tuple(self.peers))
        if not self.peers:
            raise ArgumentError("PeerTensor needs one tensor per rank in `peers`, got none")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or \
                not 0 <= self.rank < len(self.peers):
            raise ArgumentError(f"PeerTensor: rank must be an int from 0 to "
                                f"{len(self.peers) - 1} (one tensor per rank in `peers`), got "
                                f"{self.rank!r}")

    @property
    def world_size(self) -> int:
        return len(self.peers)

    @property
    def shape(self):
        return self.local.shape

    @property
    def dtype(self):
        return self.local.dtype

    @property
    def device(self):
        return self.local.device

    @classmethod
    def from_tensors(cls, tensors: Sequence, rank: int, handle=None) -> PeerTensor:
        """Rank `rank`'s view of `tensors` (one per rank, in rank order), which
        this process can address: the other ranks' kernels get the same list
        with their own rank. `handle`: what keeps their memory mapped (views of
        a PeerTensor's copies pass its handle on)."""
        tensors = tuple(tensors)
        if not tensors:
            raise ArgumentError("PeerTensor.from_tensors needs one tensor per rank, got none")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < len(tensors):
            raise ArgumentError(f"PeerTensor.from_tensors: rank must be an int from 0 to "
                                f"{len(tensors) - 1} (one tensor per rank), got {rank!r}")
        return cls(tensors[rank], tensors, rank, handle)

    def __repr__(self):
        shape = getattr(self.local, "shape", None)
        return (f"PeerTensor(rank {self.rank} of {self.world_size}, shape "
                f"{tuple(shape) if shape is not None else '?'}, "
                f"{getattr(self.local, 'dtype', '?')}, on {getattr(self.local, 'device', '?')})")


@dataclass(frozen=True)
class PeerSpec:
    """A tk.pgl argument without memory, for compiling with no GPU
    (`tk.peer_spec((T, 8192), tk.bf16, world_size=2)`)."""
    local: Any                     # a TensorSpec
    world_size: int

    @property
    def peers(self) -> tuple:
        return (self.local,) * self.world_size


def peer_spec(shape, dtype, world_size: int, strides=None) -> PeerSpec:
    from .arguments import spec
    if not isinstance(world_size, int) or isinstance(world_size, bool) or \
            not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ArgumentError(f"peer_spec: world_size must be an int from 1 to "
                            f"{MAX_WORLD_SIZE}, got {world_size!r}")
    return PeerSpec(spec(shape, dtype, strides), world_size)


# One GPU per rank of an NVLink domain; each copy is a kernel parameter of its own.
MAX_WORLD_SIZE = 8


@dataclass(frozen=True)
class PeerInfo:
    """A tk.pgl argument as the launch reads it: TensorInfo (or TensorSpec)
    of the local copy and of each rank's, and the rank."""
    local: Any
    peers: tuple
    rank: int

    @property
    def world_size(self) -> int:
        return len(self.peers)


def read_peers(obj, name: str, read_tensor) -> PeerInfo:
    """Read a tk.pgl argument (a PeerTensor, or a PeerSpec to compile), each
    copy with `read_tensor` (tensor_info, or describe); the copies must agree."""
    if isinstance(obj, PeerSpec):
        local = read_tensor(obj.local, name)
        return PeerInfo(local, (local,) * obj.world_size, 0)
    if not isinstance(obj, PeerTensor):
        from ..params import describe_value
        raise ArgumentError(f"argument '{name}' is a tk.pgl parameter: it takes a "
                            f"tk.PeerTensor (tk.peer_tensor(shape, dtype, group), or "
                            f"tk.PeerTensor.from_tensors), got {describe_value(obj)}")
    if not 1 <= obj.world_size <= MAX_WORLD_SIZE:
        raise ArgumentError(f"argument '{name}': a PeerTensor of {obj.world_size} ranks; "
                            f"tk.pgl takes 1 to {MAX_WORLD_SIZE}")
    local = read_tensor(obj.local, name)
    peers = tuple(read_tensor(t, f"{name}[{r}]") for r, t in enumerate(obj.peers))
    for r, p in enumerate(peers):
        if (tuple(p.shape), tuple(p.strides), p.dtype) != \
                (tuple(local.shape), tuple(local.strides), local.dtype):
            raise ArgumentError(
                f"argument '{name}': rank {r}'s copy has shape {tuple(p.shape)}, strides "
                f"{tuple(p.strides)}, {p.dtype}; rank {obj.rank}'s (this one) has "
                f"{tuple(local.shape)}, {tuple(local.strides)}, {local.dtype}: every rank's "
                f"copy of a peer tensor must agree (the kernel reads one set of extents)")
    if peers[obj.rank].ptr != local.ptr:
        raise ArgumentError(f"argument '{name}': peers[{obj.rank}] (this rank's copy) is not "
                            f"`local`'s memory")
    return PeerInfo(local, peers, obj.rank)


def peer_tensor(shape, dtype, group=None) -> PeerTensor:
    """A tensor of `shape` and `dtype` on every rank of `group` (default: the
    whole world), on PyTorch's symmetric memory: a collective call, each rank
    makes it on its current CUDA device. Uninitialised, as torch.empty."""
    import os
    # Peer access only: NVLink multicast is never used (and where it is on,
    # some hosts' shared GPUs can be taken out of service by a program using it).
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem
    if not dist.is_initialized():
        raise ArgumentError("tk.peer_tensor needs torch.distributed initialised (run under "
                            "torchrun and call dist.init_process_group('nccl'))")
    group = group if group is not None else dist.group.WORLD
    shape = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list, torch.Size))
                                   else (shape,)))
    local = symm_mem.empty(shape, dtype=dtype, device=torch.device("cuda",
                                                                   torch.cuda.current_device()))
    handle = symm_mem.rendezvous(local, group)
    # The handle's pointers are its allocation's base; the tensor may sit past it
    # (a pool): each peer's copy is at the same offset.
    offset, itemsize = local.data_ptr() - handle.buffer_ptrs[handle.rank], local.element_size()
    offsets = [None] * handle.world_size
    dist.all_gather_object(offsets, offset, group)
    if len(set(offsets)) != 1 or offset % itemsize:
        raise RuntimeError(f"tk.peer_tensor: the ranks' tensors sit at different offsets in "
                           f"their symmetric allocations ({offsets} bytes); allocate peer "
                           f"tensors in the same order on every rank")
    peers = tuple(local if r == handle.rank else
                  handle.get_buffer(r, shape, dtype, offset // itemsize)
                  for r in range(handle.world_size))
    return PeerTensor(local, peers, handle.rank, handle)
