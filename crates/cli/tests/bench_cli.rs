//! `lockstep bench` against the built binary: nccl-tests' flags and size suffixes, the
//! out-of-place and in-place columns, the root column, the summary lines, CSV and JSON output,
//! barrier as latency only, and real zero-byte calls. Sequential (`harness = false`): every run
//! forks ranks.

#[path = "common/cli.rs"]
mod cli;
#[path = "../../../tests/common/mod.rs"]
mod common;

use cli::{launch, Run};
use common::show;

use std::process::{Command, Output, Stdio};

use common::check;

const BIN: &str = env!("CARGO_BIN_EXE_lockstep");

fn bench(args: &[&str]) -> Result<Output, String> {
    bench_with(&[], args)
}

/// `lockstep bench ARGS` with `env` added to the environment.
fn bench_with(env: &[(&str, &str)], args: &[&str]) -> Result<Output, String> {
    Command::new(BIN)
        .arg("bench")
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .run()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The table's data rows, split into columns.
fn rows(s: &str) -> Vec<Vec<String>> {
    s.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().map(String::from).collect())
        .collect()
}

/// The value after `# Avg bus bandwidth    :`.
fn avg_busbw(s: &str) -> Option<f64> {
    s.lines()
        .find_map(|l| l.strip_prefix("# Avg bus bandwidth    :"))
        .and_then(|v| v.trim().parse().ok())
}

fn json(o: &Output) -> Result<serde_json::Value, String> {
    serde_json::from_str(&stdout(o)).map_err(|e| format!("not JSON: {e}\n{}", show(o)))
}

/// `bench(args)` with `--format json`: the run and the JSON it printed.
fn bench_json(args: &[&str]) -> Result<(Output, serde_json::Value), String> {
    let o = bench(&[args, &["--format", "json"]].concat())?;
    let v = json(&o)?;
    Ok((o, v))
}

fn nccl_tests_flags_and_columns() -> Result<(), String> {
    // -b/-e with suffixes, -f, -n, -w: 8, 64, 512, 4096, 32768 (the next, 256K, is past -e 64K).
    let o = bench(&[
        "--nprocs", "2", "-b", "8", "-e", "64K", "-f", "8", "-n", "3", "-w", "1",
    ])?;
    let s = stdout(&o);
    check(o.status.success(), "bench succeeds", show(&o))?;
    let r = rows(&s);
    let sizes: Vec<&str> = r.iter().map(|c| c[0].as_str()).collect();
    check(
        sizes == ["8", "64", "512", "4096", "32768"],
        "-b 8 -e 64K -f 8",
        &s,
    )?;
    check(
        r.iter()
            .all(|c| c.len() == 13 && c[4] == "-1" && c[8] == "0" && c[12] == "0"),
        "13 columns, root -1, nothing wrong",
        &s,
    )?;
    check(
        r.iter()
            .all(|c| c[1].parse::<usize>().ok() == c[0].parse::<usize>().ok().map(|b| b / 4)),
        "count = bytes / 4 (f32)",
        &s,
    )?;
    for h in [
        "out-of-place",
        "in-place",
        "#wrong",
        "algbw",
        "busbw",
        "redop",
        "root",
        "minBytes 8 maxBytes 65536 step: 8(factor)",
        "iters: 3",
    ] {
        check(s.contains(h), &format!("header shows {h:?}"), &s)?;
    }
    check(
        s.contains("# Out of bounds values : 0 OK"),
        "wrong-elements line",
        &s,
    )?;
    let avg = avg_busbw(&s).ok_or_else(|| format!("no Avg bus bandwidth line\n{s}"))?;
    // The average of every busbw cell, out-of-place and in-place (within the printed rounding).
    let cells: Vec<f64> = r
        .iter()
        .flat_map(|c| [c[7].parse::<f64>().unwrap(), c[11].parse::<f64>().unwrap()])
        .collect();
    let mean = cells.iter().sum::<f64>() / cells.len() as f64;
    check(
        avg > 0.0 && (avg - mean).abs() <= 0.01,
        "Avg bus bandwidth is the mean of the busbw columns",
        format!("{avg} vs {mean}\n{s}"),
    )?;
    // Old flags still work (.ci/run uses them), and the long names of -b/-e take suffixes too.
    let o = bench(&[
        "--nprocs",
        "2",
        "--min-bytes",
        "1K",
        "--max-bytes",
        "1K",
        "--iters",
        "2",
        "--warmup",
        "0",
    ])?;
    check(
        o.status.success() && rows(&stdout(&o)).len() == 1 && rows(&stdout(&o))[0][0] == "1024",
        "--min-bytes 1K",
        show(&o),
    )?;
    let o = bench(&[
        "--nprocs",
        "4",
        "--op",
        "all_gather",
        "--sizes",
        "4096,1M",
        "--buffers",
        "shared",
        "-n",
        "2",
    ])?;
    check(
        o.status.success() && rows(&stdout(&o)).len() == 2 && rows(&stdout(&o))[1][0] == "1048576",
        ".ci/run's shape",
        show(&o),
    )?;
    // Bad sizes and factors are refused with a message.
    let o = bench(&["-b", "1.5M"])?;
    check(
        o.status.code() == Some(2) && show(&o).contains("is not a size"),
        "-b 1.5M refused",
        show(&o),
    )?;
    let o = bench(&["-b", "8", "-e", "64", "-f", "1"])?;
    check(
        o.status.code() == Some(1) && show(&o).contains("step factor must be at least 2"),
        "-f 1 refused",
        show(&o),
    )?;
    let o = bench(&["-b", "64", "-e", "8"])?;
    check(
        o.status.code() == Some(1) && show(&o).contains("is larger than -e"),
        "-b > -e refused",
        show(&o),
    )?;
    // -c 0: not verified, N/A in #wrong.
    let o = bench(&["--nprocs", "2", "--sizes", "64", "-c", "0", "-n", "2"])?;
    let r = rows(&stdout(&o));
    check(
        o.status.success() && r.len() == 1 && r[0][8] == "N/A" && r[0][12] == "N/A",
        "-c 0",
        show(&o),
    )
}

fn nccl_tests_names() -> Result<(), String> {
    // nccl-tests' type names time the same type as lockstep's.
    for (theirs, ours) in [
        ("float", "f32"),
        ("half", "f16"),
        ("bfloat16", "bf16"),
        ("double", "f64"),
        ("int8", "i8"),
        ("uint64", "u64"),
    ] {
        let o = bench(&[
            "--nprocs", "2", "-d", theirs, "--sizes", "64", "-n", "2", "-w", "1",
        ])?;
        let r = rows(&stdout(&o));
        check(
            o.status.success() && r.len() == 1 && r[0][2] == ours,
            &format!("-d {theirs} times {ours}"),
            show(&o),
        )?;
    }
    // nccl-tests' `-d all` and `-o all`: every type, every operator, one block of rows each
    // (combination-major), every row verified.
    let o = bench(&[
        "--nprocs", "2", "-d", "all", "-o", "all", "--sizes", "64,4K", "-n", "2", "-w", "1",
    ])?;
    let r = rows(&stdout(&o));
    let combos: Vec<(String, String)> = r
        .iter()
        .step_by(2)
        .map(|c| (c[2].clone(), c[3].clone()))
        .collect();
    check(
        o.status.success()
            && r.len() == 10 * 5 * 2
            && combos.first() == Some(&("i8".into(), "sum".into()))
            && combos.last() == Some(&("bf16".into(), "avg".into()))
            && combos.contains(&("f16".into(), "prod".into()))
            && r.iter().all(|c| c[8] == "0" && c[12] == "0"),
        "-d all -o all: 10 types x 5 operators x 2 sizes, all verified",
        show(&o),
    )?;
    // A collective that does not reduce times each type once, whatever -o says.
    let (o, v) = bench_json(&[
        "--nprocs",
        "2",
        "--op",
        "all_gather",
        "-d",
        "all",
        "-o",
        "all",
        "--sizes",
        "64",
        "-n",
        "2",
        "-w",
        "1",
    ])?;
    check(
        o.status.success()
            && v["type"] == "all"
            && v["redop"] == "none"
            && v["rows"].as_array().map(|a| a.len()) == Some(10)
            && v["rows"][9]["type"] == "bf16",
        "all_gather -d all: one row per type",
        show(&o),
    )?;
    let o = bench(&["--op", "all_to_all_v"])?;
    check(
        o.status.code() == Some(2)
            && String::from_utf8_lossy(&o.stderr).contains("all_to_all_v takes per-rank counts"),
        "all_to_all_v is refused at parse time",
        show(&o),
    )
}

fn rooted_zero_byte_and_in_place() -> Result<(), String> {
    // A root column for rooted ops; a real zero-byte call; in-place columns where there is a form.
    let o = bench(&[
        "--nprocs",
        "3",
        "--op",
        "broadcast",
        "-r",
        "2",
        "--sizes",
        "0,4K",
        "-n",
        "3",
        "-w",
        "1",
    ])?;
    let s = stdout(&o);
    let r = rows(&s);
    check(o.status.success() && r.len() == 2, "two rows", show(&o))?;
    check(
        r[0][0] == "0" && r[0][1] == "0" && r[0][4] == "2",
        "size 0 stays 0 (count 0), root 2",
        &s,
    )?;
    check(
        r[0][5].parse::<f64>().is_ok_and(|t| t > 0.0),
        "the zero-byte call took time: it ran",
        &s,
    )?;
    check(
        r[1][0] == "4096" && r[1][4] == "2" && r[1][9] != "N/A",
        "4K with root and in-place",
        &s,
    )?;
    let (_, v) = bench_json(&[
        "--nprocs",
        "2",
        "--op",
        "all_reduce",
        "--sizes",
        "0",
        "-n",
        "3",
    ])?;
    let row = &v["rows"][0];
    check(
        row["size_bytes"] == 0
            && row["count"] == 0
            && row["out_of_place"]["time_us"]
                .as_f64()
                .is_some_and(|t| t > 0.0)
            && row["in_place"]["wrong"] == 0,
        "zero-byte all_reduce, both forms",
        &v,
    )?;
    // Every op with an in-place form verifies it; the others show N/A.
    for (op, in_place) in [
        ("reduce", true),
        ("all_gather", true),
        ("reduce_scatter", true),
        ("gather", false),
        ("scatter", false),
        ("all_to_all", false),
        ("pingpong", false),
    ] {
        let (o, v) = bench_json(&[
            "--nprocs", "2", "--op", op, "--sizes", "64,4096", "-n", "3", "-w", "1",
        ])?;
        let rows = v["rows"].as_array().cloned().unwrap_or_default();
        let ok = o.status.success()
            && v["wrong"] == 0
            && rows.len() == 2
            && rows
                .iter()
                .all(|r| r["out_of_place"]["wrong"] == 0 && (r["in_place"].is_null() != in_place));
        check(ok, &format!("{op}: in-place {in_place}"), show(&o))?;
        let rooted = matches!(op, "reduce" | "gather" | "scatter");
        check(
            rows.iter().all(|r| r["root"].is_null() != rooted),
            &format!("{op}: root column"),
            show(&o),
        )?;
    }
    // In place with a reduction that is not a sum, and a small type.
    let o = bench(&[
        "--nprocs",
        "3",
        "--op",
        "all_reduce",
        "-o",
        "max",
        "-d",
        "bf16",
        "--sizes",
        "6K",
        "-n",
        "5",
    ])?;
    check(
        o.status.success() && stdout(&o).contains("# Out of bounds values : 0 OK"),
        "max on bf16",
        show(&o),
    )
}

fn barrier_csv_json() -> Result<(), String> {
    let o = bench(&["--nprocs", "2", "--op", "barrier", "-n", "20"])?;
    let s = stdout(&o);
    let r = rows(&s);
    check(
        o.status.success()
            && r.len() == 1
            && r[0].len() == 1
            && r[0][0].parse::<f64>().is_ok_and(|t| t > 0.0),
        "barrier: one latency",
        &s,
    )?;
    check(
        !s.contains("busbw")
            && !s.contains("size")
            && !s.contains("count")
            && s.contains("# Avg latency"),
        "no size columns",
        &s,
    )?;
    let (_, v) = bench_json(&["--nprocs", "2", "--op", "barrier", "-n", "5"])?;
    check(
        v["op"] == "barrier" && v["rows"].as_array().map(Vec::len) == Some(1),
        "barrier JSON",
        &v,
    )?;
    // CSV: a header and one line per size, every line with the same number of fields.
    let o = bench(&[
        "--nprocs", "2", "--sizes", "8,1K,64K", "--format", "csv", "-n", "2",
    ])?;
    let s = stdout(&o);
    let lines: Vec<Vec<&str>> = s.lines().map(|l| l.split(',').collect()).collect();
    check(
        o.status.success() && lines.len() == 4 && lines.iter().all(|l| l.len() == lines[0].len()),
        "CSV shape",
        &s,
    )?;
    check(
        lines[0][..4] == ["op", "ranks", "size_bytes", "count"]
            && lines[3][2] == "65536"
            && lines[3][0] == "all_reduce",
        "CSV cells",
        &s,
    )?;
    let i = lines[0]
        .iter()
        .position(|h| *h == "ip_wrong")
        .ok_or("no ip_wrong column")?;
    check(
        lines[1..].iter().all(|l| l[i] == "0"),
        "in-place verified in CSV",
        &s,
    )?;
    // JSON: one object with the rows and the summary.
    let (_, v) = bench_json(&["--nprocs", "2", "-b", "1K", "-e", "4K", "-n", "2"])?;
    let rows = v["rows"].as_array().cloned().unwrap_or_default();
    let sizes: Vec<u64> = rows
        .iter()
        .filter_map(|r| r["size_bytes"].as_u64())
        .collect();
    check(
        sizes == [1024, 2048, 4096]
            && v["wrong"] == 0
            && v["avg_busbw_gbs"].as_f64().is_some_and(|b| b > 0.0),
        "JSON rows and summary",
        &v,
    )
}

/// nccl-tests' statistic by default (each rank's mean, averaged over the ranks), named in the
/// header; `--stat median` and `-a 0..3` choose others; `-a 4` is a usage error.
fn statistics() -> Result<(), String> {
    let o = bench(&["--nprocs", "2", "--sizes", "8,4K", "-n", "5", "-w", "1"])?;
    check(
        o.status.success()
            && stdout(&o).contains(
                "# time: mean per call over the timed iterations, averaged over the ranks (-a 1)",
            ),
        "the default statistic is nccl-tests' mean averaged over ranks, named in the header",
        show(&o),
    )?;
    let (o, v) = bench_json(&[
        "--nprocs", "2", "--sizes", "8", "-n", "5", "-w", "1", "--stat", "median", "-a", "3",
    ])?;
    check(
        o.status.success() && v["stat"] == "median" && v["average"] == 3 && v["wrong"] == 0,
        "--stat median -a 3 in the JSON",
        show(&o),
    )?;
    let o = bench(&["--nprocs", "2", "--sizes", "8", "-n", "5", "-a", "0"])?;
    check(
        o.status.success()
            && !stdout(&o).contains("median")
            && stdout(&o).contains("rank 0's (-a 0)"),
        "-a 0: rank 0's time",
        show(&o),
    )?;
    let o = bench(&["--nprocs", "2", "-a", "4"])?;
    check(
        o.status.code() == Some(2) && String::from_utf8_lossy(&o.stderr).contains("-a"),
        "-a 4 is refused",
        show(&o),
    )
}

/// nccl-tests' per-rank lines: one per rank, with its pid and CPUs, after the title.
fn rank_lines() -> Result<(), String> {
    let o = bench(&["--nprocs", "3", "--sizes", "8", "-n", "2", "-w", "1"])?;
    let s = stdout(&o);
    let lines: Vec<&str> = s.lines().filter(|l| l.starts_with("#  Rank")).collect();
    let pids: Vec<&str> = lines
        .iter()
        .filter_map(|l| l.split_whitespace().nth(4))
        .collect();
    let mut distinct = pids.clone();
    distinct.sort_unstable();
    distinct.dedup();
    check(
        o.status.success()
            && s.contains("# Using devices")
            && lines.len() == 3
            && (0..3).all(|r| lines[r].starts_with(&format!("#  Rank {r:>3} Pid")))
            && lines.iter().all(|l| l.contains(" cpus "))
            && distinct.len() == 3,
        "one line per rank with its own pid and CPUs",
        show(&o),
    )?;
    let (o, v) = bench_json(&["--nprocs", "2", "--sizes", "8", "-n", "2"])?;
    check(
        v["rank_info"].as_array().map(|a| a.len()) == Some(2) && v["rank_info"][1]["rank"] == 1,
        "rank_info in the JSON",
        show(&o),
    )
}

/// Under a launcher every rank runs `lockstep bench` and joins the job: one table (rank 0's),
/// for the job's ranks; --nprocs may only repeat their number.
fn under_a_launcher() -> Result<(), String> {
    let bench_launched = |n: &str, extra: &[&str]| {
        Command::new(BIN)
            .args(launch(n))
            .args(["--no-prefix", BIN, "bench"])
            .args(extra)
            .stdin(Stdio::null())
            .run()
    };
    let o = bench_launched("3", &["--sizes", "8,64K", "-n", "3", "-w", "1"])?;
    let s = stdout(&o);
    check(
        o.status.success()
            && s.matches("# lockstep bench: 3 ranks").count() == 1
            && s.lines().filter(|l| l.starts_with("#  Rank")).count() == 3
            && rows(&s).len() == 2
            && rows(&s).iter().all(|c| c[8] == "0" && c[12] == "0"),
        "3 launched ranks: one table of 2 verified rows, 3 rank lines",
        show(&o),
    )?;
    let o = bench_launched("2", &["--nprocs", "4", "--sizes", "8"])?;
    check(
        !o.status.success()
            && String::from_utf8_lossy(&o.stderr)
                .contains("--nprocs 4 but the lockstep job has 2 ranks"),
        "--nprocs disagreeing with the job is refused",
        show(&o),
    )
}

/// Timed in-place reductions reduce their own outputs again: sums and products must not grow
/// to infinity, which the finite check (`LOCKSTEP_CHECK_FINITE=1`) would refuse, so the check's
/// cost can be timed in place too.
fn in_place_stays_finite() -> Result<(), String> {
    for (op, redop) in [
        ("all_reduce", "sum"),
        ("all_reduce", "prod"),
        ("reduce_scatter", "sum"),
        ("reduce", "prod"),
    ] {
        let o = bench_with(
            &[("LOCKSTEP_CHECK_FINITE", "1")],
            &[
                "--op", op, "-o", redop, "--sizes", "8,4K", "-n", "300", "-w", "1",
            ],
        )?;
        let s = stdout(&o);
        let r = rows(&s);
        check(
            o.status.success() && r.len() == 2,
            &format!("{op} {redop}: 300 timed calls in place pass the finite check"),
            show(&o),
        )?;
        check(
            r.iter().all(|row| row[8] == "0" && row[12] == "0"),
            &format!("{op} {redop}: both columns verified, nothing wrong"),
            &s,
        )?;
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    common::run(&[
        ("nccl_tests_flags_and_columns", nccl_tests_flags_and_columns),
        ("nccl_tests_names", nccl_tests_names),
        (
            "rooted_zero_byte_and_in_place",
            rooted_zero_byte_and_in_place,
        ),
        ("barrier_csv_json", barrier_csv_json),
        ("statistics", statistics),
        ("rank_lines", rank_lines),
        ("under_a_launcher", under_a_launcher),
        ("in_place_stays_finite", in_place_stays_finite),
    ])
}
