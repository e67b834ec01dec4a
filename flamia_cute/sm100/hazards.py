"""Protocol hazard model of the sm100 kernels: their roles, barriers, and what each op reads and writes.

The CPU tile model (`reference_fwd_sm100`) checks a kernel's arithmetic; this checks the order of its
tensor- and shared-memory accesses, which the tile model cannot see. A kernel is a list of roles (FA4's
names: load, mma, softmax, ...), each a list of ops in issue order, built by mirroring the kernel's
code. The only orderings assumed are the hardware's:
- a role's thread ops run in program order (a softmax warp's tcgen05.ld/st are waited for in place);
- tcgen05 ops (MMA, tcgen05.cp) run asynchronously: in issue order among themselves, after the thread
  ops issued before them, but before no later thread op;
- tcgen05.commit arrives on an mbarrier once every earlier tcgen05 op of the role has finished;
- waiting for generation g of a barrier comes after its g-th arrive (0-based; one arriving role each).
`check(roles)` returns the hazards: a read that another write may reach between its intended write and
the read (a stale generation, or a stage overwritten before its reader finished), two unordered writes
to one place, a wait nothing arrives for. `backward_roles` builds the planned backward's roles the same
way, before any kernel.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ..quant.mx_layout import MX_TILE
from .plan import BWD_QUERY_TILE, O_STAGES, P_STAGES, S_STAGES, TMEM_COLS, bwd_tmem_plan, fwd_tmem_plan

# s_first: S of tile 1 before the diagonal's P V (the clobber); mutants of Q's conversion to bf16:
# qd_unwaited issues the diagonal's bf16 S without waiting for it, q_unwaited converts before Q's TMA lands
FWD_ORDERS = ("pv_first", "s_first", "qd_unwaited", "q_unwaited")
# the backward's planned order, then mutants check() must fail: s_lookahead issues the next tile's S^T
# right after dP^T (FA4's 1-CTA order, which needs dQ in its own columns); dq_early_release has the
# reduction free dQ before its tcgen05.ld; no_dq_wait issues S^T without waiting for that release
BWD_ORDERS = ("planned", "s_lookahead", "dq_early_release", "no_dq_wait")


@dataclass(frozen=True)
class Region:
    space: str  # "tmem" (columns lo..hi) or a shared-memory buffer ("sK[1]")
    lo: int = 0
    hi: int = 1

    def overlaps(self, other: Region) -> bool:
        return self.space == other.space and self.lo < other.hi and other.lo < self.hi

    def __str__(self):
        return f"tmem[{self.lo}:{self.hi})" if self.space == "tmem" else self.space


@dataclass(eq=False)
class Op:
    role: str
    label: str
    tc: bool  # a tcgen05 op or commit (asynchronous), else a thread op
    reads: tuple = ()  # (Region, label of the op whose write it means to read)
    writes: tuple = ()
    wait: tuple | None = None  # (barrier, generation)
    arrive: str | None = None
    preds: list = field(default_factory=list)


class Role:
    def __init__(self, name: str):
        self.name, self.ops = name, []

    def do(self, label, reads=(), writes=(), tc=False):
        self.ops.append(Op(self.name, label, tc, tuple(reads), tuple(writes)))

    def wait(self, barrier, gen):
        self.ops.append(Op(self.name, f"wait {barrier}#{gen}", False, wait=(barrier, gen)))

    def arrive(self, barrier, tc=False):  # tc: tcgen05.commit
        self.ops.append(Op(self.name, f"{'commit' if tc else 'arrive'} {barrier}", tc, arrive=barrier))


class Pipe:
    """A ring of `stages` with a full and an empty barrier each, stepped as the DSL's PipelineState: the
    u-th use of stage i waits for generation u of full[i] (consumer) or u - 1 of empty[i] (producer)."""

    def __init__(self, name, stages, tc_producer=False, tc_consumer=False):
        self.name, self.stages, self.tc = name, stages, (tc_producer, tc_consumer)
        self.produced = self.consumed = 0

    def acquire(self, role) -> int:
        use, i = divmod(self.produced, self.stages)
        if use:
            role.wait(f"{self.name}.empty[{i}]", use - 1)
        self.produced += 1
        return i

    def commit(self, role, i):
        role.arrive(f"{self.name}.full[{i}]", self.tc[0])

    def wait(self, role) -> int:
        use, i = divmod(self.consumed, self.stages)
        role.wait(f"{self.name}.full[{i}]", use)
        self.consumed += 1
        return i

    def release(self, role, i):
        role.arrive(f"{self.name}.empty[{i}]", self.tc[1])


def check(roles) -> list[str]:
    """The hazards of the roles' ops under the happens-before order above (empty: none)."""
    ops = [op for r in roles for op in r.ops]
    arrives, arriver = defaultdict(list), {}
    for r in roles:
        last_thread = last_tc = None
        for op in r.ops:
            op.preds = [p for p in ((last_thread, last_tc) if op.tc else (last_thread,)) if p is not None]
            if op.tc:
                last_tc = op
            else:
                last_thread = op
            if op.arrive:
                if arriver.setdefault(op.arrive, r.name) != r.name:
                    raise ValueError(f"{op.arrive}: arrived on by {arriver[op.arrive]} and {r.name}")
                arrives[op.arrive].append(op)
    problems = []
    for op in ops:
        if op.wait:
            bar, gen = op.wait
            if gen < len(arrives[bar]):
                op.preds.append(arrives[bar][gen])
            else:
                problems.append(f"{op.role}: {op.label} waits for an arrive that never comes")
    # topological order (Kahn); each op's ancestors as a bitset
    bit = {op: 1 << n for n, op in enumerate(ops)}
    succs, indeg = defaultdict(list), {op: len(op.preds) for op in ops}
    for op in ops:
        for p in op.preds:
            succs[p].append(op)
    ready, anc, done = [op for op in ops if not indeg[op]], {}, 0
    while ready:
        op = ready.pop()
        anc[op] = 0
        for p in op.preds:
            anc[op] |= anc[p] | bit[p]
        done += 1
        for s in succs[op]:
            indeg[s] -= 1
            if not indeg[s]:
                ready.append(s)
    if done < len(ops):
        return problems + ["deadlock: the waits form a cycle"]

    def hb(a, b):
        return bool(anc[b] & bit[a])

    writes = [(op, reg) for op in ops for reg in op.writes]
    by_label = {op.label: op for op in ops}
    for op in ops:
        for reg, src in op.reads:
            w = by_label.get(src)
            if w is None or not any(reg.overlaps(x) for x in w.writes):
                problems.append(f"{op.label} reads {reg} from {src}, which does not write it")
                continue
            if not hb(w, op):
                problems.append(f"{op.label} may read {reg} before {src} writes it")
            for w2, reg2 in writes:
                if w2 not in (w, op) and reg.overlaps(reg2) and not (hb(w2, w) or hb(op, w2)):
                    problems.append(f"{w2.role}: {w2.label} writes {reg2} between {src}'s write and "
                                    f"{op.role}: {op.label}'s read of {reg}")
    for n, (a, ra) in enumerate(writes):
        for b, rb in writes[n + 1:]:
            if a is not b and ra.overlaps(rb) and not (hb(a, b) or hb(b, a)):
                problems.append(f"unordered writes: {a.label} and {b.label} to {ra}")
    return problems


def forward_roles(n_tiles: int, kv_stages: int = 2, order: str = "pv_first", head_dim: int = 128):
    """The sm_100a forward's roles for one CTA with `n_tiles` key tiles (tile 0 the diagonal), as
    attention_fwd.py issues them (load, mma, softmax with Q's conversion to bf16 and the epilogue).
    order="s_first" is the order before the fix (S of tile 1 issued before the diagonal's P V);
    it and the other FWD_ORDERS but "pv_first" are mutants check() must fail."""
    if order not in FWD_ORDERS or n_tiles < 1:
        raise ValueError(f"order must be one of {FWD_ORDERS} and n_tiles >= 1, got {order!r}, {n_tiles}")
    plan = fwd_tmem_plan(head_dim)

    def tm(name, cols=None):
        lo, hi = plan[name]
        return Region("tmem", lo, hi if cols is None else lo + cols)

    def stage(i, cols=None):  # S stage i; P's e4m3 codes take MX_TILE // 4 columns, bf16 P MX_TILE // 2
        return tm(f"S{i}", cols)

    sm = Region
    load, mma, softmax = Role("load"), Role("mma"), Role("softmax")
    q, d = Pipe("q", 1, tc_consumer=True), Pipe("d", 1, tc_consumer=True)
    k, v = Pipe("k", kv_stages, tc_consumer=True), Pipe("v", kv_stages, tc_consumer=True)
    s, o = Pipe("s", S_STAGES, tc_producer=True), Pipe("o", O_STAGES, tc_producer=True)
    p, qd = Pipe("p", P_STAGES, tc_consumer=True), Pipe("qd", 1, tc_consumer=True)

    # warp 5: TMA (a copy's bytes land before it completes the stage's full barrier)
    i = q.acquire(load)
    load.do("load_q", writes=[sm("sQ"), sm("sfQ")])
    q.commit(load, i)
    i = d.acquire(load)
    load.do("load_d", writes=[sm("sKd"), sm("sVd")])
    d.commit(load, i)
    for j in range(n_tiles):
        for pipe, buf in ((k, "K"), (v, "V")):
            i = pipe.acquire(load)
            load.do(f"load_{buf}{j}", writes=[sm(f"s{buf}[{i}]"), sm(f"sf{buf}[{i}]")])
            pipe.commit(load, i)

    # warp 4: one thread issues every tcgen05 op
    def issue_s(j):
        ki = k.wait(mma)
        mma.do(f"cp_sfK{j}", [(sm(f"sfK[{ki}]"), f"load_K{j}")], [tm("SFK")], tc=True)
        si = s.acquire(mma)
        mma.do(f"S{j}", [(sm("sQ"), "load_q"), (sm(f"sK[{ki}]"), f"load_K{j}"), (tm("SFQ"), "cp_sfQ"),
                         (tm("SFK"), f"cp_sfK{j}")], [stage(si)], tc=True)
        s.commit(mma, si)
        k.release(mma, ki)

    def issue_pv(j):
        vi, oi, pi = v.wait(mma), o.acquire(mma), p.wait(mma)
        mma.do(f"cp_sfP{j}", [(sm(f"sfP[{pi}]"), f"P{j}")], [tm("SFP")], tc=True)
        mma.do(f"cp_sfV{j}", [(sm(f"sfV[{vi}]"), f"load_V{j}")], [tm("SFV")], tc=True)
        acc = [(tm("O"), f"rescale{j}")] if j else []  # the diagonal's P V overwrites O
        mma.do(f"PV{j}", [(stage(pi, MX_TILE // 4), f"P{j}"), (sm(f"sV[{vi}]"), f"load_V{j}"),
                          (tm("SFP"), f"cp_sfP{j}"), (tm("SFV"), f"cp_sfV{j}"), *acc], [tm("O")], tc=True)
        p.release(mma, pi)
        if j == 0:  # + the own blocks' bf16 P V; bf16 P is read from S stage 1
            pi = p.wait(mma)
            mma.do("PVbf0", [(stage(1, MX_TILE // 2), "Pbf0"), (sm("sVd"), "load_d"), (tm("O"), "PV0")],
                   [tm("O")], tc=True)
            p.release(mma, pi)
        o.commit(mma, oi)
        v.release(mma, vi)

    q.wait(mma)
    mma.do("cp_sfQ", [(sm("sfQ"), "load_q")], [tm("SFQ")], tc=True)
    issue_s(0)
    d.wait(mma)
    if order != "qd_unwaited":
        qd.wait(mma)
    si = s.acquire(mma)
    mma.do("Sbf0", [(sm("sQd"), "cvt_Qd"), (sm("sKd"), "load_d")], [stage(si)], tc=True)
    s.commit(mma, si)
    first = [lambda: issue_pv(0)] + ([lambda: issue_s(1)] if n_tiles > 1 else [])
    for step in (first[::-1] if order == "s_first" else first):
        step()
    for j in range(1, n_tiles):
        if j + 1 < n_tiles:
            issue_s(j + 1)
        issue_pv(j)
    mma.wait("tmem_free", 0)
    mma.do("dealloc", writes=[Region("tmem", 0, TMEM_COLS)])

    # warps 0-3: Q's bf16 MX values (waiting on the TMA's barrier without consuming it), the softmax,
    # then the epilogue
    if order != "q_unwaited":
        softmax.wait("q.full[0]", 0)
    i = qd.acquire(softmax)
    softmax.do("cvt_Qd", [(sm("sQ"), "load_q"), (sm("sfQ"), "load_q")], [sm("sQd")])
    qd.commit(softmax, i)

    def last_pv(j):
        return "PVbf0" if j == 0 else f"PV{j}"

    for j in range(n_tiles):
        si = s.wait(softmax)
        softmax.do(f"ld_S{j}", [(stage(si), f"S{j}")])
        if j == 0:  # the bf16 S of the own blocks, from the second stage
            si_bf = s.wait(softmax)
            softmax.do("ld_Sbf0", [(stage(si_bf), "Sbf0")])
        else:  # O *= alpha once the previous P V has finished
            oi = o.wait(softmax)
            softmax.do(f"rescale{j}", [(tm("O"), last_pv(j - 1))], [tm("O")])
            o.release(softmax, oi)
        pi = p.acquire(softmax)
        softmax.do(f"P{j}", writes=[stage(pi, MX_TILE // 4), sm(f"sfP[{pi}]")])
        p.commit(softmax, pi)
        s.release(softmax, si)
        if j == 0:
            pi = p.acquire(softmax)
            softmax.do("Pbf0", writes=[stage(pi, MX_TILE // 2)])
            p.commit(softmax, pi)
            s.release(softmax, si_bf)
    oi = o.wait(softmax)
    softmax.do("store_O", [(tm("O"), last_pv(n_tiles - 1))])
    o.release(softmax, oi)
    softmax.arrive("tmem_free")
    return [load, mma, softmax]


def backward_roles(n_tiles: int, q_stages: int = 2, do_stages: int = 1, order: str = "planned",
                   head_dim: int = 128):
    """The planned sm_100a MXFP8 backward's roles for one CTA (one KV head, one 128-key block) over
    `n_tiles` query tiles of BWD_QUERY_TILE, in FA4's flash_bwd_sm100 layout and the columns of
    bwd_tmem_plan. Per tile j the MMA role issues S^T = K Q^T, dP^T = V dO^T, dV += P^T dO,
    dK += dS^T Q, dQ = dS K; the compute role turns S^T into P^T and dP^T into dS^T (e4m3 codes to
    tensor memory over S^T / dP^T, scales to shared memory; dS scaled along the keys to shared memory
    for dQ); the reduction role reads dQ and adds it to global memory; the epilogue writes dK, dV.
    MX operands are scaled along their contraction axis, so Q, K and dO come in two orientations."""
    if order not in BWD_ORDERS or n_tiles < 1:
        raise ValueError(f"order must be one of {BWD_ORDERS} and n_tiles >= 1, got {order!r}, {n_tiles}")
    plan = bwd_tmem_plan(head_dim)
    codes = BWD_QUERY_TILE // 4  # e4m3 codes of a query_tile-wide row, in 32-bit columns

    def tm(name, cols=None):
        lo, hi = plan[name]
        return Region("tmem", lo, hi if cols is None else lo + cols)

    sm = Region
    load, mma, compute = Role("load"), Role("mma"), Role("compute")
    reduce, epilogue = Role("dq_reduce"), Role("epilogue")
    kv = Pipe("kv", 1, tc_consumer=True)
    q, do = Pipe("q", q_stages, tc_consumer=True), Pipe("do", do_stages, tc_consumer=True)
    lse, dsum = Pipe("lse", q_stages), Pipe("dsum", do_stages)
    s, dp = Pipe("s", 1, tc_producer=True), Pipe("dp", 1, tc_producer=True)
    p, ds = Pipe("p", 1, tc_consumer=True), Pipe("ds", 1, tc_consumer=True)
    dq, dkv = Pipe("dq", 1, tc_producer=True), Pipe("dkv", 1, tc_producer=True)

    # load warp (TMA): K, V and K scaled along the keys once; per query tile a Q ring and a dO ring
    i = kv.acquire(load)
    load.do("load_kv", writes=[sm(b) for b in ("sK", "sfK", "sV", "sfV", "sKt", "sfKt")])
    kv.commit(load, i)
    for j in range(n_tiles):
        for pipe, label, bufs in ((q, "Q", ("sQ", "sfQ", "sQt", "sfQt")), (lse, "lse", ("sLSE",)),
                                  (do, "dO", ("sdO", "sfdO", "sdOt", "sfdOt")), (dsum, "dsum", ("sD",))):
            i = pipe.acquire(load)
            load.do(f"load_{label}{j}", writes=[sm(f"{b}[{i}]") for b in bufs])
            pipe.commit(load, i)

    # MMA warp: one thread issues every tcgen05 op
    kv.wait(mma)
    for chunk in ("K", "V", "Kt"):
        mma.do(f"cp_sf{chunk}", [(sm(f"sf{chunk}"), "load_kv")], [tm(f"SF{chunk}")], tc=True)
    pending = {}  # (tile, "q" | "dq") -> the stage taken when its S^T was issued

    def issue_s(j):
        qi = q.wait(mma)
        if j and order not in ("s_lookahead", "no_dq_wait"):  # dQ of tile j-1 lies over S^T and dP^T
            pending[j, "dq"] = dq.acquire(mma)
        si = s.acquire(mma)
        mma.do(f"cp_sfQ{j}", [(sm(f"sfQ[{qi}]"), f"load_Q{j}")], [tm("SFQ")], tc=True)
        mma.do(f"S{j}", [(sm("sK"), "load_kv"), (sm(f"sQ[{qi}]"), f"load_Q{j}"), (tm("SFK"), "cp_sfK"),
                         (tm("SFQ"), f"cp_sfQ{j}")], [tm("S")], tc=True)
        s.commit(mma, si)
        pending[j, "q"] = qi

    def issue_rest(j):
        qi = pending[j, "q"]
        doi, dpi = do.wait(mma), dp.acquire(mma)
        mma.do(f"cp_sfdO{j}", [(sm(f"sfdO[{doi}]"), f"load_dO{j}")], [tm("SFdO")], tc=True)
        mma.do(f"dP{j}", [(sm("sV"), "load_kv"), (sm(f"sdO[{doi}]"), f"load_dO{j}"),
                          (tm("SFV"), "cp_sfV"), (tm("SFdO"), f"cp_sfdO{j}")], [tm("dP")], tc=True)
        dp.commit(mma, dpi)
        if order == "s_lookahead" and j + 1 < n_tiles:
            issue_s(j + 1)
        pi = p.wait(mma)
        mma.do(f"cp_sfP{j}", [(sm("sfP"), f"P{j}")], [tm("SFP")], tc=True)
        mma.do(f"cp_sfdOt{j}", [(sm(f"sfdOt[{doi}]"), f"load_dO{j}")], [tm("SFdOt")], tc=True)
        acc = [(tm("dV"), f"dV{j - 1}")] if j else []
        mma.do(f"dV{j}", [(tm("S", codes), f"P{j}"), (sm(f"sdOt[{doi}]"), f"load_dO{j}"),
                          (tm("SFP"), f"cp_sfP{j}"), (tm("SFdOt"), f"cp_sfdOt{j}"), *acc], [tm("dV")], tc=True)
        p.release(mma, pi)
        di = ds.wait(mma)
        mma.do(f"cp_sfdSt{j}", [(sm("sfdSt"), f"dS{j}")], [tm("SFdSt")], tc=True)
        mma.do(f"cp_sfQt{j}", [(sm(f"sfQt[{qi}]"), f"load_Q{j}")], [tm("SFQt")], tc=True)
        acc = [(tm("dK"), f"dK{j - 1}")] if j else []
        mma.do(f"dK{j}", [(tm("dP", codes), f"dS{j}"), (sm(f"sQt[{qi}]"), f"load_Q{j}"),
                          (tm("SFdSt"), f"cp_sfdSt{j}"), (tm("SFQt"), f"cp_sfQt{j}"), *acc], [tm("dK")], tc=True)
        q.release(mma, qi)
        dqi = pending.pop((j, "dq"), None)
        if dqi is None:  # tile 0, or a mutant that did not wait before S^T
            dqi = dq.acquire(mma)
        mma.do(f"cp_sfdS{j}", [(sm("sfdS"), f"dS{j}")], [tm("SFdS")], tc=True)
        mma.do(f"dQ{j}", [(sm("sdS"), f"dS{j}"), (sm("sKt"), "load_kv"), (tm("SFdS"), f"cp_sfdS{j}"),
                          (tm("SFKt"), "cp_sfKt")], [tm("dQ")], tc=True)
        dq.commit(mma, dqi)
        ds.release(mma, di)
        do.release(mma, doi)

    issue_s(0)
    for j in range(n_tiles):
        issue_rest(j)
        if j + 1 < n_tiles and order != "s_lookahead":
            issue_s(j + 1)
    i = dkv.acquire(mma)
    dkv.commit(mma, i)  # dV and dK final once every MMA above has finished
    mma.wait("dq.empty[0]", n_tiles - 1)  # the last dQ read before the columns are freed
    mma.wait("tmem_free", 0)
    mma.do("dealloc", writes=[Region("tmem", 0, TMEM_COLS)])

    # compute warps: P^T = exp(S^T - LSE), dS^T = P^T (dP^T - D), each quantized to MX
    for j in range(n_tiles):
        li, si = lse.wait(compute), s.wait(compute)
        compute.do(f"ld_S{j}", [(tm("S"), f"S{j}"), (sm(f"sLSE[{li}]"), f"load_lse{j}")])
        s.release(compute, si)
        lse.release(compute, li)
        pi = p.acquire(compute)  # P^T's codes and scales free once dV of the tile before has run
        compute.do(f"P{j}", writes=[tm("S", codes), sm("sfP")])
        p.commit(compute, pi)
        di, dpi = dsum.wait(compute), dp.wait(compute)
        compute.do(f"ld_dP{j}", [(tm("dP"), f"dP{j}"), (sm(f"sD[{di}]"), f"load_dsum{j}")])
        dp.release(compute, dpi)
        dsum.release(compute, di)
        dsi = ds.acquire(compute)  # dS^T in tensor memory; dS and both scale sets in shared memory
        compute.do(f"dS{j}", writes=[tm("dP", codes), sm("sfdSt"), sm("sdS"), sm("sfdS")])
        ds.commit(compute, dsi)

    # dQ reduction warps: tcgen05.ld dQ, stage it in shared memory, TMA-reduce-add it to global dQ
    for j in range(n_tiles):
        i = dq.wait(reduce)
        if order == "dq_early_release":
            dq.release(reduce, i)
        reduce.do(f"ld_dQ{j}", [(tm("dQ"), f"dQ{j}")])
        if order != "dq_early_release":
            dq.release(reduce, i)
        reduce.do(f"st_dQ{j}", writes=[sm("sdQ")])  # waited for the previous bulk reduce's smem read
        reduce.do(f"red_dQ{j}", [(sm("sdQ"), f"st_dQ{j}")], [sm(f"gdQ[{j}]")])

    # epilogue (FA4: the compute warps): dV and dK out of tensor memory once the last MMA finished
    i = dkv.wait(epilogue)
    epilogue.do("store_dV", [(tm("dV"), f"dV{n_tiles - 1}")])
    epilogue.do("store_dK", [(tm("dK"), f"dK{n_tiles - 1}")])
    dkv.release(epilogue, i)
    epilogue.arrive("tmem_free")
    return [load, mma, compute, reduce, epilogue]
