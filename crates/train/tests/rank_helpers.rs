//! The Accelerate-style helpers on `RankContext`, across 3 forked ranks (harness = false: the
//! launcher forks): who is main, print and save on the main process only, main-process-first
//! ordering (global and per node), `wait_for_everyone`, `set_seed` (agreement checked, every
//! generator of the engine moved), `gather_for_metrics` (padding dropped, epoch order, per batch)
//! and scalar `reduce`.

#[path = "../../../tests/common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use lockstep::launch::{launch, LaunchConfig, RankContext};
use lockstep::{CommError, ReduceOp};
use lockstep_train::sampler::DistributedSampler;
use lockstep_train::trainer::TrainConfig;

const WORLD: usize = 3;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "lockstep-rank-helpers-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

fn run<R, F>(f: F) -> Result<Vec<R>, String>
where
    R: serde::Serialize + serde::de::DeserializeOwned,
    F: FnOnce(RankContext) -> lockstep::RankResult<R>,
{
    launch(&LaunchConfig::new(WORLD), f).map_err(|e| e.to_string())
}

fn who_is_main_and_print() -> Result<(), String> {
    let res = run(|ctx: RankContext| {
        let mut out = Vec::new();
        ctx.print_to(&mut out, format_args!("hello from rank {}", ctx.rank))?;
        Ok((
            ctx.is_main_process(),
            ctx.is_local_main_process(),
            String::from_utf8(out)?,
        ))
    })?;
    let want = vec![
        (true, true, "hello from rank 0\n".to_string()),
        (false, false, String::new()),
        (false, false, String::new()),
    ];
    if res != want {
        return Err(format!("got {res:?}\nwant {want:?}"));
    }
    Ok(())
}

fn save_on_main_only_and_atomic() -> Result<(), String> {
    let d = tmp("save");
    let path = d.join("metrics.json");
    let res = run(|mut ctx: RankContext| {
        let wrote = ctx.save(&path, format!("written by rank {}", ctx.rank))?;
        ctx.wait_for_everyone()?;
        // After the barrier every rank sees the complete file of the main process.
        Ok((wrote, std::fs::read_to_string(&path)?))
    })?;
    let names: Vec<String> = std::fs::read_dir(&d)
        .map_err(|e| e.to_string())?
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let _ = std::fs::remove_dir_all(&d);
    let wrote: Vec<bool> = res.iter().map(|r| r.0).collect();
    if wrote != [true, false, false] {
        return Err(format!("save returned {wrote:?}; only rank 0 writes"));
    }
    if res.iter().any(|r| r.1 != "written by rank 0") {
        return Err(format!(
            "ranks read {:?}",
            res.iter().map(|r| &r.1).collect::<Vec<_>>()
        ));
    }
    if names != ["metrics.json"] {
        return Err(format!(
            "the directory holds {names:?}: temporary files were left"
        ));
    }
    // A path that cannot be saved is an error naming it (on the main process).
    let bad = run(|ctx: RankContext| {
        Ok(ctx
            .save("/nonexistent-dir/x.bin", b"x")
            .map_err(|e| e.to_string()))
    })?;
    match &bad[0] {
        Err(m) if m.contains("/nonexistent-dir/x.bin") && m.contains("directory exists") => {}
        other => return Err(format!("rank 0 saving into a missing directory: {other:?}")),
    }
    if bad[1..].iter().any(|r| r != &Ok(false)) {
        return Err(format!("other ranks: {:?}", &bad[1..]));
    }
    Ok(())
}

/// `f` of the ranks that go first has finished (its file exists) when the others' `f` starts,
/// and every `f` has finished when the helper returns on any rank.
fn ordering(local: bool) -> Result<(), String> {
    let d = tmp(if local { "local-first" } else { "main-first" });
    let res = run(|ctx: RankContext| {
        // Pretend to be 2 nodes for the per-node variant: ranks 0 and 2 lead a node each.
        let local_rank = if local { ctx.rank % 2 } else { ctx.local_rank };
        let mut ctx = RankContext { local_rank, ..ctx };
        let leads = if local {
            ctx.is_local_main_process()
        } else {
            ctx.is_main_process()
        };
        let me = ctx.rank;
        let dir = d.clone();
        let body = move || -> std::io::Result<Vec<String>> {
            if leads {
                // Slow on purpose: the others must wait for it, not race it.
                std::thread::sleep(Duration::from_millis(300));
            }
            let mut seen: Vec<String> = std::fs::read_dir(&dir)?
                .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
                .collect::<Result<_, _>>()?;
            seen.sort();
            std::fs::write(dir.join(format!("done-{me}")), b"")?;
            Ok(seen)
        };
        let seen = if local {
            ctx.local_main_process_first(body)?
        } else {
            ctx.main_process_first(body)?
        }?;
        let after = std::fs::read_dir(&d)?.count();
        Ok((leads, seen, after))
    })?;
    let _ = std::fs::remove_dir_all(&d);
    let leaders: Vec<usize> = (0..WORLD).filter(|&r| res[r].0).collect();
    let leader_files: Vec<String> = leaders.iter().map(|l| format!("done-{l}")).collect();
    for (r, (leads, seen, after)) in res.iter().enumerate() {
        // Leaders run together (per node), before everyone else.
        if *leads && !seen.iter().all(|n| leader_files.contains(n)) {
            return Err(format!("leader rank {r} ran after others: it saw {seen:?}"));
        }
        if !*leads && !leader_files.iter().all(|w| seen.contains(w)) {
            return Err(format!(
                "rank {r} ran before the leaders {leaders:?} finished: it saw {seen:?}"
            ));
        }
        if *after != WORLD {
            return Err(format!(
                "rank {r} returned before every rank's f finished ({after} of {WORLD} files)"
            ));
        }
    }
    Ok(())
}

fn main_process_first() -> Result<(), String> {
    ordering(false)
}

fn local_main_process_first() -> Result<(), String> {
    ordering(true)
}

fn wait_for_everyone() -> Result<(), String> {
    let res = run(|mut ctx: RankContext| {
        let t = Instant::now();
        std::thread::sleep(Duration::from_millis(150 * ctx.rank as u64));
        ctx.wait_for_everyone()?;
        Ok(t.elapsed().as_secs_f64())
    })?;
    if let Some((r, s)) = res.iter().enumerate().find(|(_, &s)| s < 0.29) {
        return Err(format!(
            "rank {r} left the barrier after {s:.3} s, before the slowest rank arrived (0.3 s)"
        ));
    }
    Ok(())
}

fn set_seed_moves_every_generator_and_is_checked() -> Result<(), String> {
    let res = run(|mut ctx: RankContext| {
        let before = TrainConfig::default().seed;
        lockstep_train::set_seed(&mut ctx.comm, 1234)?;
        let after = TrainConfig::default().seed;
        // The data order follows the seed: the same on every rank, different from the default.
        let order = |seed| {
            let mut s = DistributedSampler::new(30, 1, 0, true, seed);
            let mut v = Vec::new();
            s.indices(0, &mut v);
            v
        };
        let moved = order(after) != order(before);
        // Different seeds on different ranks: refused everywhere, nothing changed.
        let e = lockstep_train::set_seed(&mut ctx.comm, ctx.rank as u64)
            .expect_err("different seeds must be refused");
        Ok((
            before,
            after,
            moved,
            TrainConfig::default().seed,
            e.to_string(),
        ))
    })?;
    for (r, (before, after, moved, kept, e)) in res.iter().enumerate() {
        if *before != lockstep_train::rng::DEFAULT_SEED || *after != 1234 || !moved || *kept != 1234
        {
            return Err(format!("rank {r}: default seed {before} -> {after} (order moved: {moved}), after the refused call {kept}"));
        }
        if !(e.contains("different seeds") && e.contains("from 0 to 2")) {
            return Err(format!("rank {r}: {e}"));
        }
    }
    Ok(())
}

fn gather_for_metrics_drops_padding() -> Result<(), String> {
    for len in [10usize, 9, 11, 1, 2] {
        let res = run(move |mut ctx: RankContext| {
            // Whole shard, unshuffled: exactly the dataset's ids in order.
            let mut s = DistributedSampler::new(len, ctx.world_size, ctx.rank, false, 0);
            let mut idx = Vec::new();
            s.indices(0, &mut idx);
            let ids: Vec<u64> = idx.iter().map(|&i| i as u64).collect();
            let whole = ctx.gather_for_metrics(&ids, 1, len, 0)?;
            // Two values per sample, batch by batch (batches of 2), shuffled: the epoch's order.
            let mut sh = DistributedSampler::new(len, ctx.world_size, ctx.rank, true, 7);
            let mut sidx = Vec::new();
            sh.indices(3, &mut sidx);
            let mut batched = Vec::new();
            for (b, chunk) in sidx.chunks(2).enumerate() {
                let vals: Vec<i64> = chunk
                    .iter()
                    .flat_map(|&i| [i as i64, -(i as i64)])
                    .collect();
                batched.extend(ctx.gather_for_metrics(&vals, 2, len, 2 * b)?);
            }
            Ok((whole, batched))
        })?;
        let mut full = DistributedSampler::new(len, 1, 0, true, 7);
        let mut perm = Vec::new();
        full.indices(3, &mut perm);
        let want_batched: Vec<i64> = perm.iter().flat_map(|&i| [i as i64, -(i as i64)]).collect();
        for (r, (whole, batched)) in res.iter().enumerate() {
            if *whole != (0..len as u64).collect::<Vec<_>>() {
                return Err(format!(
                    "len {len}, rank {r}: whole shard gathered {whole:?}"
                ));
            }
            if *batched != want_batched {
                return Err(format!(
                    "len {len}, rank {r}: batches gathered {batched:?}, want {want_batched:?}"
                ));
            }
        }
    }
    // Bad arguments are refused on the rank that passed them, and its peers fail too instead
    // of waiting.
    let res = run(|mut ctx: RankContext| {
        let item = if ctx.rank == 1 { 0 } else { 1 };
        Ok(ctx
            .gather_for_metrics(&[1.0f32, 2.0], item, 6, 0)
            .map_err(|e| e.to_string()))
    })?;
    match &res[1] {
        Err(m) if m.contains("item_len is 0") => {}
        other => return Err(format!("rank 1 passed item_len 0: {other:?}")),
    }
    if res.iter().any(|r| r.is_ok()) {
        return Err(format!("every rank must fail: {res:?}"));
    }
    Ok(())
}

fn reduce_scalars() -> Result<(), String> {
    let res = run(|mut ctx: RankContext| {
        let r = ctx.rank;
        Ok((
            ctx.reduce(r as u64 + 1, ReduceOp::Sum)?,
            ctx.reduce(r as f64 * 0.5, ReduceOp::Max)?,
            ctx.reduce(r as f32 + 1.0, ReduceOp::Avg)?,
            ctx.reduce(10i64 - r as i64, ReduceOp::Min)?,
        ))
    })?;
    if res.iter().any(|&v| v != (6, 1.0, 2.0, 8)) {
        return Err(format!("got {res:?}, want (6, 1.0, 2.0, 8) on every rank"));
    }
    // A communicator error surfaces as an error value.
    let e: Result<Vec<String>, String> = run(|mut ctx: RankContext| {
        let r = if ctx.rank == 2 {
            ctx.reduce(1u64, ReduceOp::Sum).map(|_| ())
        } else {
            ctx.reduce(1u32, ReduceOp::Sum).map(|_| ())
        };
        Ok(match r {
            Err(CommError::Mismatch { .. }) => "mismatch".to_string(),
            other => format!("{other:?}"),
        })
    });
    match e {
        Ok(v) if v.iter().all(|s| s == "mismatch") => Ok(()),
        other => Err(format!(
            "a dtype disagreement must be a mismatch on every rank: {other:?}"
        )),
    }
}

fn main() -> std::process::ExitCode {
    common::run(&[
        ("who_is_main_and_print", who_is_main_and_print),
        ("save_on_main_only_and_atomic", save_on_main_only_and_atomic),
        ("main_process_first", main_process_first),
        ("local_main_process_first", local_main_process_first),
        ("wait_for_everyone", wait_for_everyone),
        (
            "set_seed_moves_every_generator_and_is_checked",
            set_seed_moves_every_generator_and_is_checked,
        ),
        (
            "gather_for_metrics_drops_padding",
            gather_for_metrics_drops_padding,
        ),
        ("reduce_scalars", reduce_scalars),
    ])
}
