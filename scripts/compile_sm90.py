"""Compile the Triton kernels for an H100 (sm_90) on a machine without a GPU, and report what the device would:
shared memory per program, registers per thread and spills (from ptxas via cuobjdump). Catches compile errors
and shared-memory overflows before any GPU time is spent.

    python scripts/compile_sm90.py [--bt 64] [--k 128] [--v 128] [--dtype bf16] [--only NAME,...]

Arguments are specialised as Triton's launcher does for the benchmark shape: pointers 16-byte aligned (torch
allocations are), H and HV as given by --heads (16: a multiple-of-16 hint). Before 2026-11-24 this script gave no
such hints, so every load and store compiled unvectorised, with one 64-bit address per element; that overstated
registers and spills (sm_90, K=V=128 bf16, 8 warps: `_chunk_bwd` phase 2 2048 B of stack without the hints,
400 B with them; phase 1 296 B vs none). --no-align reproduces the old numbers.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hybridlm.ops.triton import gdn_kernels as kern

TARGET = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 232448  # bytes of shared memory one H100 program may use


def compile_one(fn, sig, constexprs, num_warps, num_stages, div16=(), maxnreg=None, dump=None):
    """div16: argument names the launcher would specialise as multiples of 16 (pointers from torch allocations,
    ints like H = 16): without that hint the loads and stores are not vectorised (one 64-bit address per element,
    so far more registers than a real launch uses). maxnreg: the launch option of that name (ptxas' register cap
    per thread; None: ptxas takes up to 255 at 8 warps, whatever the occupancy). dump: a path prefix to write the
    kernel's TTGIR and PTX to (`.ttgir`, `.ptx`: which MMA each dot became, its layouts, the async copies)."""
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    k = triton.compile(src, target=TARGET, options=opts)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bt", type=int, default=64, help="chunk size")
    ap.add_argument("--k", type=int, default=128, help="key head dim")
    ap.add_argument("--v", type=int, default=128, help="value head dim")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="input dtype")
    ap.add_argument("--bv", type=int, default=64, help="V block of the recurrences")
    ap.add_argument("--bwd-bv", type=int, default=64, help="V block of the chunk backward")
    ap.add_argument("--sf-bv", default="32,64", help="V blocks of the state-first chunk backward to compile")
    ap.add_argument("--warps", default="4,8", help="num_warps values to try")
    ap.add_argument("--gdn-bk", default="32,64", help="key-channel blocks of the K-blocked GDN prep and chunk "
                    "backward to try")
    ap.add_argument("--kda-maxnreg", default="", help="comma-separated register caps to also compile the K-blocked "
                    "KDA kernels with (kda.TUNE maxnreg)")
    ap.add_argument("--kda-bk", default="32,64", help="key-channel blocks of the K-blocked KDA kernels to try")
    ap.add_argument("--maxnreg", type=int, default=128, help="register cap of the capped K-blocked chunk-backward "
                    "jobs (gdn.TUNE bwd_maxnreg)")
    ap.add_argument("--bwd-stages", type=int, default=1, help="num_stages of the K-blocked chunk-backward jobs "
                    "(gdn.TUNE bwd_stages)")
    ap.add_argument("--dump", default=None, help="write each kernel's TTGIR and PTX into this folder")
    ap.add_argument("--only", default=None, help="comma-separated kernel names to compile (default: all)")
    ap.add_argument("--heads", default="16,16", help="H,HV as a launch would see them (1: constexpr, multiple of "
                    "16: divisibility hint, as Triton's launcher specialises ints)")
    ap.add_argument("--no-align", action="store_true", help="no 16-byte alignment hint on the pointers (compiles "
                    "as before 2026-11-24: unvectorised memory access, registers and spills overstated)")
    args = ap.parse_args(argv)
    dt = args.dtype
    sd = dt  # storage dtype of W, U, states, Vn
    prec = "ieee" if dt == "fp32" else "tf32"
    lowp = dt != "fp32"
    common = dict(K=args.k, V=args.v, BT=args.bt, L2=True, PREC=prec)
    i32 = "i32"
    prep_ptrs = dict(q=dt, k=dt, v=dt, g="fp32", beta=dt, Tbuf="fp32", Tout=sd, Wbuf=sd, Ubuf=sd, Qg=sd, Kd=sd,
                     Pb=sd, RK="fp32", cu=i32, chunk_seq=i32, chunk_start=i32)
    prep_ints = dict(H=i32, HV=i32, scale="fp32")
    jobs = {
        f"_prep_fwd(stage {st}{' il' if il else ''}{' lowp' if lp else ''})": (
            kern._prep_fwd, prep_ptrs, prep_ints,
            dict(common, BV=min(64, args.v), STAGE=st, INTERLEAVE=il, LOWP=lp and lowp), 1)
        for st, il, lp in ((0, False, False), (1, False, False), (1, False, True), (2, False, False),
                           (2, True, False), (3, False, False), (3, False, True))
    }
    # the K-blocked prep (gdn.TUNE prep_variant "kblock"): stages 1 and 3 at each key-channel block, stage 0 (all
    # in one launch) and the solve (stage 2, interleaved) once
    for bk in (int(x) for x in args.gdn_bk.split(",")):
        for st, lp in ((1, False), (3, False), (3, True), (0, False)):
            jobs[f"_prep_fwd_blk(stage {st}, bk {bk}{' lowp' if lp else ''})"] = (
                kern._prep_fwd_blk, prep_ptrs, prep_ints,
                dict(common, BK=bk, BV=min(64, args.v), STAGE=st, INTERLEAVE=True, LOWP=lp and lowp), 1)
        # stage 3 of the raw-output forward (gdn.TUNE fwd_raw_out): KD 1 writes Kd, KD 2 its row scales (state_raw_k)
        for kd in (1, 2):
            jobs[f"_prep_fwd_blk(stage 3, bk {bk} lowp KD {kd})"] = (
                kern._prep_fwd_blk, dict(prep_ptrs, Kd=sd if kd == 1 else "fp32"), prep_ints,
                dict(common, BK=bk, BV=min(64, args.v), STAGE=3, INTERLEAVE=True, LOWP=lowp, KD=kd, WITH_A=False), 1)
    jobs["_prep_fwd_blk(stage 2 il)"] = (kern._prep_fwd_blk, prep_ptrs, prep_ints,
                                         dict(common, BK=64, BV=min(64, args.v), STAGE=2, INTERLEAVE=True), 1)
    for bk in (32, 64):  # A and its solve in one launch (gdn.TUNE prep_kkt, kkt_bk)
        jobs[f"_kkt_solve(bk {bk})"] = (
            kern._kkt_solve, dict(k=dt, g="fp32", beta=dt, Tout=sd, cu=i32, chunk_seq=i32, chunk_start=i32),
            dict(H=i32, HV=i32), dict(K=args.k, BT=args.bt, BK=bk, L2=True, PREC=prec, SPREC="tf32", DPREC="tf32"), 1)
    for sp in ("tf32", "ieee"):  # the in-memory block solve (kda.TUNE solve_blocks)
        jobs[f"_solve_blocks({sp})"] = (kern._solve_blocks, dict(Tbuf="fp32"), dict(HV=i32),
                                        dict(BT=args.bt, DPREC=sp, SPREC=sp), 1)
    for sp, mode in ((sp, m) for sp in ("tf32x3", "ieee") for m in (1, 2)):  # gdn.TUNE solve, solve_prec
        jobs[f"_prep_fwd_blk(stage 2 doubling{'16' if mode == 2 else ''} {sp})"] = (
            kern._prep_fwd_blk, prep_ptrs, prep_ints,
            dict(common, BK=64, BV=min(64, args.v), STAGE=2, INTERLEAVE=True, DOUBLING=mode, SPREC=sp), 1)
    jobs.update({
        "_recur_fwd(save)": (kern._recur_fwd, dict(g="fp32", Wbuf=sd, Ubuf=sd, Qg=sd, Kd=sd, Pb=sd, o=dt,
                                                   h0="fp32", ht="fp32", hbuf=sd, vnbuf=sd, cu=i32, chunk_off=i32),
                             dict(NCH=i32, scale="fp32", H=i32, HV=i32),
                             dict(common, BV=args.bv, HAS_H0=False, STORE_HT=False, STORE=True, LOWP=lowp,
                                  OUT=True), 2),
        "_recur_fwd(state)": (kern._recur_fwd, dict(g="fp32", Wbuf=sd, Ubuf=sd, Qg=sd, Kd=sd, Pb=sd, o=dt,
                                                    h0="fp32", ht="fp32", hbuf=sd, vnbuf=sd, cu=i32, chunk_off=i32),
                              dict(NCH=i32, scale="fp32", H=i32, HV=i32),
                              dict(common, BV=args.bv, HAS_H0=False, STORE_HT=False, STORE=True, LOWP=lowp,
                                   OUT=False), 2),
        "_out_fwd": (kern._out_fwd, dict(Qg=sd, Pb=sd, hbuf=sd, vnbuf=sd, o=dt, cu=i32, chunk_seq=i32,
                                         chunk_start=i32),
                     dict(HV=i32), dict(K=args.k, V=args.v, BT=args.bt, PREC=prec, BV=min(64, args.v), LOWP=lowp), 1),
        "_recur_bwd": (kern._recur_bwd, dict(g="fp32", Wbuf=sd, Qg=sd, Kd=sd, Pb=sd, do=dt, dht="fp32",
                                             dh0="fp32", dhbuf=sd, dvnbuf=sd, cu=i32, chunk_off=i32),
                       dict(NCH=i32, H=i32, HV=i32),
                       dict(common, BV=args.bv, HAS_DHT=False, STORE_DH0=False, LOWP=lowp), 2),
    })
    # the state pass on raw k with W/U's key scales (gdn.TUNE state_raw_k): Kd is the raw k, Pb s_k [tokens, HV]
    fn, ptrs, ints, cx, stages = jobs["_recur_fwd(state)"]
    jobs["_recur_fwd(state raw k)"] = (fn, dict(ptrs, Kd=dt, Pb="fp32"), ints, dict(cx, SK=True), stages)
    # the state backward from raw q and k (gdn.TUNE bwd_raw_qk): Qg, Kd are the raw [tokens, H, K] inputs
    fn, ptrs, ints, cx, stages = jobs["_recur_bwd"]
    jobs["_recur_bwd raw"] = (fn, dict(ptrs, Qg=dt, Kd=dt), dict(ints, scale="fp32"), dict(cx, L2=True, RAW=True),
                              stages)
    for name in ("_recur_fwd(save)", "_recur_fwd(state)", "_recur_bwd"):  # KDA's launches: one decay per channel
        fn, ptrs, ints, cx, stages = jobs[name]
        jobs[name + " channel"] = (fn, ptrs, ints, dict(cx, CHANNEL=True), stages)
        # one pipeline stage: fits at K=256 but made an illegal memory access on the H100 (2026-11-23), so the
        # launches take V block 16 there instead (gdn._recur_bv); kept to compare
        for key in (name, name + " channel"):
            jobs[key + " 1 stage"] = jobs[key][:4] + (1,)
    # the lean inference forward (gdn.TUNE fwd_variant "lean"): one-launch prep at each key block, the state pass
    # on raw k (state only, or with the output inline on raw q), the output launch on raw q and k
    for bk, st in ((int(x), st) for x in args.gdn_bk.split(",") for st in (0, 1, 2)):
        jobs[f"_prep_lean(bk {bk}, stage {st})"] = (
            kern._prep_lean, dict(k=dt, v=dt, g="fp32", beta=dt, Tbuf="fp32", Wbuf=sd, Ubuf=sd, RK="fp32", cu=i32,
                                  chunk_seq=i32, chunk_start=i32), dict(H=i32, HV=i32),
            dict(common, BK=bk, BV=min(64, args.v), INTERLEAVE=True, LOWP=False, STAGE=st), 1)
        if st != 1:
            jobs[f"_prep_lean(bk {bk}, stage {st}, doubling)"] = (
                kern._prep_lean, dict(k=dt, v=dt, g="fp32", beta=dt, Tbuf="fp32", Wbuf=sd, Ubuf=sd, RK="fp32",
                                      cu=i32, chunk_seq=i32, chunk_start=i32), dict(H=i32, HV=i32),
                dict(common, BK=bk, BV=min(64, args.v), INTERLEAVE=True, LOWP=False, STAGE=st, DOUBLING=1,
                     SPREC="tf32x3"), 1)
    for out in (False, True):
        jobs[f"_recur_fwd(lean{' inline' if out else ''})"] = (
            kern._recur_fwd, dict(g="fp32", Wbuf=sd, Ubuf=sd, Qg=dt, Kd=dt, Pb="fp32", o=dt, h0="fp32", ht="fp32",
                                  hbuf=sd, vnbuf=sd, cu=i32, chunk_off=i32),
            dict(NCH=i32, scale="fp32", H=i32, HV=i32),
            dict(common, BV=args.bv, HAS_H0=False, STORE_HT=False, STORE=not out, LOWP=lowp, OUT=out, RAWK=True), 2)
    for bv, sp in ((64, False), (128, False), (64, True), (128, True)):  # STORE_P: the raw-output training forward
        jobs[f"_out_fwd_raw(BV {bv}{' store P' if sp else ''})"] = (
            kern._out_fwd_raw, dict(q=dt, k=dt, g="fp32", RK="fp32", hbuf=sd, vnbuf=sd, o=dt, Pb=sd, cu=i32,
                                    chunk_seq=i32, chunk_start=i32), dict(scale="fp32", H=i32, HV=i32),
            dict(common, BV=min(bv, args.v), LOWP=lowp, STORE_P=sp), 1)
    for ph in (1, 2):
        jobs[f"_chunk_bwd(phase {ph})"] = (
            kern._chunk_bwd, dict(q=dt, k=dt, v=dt, g="fp32", beta=dt, Tbuf="fp32", hbuf=sd, dhbuf=sd, vnbuf=sd,
                                  dvnbuf=sd, do=dt, dq=dt, dk=dt, dkp="fp32", dv=dt, dg="fp32", dbeta="fp32", cu=i32,
                                  chunk_seq=i32, chunk_start=i32),
            dict(scale="fp32", H=i32, HV=i32), dict(common, BV=args.bwd_bv, LOWP=lowp, PHASE=ph), 1)
    # the state-first plan (TUNE bwd_variant "statefirst"): the state launch, then the output launch, with the UT
    # transform's dKK dots in the first (default, BV 32) or parked for the second (bwd_ut_dots=False, BV 64)
    for ut, bv in ((ut, int(bv)) for ut in (True, False) for bv in args.sf_bv.split(",")):
        tag = f"{'ut dots' if ut else 'dKK parked'}, BV {bv}"
        jobs[f"_chunk_bwd_state({tag})"] = (
            kern._chunk_bwd_state, dict(k=dt, v=dt, g="fp32", beta=dt, Tbuf="fp32", hbuf=sd, dhbuf=sd, vnbuf=sd,
                                        dvnbuf=sd, dkp="fp32", dv=dt, dg="fp32", dbeta="fp32", dKKbuf=sd, cu=i32,
                                        chunk_seq=i32, chunk_start=i32),
            dict(H=i32, HV=i32), dict(common, BV=bv, LOWP=lowp, UT_DOTS=ut), 1)
        jobs[f"_chunk_bwd_out({tag})"] = (
            kern._chunk_bwd_out, dict(q=dt, k=dt, g="fp32", beta=dt, hbuf=sd, vnbuf=sd, do=dt, dq=dt, dk=dt,
                                      dkp="fp32", dg="fp32", dKKbuf=sd, cu=i32, chunk_seq=i32, chunk_start=i32),
            dict(scale="fp32", H=i32, HV=i32), dict(common, BV=bv, LOWP=lowp, UT_DOTS=ut), 1)
    # the K-blocked state-first plan (TUNE bwd_variant "kblock"): both launches at each key-channel block and V block,
    # with ptxas free (up to 255 registers at 8 warps) and capped as the host launches them (TUNE bwd_maxnreg)
    for bk, bv, cap in ((int(bk), int(bv), cap) for bk in args.gdn_bk.split(",") for bv in args.sf_bv.split(",")
                        for cap in (None, args.maxnreg)):
        tag = f"bk {bk}, BV {bv}{f', maxnreg {cap}' if cap else ''}"
        jobs[f"_chunk_bwd_state_blk({tag})"] = (
            kern._chunk_bwd_state_blk, dict(k=dt, v=dt, g="fp32", beta=dt, Tbuf="fp32", hbuf=sd, dhbuf=sd, vnbuf=sd,
                                            dvnbuf=sd, dkp="fp32", dv=dt, dg="fp32", dbeta="fp32", dKKbuf=sd,
                                            dsk="fp32", cu=i32, chunk_seq=i32, chunk_start=i32),
            dict(H=i32, HV=i32), dict(common, BK=bk, BV=bv, LOWP=lowp), args.bwd_stages, cap)
        jobs[f"_chunk_bwd_out_blk({tag})"] = (
            kern._chunk_bwd_out_blk, dict(q=dt, k=dt, g="fp32", hbuf=sd, vnbuf=sd, do=dt, dq=dt, dk=dt, dkp="fp32",
                                          dg="fp32", dKKbuf=sd, dsk="fp32", cu=i32, chunk_seq=i32, chunk_start=i32),
            dict(scale="fp32", H=i32, HV=i32), dict(common, BK=bk, BV=bv, LOWP=lowp), args.bwd_stages, cap)
    from hybridlm.ops.triton import kda_kernels as kk

    jobs["_kda_prep_fwd"] = (kk._kda_prep_fwd, dict(prep_ptrs, Bc="fp32", BL="fp32"), prep_ints,
                             dict(common, BV=min(64, args.v)), 1)
    for ph in (1, 2):
        jobs[f"_kda_chunk_bwd(phase {ph})"] = (
            kk._kda_chunk_bwd, dict(q=dt, k=dt, v=dt, g="fp32", beta=dt, Tbuf="fp32", Bc="fp32", BL="fp32", hbuf=sd,
                                    dhbuf=sd, vnbuf=sd, dvnbuf=sd, do=dt, dq="fp32", dk="fp32", dv="fp32",
                                    dg="fp32", dbeta="fp32", cu=i32, chunk_seq=i32, chunk_start=i32),
            dict(scale="fp32", H=i32, HV=i32), dict(common, BV=min(64, args.v), LOWP=lowp, PHASE=ph), 1)
    # the K-blocked KDA kernels (kda.TUNE variant "kblock"), at each key-channel block
    kda_caps = [None] + [int(x) for x in args.kda_maxnreg.split(",") if x]
    for bk, cap in ((int(x), c) for x in args.kda_bk.split(",") for c in kda_caps):
        kc = dict(common, BK=bk)
        tag = f"bk {bk}{f', maxnreg {cap}' if cap else ''}"
        chunk_ptrs = dict(cu=i32, chunk_seq=i32, chunk_start=i32)
        for mode in (1, 4, 2, 0):  # the diagonal blocks by dot, by half-block dots, the exact rest; or all exactly
            dtag = f"{tag}, {('exact', 'dot', 'exact rest', '', 'half-block dots')[mode]}"
            kd = dict(kc, DIAG=mode)
            jobs[f"_kda_prep_ap({dtag})"] = (
                kk._kda_prep_ap, dict(chunk_ptrs, q=dt, k=dt, g="fp32", beta=dt, Tbuf="fp32", Qg=sd, Kd=sd, Pb=sd,
                                      BL="fp32", redo=i32), prep_ints, kd, 1, cap)
            jobs[f"_kda_bwd_out_blk({dtag})"] = (
                kk._kda_bwd_out_blk, dict(chunk_ptrs, q=dt, k=dt, g="fp32", hbuf=sd, vnbuf=sd, do=dt,
                                          dq="fp32", dk="fp32", dg="fp32", redo=i32),
                dict(scale="fp32", H=i32, HV=i32), dict(kd, BV=min(64, args.v), LOWP=lowp), 1, cap)
            jobs[f"_kda_bwd_state_blk({dtag})"] = (
                kk._kda_bwd_state_blk, dict(chunk_ptrs, k=dt, v=dt, g="fp32", beta=dt, Tbuf="fp32", BL="fp32",
                                            hbuf=sd, dhbuf=sd, vnbuf=sd, dvnbuf=sd, dk="fp32", dv="fp32", dg="fp32",
                                            dbeta="fp32", redo=i32),
                dict(H=i32, HV=i32), dict(kd, BV=min(64, args.v), LOWP=lowp, MARKED=mode == 1), 1, cap)
        # the whole chunk as one dot where the decay allows (kda.TUNE whole_dot; then the launches above)
        jobs[f"_kda_prep_ap({tag}, whole chunk)"] = (
            kk._kda_prep_ap, dict(chunk_ptrs, q=dt, k=dt, g="fp32", beta=dt, Tbuf="fp32", Qg=sd, Kd=sd, Pb=sd,
                                  BL="fp32", redo=i32), prep_ints, dict(kc, DIAG=3), 1, cap)
        jobs[f"_kda_bwd_out_blk({tag}, whole chunk)"] = (
            kk._kda_bwd_out_blk, dict(chunk_ptrs, q=dt, k=dt, g="fp32", hbuf=sd, vnbuf=sd, do=dt,
                                      dq="fp32", dk="fp32", dg="fp32", redo=i32),
            dict(scale="fp32", H=i32, HV=i32), dict(kc, BV=min(64, args.v), LOWP=lowp, DIAG=3), 1, cap)
        jobs[f"_kda_bwd_state_blk({tag}, whole chunk)"] = (
            kk._kda_bwd_state_blk, dict(chunk_ptrs, k=dt, v=dt, g="fp32", beta=dt, Tbuf="fp32", BL="fp32",
                                        hbuf=sd, dhbuf=sd, vnbuf=sd, dvnbuf=sd, dk="fp32", dv="fp32", dg="fp32",
                                        dbeta="fp32", redo=i32),
            dict(H=i32, HV=i32), dict(kc, BV=min(64, args.v), LOWP=lowp, DIAG=3, MARKED=True), 1, cap)
        jobs[f"_kda_bwd_out_blk({tag}, dot after whole)"] = (
            kk._kda_bwd_out_blk, dict(chunk_ptrs, q=dt, k=dt, g="fp32", hbuf=sd, vnbuf=sd, do=dt,
                                      dq="fp32", dk="fp32", dg="fp32", redo=i32),
            dict(scale="fp32", H=i32, HV=i32), dict(kc, BV=min(64, args.v), LOWP=lowp, DIAG=1, WHOLE=True), 1, cap)
        jobs[f"_kda_prep_wu({tag})"] = (
            kk._kda_prep_wu, dict(chunk_ptrs, k=dt, v=dt, g="fp32", beta=dt, Tbuf="fp32", Wbuf=sd, Ubuf=sd),
            prep_ints, dict(kc, BV=min(64, args.v), LOWP=False), 1, cap)
    jobs["_kda_solve"] = (kk._kda_solve, dict(Tbuf="fp32"), dict(HV=i32), dict(BT=args.bt, INTERLEAVE=True), 1)
    heads = dict(zip(("H", "HV"), (int(x) for x in args.heads.split(","))))
    print(f"sm_90, K={args.k} V={args.v} BT={args.bt} {dt}, BV={args.bv}, chunk-bwd BV={args.bwd_bv}, "
          f"H,HV={args.heads}, {'no ' if args.no_align else ''}pointer alignment hint")
    for name, (fn, ptrs, ints, cx, stages, *cap) in jobs.items():
        if args.only and not any(name.startswith(x) for x in args.only.split(",")):
            continue
        for w in (int(x) for x in args.warps.split(",")):
            names = fn.arg_names
            defaults = {n: p.default for n, p in inspect.signature(fn.fn).parameters.items()}
            sig = {}
            consts = {n: cx[n] for n in names if n in cx}
            div16 = []
            for n in names:
                if n in ptrs:
                    sig[n] = "*" + ptrs[n]
                    div16 += [] if args.no_align else [n]
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
            try:
                dump = os.path.join(args.dump, re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{name}_w{w}")) if args.dump else None
                r = compile_one(fn, sig, consts, w, stages, div16, *cap, dump=dump)
                flag = " SMEM OVER" if r["shared"] > SMEM_LIMIT else ""
                print(f"{name:42} warps {w}: shared {r['shared'] / 1024:6.1f} KB, regs {r['regs']}, "
                      f"local(stack) {r['stack']} B{flag}")
            except Exception as e:  # noqa: BLE001
                print(f"{name:42} warps {w}: FAILED {type(e).__name__}: {str(e)[-300:]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
