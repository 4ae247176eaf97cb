"""The host link as activation offload uses it (agoq.runtime.activations.offload): pinned-memory copy rates each way, measured
while the GPU computes, what those copies cost the compute, and how much host memory may be pinned.

`measure_host_link(device)` copies a device buffer to a pinned host buffer on one side stream (device-to-host, D2H)
and a pinned host buffer to a device buffer on another (host-to-device, H2D), both at once, while bf16 matmuls run
back to back on the current stream: the three streams offload runs in a training step (its D2H copies under
forward, its H2D prefetches under backward, both at once where forward and backward of micro-batches interleave).

Rates, in bytes per second: a copy stream's bytes over its seconds, `copies * nbytes / (end - start)` with start and
end CUDA events recorded on that copy stream around its `copies` back-to-back copies of `nbytes`; the median over
`repeats` rounds after a warm-up. The matmul loop is sized to outlast both copy streams, so every timed byte
crossed the link while compute ran (a round whose copies outlast it is dropped and the loop doubled).

Compute slowdown (a ratio, no unit): `median(matmul seconds while both copies ran) / median(matmul seconds alone)
- 1`, floored at 0. Every matmul has its own pair of CUDA events; a matmul counts as "while both copies ran" when
it started after both copy streams had started and ended before either ended. 0.02: matmuls 2 % slower while both
copies run, what the search adds to the compute time an offload overlaps.

`pinnable_bytes()`: host bytes the offload pool may pin on this machine (half of what the OS reports available).
"""

from __future__ import annotations

import math
import os
import statistics

import torch

MATMUL_SIZE = 8192  # bf16 n x n @ n x n: ~1.1 TFLOP, about a millisecond on an H100/H200, saturating the SMs
MIN_MATMULS_UNDER_COPIES = 10  # the copies of one round span at least this many matmuls (for the slowdown's median)
MAX_COPIES = 1024  # back-to-back copies per stream and round, at most
MAX_MATMULS = 20000  # matmuls per round, at most
GATE_CYCLES = 20_000_000  # GPU clock cycles (~10 ms) the streams are held at each round's start while it is queued


def pinnable_bytes() -> int:
    """Bytes of host memory that are safe to pin (page-lock) for offloaded activations: half of MemAvailable in
    /proc/meminfo (kB there, bytes here), or, where that cannot be read, half of os.sysconf's SC_AVPHYS_PAGES *
    SC_PAGE_SIZE (free pages, which leaves out reclaimable page cache: lower); 0 if neither can be read.

    Why half: pinned pages cannot be swapped or reclaimed, and the rest of the available memory is needed beside
    them: by the OS and its page cache, by the data loader's workers, and by checkpointing, whose copies of the
    weights and optimizer state pass through ordinary (pageable) host memory. Pinning all that is available can
    make the machine swap or the OOM killer end the run."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):  # "MemAvailable:   123456 kB"
                    return int(line.split()[1]) * 1024 // 2
    except (OSError, ValueError, IndexError):
        pass
    try:
        pages, page_size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        if pages > 0 and page_size > 0:
            return pages * page_size // 2
    except (AttributeError, ValueError, OSError):
        pass
    return 0


def _events(n: int) -> list:
    return [torch.cuda.Event(enable_timing=True) for _ in range(n)]


def _ms(a, b) -> float:
    """Milliseconds from event a to event b (both recorded, on any stream of one device)."""
    return a.elapsed_time(b)


def measure_host_link(device, *, nbytes: int = 256 << 20, repeats: int = 5,
                      matmul_size: int = MATMUL_SIZE) -> dict | None:
    """The pinned-memory host link of CUDA `device` while it computes (module docstring); None on any other device.

    Returns `{"d2h_bytes_per_second", "h2d_bytes_per_second"` (floats, bytes/s: median over `repeats` rounds),
    `"bytes_per_copy"` (int, `nbytes`: the size of each copy), `"compute_slowdown"` (float >= 0, a ratio: bf16
    `matmul_size`-square matmuls this much slower while both copies run), `"pinnable_bytes"}` (int, `pinnable_bytes()`).

    Allocates two pinned host buffers and two device buffers of `nbytes` (one pair per direction, so the two copies
    share no memory) and three `matmul_size`-square bf16 matrices; all are freed before it returns (the device's
    cached blocks and the pinned host cache emptied). `nbytes` should be large (tens of MiB and up): a small copy
    measures launch latency, not the link."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if nbytes <= 0 or repeats < 1 or matmul_size <= 0:
        raise ValueError(f"nbytes, repeats and matmul_size must be > 0, got {nbytes}, {repeats}, {matmul_size}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    held: dict = {}  # everything allocated, dropped in `finally` (an exception's traceback would keep locals alive)
    try:
        with torch.cuda.device(device):
            return _measure(device, nbytes, repeats, matmul_size, held)
    finally:
        try:
            torch.cuda.synchronize(device)  # no copy may still use a buffer when it is freed
        finally:
            held.clear()
        torch.cuda.empty_cache()
        empty_host_cache = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        if empty_host_cache is not None:  # torch keeps freed pinned blocks cached: give them back to the OS
            empty_host_cache()


def _measure(device: torch.device, nbytes: int, repeats: int, size: int, held: dict) -> dict:
    u8 = torch.uint8
    held["host_out"] = torch.empty(nbytes, dtype=u8, pin_memory=True)  # D2H destination
    held["host_in"] = torch.empty(nbytes, dtype=u8, pin_memory=True).fill_(1)  # H2D source
    held["dev_src"] = torch.ones(nbytes, dtype=u8, device=device)  # D2H source
    held["dev_dst"] = torch.empty(nbytes, dtype=u8, device=device)  # H2D destination
    gen = torch.Generator(device=device).manual_seed(0)
    held["a"] = torch.randn(size, size, generator=gen, device=device, dtype=torch.bfloat16)
    held["b"] = torch.randn(size, size, generator=gen, device=device, dtype=torch.bfloat16)
    held["c"] = torch.empty(size, size, device=device, dtype=torch.bfloat16)
    compute = torch.cuda.current_stream(device)
    held["d2h"], held["h2d"] = torch.cuda.Stream(device), torch.cuda.Stream(device)
    sleep = getattr(torch.cuda, "_sleep", None)

    def start_round():
        """An event on the compute stream at which all streams start, held back until the round is queued."""
        if sleep is not None:
            sleep(GATE_CYCLES)
        go = torch.cuda.Event(enable_timing=True)
        go.record(compute)
        return go

    def matmuls(n: int) -> list:
        """n matmuls on the compute stream, an event before the first and after each."""
        marks = _events(n + 1)
        marks[0].record(compute)
        for i in range(n):
            torch.matmul(held["a"], held["b"], out=held["c"])
            marks[i + 1].record(compute)
        return marks

    def copies(stream, dst, src, k: int, go) -> tuple:
        """k back-to-back copies src -> dst on `stream` after `go`; (start, end) events on that stream."""
        stream.wait_event(go)
        start, end = _events(2)
        with torch.cuda.stream(stream):
            start.record(stream)
            for _ in range(k):
                dst.copy_(src, non_blocking=True)
            end.record(stream)
        return start, end

    def both_copies(k: int, go) -> tuple:
        return (copies(held["d2h"], held["host_out"], held["dev_src"], k, go),
                copies(held["h2d"], held["dev_dst"], held["host_in"], k, go))

    def matmul_seconds(marks) -> list[float]:
        return [_ms(marks[i], marks[i + 1]) / 1e3 for i in range(len(marks) - 1)]

    # warm-up (cuBLAS's choice of kernel, the copy engines), then each alone: one matmul's and one copy's seconds
    matmuls(3)
    both_copies(1, start_round())
    torch.cuda.synchronize(device)
    go = start_round()
    marks = matmuls(10)
    torch.cuda.synchronize(device)
    t_matmul = statistics.median(matmul_seconds(marks))
    go = start_round()
    (d_start, d_end), (h_start, h_end) = both_copies(1, go)
    torch.cuda.synchronize(device)
    t_copy = max(_ms(d_start, d_end), _ms(h_start, h_end)) / 1e3
    k = min(MAX_COPIES, max(1, math.ceil(MIN_MATMULS_UNDER_COPIES * t_matmul / t_copy)))
    n = min(MAX_MATMULS, math.ceil(1.5 * k * t_copy / t_matmul) + 2)

    # rounds: both copy streams and the matmul loop start together; the first is a warm-up
    d2h_rates, h2d_rates, under_copies, alone = [], [], [], []
    counted, tries = 0, 0
    while counted < repeats and tries < repeats + 6:
        tries += 1
        go = start_round()
        (d_start, d_end), (h_start, h_end) = both_copies(k, go)
        marks = matmuls(n)
        torch.cuda.synchronize(device)
        at = [_ms(go, m) for m in marks]
        d0, d1, h0, h1 = (_ms(go, e) for e in (d_start, d_end, h_start, h_end))
        if max(d1, h1) > at[-1]:  # the copies outlasted the compute: part of them ran uncontended
            n = min(MAX_MATMULS, 2 * n)
            continue
        if tries == 1:
            continue
        counted += 1
        d2h_rates.append(k * nbytes / ((d1 - d0) / 1e3))
        h2d_rates.append(k * nbytes / ((h1 - h0) / 1e3))
        lo, hi = max(d0, h0), min(d1, h1)
        under_copies += [(at[i + 1] - at[i]) / 1e3 for i in range(n) if at[i] >= lo and at[i + 1] <= hi]
    if not counted:
        raise RuntimeError(f"the host copies ({k} x {nbytes} bytes) outlasted {n} matmuls in every round")
    if not under_copies:
        raise RuntimeError(f"no matmul ran entirely while both copies ran ({k} x {nbytes} bytes per stream): "
                           "use larger copies")
    for _ in range(repeats):  # the same loop without copies
        start_round()
        marks = matmuls(n)
        torch.cuda.synchronize(device)
        alone += matmul_seconds(marks)
    slowdown = max(0.0, statistics.median(under_copies) / statistics.median(alone) - 1.0)
    return {"d2h_bytes_per_second": float(statistics.median(d2h_rates)),
            "h2d_bytes_per_second": float(statistics.median(h2d_rates)),
            "bytes_per_copy": int(nbytes), "compute_slowdown": float(slowdown), "pinnable_bytes": pinnable_bytes()}
