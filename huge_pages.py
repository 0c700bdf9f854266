"""Weights in 2 MB pages: where Linux gives them, a quantized model's stored tensors are copied
side by side into memory it backs with huge pages (quantize.pack_layers calls into_huge_pages),
so that a decode step, which reads every weight once, walks the page tables for 47 pages of
SmolLM2-135M instead of 24,000.
"""
import ctypes
import mmap

import torch

# A decode step reads every weight once. In 4 KB pages each page is a miss of the CPU's address
# cache (its TLB holds a few thousand pages: 12 MB) and costs a walk of the page tables; in 2 MB
# pages (Linux's transparent huge pages, which it gives to memory marked MADV_HUGEPAGE before its
# first write) SmolLM2-135M's 94 MB of weights are 47 pages. Measured on a 2-core EPYC, the
# compiled model moved against left where it loaded, in one process, blocks of steps alternated,
# both load orders (the second model loaded ran faster by itself): a 1-token step in 0.86-0.90x
# the time on one thread, 0.95x on two; a 2- or 3-token verification 0.94x on two.
SLAB = 32 << 20  # bytes: weights are copied into slabs of this size (or one tensor's, if larger)
HUGE = 2 << 20   # bytes of a huge page
HUGE_PAGES = hasattr(mmap, "MADV_HUGEPAGE")  # whether memory can be asked for in them (Linux)


def into_huge_pages(layers: list, names: tuple[str, ...]) -> int:
    """Copy the layers' tensors named `names` (quantize.pack_layers: the quantized layers' stored
    weights) side by side into slabs of memory that Linux backs with 2 MB pages, and point every
    layer that held one (a tied embedding shares the head's) at its copy: the same values, read
    through fewer pages. A slab at a time, so loading peaks at about one slab (or the largest
    tensor) more than before. Elsewhere than Linux nothing moves. Returns the bytes moved."""
    if not HUGE_PAGES:  # a copy into plain memory would gain nothing
        return 0
    holders = {}  # id(tensor) -> every (layer, name) that holds it (a tied embedding the head's)
    for m in layers:
        for name in names:
            t = getattr(m, name)
            if t is not None and t.device.type == "cpu":
                holders.setdefault(id(t), []).append((m, name))
    slab, free, moved = None, 0, 0
    for refs in holders.values():
        t = getattr(*refs[0])
        size = -(-t.nbytes // 64) * 64  # each tensor starts on a cache line
        if size > free:  # a new slab, once the memory the last one's tensors held is given back
            release_freed_memory()
            slab = huge_page_slab(max(SLAB, size))
            free = slab.numel()
        start = slab.numel() - free
        copy = slab[start:start + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
        for m, name in refs:
            setattr(m, name, copy)  # the old tensor is freed with its last holder
        free, moved = free - size, moved + t.nbytes
    release_freed_memory()
    return moved


def release_freed_memory():
    """Give the memory the moved tensors held back to the system: C's allocator keeps freed
    blocks of up to 32 MB for reuse (without this, SmolLM2-135M's int4 layers, 66 MB, stayed
    resident after their move, and an 8B model in int4 peaked at 9.5 GB against 6.9).
    glibc's malloc_trim; elsewhere nothing."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def huge_page_slab(size: int) -> torch.Tensor:
    """A uint8 tensor [size] at a 2 MB boundary of fresh anonymous memory marked MADV_HUGEPAGE
    (its pages are made on first write, so the mark comes first). It keeps its memory alive.
    Elsewhere than Linux, plain memory of that size."""
    size = -(-size // HUGE) * HUGE
    if not HUGE_PAGES:
        return torch.empty(size, dtype=torch.uint8)
    # private: Python's anonymous mmap is shared by default, which Linux gives no huge pages
    memory = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(memory, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE
    try:
        memory.madvise(mmap.MADV_HUGEPAGE, start, size)
    except OSError:  # a kernel built without huge pages (EINVAL): 4 KB pages, as before
        pass
    return whole[start:start + size]
