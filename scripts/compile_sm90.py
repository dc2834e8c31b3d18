"""Compile the Triton kernels for an H100 (sm_90) on a machine without a GPU, and report what the device would:
shared memory per program, registers per thread and spills (from ptxas via cuobjdump). Catches compile errors
and shared-memory overflows before any GPU time is spent. Every kernel compiles at the launch settings of its table
(gdn.TUNE, kda.TUNE), or at the --warps given.

    python scripts/compile_sm90.py [--bt 64] [--k 128] [--v 128] [--dtype bf16] [--only NAME,...] [--warps 4,8]

Arguments are specialised as Triton's launcher does for the benchmark shape: pointers 16-byte aligned (torch
allocations are), H and HV as given by --heads (16: a multiple-of-16 hint). Without those hints every load and store
compiles unvectorised, with one 64-bit address per element, which overstates registers and spills; --no-align shows
that.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hybridlm.ops.triton import chunk_bwd, chunk_out, decode, gdn, kda, kda_bwd, kda_prep, state_pass, ut_solve, wy

TARGET = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 232448  # bytes of shared memory one H100 program may use
HEADS = {"H": 16, "HV": 16}  # H, HV as the benchmark launches them (--heads)


def compile_one(fn, sig, constexprs, attrs, options, dump=None):
    """Compile one launch (`launch`'s tuple) for sm_90 down to cubin: its shared memory, and registers and stack
    from cuobjdump. dump: a path prefix to write the kernel's TTGIR and PTX to (`.ttgir`, `.ptx`: which MMA each
    dot became, its layouts, the async copies)."""
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=TARGET, options=options)
    res = {"shared": k.metadata.shared}
    if dump:
        for ext in ("ttgir", "ptx"):
            with open(f"{dump}.{ext}", "w") as f:
                f.write(k.asm[ext])
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.cubin")
        with open(p, "wb") as f:
            f.write(k.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        out = subprocess.run([tool, "-res-usage", p], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+)", out)
    res["regs"] = int(m.group(1)) if m else None
    m = re.search(r"STACK:(\d+)", out)
    res["stack"] = int(m.group(1)) if m else None  # bytes of local memory per thread: spills live here
    return res


def gdn_jobs(dt: str, K: int, V: int, BT: int, bv: int) -> dict:
    """name -> (kernel, pointer dtypes, int args, constexprs, num_warps, num_stages) of every GDN launch. The chunk
    kernels compile at K, V padded to the next native dim (`gdn.padded_dim`: what they run at), the decode step at
    K, V themselves (it masks)."""
    T = gdn.TUNE
    dbk = max(16, triton.next_power_of_2(K))  # the decode step's blocks, as `gdn.decode_launch` sets them
    dbv = min(32 if dbk <= 128 else 16, max(16, triton.next_power_of_2(V)))
    DK, DV, K, V = K, V, gdn.padded_dim(K), gdn.padded_dim(V)
    sd, i32, f32 = dt, "i32", "fp32"
    prec, lowp = ("ieee", False) if dt == "fp32" else ("tf32", True)
    common = dict(K=K, V=V, BT=BT, L2=True, PREC=prec)
    chunks = dict(cu=i32, chunk_seq=i32, chunk_start=i32)
    kbk = min(T.kkt_bk, K, 32 if dt == "fp32" else K)
    wbk = min(T.wu_bk, K, 32 if dt == "fp32" else K)
    BK, BVb = gdn.kblock_bwd_blocks(K, V)
    jobs = {
        "_kkt_solve": (ut_solve._kkt_solve, dict(chunks, k=dt, g=f32, beta=dt, Tout=sd), dict(H=i32, HV=i32),
                       dict(common, BK=kbk), T.kkt_warps, 1),
        "_wu_fwd": (wy._wu_fwd, dict(chunks, k=dt, v=dt, g=f32, beta=dt, Tbuf=sd, Wbuf=sd, Ubuf=sd, SK=f32, RK=f32),
                    dict(H=i32, HV=i32), dict(common, BK=wbk, BV=min(64, V), LOWP=lowp), T.wu_warps, T.wu_stages),
        "_recur_fwd": (state_pass._recur_fwd, dict(g=f32, Wbuf=sd, Ubuf=sd, Kd=dt, SK=f32, h0=f32, ht=f32, hbuf=sd,
                                                   vnbuf=sd, cu=i32, chunk_off=i32), dict(NCH=i32, H=i32, HV=i32),
                       dict(common, BV=bv, HAS_H0=False, STORE_HT=False, LOWP=lowp), T.fwd_warps, T.fwd_stages),
        "_recur_bwd": (state_pass._recur_bwd, dict(g=f32, Wbuf=sd, Qg=dt, Kd=dt, Pb=sd, do=dt, dht=f32, dh0=f32,
                                                   dhbuf=sd, dvnbuf=sd, cu=i32, chunk_off=i32),
                       dict(NCH=i32, H=i32, HV=i32, scale=f32),
                       dict(common, BV=bv, HAS_DHT=False, STORE_DH0=False, LOWP=lowp), T.rbwd_warps, T.fwd_stages),
        "_chunk_bwd_state_blk": (chunk_bwd._chunk_bwd_state_blk,
                                 dict(chunks, k=dt, v=dt, g=f32, beta=dt, Tbuf=sd, hbuf=sd, dhbuf=sd, vnbuf=sd,
                                      dvnbuf=sd, dkp=f32, dv=dt, dg=f32, dbeta=f32, dKKbuf=sd, dsk=f32),
                                 dict(H=i32, HV=i32), dict(common, BK=BK, BV=BVb, LOWP=lowp), T.bwd_warps,
                                 T.bwd_stages),
        "_chunk_bwd_out_blk": (chunk_bwd._chunk_bwd_out_blk,
                               dict(chunks, q=dt, k=dt, g=f32, hbuf=sd, vnbuf=sd, do=dt, dq=dt, dk=dt, dkp=f32,
                                    dg=f32, dKKbuf=sd, dsk=f32), dict(scale=f32, H=i32, HV=i32),
                               dict(common, BK=BK, BV=BVb, LOWP=lowp), T.bwd_warps, T.bwd_stages),
        "_decode_step": (decode._decode_step, dict(q=dt, k=dt, v=dt, g=f32, beta=f32, pool=f32, idx=i32, o=dt,
                                                   inter=f32, acc=i32),
                         dict(scale=f32, H=i32, HV=i32), dict(T=1, TP=2, K=DK, V=DV, BK=dbk, BV=dbv, L2=True), 4, 1),
        # draft tokens, every state kept (gdn.decode_launch: one warp a program for T > 1)
        "_decode_step T4": (decode._decode_step, dict(q=dt, k=dt, v=dt, g=f32, beta=f32, pool=f32, idx=i32, o=dt,
                                                      inter=f32, acc=i32),
                            dict(scale=f32, H=i32, HV=i32),
                            dict(T=4, TP=4, K=DK, V=DV, BK=dbk, BV=dbv, L2=True, INTER=True), 1, 1),
    }
    for store_p in (False, True):  # inference; training (P stored for the backward)
        jobs[f"_out_fwd_raw{' store P' if store_p else ''}"] = (
            chunk_out._out_fwd_raw, dict(chunks, q=dt, k=dt, g=f32, RK=f32, hbuf=sd, vnbuf=sd, o=dt, Pb=sd),
            dict(scale=f32, H=i32, HV=i32), dict(common, BV=min(T.out_bv, V), LOWP=lowp, STORE_P=store_p),
            T.out_warps, 1)
    return jobs


def kda_jobs(dt: str, K: int, V: int, BT: int, bv: int) -> dict:
    """As `gdn_jobs`, for KDA's launches (its state passes are GDN's with CHANNEL)."""
    T = kda.TUNE
    g = gdn_jobs(dt, K, V, BT, bv)
    K, V = gdn.padded_dim(K), gdn.padded_dim(V)  # the chunk kernels run padded
    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    sdt, prec = kda._numerics(names[dt])  # float16 inputs keep float32 intermediates
    sd, i32, f32 = next(n for n, t in names.items() if t == sdt), "i32", "fp32"
    lowp = sd != "fp32"
    common = dict(K=K, BT=BT, L2=True, PREC=prec)
    chunks = dict(cu=i32, chunk_seq=i32, chunk_start=i32)
    bk = min(T.bk, K)
    jobs = {name + " channel": (fn, ptrs, ints, dict(cx, CHANNEL=True, PREC=prec, LOWP=lowp), T.state_warps, st)
            for name, (fn, ptrs, ints, cx, _w, st) in g.items() if name in ("_recur_fwd", "_recur_bwd")}
    jobs["_recur_fwd channel"][1].update(Wbuf=sd, Ubuf=sd, Kd=sd, hbuf=sd, vnbuf=sd)
    jobs["_recur_bwd channel"][1].update(Wbuf=sd, Qg=sd, Kd=sd, Pb=sd, dhbuf=sd, dvnbuf=sd)
    jobs["_solve_blocks"] = (ut_solve._solve_blocks, dict(Tbuf=f32), dict(HV=i32), dict(BT=BT, PREC=prec), 1, 1)
    jobs["_kda_prep_wu"] = (kda_prep._kda_prep_wu, dict(chunks, k=dt, v=dt, g=f32, beta=dt, Tbuf=f32, Wbuf=sd,
                                                         Ubuf=sd), dict(H=i32, HV=i32),
                            dict(common, V=V, BK=bk, BV=min(64, V)), T.prep_warps, 1)
    jobs["_out_fwd"] = (chunk_out._out_fwd, dict(chunks, Qg=sd, Pb=sd, hbuf=sd, vnbuf=sd, o=dt), dict(HV=i32),
                        dict(K=K, V=V, BT=BT, PREC=prec, BV=min(T.out_bv, V), LOWP=lowp), T.out_warps, 1)
    # Kimi's gate inside the kernels (`kda.Gate`): its pointers and ints; unused (GATE off) they are g's
    gate_ptrs, gate_ints = dict(raw=dt, A_log=f32, dt_bias=f32), dict(KR=i32, lb=f32)
    for mode in kda.DIAG_MODES:
        tag = f"DIAG {mode}"
        for gate in (False, True) if mode == kda.DIAG_MODES[0] else (False,):  # the first launch makes g
            jobs[f"_kda_prep_ap {tag}{' gate' if gate else ''}"] = (
                kda_prep._kda_prep_ap, dict(chunks, q=dt, k=dt, g=f32, beta=dt, Tbuf=f32, Qg=sd, Kd=sd, Pb=sd,
                                            BL=f32, redo=i32, **gate_ptrs), dict(H=i32, HV=i32, scale=f32, **gate_ints),
                dict(common, BK=bk, DIAG=mode, GATE=gate), T.prep_warps, 1)
        jobs[f"_kda_bwd_out_blk {tag}"] = (
            kda_bwd._kda_bwd_out_blk, dict(chunks, q=dt, k=dt, g=f32, hbuf=sd, vnbuf=sd, do=dt, dq=f32, dk=f32,
                                           dg=f32, redo=i32), dict(scale=f32, H=i32, HV=i32),
            dict(common, V=V, BK=bk, BV=min(64, V), LOWP=lowp, DIAG=mode), T.bwd_warps, 1)
        for gate in (False, True):  # the last pass writes the raw gate's gradient
            jobs[f"_kda_bwd_state_blk {tag}{' gate' if gate else ''}"] = (
                kda_bwd._kda_bwd_state_blk, dict(chunks, k=dt, v=dt, g=f32, beta=dt, Tbuf=f32, BL=f32, hbuf=sd,
                                                 dhbuf=sd, vnbuf=sd, dvnbuf=sd, dk=f32, dv=dt, dg=f32, dbeta=f32,
                                                 redo=i32, draw=dt, dAp=f32, ddtp=f32, **gate_ptrs),
                dict(H=i32, HV=i32, **gate_ints),
                dict(common, V=V, BK=bk, BV=min(64, V), LOWP=lowp, DIAG=mode, MARKED=True, GATE=gate), T.bwd_warps, 1)
    return jobs


def all_jobs(dt: str = "bf16", K: int = 128, V: int = 128, BT: int = 64, bv: int = 32) -> dict:
    """Every GDN and KDA launch (`gdn_jobs`, then `kda_jobs`) at one shape; the defaults are the script's."""
    jobs = gdn_jobs(dt, K, V, BT, bv)
    jobs.update(kda_jobs(dt, K, V, BT, bv))
    return jobs


def launch(jobs: dict, name: str, *, heads: dict | None = None, align: bool = True, num_warps: int | None = None):
    """(fn, signature, constexprs, attrs, options) of job `name` of `jobs`, typed as Triton's launcher would see
    the call: pointers as the table's dtypes (16-byte aligned unless not align), ints as i32/fp32 (an int in heads
    equal to 1 becomes a constant, a multiple of 16 gets the divisibility hint), every other argument a constexpr
    (the table's value, else the kernel's default). heads: {"H": .., "HV": ..} (default HEADS); num_warps: the
    table's setting unless given."""
    fn, ptrs, ints, cx, warps, stages = jobs[name]
    heads = HEADS if heads is None else heads
    defaults = {n: p.default for n, p in inspect.signature(fn.fn).parameters.items()}
    sig = {}
    consts = {n: cx[n] for n in fn.arg_names if n in cx}
    div16 = []
    for n in fn.arg_names:
        if n in ptrs:
            sig[n] = "*" + ptrs[n]
            div16 += [n] if align else []
        elif n in heads and heads[n] == 1:  # the launcher passes an int equal to 1 as a constant
            sig[n] = "constexpr"
            consts[n] = 1
        elif n in ints:
            sig[n] = ints[n]
            div16 += [n] if n in heads and heads[n] % 16 == 0 else []
        else:
            sig[n] = "constexpr"
            if n not in consts and defaults[n] is not inspect.Parameter.empty:
                consts[n] = defaults[n]  # as the launcher does when the call leaves it out
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    options = {"num_warps": num_warps or warps, "num_stages": stages}
    return fn, sig, consts, attrs, options


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bt", type=int, default=64, help="chunk size")
    ap.add_argument("--k", type=int, default=128, help="key head dim")
    ap.add_argument("--v", type=int, default=128, help="value head dim")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="input dtype")
    ap.add_argument("--bv", type=int, default=32, help="V block of the state passes")
    ap.add_argument("--warps", default=None, help="num_warps values to try (default: each table's setting)")
    ap.add_argument("--dump", default=None, help="write each kernel's TTGIR and PTX into this folder")
    ap.add_argument("--only", default=None, help="comma-separated kernel names to compile (default: all)")
    ap.add_argument("--heads", default="16,16", help="H,HV as a launch would see them (1: constexpr, multiple of "
                    "16: divisibility hint, as Triton's launcher specialises ints)")
    ap.add_argument("--no-align", action="store_true", help="no 16-byte alignment hint on the pointers "
                    "(unvectorised memory access: registers and spills overstated)")
    args = ap.parse_args(argv)
    jobs = all_jobs(args.dtype, args.k, args.v, args.bt, args.bv)
    heads = dict(zip(("H", "HV"), (int(x) for x in args.heads.split(","))))
    print(f"sm_90, K={args.k} V={args.v} BT={args.bt} {args.dtype}, state-pass BV={args.bv}, H,HV={args.heads}, "
          f"{'no ' if args.no_align else ''}pointer alignment hint")
    for name, (_fn, _ptrs, _ints, _cx, warps, _stages) in jobs.items():
        if args.only and not any(name.startswith(x) for x in args.only.split(",")):
            continue
        for w in ([int(x) for x in args.warps.split(",")] if args.warps else [warps]):
            try:
                dump = os.path.join(args.dump, re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{name}_w{w}")) if args.dump else None
                r = compile_one(*launch(jobs, name, heads=heads, align=not args.no_align, num_warps=w), dump=dump)
                flag = " SMEM OVER" if r["shared"] > SMEM_LIMIT else ""
                print(f"{name:42} warps {w}: shared {r['shared'] / 1024:6.1f} KB, regs {r['regs']}, "
                      f"local(stack) {r['stack']} B{flag}")
            except Exception as e:  # noqa: BLE001
                print(f"{name:42} warps {w}: FAILED {type(e).__name__}: {str(e)[-300:]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
