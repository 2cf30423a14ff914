import time, torch, triton, triton.language as tl
@triton.jit
def k(x_ptr, N: tl.constexpr, R: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    base = x_ptr + pid * N
    j = tl.arange(0, R)
    offs = j[:, None] * (N // R) + tl.arange(0, N // R)[None, :]
    x = tl.load(base + offs)
    tl.store(base + offs, tl.sort(x))
for N, R, nw in [(2048,1,4),(2048,1,8),(4096,1,8),(4096,1,16),(16384,1,16),(16384,8,16),(8192,1,16)]:
    x = torch.randint(0, 1<<40, (32, N), device="cuda")
    t=time.time(); k[(32,)](x, N, R, num_warps=nw); torch.cuda.synchronize(); ct=time.time()-t
    ok = bool((x.view(32, R, N//R).diff(dim=-1) >= 0).all())
    ev=[]
    for _ in range(20):
        a,b=torch.cuda.Event(enable_timing=True),torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(100000); a.record(); k[(32,)](x, N, R, num_warps=nw); b.record(); ev.append((a,b))
    torch.cuda.synchronize()
    ts=sorted(a.elapsed_time(b) for a,b in ev)
    print(f"sort N={N} rows={R} warps={nw} compile={ct:.1f}s ok={ok} median={ts[10]*1e3:.1f}us min={ts[0]*1e3:.1f}us", flush=True)
