"""Devices and dtypes: where a model runs, in what precision, and how tensors cross between the
host and the device. Every file that moves data to or from a device does it through here, so
that tests can count the crossings (each one may stall a GPU) and a GPU user finds the rules in
one place.
"""
import torch

# --dtype names, as vLLM's; "auto" is bfloat16 on CUDA and float32 elsewhere
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# torch >= 2.8 multiplies bf16/fp16 matrices into a float32 result on CUDA (aten::mm.dtype, cuBLAS);
# "meta" runs the same call without data, so that a CPU-only test checks it. Older torch builds
# are refused for bf16/fp16 on CUDA (resolve_dtype; requirements.txt)
MM_FP32_OUT = ("cuda", "meta") if "dtype" in torch.ops.aten.mm.overloads() else ()


def check_device(device) -> torch.device:
    """A device name as this process will use it, refused in one line if it cannot be: a GPU that
    CUDA cannot see here. "cuda" without an index becomes the current GPU's name, so that every
    process and torch.cuda.set_device (which needs the index) agree on it."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a device name: use cpu or cuda:N") from None
    if d.type == "cpu":
        return d
    if d.type != "cuda":  # mps, xpu, meta, ...: the engine's kernels and processes know neither
        raise ValueError(f"device {device!r} is not supported: use cpu or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device} requested but CUDA is not available here: give cpu "
                         f"instead (--device cpu, --target-devices cpu,cpu, ...)")
    index = torch.cuda.current_device() if d.index is None else d.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {device} does not exist ({torch.cuda.device_count()} GPUs "
                         f"visible)")
    return torch.device("cuda", index)


def placement(device, dtype) -> tuple[torch.device, torch.dtype]:
    """Where a model runs and in what: check_device's device and resolve_dtype's dtype on it."""
    device = check_device(device)
    return device, resolve_dtype(dtype, device)


def tp_backend(devices: list[str]) -> str:
    """The process group's backend for a tensor-parallel target's devices (tp.py): NCCL over
    distinct GPUs, gloo over CPUs; any other list refused in one line."""
    kinds = {torch.device(d).type for d in devices}
    if kinds == {"cpu"}:
        return "gloo"
    if kinds != {"cuda"}:
        raise ValueError(f"target_devices={devices}: use only cuda:N devices (NCCL) or only cpu "
                         f"(gloo), not a mix")
    idx = [torch.device(d).index or 0 for d in devices]
    if len(set(idx)) != len(idx):
        raise ValueError(f"target_devices={devices} repeats a GPU: tensor parallelism needs one "
                         f"GPU per rank")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if max(idx) >= visible:
        raise ValueError(f"target_devices={devices}: only {visible} GPUs are visible")
    return "nccl"


def resolve_dtype(dtype, device) -> torch.dtype:
    """The dtype of a model's weights and activations on `device`: "auto" (or None), a DTYPES
    name or a torch dtype. bf16/fp16 on CUDA need torch >= 2.8 (MM_FP32_OUT): an older one would
    upcast the LM head to a float32 copy in every step (matmul_fp32), so it is refused."""
    device = torch.device(device)
    if dtype is None or dtype == "auto":
        resolved = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        resolved = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in DTYPES.values():
        raise ValueError(f"unknown dtype {dtype!r}: use auto, {', '.join(DTYPES)} (--dtype)")
    if resolved != torch.float32 and device.type == "cuda" and "cuda" not in MM_FP32_OUT:
        raise ValueError(f"torch {torch.__version__} has no float32-output GEMM for "
                         f"{str(resolved)[6:]} on CUDA (aten::mm.dtype): install torch >= 2.8, "
                         f"or use --dtype float32")
    if resolved == torch.bfloat16 and device.type == "cuda" and torch.cuda.is_available() \
            and torch.cuda.get_device_capability(device)[0] < 8:
        raise ValueError(f"{device} has no bfloat16 arithmetic (a GPU older than Ampere): use "
                         f"dtype float16 (--dtype float16) or float32")
    return resolved


def matmul_fp32(x, w):
    """x [..., in] @ w [out, in].T -> float32 [..., out] for bf16/fp16 x and w, never rounded to
    their dtype (a product of two bf16 numbers is exact in float32). On CUDA cuBLAS reads the bf16
    weight once; on the CPU the weight is upcast, a float32 copy per call (on CUDA that copy, 2 GB
    for an 8B model's head, in every step and graph, is why torch < 2.8 is refused there)."""
    if x.device.type in MM_FP32_OUT:
        y = torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32)
        return y.view(*x.shape[:-1], -1)
    return torch.nn.functional.linear(x.float(), w.float())


# --------------------------------------------------------------------------------------------------
# Host <-> device

def to_device(host: torch.Tensor, device, out: torch.Tensor | None = None) -> torch.Tensor:
    """Every tensor the host builds crosses to the device here (a forward's metadata in one copy;
    tests count the calls and check that nothing built from Python data crosses any other way):
    into a new tensor, or into `out` (a static-shape step's buffer). On CUDA the copy comes from
    page-locked memory without blocking: from pageable memory, or with a blocking copy, the host
    would wait for the GPU to finish its queue (a copy made straight on the device, as with
    torch.tensor(list, device=...) or indexing a device tensor with a list, waits as well). A
    tensor already on the device is returned as it is. Into the CPU (a CUDA draft's proposals
    for a CPU target) the copy blocks: the host reads the result next, and a non-blocking copy
    from CUDA may not have landed yet."""
    device = torch.device(device) if out is None else out.device
    if device.type == "cuda" and host.device.type == "cpu" and not host.is_pinned():
        host = host.pin_memory()  # the caching host allocator keeps it until the copy has run
    non_blocking = device.type == "cuda"
    if out is None:
        return host.to(device, non_blocking=non_blocking)
    return out.copy_(host, non_blocking=non_blocking)


def device_index(idx: list[int], device) -> torch.Tensor:
    """A list of row positions as a LongTensor on `device`, for index_select / index_copy_ on
    device tensors: built on the host, it crosses in one copy (to_device)."""
    return to_device(torch.tensor(idx, dtype=torch.long, device="cpu"), device)


def to_host(x: torch.Tensor) -> list:
    """The values of a device tensor, as Python lists: the decode loop's every device-to-host read
    goes through here (each one is a sync on a GPU; tests count the calls). Callers stack what a
    step needs into one tensor first, so a round reads a few times, not once per row."""
    return x.tolist()


def sync(device):
    """Wait until `device` has run the work queued on it (GPU kernels run asynchronously; a no-op
    on the CPU): a clock stopped before that would charge the work to what comes next."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
