//! Canonical reductions (`docs/determinism.md`): every reduction of the shared-memory backend
//! gives the bits of `lockstep::reference::reduce` over the same inputs, on every rank, whatever
//! the path (fast entries, one-phase, staged slots cached or streaming, single-copy, zero-copy),
//! the chunking (one call, or the same data cut into random pieces with one call per piece), in
//! place or out of place, on ordinary or shared buffers, for all_reduce, reduce (the root's
//! result) and reduce_scatter (each rank's block).
//!
//! A property test: a seeded generator (`CANONICAL_SEED=N` replays another run; the seed is
//! printed) draws each case's dtype, op, length and data; every rank draws every rank's input
//! from the same seed, so each checks its own results against the reference locally. Lengths
//! gather around each path's threshold of the configuration; float inputs mix ordinary values of
//! nearby magnitudes (so sums round), subnormals, ±0, ±Inf, NaN and values near overflow.
//! Results must be equal bit for bit, to the reference and to the first call's; a NaN from sum,
//! prod or avg must be a NaN where the reference has one, its sign and payload aside (see
//! `nan_bits`).
//!
//! `harness = false`: the process forks, so it stays single-threaded; the binary ends with
//! `N passed, M skipped, F failed`.

#[path = "common/runner.rs"]
mod runner;

use std::ops::{Deref, DerefMut};
use std::time::Duration;

use half::{bf16, f16};
use lockstep::comm::{Communicator, Element, ReduceOp, SharedBuffer};
use lockstep::launch::{launch, LaunchConfig, RankContext, RankResult};
use lockstep::reference;
use lockstep::shm::{ShmConfig, SingleCopyMode, StageMode};

// -------------------------------------------------------------------------------------------------
// Generator

/// xorshift64*: small, seedable, the same sequence on every rank.
#[derive(Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        // splitmix64 of the seed, so nearby seeds give unrelated streams (never 0).
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `0..n` (n > 0).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// True with probability `p` percent.
    fn pct(&mut self, p: usize) -> bool {
        self.below(100) < p
    }
}

/// An element type as the generator and the comparison see it: its raw bits, and for floats the
/// layout that lets the generator build every class of value.
trait Val: Element {
    /// Total bits.
    const BITS: u32;
    /// Significand bits (without the implicit one); 0 for integers.
    const MANT: u32;
    fn from_raw(b: u64) -> Self;
    fn raw(self) -> u64;
}

macro_rules! int_val {
    ($($t:ty => $u:ty),*) => {$(
        impl Val for $t {
            const BITS: u32 = <$u>::BITS;
            const MANT: u32 = 0;
            fn from_raw(b: u64) -> Self { b as $u as $t }
            fn raw(self) -> u64 { self as $u as u64 }
        }
    )*};
}
int_val!(i8 => u8, u8 => u8, i32 => u32, u32 => u32, i64 => u64, u64 => u64);

macro_rules! float_val {
    ($($t:ty => $u:ty, $m:expr);*) => {$(
        impl Val for $t {
            const BITS: u32 = <$u>::BITS;
            const MANT: u32 = $m;
            fn from_raw(b: u64) -> Self { <$t>::from_bits(b as $u) }
            fn raw(self) -> u64 { self.to_bits() as u64 }
        }
    )*};
}
float_val!(f32 => u32, 23; f64 => u64, 52; f16 => u16, 10; bf16 => u16, 7);

fn is_nan<T: Val>(x: T) -> bool {
    if T::MANT == 0 {
        return false;
    }
    let b = x.raw();
    let exp_mask = ((1u64 << (T::BITS - 1 - T::MANT)) - 1) << T::MANT;
    b & exp_mask == exp_mask && b & ((1u64 << T::MANT) - 1) != 0
}

/// One input element. `wild`: the case mixes in every special value; otherwise ordinary values
/// and subnormals only (so most results stay finite and their rounding is what is compared).
fn draw<T: Val>(g: &mut Rng, wild: bool) -> T {
    if T::MANT == 0 {
        let mask = if T::BITS == 64 {
            u64::MAX
        } else {
            (1u64 << T::BITS) - 1
        };
        let v = match g.below(10) {
            0..=4 => g.next(),
            5..=7 => (g.below(17) as u64).wrapping_sub(8),
            8 => [0, 1, mask, mask >> 1, (mask >> 1) + 1][g.below(5)],
            _ => g.next() >> g.below(64),
        };
        return T::from_raw(v & mask);
    }
    let (bits, mant) = (T::BITS, T::MANT);
    let ebits = bits - 1 - mant;
    let emax = (1u64 << ebits) - 1; // all ones: Inf or NaN
    let bias = emax >> 1;
    let sign = (g.next() & 1) << (bits - 1);
    let frac = g.next() & ((1u64 << mant) - 1);
    let cls = if wild { g.below(100) } else { g.below(80) };
    let (e, frac) = match cls {
        // Nearby magnitudes: sums and products round, cancellations happen.
        0..=54 => (bias - 6 + g.below(13) as u64, frac),
        // Subnormals (frac 0 would be ±0: make it the smallest).
        55..=66 => (0, frac.max(1)),
        // The smallest normals: sums and differences fall into the subnormals.
        67..=71 => (1 + g.below(2) as u64, frac),
        // Small integers: exact sums, ties of min/max.
        72..=79 => {
            let v = g.below(9) as f64 - 4.0;
            return to_val::<T>(v);
        }
        // ±0.
        80..=85 => (0, 0),
        // Near overflow: sums and products reach ±Inf.
        86..=90 => (emax - 1 - g.below(2) as u64, frac),
        // ±Inf.
        91..=95 => (emax, 0),
        // NaN, quiet, any payload.
        96..=97 => (emax, frac | (1 << (mant - 1))),
        // Anything finite.
        _ => (g.next() % emax, frac),
    };
    T::from_raw(sign | (e << mant) | frac)
}

fn to_val<T: Val>(v: f64) -> T {
    // Through the bit layout: every float type here holds small integers exactly.
    match T::BITS {
        16 if T::MANT == 10 => T::from_raw(f16::from_f64(v).to_bits() as u64),
        16 => T::from_raw(bf16::from_f64(v).to_bits() as u64),
        32 => T::from_raw((v as f32).to_bits() as u64),
        _ => T::from_raw(v.to_bits()),
    }
}

// -------------------------------------------------------------------------------------------------
// Comparison

/// Whether NaN results must match bit for bit. Sum, prod or avg of two NaNs returns one of them,
/// chosen by the CPU from the operands' positions, which the compiler may swap (it does in the
/// kernel's vectorised remainder loop for f16/bf16, so the NaN depends on where the element falls
/// in the call), so only "is NaN" is guaranteed there (`docs/determinism.md`); min and max
/// compare and select, and keep their NaN's bits. Everything else is compared by bits.
fn nan_bits(op: ReduceOp) -> bool {
    matches!(op, ReduceOp::Min | ReduceOp::Max)
}

/// The first element of `got` whose bits differ from `want`'s, described; with `any_nan`, a NaN
/// matches any NaN.
fn differ<T: Val>(got: &[T], want: &[T], any_nan: bool) -> Option<(usize, String)> {
    if got.len() != want.len() {
        return Some((0, format!("{} elements, want {}", got.len(), want.len())));
    }
    let bad = got
        .iter()
        .zip(want)
        .position(|(&a, &b)| a.raw() != b.raw() && !(any_nan && is_nan(a) && is_nan(b)))?;
    let w = (T::BITS / 4) as usize;
    let msg = format!(
        "element {bad}: got {:#0w$x} ({:?}), want {:#0w$x} ({:?}); {} differ",
        got[bad].raw(),
        got[bad],
        want[bad].raw(),
        want[bad],
        got.iter()
            .zip(want)
            .filter(|(&a, &b)| a.raw() != b.raw() && !(any_nan && is_nan(a) && is_nan(b)))
            .count(),
        w = w + 2
    );
    Some((bad, msg))
}

// -------------------------------------------------------------------------------------------------
// Buffers

/// A rank's buffer: ordinary memory, or allocated in the backend's shared heap (registered).
enum Store<T: Element> {
    Vec(Vec<T>),
    Shm(SharedBuffer<T>),
}

impl<T: Element> Deref for Store<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Store::Vec(v) => v,
            Store::Shm(s) => s,
        }
    }
}

impl<T: Element> DerefMut for Store<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            Store::Vec(v) => v,
            Store::Shm(s) => s,
        }
    }
}

fn store<T: Element>(c: &mut Communicator, shared: bool, data: &[T]) -> Result<Store<T>, String> {
    if !shared {
        return Ok(Store::Vec(data.to_vec()));
    }
    let mut b = c.alloc_shared::<T>(data.len()).map_err(|e| e.to_string())?;
    b.copy_from_slice(data);
    Ok(Store::Shm(b))
}

/// Random cut points of `0..len` into 1 to 6 pieces (empty pieces included).
fn pieces(g: &mut Rng, len: usize) -> Vec<(usize, usize)> {
    let k = 1 + g.below(6);
    let mut cuts: Vec<usize> = (1..k).map(|_| g.below(len + 1)).collect();
    cuts.push(0);
    cuts.push(len);
    cuts.sort();
    cuts.windows(2).map(|w| (w[0], w[1])).collect()
}

// -------------------------------------------------------------------------------------------------
// One case

/// What a case is: drawn from its seed alone, identically on every rank.
struct Case {
    seed: u64,
    dtype: usize,
    op: ReduceOp,
    len: usize,
    wild: bool,
    /// Buffers in the shared heap (registered)...
    shared: bool,
    /// ...except on this rank, whose buffers are ordinary.
    ordinary_on: Option<usize>,
}

const DTYPES: [&str; 10] = [
    "f32", "f64", "f16", "bf16", "i32", "i64", "u8", "i8", "u32", "u64",
];

fn esize(dtype: usize) -> usize {
    [4, 8, 2, 2, 4, 8, 1, 1, 4, 8][dtype]
}

/// Per-rank message sizes (bytes) where a path begins or ends under `cfg`, for `n` ranks.
fn thresholds(cfg: &ShmConfig, n: usize) -> Vec<usize> {
    let cfg = cfg.clone().normalized_for(n);
    let mut t = vec![
        cfg.fast_bytes,
        cfg.small_bytes,
        cfg.slot_bytes / (n - 1),
        cfg.slot_bytes,
        cfg.slot_bytes / (n - 1) * n,
        cfg.nt_bytes,
    ];
    if cfg.cma_bytes > 0 {
        t.push(cfg.cma_bytes);
    }
    t.retain(|&b| b > 0 && b <= 1 << 20);
    t
}

fn draw_case(seed: u64, cfg: &ShmConfig, n: usize, shared: bool, max_bytes: usize) -> Case {
    let mut g = Rng::new(seed);
    let dtype = g.below(DTYPES.len());
    let op = ReduceOp::ALL[g.below(5)];
    let esz = esize(dtype);
    let th = thresholds(cfg, n);
    let len = match g.below(10) {
        // Tiny: 0, 1, around the world size.
        0 => g.below(2 * n + 2),
        // Around a threshold of one rank's message (all-reduce) or block (reduce-scatter: the
        // message is n blocks).
        1..=6 => {
            let b = th[g.below(th.len())] * if g.pct(30) { n } else { 1 };
            let d = [0isize, 1, -1, 2, -3, 7, -17, 64][g.below(8)];
            ((b / esz) as isize + d).max(0) as usize
        }
        // Anything up to the case's maximum, often odd.
        _ => g.below(max_bytes / esz + 1) | g.below(2),
    };
    Case {
        seed,
        dtype,
        op,
        len,
        wild: g.pct(60),
        shared,
        // Now and then one rank's buffers are ordinary while the others' are shared: every rank
        // must then fall back to a path that does not read the peers' heaps.
        ordinary_on: (shared && g.pct(15)).then(|| g.below(n)),
    }
}

fn describe(c: &Case, n: usize) -> String {
    format!(
        "seed {:#x}: {} ranks, {} {}, {} elements{}{}{}",
        c.seed,
        n,
        DTYPES[c.dtype],
        c.op,
        c.len,
        if c.wild { ", specials" } else { "" },
        if c.shared { ", shared buffers" } else { "" },
        c.ordinary_on
            .map(|r| format!(" (ordinary on rank {r})"))
            .unwrap_or_default()
    )
}

fn run_case(comm: &mut Communicator, c: &Case) -> Result<Vec<String>, String> {
    match c.dtype {
        0 => case::<f32>(comm, c),
        1 => case::<f64>(comm, c),
        2 => case::<f16>(comm, c),
        3 => case::<bf16>(comm, c),
        4 => case::<i32>(comm, c),
        5 => case::<i64>(comm, c),
        6 => case::<u8>(comm, c),
        7 => case::<i8>(comm, c),
        8 => case::<u32>(comm, c),
        _ => case::<u64>(comm, c),
    }
}

/// Every way of reducing the case's data on this rank; returns one line per result that differs
/// from the reference.
fn case<T: Val>(comm: &mut Communicator, c: &Case) -> Result<Vec<String>, String> {
    let (n, me) = (comm.world_size(), comm.rank());
    let shared = c.shared && c.ordinary_on != Some(me);
    let op = c.op;
    // Every rank's input, drawn from the case's seed and the rank.
    let inputs: Vec<Vec<T>> = (0..n)
        .map(|r| {
            let mut g = Rng::new(c.seed ^ ((r as u64 + 1) << 48));
            (0..c.len).map(|_| draw::<T>(&mut g, c.wild)).collect()
        })
        .collect();
    let refs: Vec<&[T]> = inputs.iter().map(|v| &v[..]).collect();
    let want = reference::reduce(&refs, op);
    let mine = &inputs[me][..];
    // Choices every rank makes alike: roots, cut points.
    let mut g = Rng::new(c.seed ^ 0xC0FFEE);
    let mut bad = Vec::new();
    let e = |e: lockstep::comm::CommError| e.to_string();

    // all_reduce: one call, out of place and in place.
    let send = store(comm, shared, mine)?;
    let mut recv = store(comm, shared, &vec![T::default(); c.len])?;
    comm.all_reduce(&*send, &mut *recv, op).map_err(e)?;
    // The inputs at element `i` of the message, for the report.
    let there = |i: usize| {
        let v: Vec<String> = inputs
            .iter()
            .map(|x| format!("{:#x}", x[i].raw()))
            .collect();
        format!("; inputs there: [{}]", v.join(", "))
    };
    if let Some((i, d)) = differ(&recv, &want, !nan_bits(op)) {
        bad.push(format!("all_reduce: {d}{}", there(i)));
    }
    if let Some((_, d)) = differ(&send, mine, false) {
        bad.push(format!("all_reduce changed its input: {d}"));
    }
    // Every other result: the reference's bits, and the first call's bits, NaN included for min
    // and max; a NaN from sum, prod or avg may be another NaN (see `nan_bits`).
    let first = recv.to_vec();
    // `at`: where `got` starts in the message.
    let mut check = |what: &str, got: &[T], want: &[T], same: &[T], at: usize| {
        if let Some((i, d)) = differ(got, want, !nan_bits(op)) {
            bad.push(format!("{what}: {d}{}", there(at + i)));
        } else if let Some((i, d)) = differ(got, same, !nan_bits(op)) {
            bad.push(format!(
                "{what}, against the first all_reduce: {d}{}",
                there(at + i)
            ));
        }
    };
    let mut buf = store(comm, shared, mine)?;
    comm.all_reduce_in_place(&mut *buf, op).map_err(e)?;
    check("all_reduce in place", &buf, &want, &first, 0);

    // all_reduce in pieces, each piece in place or out of place.
    let mut buf = store(comm, shared, mine)?;
    let mut out = store(comm, shared, &vec![T::default(); c.len])?;
    let cuts = pieces(&mut g, c.len);
    for &(a, b) in &cuts {
        if g.pct(50) {
            comm.all_reduce_in_place(&mut buf[a..b], op).map_err(e)?;
            out[a..b].copy_from_slice(&buf[a..b]);
        } else {
            comm.all_reduce(&buf[a..b], &mut out[a..b], op).map_err(e)?;
        }
    }
    check(
        &format!("all_reduce in pieces {cuts:?}"),
        &out,
        &want,
        &first,
        0,
    );

    // reduce to a random root, out of place and in place.
    let root = g.below(n);
    let mut recv = store(
        comm,
        shared,
        &vec![T::default(); if me == root { c.len } else { 0 }],
    )?;
    comm.reduce(&*send, &mut *recv, op, root).map_err(e)?;
    if me == root {
        check(&format!("reduce to {root}"), &recv, &want, &first, 0);
    }
    let root = g.below(n);
    let mut buf = store(comm, shared, mine)?;
    comm.reduce_in_place(&mut *buf, op, root).map_err(e)?;
    check(
        &format!("reduce in place to {root}"),
        &buf,
        if me == root { &want } else { mine },
        if me == root { &first } else { mine },
        0,
    );

    // reduce_scatter of the first n × cb elements (blocks of cb), out of place, in place and in
    // pieces of each block.
    let cb = c.len / n;
    let block = &want[me * cb..(me + 1) * cb];
    let same = &first[me * cb..(me + 1) * cb];
    let send = store(comm, shared, &mine[..n * cb])?;
    let mut recv = store(comm, shared, &vec![T::default(); cb])?;
    comm.reduce_scatter(&*send, &mut *recv, op).map_err(e)?;
    check("reduce_scatter", &recv, block, same, me * cb);
    let mut buf = store(comm, shared, &mine[..n * cb])?;
    comm.reduce_scatter_in_place(&mut *buf, op).map_err(e)?;
    check(
        "reduce_scatter in place",
        &buf[me * cb..(me + 1) * cb],
        block,
        same,
        me * cb,
    );
    let cuts = pieces(&mut g, cb);
    let mut out = vec![T::default(); cb];
    for &(a, b) in &cuts {
        let part: Vec<T> = (0..n)
            .flat_map(|j| mine[j * cb + a..j * cb + b].iter().copied())
            .collect();
        let send = store(comm, shared, &part)?;
        let mut recv = store(comm, shared, &vec![T::default(); b - a])?;
        comm.reduce_scatter(&*send, &mut *recv, op).map_err(e)?;
        out[a..b].copy_from_slice(&recv);
    }
    check(
        &format!("reduce_scatter in pieces {cuts:?}"),
        &out,
        block,
        same,
        me * cb,
    );
    Ok(bad)
}

// -------------------------------------------------------------------------------------------------
// Configurations

fn base(n: usize) -> LaunchConfig {
    let mut cfg = LaunchConfig::new(n);
    cfg.shm.heap_bytes = 64 << 20;
    cfg.shm.timeout = Duration::from_secs(60);
    cfg
}

/// The paths, each favoured by one configuration (sizes around every threshold reach the others
/// too): `(name, config, shared buffers, largest message in bytes)`.
fn configs(n: usize) -> Vec<(&'static str, LaunchConfig, bool, usize)> {
    let mut v = Vec::new();
    // Fast entries, one-phase and a few staged rounds, cached staging.
    let mut c = base(n);
    c.shm.slot_bytes = 16 << 10;
    c.shm.small_bytes = 8 << 10;
    c.shm.single_copy = SingleCopyMode::Never;
    c.shm.stage = StageMode::Cached;
    v.push(("inline/one-phase/slots", c, false, 48 << 10));
    // Staged through small slots (many rounds), streaming stores into slots and outputs.
    let mut c = base(n);
    c.shm.fast_bytes = 0;
    c.shm.slot_bytes = 8192;
    c.shm.small_bytes = 1024;
    c.shm.nt_bytes = 2048;
    c.shm.single_copy = SingleCopyMode::Never;
    c.shm.stage = StageMode::Streaming;
    v.push(("slots, streaming", c, false, 40 << 10));
    // Single copy (cross-memory attach) wherever the sizes allow.
    let mut c = base(n);
    c.shm.fast_bytes = 0;
    c.shm.slot_bytes = 8192;
    c.shm.small_bytes = 1024;
    c.shm.cma_bytes = 4096;
    c.shm.nt_bytes = 4 << 20;
    c.shm.single_copy = SingleCopyMode::Always;
    v.push(("single-copy (CMA)", c, false, 300 << 10));
    // Zero-copy on shared (registered) buffers.
    let mut c = base(n);
    c.shm.slot_bytes = 8192;
    c.shm.small_bytes = 1024;
    c.shm.nt_bytes = 16 << 10;
    v.push(("zero-copy (alloc_shared)", c, true, 100 << 10));
    v.into_iter()
        .map(|(s, mut c, sh, m)| {
            c.shm = c.shm.normalized();
            (s, c, sh, m)
        })
        .collect()
}

fn base_seed() -> u64 {
    std::env::var("CANONICAL_SEED")
        .ok()
        .and_then(|s| {
            let s = s.trim();
            match s.strip_prefix("0x") {
                Some(h) => u64::from_str_radix(h, 16).ok(),
                None => s.parse().ok(),
            }
        })
        .unwrap_or(0x5EED_CA70)
}

/// Run `cases` cases on `n` ranks under `cfg`; every rank checks its own results.
fn run_cases(
    name: &str,
    cfg: &LaunchConfig,
    shared: bool,
    max_bytes: usize,
    cases: usize,
    salt: u64,
) -> Result<(), String> {
    let n = cfg.nprocs;
    let seed0 = base_seed() ^ salt.wrapping_mul(0x1000_0000_01B3);
    let shm = cfg.shm.clone();
    let out = launch(cfg, |mut ctx: RankContext| -> RankResult<Vec<String>> {
        let mut bad = Vec::new();
        for k in 0..cases {
            let c = draw_case(seed0.wrapping_add(k as u64), &shm, n, shared, max_bytes);
            for line in run_case(&mut ctx.comm, &c)? {
                bad.push(format!("rank {}: {}: {line}", ctx.rank, describe(&c, n)));
            }
        }
        Ok(bad)
    })
    .map_err(|e| format!("{name}, {n} ranks: {e}"))?;
    let bad: Vec<String> = out.into_iter().flatten().collect();
    if bad.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{name}, {n} ranks: {} results differ from reference::reduce (CANONICAL_SEED={:#x} replays):\n{}",
            bad.len(),
            base_seed(),
            bad.iter().take(12).cloned().collect::<Vec<_>>().join("\n")
        ))
    }
}

/// Which path an all-reduce of `bytes` per rank takes under `cfg` (the backend's size rules, for
/// the coverage tally: `src/shm/path.rs`).
fn path_of(cfg: &ShmConfig, n: usize, bytes: usize, shared: bool) -> usize {
    let cfg = cfg.clone().normalized_for(n);
    let direct = cfg.single_copy == SingleCopyMode::Always
        && cfg.cma_bytes > 0
        && bytes >= cfg.cma_bytes
        && bytes > cfg.small_bytes
        && bytes < cfg.nt_bytes;
    if bytes <= cfg.fast_bytes {
        0
    } else if bytes <= cfg.small_bytes {
        1
    } else if shared {
        2
    } else if direct {
        3
    } else {
        4
    }
}

const PATHS: [&str; 5] = ["fast", "one-phase", "zero-copy", "single-copy", "slots"];

/// Cases per configuration and world size.
const CASES: usize = 120;

fn t_paths() -> Result<(), String> {
    println!("  CANONICAL_SEED={:#x}", base_seed());
    // One-call all-reduces per path, by the size rules (the pieces and the reduce-scatters spread
    // over the paths further).
    let mut tally = [0usize; 5];
    for n in [2, 3, 4] {
        for (i, (name, cfg, shared, max)) in configs(n).into_iter().enumerate() {
            let salt = (n * 16 + i) as u64;
            run_cases(name, &cfg, shared, max, CASES, salt)?;
            let seed0 = base_seed() ^ salt.wrapping_mul(0x1000_0000_01B3);
            for k in 0..CASES {
                let c = draw_case(seed0.wrapping_add(k as u64), &cfg.shm, n, shared, max);
                let all_shared = shared && c.ordinary_on.is_none();
                tally[path_of(&cfg.shm, n, c.len * esize(c.dtype), all_shared)] += 1;
            }
        }
    }
    let t: Vec<String> = PATHS
        .iter()
        .zip(tally)
        .map(|(p, k)| format!("{p} {k}"))
        .collect();
    println!(
        "  cases by path of the one-call all-reduce: {}",
        t.join(", ")
    );
    if tally.contains(&0) {
        return Err(format!("a path got no case: {}", t.join(", ")));
    }
    Ok(())
}

/// The same paths forced through the `LOCKSTEP_SHM_*` variables instead of `ShmConfig` fields.
fn t_env() -> Result<(), String> {
    let vars = [
        ("LOCKSTEP_SHM_SLOT_BYTES", "12288"),
        ("LOCKSTEP_SHM_SMALL_BYTES", "2048"),
        ("LOCKSTEP_SHM_CMA_BYTES", "8192"),
        ("LOCKSTEP_SHM_NT_BYTES", "65536"),
        ("LOCKSTEP_SHM_SINGLE_COPY", "always"),
        ("LOCKSTEP_SHM_STAGE", "streaming"),
    ];
    // Single-threaded (harness = false): nobody else reads the environment meanwhile.
    for (k, v) in vars {
        std::env::set_var(k, v);
    }
    let res = (|| {
        for n in [2, 3] {
            let mut cfg = LaunchConfig::new(n);
            cfg.shm.heap_bytes = 64 << 20;
            let c = &cfg.shm;
            if c.cma_bytes != 8192 || c.single_copy != SingleCopyMode::Always {
                return Err(format!("the variables were not read: {c:?}"));
            }
            run_cases(
                "LOCKSTEP_SHM_* variables",
                &cfg,
                false,
                200 << 10,
                CASES,
                99 + n as u64,
            )?;
        }
        Ok(())
    })();
    for (k, _) in vars {
        std::env::remove_var(k);
    }
    res
}

/// One 64 MiB all-reduce equals 64 all-reduces of 1 MiB over the same data, and both equal the
/// reference, with today's defaults (the paths and tuning a user gets).
fn t_one_call_equals_many() -> Result<(), String> {
    const LEN: usize = (64 << 20) / 4;
    let n = 2;
    let mut cfg = LaunchConfig::new(n);
    cfg.shm = ShmConfig::default().normalized();
    let out = launch(&cfg, |mut ctx: RankContext| -> RankResult<Vec<String>> {
        let me = ctx.rank;
        let gen = |r: usize| -> Vec<f32> {
            let mut g = Rng::new(0xB16 + r as u64);
            (0..LEN).map(|_| draw::<f32>(&mut g, false)).collect()
        };
        let inputs: Vec<Vec<f32>> = (0..n).map(gen).collect();
        let want = reference::reduce(&[&inputs[0][..], &inputs[1]], ReduceOp::Sum);
        let mut bad = Vec::new();
        let mut one = vec![0f32; LEN];
        ctx.comm
            .all_reduce(&inputs[me][..], &mut one[..], ReduceOp::Sum)?;
        let mut many = vec![0f32; LEN];
        let step = LEN / 64;
        for (s, o) in inputs[me].chunks(step).zip(many.chunks_mut(step)) {
            ctx.comm.all_reduce(s, o, ReduceOp::Sum)?;
        }
        let mut inplace = inputs[me].clone();
        ctx.comm
            .all_reduce_in_place(&mut inplace[..], ReduceOp::Sum)?;
        for (what, got) in [
            ("one call", &one),
            ("64 calls", &many),
            ("in place", &inplace),
        ] {
            if let Some((_, d)) = differ(&got[..], &want, false) {
                bad.push(format!("rank {me}, {what}: {d}"));
            }
        }
        Ok(bad)
    })
    .map_err(|e| e.to_string())?;
    let bad: Vec<String> = out.into_iter().flatten().collect();
    if bad.is_empty() {
        Ok(())
    } else {
        Err(bad.join("\n"))
    }
}

fn main() -> std::process::ExitCode {
    runner::run(&[
        ("canonical_every_path", t_paths),
        ("canonical_env_forced", t_env),
        ("canonical_64mib_one_call_equals_64", t_one_call_equals_many),
    ])
}
