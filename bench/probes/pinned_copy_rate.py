# Pinned host memory on the GPU host: what page-locking costs against the copy it enables
# (BENCHMARKS "Parking in pinned host memory"). Run: python3 bench/probes/pinned_copy_rate.py
import time, torch
dev = torch.device("cuda")
G = 1 << 30
x = torch.empty(4 * G, dtype=torch.uint8, device=dev); x.fill_(1); torch.cuda.synchronize()
t = time.perf_counter(); slabs = [torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(64)]
print(f"pin 4 GiB in 64 MiB slabs: {time.perf_counter()-t:.3f} s")
piece = 2 << 20
def d2h():
    t = time.perf_counter(); off = 0
    for s in slabs:
        for p in range(0, 64 << 20, piece):
            s[p:p+piece].copy_(x[off:off+piece], non_blocking=True); torch.cuda.synchronize(); off += piece
    return time.perf_counter() - t
def h2d():
    t = time.perf_counter(); off = 0
    for s in slabs:
        for p in range(0, 64 << 20, piece):
            x[off:off+piece].copy_(s[p:p+piece], non_blocking=True); torch.cuda.synchronize(); off += piece
    return time.perf_counter() - t
for i in range(2):
    a = d2h(); b = h2d()
    print(f"2 MiB pieces, sync each: D2H {4/a:.1f} GiB/s ({a:.3f} s), H2D {4/b:.1f} GiB/s ({b:.3f} s)")
big = torch.empty(4 * G, dtype=torch.uint8, pin_memory=True)
t = time.perf_counter(); big.copy_(x, non_blocking=True); torch.cuda.synchronize(); a = time.perf_counter() - t
print(f"one 4 GiB D2H: {4/a:.1f} GiB/s")
t = time.perf_counter(); del x; torch.cuda.empty_cache(); torch.cuda.synchronize(); print(f"free 4 GiB device: {time.perf_counter()-t:.3f} s")
