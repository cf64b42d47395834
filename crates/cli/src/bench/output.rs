//! What `lockstep bench` prints: the rows as nccl-tests' table, CSV or JSON.

use lockstep::comm::{CollKind, Dtype, ReduceOp};

use super::measure::{RankInfo, Report};
use super::options::{Average, BenchOptions, Buffers, Format, Stat};

/// One timed variant (out-of-place or in-place) of one size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    /// Time per call in microseconds: each rank's mean or median (`--stat`), combined over the
    /// ranks as `-a` says.
    pub time_us: f64,
    /// 99th percentile of the time per call in microseconds (max over ranks): how far the slow
    /// calls stray. `None` where the calls were timed as a batch (the mean on device buffers).
    pub p99_us: Option<f64>,
    /// Algorithm bandwidth, GB/s.
    pub algbw: f64,
    /// Bus bandwidth, GB/s.
    pub busbw: f64,
    /// Wrong elements found by verification (all ranks); `None` when not verified.
    pub wrong: Option<u64>,
}

/// One measured row.
#[derive(Clone, Debug)]
pub struct Row {
    /// Size in bytes, as nccl-tests counts it.
    pub bytes: usize,
    /// Element count, as nccl-tests counts it.
    pub count: usize,
    /// Element type.
    pub dtype: Dtype,
    /// Reduction operator, for a collective that reduces.
    pub redop: Option<ReduceOp>,
    /// Root of a rooted collective.
    pub root: Option<usize>,
    /// The out-of-place call (separate send and receive buffers).
    pub out_of_place: Timing,
    /// The in-place call, for collectives that have one.
    pub in_place: Option<Timing>,
}

/// Wrong elements over every row and variant.
pub fn wrong_total(rows: &[Row]) -> u64 {
    rows.iter()
        .flat_map(|r| std::iter::once(r.out_of_place).chain(r.in_place))
        .filter_map(|t| t.wrong)
        .sum()
}

/// Average bus bandwidth over every row and variant (nccl-tests' `# Avg bus bandwidth`).
pub fn avg_busbw(rows: &[Row]) -> f64 {
    let v: Vec<f64> = rows
        .iter()
        .flat_map(|r| std::iter::once(r.out_of_place).chain(r.in_place))
        .map(|t| t.busbw)
        .collect();
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// The first comment line: ranks, operation, buffers, backend.
fn title(a: &BenchOptions) -> String {
    format!(
        "lockstep bench: {} ranks, {} on {} buffers, backend {}",
        a.nprocs,
        if a.op == CollKind::Send {
            "pingpong (send/recv between ranks 0 and 1, one-way time)"
        } else {
            a.op.name()
        },
        match (a.device.as_str(), a.buffers) {
            ("cuda", _) => "device",
            (_, Buffers::Ordinary) => "ordinary",
            (_, Buffers::Shared) => "shared",
        },
        if a.device == "cuda" {
            "nccl (or staged through host memory: each rank's line names its own)"
        } else {
            "shm"
        }
    )
}

/// What the time column holds, for the header.
fn statistic(a: &BenchOptions) -> String {
    let per_rank = match a.stat {
        Stat::Median => "median",
        _ => "mean",
    };
    let over = match a.average {
        Average::Rank0 => "rank 0's",
        Average::Min => "the fastest rank's",
        Average::Max => "the slowest rank's",
        _ => "averaged over the ranks",
    };
    format!(
        "{per_rank} per call over the timed iterations, {over} (-a {})",
        a.average.code()
    )
}

fn redop_name(r: &Row) -> &'static str {
    r.redop.map_or("none", |o| o.name())
}

/// The type of the run: one name, or `all` (`-d all`).
fn dtype_name(a: &BenchOptions) -> String {
    if a.every_dtype {
        "all".into()
    } else {
        a.dtype.to_string()
    }
}

/// The operator of the run: one name, `all` (`-o all`), or `none` for a collective that does not
/// reduce.
fn run_redop_name(a: &BenchOptions) -> &'static str {
    match (a.op.has_op(), a.every_redop) {
        (false, _) => "none",
        (true, true) => "all",
        (true, false) => a.redop.name(),
    }
}

/// nccl-tests' device lines: one per rank, with its host, pid and CPUs or GPU.
fn rank_lines(ranks: &[RankInfo]) -> String {
    let mut s = String::from("# Using devices\n");
    for r in ranks {
        s += &format!(
            "#  Rank {:>3} Pid {:>7} on {} {}\n",
            r.rank, r.pid, r.host, r.device
        );
    }
    s
}

fn wrong_text(w: Option<u64>) -> String {
    w.map(|w| w.to_string()).unwrap_or_else(|| "N/A".into())
}

/// The run in `format`.
pub fn render(a: &BenchOptions, report: &Report, format: Format) -> String {
    match format {
        Format::Text => {
            let t = table(a, &report.rows);
            // The ranks' lines after the title line, as nccl-tests prints them.
            let (title, rest) = t.split_once('\n').unwrap_or((&t, ""));
            format!("{title}\n{}#\n{rest}", rank_lines(&report.ranks))
        }
        Format::Csv => csv(a, &report.rows),
        Format::Json => json(a, report),
    }
}

/// The rows as nccl-tests prints them: out-of-place and in-place columns side by side, then the
/// wrong elements and the average bus bandwidth; a barrier as its latency alone.
pub fn table(a: &BenchOptions, rows: &[Row]) -> String {
    let mut s = format!("# {}\n", title(a));
    let iters = if a.iters > 0 {
        a.iters.to_string()
    } else {
        "auto".into()
    };
    let wrong = wrong_total(rows);
    let ok = if wrong == 0 { "OK" } else { "FAILED" };
    if a.op == CollKind::Barrier {
        s += &format!(
            "# warmup iters: {} iters: {iters} validation: {}\n#\n",
            a.warmup, a.check as u8
        );
        s += &format!("# {:>10}\n# {:>10}\n", "time", "(us)");
        for r in rows {
            s += &format!("  {:>10.2}\n", r.out_of_place.time_us);
        }
        let avg =
            rows.iter().map(|r| r.out_of_place.time_us).sum::<f64>() / rows.len().max(1) as f64;
        s += &format!("# Avg latency          : {avg:.2} us\n");
        return s;
    }
    let range = if a.sizes.is_empty() {
        format!(
            "minBytes {} maxBytes {} step: {}(factor)",
            a.min_bytes, a.max_bytes, a.factor
        )
    } else {
        format!(
            "sizes {}",
            a.sizes
                .iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(",")
        )
    };
    s += &format!(
        "# {range} warmup iters: {} iters: {iters} validation: {}\n# time: {}\n#\n",
        a.warmup,
        a.check as u8,
        statistic(a)
    );
    s += &format!(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:^31}  {:^31}\n",
        "", "", "", "", "", "out-of-place", "in-place"
    );
    s += &format!(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}\n",
        "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong"
    );
    s += &format!(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}\n",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", ""
    );
    let cell = |t: Option<Timing>| match t {
        Some(t) => format!(
            "  {:>7}  {:>6.2}  {:>6.2}  {:>6}",
            time_text(t.time_us),
            t.algbw,
            t.busbw,
            wrong_text(t.wrong)
        ),
        None => format!("  {:>7}  {:>6}  {:>6}  {:>6}", "N/A", "N/A", "N/A", "N/A"),
    };
    for r in rows {
        let root = r.root.map(|x| x as i64).unwrap_or(-1);
        s += &format!(
            "  {:>10}  {:>12}  {:>8}  {:>6}  {:>6}",
            r.bytes,
            r.count,
            r.dtype.to_string(),
            redop_name(r),
            root
        );
        s += &cell(Some(r.out_of_place));
        s += &cell(r.in_place);
        s += "\n";
    }
    s += &format!("# Out of bounds values : {wrong} {ok}\n");
    s += &format!("# Avg bus bandwidth    : {:.4} \n#\n", avg_busbw(rows));
    s
}

/// nccl-tests' time cell: two decimals below 10 000 µs, one above, none from 1 s.
fn time_text(us: f64) -> String {
    if us < 1e4 {
        format!("{us:.2}")
    } else if us < 1e6 {
        format!("{us:.1}")
    } else {
        format!("{us:.0}")
    }
}

/// The rows as CSV: a header line, then one line per size; empty cells where there is no
/// in-place form or no verification.
pub fn csv(a: &BenchOptions, rows: &[Row]) -> String {
    let mut s = String::from(
        "op,ranks,size_bytes,count,type,redop,root,oop_time_us,oop_algbw_gbs,oop_busbw_gbs,oop_wrong,ip_time_us,ip_algbw_gbs,ip_busbw_gbs,ip_wrong,oop_p99_us,ip_p99_us\n",
    );
    let cells = |t: Option<Timing>| match t {
        Some(t) => format!(
            "{:.3},{:.4},{:.4},{}",
            t.time_us,
            t.algbw,
            t.busbw,
            t.wrong.map(|w| w.to_string()).unwrap_or_default()
        ),
        None => ",,,".into(),
    };
    let p99 = |t: Option<Timing>| {
        t.and_then(|t| t.p99_us)
            .map(|p| format!("{p:.3}"))
            .unwrap_or_default()
    };
    let op = if a.op == CollKind::Send {
        "pingpong"
    } else {
        a.op.name()
    };
    for r in rows {
        let root = r.root.map(|x| x.to_string()).unwrap_or_default();
        s += &format!(
            "{op},{},{},{},{},{},{root},{},{},{},{}\n",
            a.nprocs,
            r.bytes,
            r.count,
            r.dtype,
            redop_name(r),
            cells(Some(r.out_of_place)),
            cells(r.in_place),
            p99(Some(r.out_of_place)),
            p99(r.in_place)
        );
    }
    s
}

/// A finite number as JSON (`null` otherwise: JSON has no infinities).
/// A figure as JSON: a number, or null when it is not finite (JSON has no NaN or infinity).
fn json_num(v: f64) -> serde_json::Value {
    serde_json::Number::from_f64(v).map_or(serde_json::Value::Null, serde_json::Value::Number)
}

/// The run as one JSON object on one line: settings, rows, wrong elements, average bus bandwidth.
pub fn json(a: &BenchOptions, report: &Report) -> String {
    let rows = &report.rows[..];
    use serde_json::{json, Value};
    let timing = |t: Option<Timing>| match t {
        Some(t) => json!({
            "time_us": json_num(t.time_us),
            "p99_us": t.p99_us.map(json_num),
            "algbw_gbs": json_num(t.algbw),
            "busbw_gbs": json_num(t.busbw),
            "wrong": t.wrong,
        }),
        None => Value::Null,
    };
    let items: Vec<Value> = rows
        .iter()
        .map(|r| {
            json!({
                "size_bytes": r.bytes,
                "count": r.count,
                "type": r.dtype.to_string(),
                "redop": redop_name(r),
                "root": r.root,
                "out_of_place": timing(Some(r.out_of_place)),
                "in_place": timing(r.in_place),
            })
        })
        .collect();
    let op = if a.op == CollKind::Send {
        "pingpong"
    } else {
        a.op.name()
    };
    let doc = json!({
        "op": op,
        "ranks": a.nprocs,
        "type": dtype_name(a),
        "redop": run_redop_name(a),
        "rank_info": report.ranks.iter().map(|r| json!({
            "rank": r.rank,
            "host": r.host,
            "pid": r.pid,
            "device": r.device,
        })).collect::<Vec<_>>(),
        "device": if a.device == "cuda" { "cuda" } else { "cpu" },
        "warmup": a.warmup,
        "iters": a.iters,
        "check": a.check,
        "stat": match a.stat {
            Stat::Median => "median",
            _ => "mean",
        },
        "average": a.average.code(),
        "rows": items,
        "wrong": wrong_total(rows),
        "avg_busbw_gbs": json_num(avg_busbw(rows)),
    });
    format!("{doc}\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendering() {
        let t = Timing {
            time_us: 10.0,
            p99_us: Some(12.0),
            algbw: 1.0,
            busbw: 2.0,
            wrong: Some(0),
        };
        let rows = vec![
            Row {
                bytes: 0,
                count: 0,
                dtype: Dtype::F32,
                redop: None,
                root: Some(1),
                out_of_place: Timing {
                    algbw: 0.0,
                    busbw: 0.0,
                    ..t
                },
                in_place: None,
            },
            Row {
                bytes: 1024,
                count: 256,
                dtype: Dtype::F32,
                redop: None,
                root: Some(1),
                out_of_place: t,
                in_place: Some(Timing {
                    busbw: 4.0,
                    wrong: None,
                    ..t
                }),
            },
        ];
        let a = BenchOptions {
            op: CollKind::Broadcast,
            root: 1,
            ..Default::default()
        };
        assert_eq!(avg_busbw(&rows), 2.0);
        let text = table(&a, &rows);
        assert!(
            text.contains("out-of-place") && text.contains("in-place") && text.contains("root"),
            "{text}"
        );
        assert!(text.contains("# Avg bus bandwidth    : 2.0000"), "{text}");
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with("1024"))
            .unwrap();
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            cols,
            [
                "1024", "256", "f32", "none", "1", "10.00", "1.00", "2.00", "0", "10.00", "1.00",
                "4.00", "N/A"
            ],
            "{line}"
        );
        let csv = csv(&a, &rows);
        assert_eq!(csv.lines().count(), 3);
        assert_eq!(
            csv.lines().nth(1).unwrap().split(',').count(),
            csv.lines().next().unwrap().split(',').count()
        );
        assert!(
            csv.lines().nth(2).unwrap().ends_with(",12.000,12.000"),
            "{csv}"
        );
        let report = Report {
            ranks: vec![RankInfo {
                rank: 0,
                host: "h".into(),
                pid: 7,
                device: "cpus 0".into(),
            }],
            rows: rows.clone(),
            print: true,
            rank: 0,
        };
        let j = json(&a, &report);
        let v: serde_json::Value = serde_json::from_str(&j).expect("valid JSON");
        assert!(
            j.starts_with("{\"op\":\"broadcast\"")
                && j.ends_with("}\n")
                && v["rows"][0]["in_place"].is_null()
                && v["avg_busbw_gbs"] == 2.0
                && v["stat"] == "mean"
                && v["average"] == 1
                && v["rank_info"][0]["pid"] == 7
                && v["rows"][1]["type"] == "f32",
            "{j}"
        );
        let t = &v["rows"][1]["out_of_place"];
        assert!(t["time_us"] == 10.0 && t["p99_us"] == 12.0, "{j}");
        let b = BenchOptions {
            op: CollKind::Barrier,
            ..Default::default()
        };
        let text = table(&b, &rows[..1]);
        assert!(
            !text.contains("busbw") && !text.contains("size") && text.contains("Avg latency"),
            "{text}"
        );
    }
}
