//! What rank 0 of `train-cnn` shows and writes: a progress bar on a terminal, per-step lines
//! (`epoch 1/4 step 100/469 loss 0.4384 2345 img/s`, the reference PyTorch script's shape) off one, one line or JSON
//! object per epoch, the peak-RSS summary of every rank, the `--metrics` JSON-lines file and the
//! `--plot` SVG.
//!
//! The bar is drawn only in text mode, on stdout, the stream of the epoch lines: one stream keeps
//! the order of redraws and lines wherever the output is forwarded. Each redraw is
//! `ESC[2K <bar> \r` (clear the line, draw, back to its start), so `lockstep launch`, which
//! forwards a segment at every `\r`, shows it at once; every line printed while a bar is up
//! starts with `ESC[2K`, wiping the bar, which the next redraw puts back below. A terminal is
//! stdout itself, or the launcher's word for it: `LOCKSTEP_CONSOLE_TTY=1` (`lockstep launch` sets
//! it when its console is a terminal, and `train-cnn` for the ranks it forks, whose stdout is a
//! pipe to it).
//!
//! `--metrics FILE` holds JSON lines: `{"kind":"step",...}` per reported step,
//! `{"kind":"epoch",...}` per epoch and a final `{"kind":"summary",...}`. It is rewritten whole
//! and atomically (temporary file, fsync, rename, fsync of the directory) after every epoch and
//! at the end: a reader never sees a torn line, and a run that dies keeps the epochs it finished.
//! Appending instead would leave a half-written last line on a crash and could not replace a
//! file from an earlier run atomically; the file stays small (one line per step), so rewriting
//! costs nothing measurable.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lockstep::types::write_atomic;
use lockstep_train::trainer::{EpochReport, Observer};
use serde_json::{json, Map, Value};

/// Steps between per-step lines off a terminal when `--log-every` is not given (the reference PyTorch script's).
pub const DEFAULT_LOG_EVERY: usize = 100;
/// Least time between two redraws of the bar.
const REDRAW: Duration = Duration::from_millis(100);
/// Characters of the bar itself.
const BAR_WIDTH: usize = 30;
/// Clear the whole line (ANSI CSI 2 K).
const CLEAR: &str = "\x1b[2K";

/// How rank 0 reports.
#[derive(Clone, Debug, Default)]
pub struct ConsoleOptions {
    /// JSON objects on stdout instead of text (no bar).
    pub json: bool,
    /// Per-step lines every this many steps (`--log-every`); `None` picks: off a terminal in
    /// text mode every [`DEFAULT_LOG_EVERY`], otherwise none.
    pub log_every: Option<usize>,
    /// Draw the progress bar (text mode on a terminal, see [`bar_wanted`]).
    pub bar: bool,
    /// Write the metrics JSON lines here.
    pub metrics: Option<PathBuf>,
    /// Draw loss and accuracy per epoch here (SVG).
    pub plot: Option<PathBuf>,
}

/// Whether text output goes to a terminal: stdout is one, or the launcher says its console is
/// (`LOCKSTEP_CONSOLE_TTY=1`). A malformed value is an error naming it.
pub fn console_is_terminal() -> Result<bool, String> {
    let said = lockstep::types::env::CONSOLE_TTY
        .flag()
        .map_err(|e| e.to_string())?;
    Ok(std::io::stdout().is_terminal() || said == Some(true))
}

/// The bar is for people: text mode on a terminal only.
pub fn bar_wanted(json: bool) -> Result<bool, String> {
    Ok(!json && console_is_terminal()?)
}

/// Rank 0's console and files; an [`Observer`] of the training loop.
pub struct Console {
    opts: ConsoleOptions,
    log_every: Option<usize>,
    epoch: u64,
    epochs: u64,
    steps: usize,
    /// Bucket (`step / log_every`) of the last per-step line, so engines that report every few
    /// steps (the CUDA one) still log once per bucket.
    logged: usize,
    bar_up: bool,
    last_draw: Option<Instant>,
    records: Vec<String>,
    history: Vec<EpochReport>,
    /// First error writing the metrics file or the plot: reported at the end, training goes on.
    file_error: Option<String>,
}

impl Console {
    /// A console with these options.
    pub fn new(opts: ConsoleOptions) -> Console {
        let log_every = match opts.log_every {
            Some(n) => Some(n),
            None if !opts.json && !opts.bar => Some(DEFAULT_LOG_EVERY),
            None => None,
        };
        Console {
            opts,
            log_every,
            epoch: 0,
            epochs: 0,
            steps: 0,
            logged: 0,
            bar_up: false,
            last_draw: None,
            records: Vec::new(),
            history: Vec::new(),
            file_error: None,
        }
    }

    /// Write `text` (one or more whole lines) to stdout, wiping the bar first if one is up.
    fn line(&mut self, text: &str) {
        let mut out = std::io::stdout().lock();
        // A closed stdout must not stop the training: the result still reaches the files.
        let _ = if self.bar_up {
            write!(out, "{CLEAR}{text}")
        } else {
            write!(out, "{text}")
        };
        let _ = out.flush();
        self.bar_up = false;
        self.last_draw = None;
    }

    fn draw_bar(&mut self, step: usize, loss: f32, images_per_s: f64) {
        let now = Instant::now();
        if step < self.steps && self.last_draw.is_some_and(|t| now - t < REDRAW) {
            return;
        }
        self.last_draw = Some(now);
        let bar = render_bar(
            self.epoch,
            self.epochs,
            step,
            self.steps,
            Some((loss, images_per_s)),
        );
        let mut out = std::io::stdout().lock();
        let _ = write!(out, "{CLEAR}{bar}\r");
        let _ = out.flush();
        self.bar_up = true;
    }

    /// Rewrite the metrics file and the plot with everything so far.
    fn write_files(&mut self) {
        if let Some(path) = self.opts.metrics.clone() {
            let mut text = self.records.join("\n");
            text.push('\n');
            if let Err(e) = write_atomic(&path, text.as_bytes(), 0o644) {
                self.note_file_error(format!("--metrics {}: {e}", path.display()));
            }
        }
        if let Some(path) = self.opts.plot.clone() {
            if let Err(e) = super::plot::write_svg(&path, &self.history) {
                self.note_file_error(format!("--plot {}: {e}", path.display()));
            }
        }
    }

    fn note_file_error(&mut self, e: String) {
        if self.file_error.is_none() {
            tracing::warn!("{e}; training goes on, the run will end with an error");
            self.file_error = Some(e);
        }
    }

    /// The end of the run: the peak RSS of every rank (KiB, rank order) on the console and in the
    /// metrics file, the files written a last time. An error writing them is returned now.
    pub fn finish(&mut self, rss_kib: &[u64]) -> Result<(), String> {
        let mib: Vec<f64> = rss_kib.iter().map(|k| *k as f64 / 1024.0).collect();
        let values: Vec<Value> = mib.iter().map(|m| num(*m, 1)).collect();
        let text = if self.opts.json {
            format!("{}\n", json!({ "peak_rss_mib": values }))
        } else {
            let t: Vec<String> = mib.iter().map(|m| format!("{m:.1}")).collect();
            format!("peak RSS per rank: {} MiB\n", t.join(", "))
        };
        self.line(&text);
        self.records
            .push(json!({ "kind": "summary", "peak_rss_mib": values }).to_string());
        self.write_files();
        match self.file_error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// `epoch 1/4 [=====>     ] 120/469 loss 0.4384 2345 img/s`.
pub fn render_bar(
    epoch: u64,
    epochs: u64,
    pos: usize,
    len: usize,
    stats: Option<(f32, f64)>,
) -> String {
    let done = (pos.min(len) * BAR_WIDTH)
        .checked_div(len)
        .unwrap_or(BAR_WIDTH);
    let mut bar = "=".repeat(done);
    if done < BAR_WIDTH {
        bar.push('>');
        bar.push_str(&" ".repeat(BAR_WIDTH - done - 1));
    }
    let mut s = format!("epoch {epoch}/{epochs} [{bar}] {pos}/{len}");
    if let Some((loss, ips)) = stats {
        s.push_str(&format!(" loss {loss:.4} {ips:.0} img/s"));
    }
    s
}

/// `epoch 1/4 step 100/469 loss 0.4384 2345 img/s`: the reference PyTorch script's per-step line.
pub fn step_line(
    epoch: u64,
    epochs: u64,
    step: usize,
    steps: usize,
    loss: f32,
    images_per_s: f64,
) -> String {
    format!("epoch {epoch}/{epochs} step {step}/{steps} loss {loss:.4} {images_per_s:.0} img/s")
}

/// An epoch's fields, after `kind` when given (the metrics file's records have one).
fn epoch_json(kind: Option<&str>, r: &EpochReport) -> Value {
    let mut m = Map::new();
    if let Some(k) = kind {
        m.insert("kind".into(), k.into());
    }
    m.insert("epoch".into(), r.epoch.into());
    m.insert("epochs".into(), r.epochs.into());
    m.insert("train_loss".into(), num(r.train_loss, 6));
    m.insert("test_acc".into(), num(r.test_acc, 4));
    m.insert("test_count".into(), r.test_count.into());
    m.insert("epoch_s".into(), num(r.epoch_s, 3));
    m.insert("images_per_s".into(), num(r.images_per_s, 1));
    m.insert("steps".into(), r.steps.into());
    // fp16's loss scaling adds its skipped steps and the scale (other precisions scale nothing).
    if let Some(scale) = r.loss_scale {
        m.insert("skipped_steps".into(), r.skipped_steps.into());
        m.insert("loss_scale".into(), num(scale as f64, 1));
    }
    Value::Object(m)
}

/// A JSON number rounded to `decimals` places, or `null` for a value that is not finite (JSON has
/// no NaN or infinity).
fn num(x: f64, decimals: i32) -> Value {
    let p = 10f64.powi(decimals);
    serde_json::Number::from_f64((x * p).round() / p).map_or(Value::Null, Value::Number)
}

impl Observer for Console {
    fn epoch_start(&mut self, epoch: u64, epochs: u64, steps: usize) {
        (self.epoch, self.epochs, self.steps, self.logged) = (epoch, epochs, steps, 0);
        if self.opts.bar {
            self.last_draw = None;
            let bar = render_bar(epoch, epochs, 0, steps, None);
            let mut out = std::io::stdout().lock();
            let _ = write!(out, "{CLEAR}{bar}\r");
            let _ = out.flush();
            self.bar_up = true;
        }
    }

    fn step(&mut self, step: usize, loss: f32, images_per_s: f64) {
        let (e, es, n) = (self.epoch, self.epochs, self.steps);
        if self.opts.metrics.is_some() {
            self.records.push(
                json!({
                    "kind": "step",
                    "epoch": e,
                    "step": step,
                    "steps": n,
                    "loss": num(loss as f64, 6),
                    "images_per_s": num(images_per_s, 1),
                })
                .to_string(),
            );
        }
        if let Some(every) = self.log_every {
            let bucket = step / every;
            if bucket > self.logged {
                self.logged = bucket;
                let text = if self.opts.json {
                    let v = json!({
                        "step": step,
                        "steps": n,
                        "epoch": e,
                        "epochs": es,
                        "loss": num(loss as f64, 6),
                        "images_per_s": num(images_per_s, 1),
                    });
                    format!("{v}\n")
                } else {
                    format!("{}\n", step_line(e, es, step, n, loss, images_per_s))
                };
                self.line(&text);
            }
        }
        if self.opts.bar {
            self.draw_bar(step, loss, images_per_s);
        }
    }

    fn epoch_end(&mut self, r: &EpochReport) {
        let text = if self.opts.json {
            format!("{}\n", epoch_json(None, r))
        } else {
            let amp = match r.loss_scale {
                Some(scale) => format!("  fp16: {} skipped, loss scale {scale}", r.skipped_steps),
                None => String::new(),
            };
            format!(
                "epoch {}/{}  loss {:.4}  test acc {:.2} %  {:.1} s  ({:.0} img/s){amp}\n",
                r.epoch, r.epochs, r.train_loss, r.test_acc, r.epoch_s, r.images_per_s
            )
        };
        self.line(&text);
        self.records.push(epoch_json(Some("epoch"), r).to_string());
        self.history.push(r.clone());
        self.write_files();
    }
}

/// Check a `--metrics` or `--plot` path before any training: its directory exists and the path is
/// not a directory. (Writability shows at the first write, after epoch 1; the run then ends with
/// an error naming the file.)
pub fn check_output_path(flag: &str, path: &Path) -> Result<(), String> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if path.file_name().is_none() {
        return Err(format!(
            "{flag} {}: the path names no file; pass a file path",
            path.display()
        ));
    }
    if !dir.is_dir() {
        return Err(format!(
            "{flag} {}: directory {} does not exist; create it first",
            path.display(),
            dir.display()
        ));
    }
    if path.is_dir() {
        return Err(format!(
            "{flag} {}: is a directory; pass a file path",
            path.display()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bar_and_step_line_shapes() {
        assert_eq!(
            render_bar(1, 4, 0, 10, None),
            format!("epoch 1/4 [>{}] 0/10", " ".repeat(29))
        );
        assert_eq!(
            render_bar(2, 4, 5, 10, Some((0.43843, 2345.4))),
            format!(
                "epoch 2/4 [{}>{}] 5/10 loss 0.4384 2345 img/s",
                "=".repeat(15),
                " ".repeat(14)
            )
        );
        assert_eq!(
            render_bar(4, 4, 10, 10, None),
            format!("epoch 4/4 [{}] 10/10", "=".repeat(30))
        );
        assert_eq!(
            step_line(1, 4, 100, 469, 0.43843934, 2345.6),
            "epoch 1/4 step 100/469 loss 0.4384 2346 img/s"
        );
        assert_eq!(num(f64::NAN, 2), Value::Null);
        assert_eq!(num(0.43843934, 4), json!(0.4384));
    }
}
