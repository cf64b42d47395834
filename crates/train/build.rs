//! Build script: embed `kernels/*.cu` and `kernels/*.cuh` into the crate, with the signature of
//! every entry point read from the sources themselves.
//!
//! Writes `OUT_DIR/kernels.rs`, included by `src/device/kernels/sources.rs`:
//! - `KERNEL_HEADERS`: every `kernels/*.cuh` as `(file name, source)`, NVRTC's in-memory headers;
//! - one `static` `cuda::KernelSource` per `kernels/*.cu` (named after the file: `conv2d.cu` ->
//!   `CONV2D`) whose `functions` table is parsed from the file's `extern "C" __global__`
//!   declarations, so the table the launch builder checks against cannot drift from the source;
//! - `ALL_SOURCES`: every one of them, in file-name order.
//!
//! Kernels are compiled at run time by NVRTC, so the build needs neither nvcc nor a CUDA toolkit.
//! A declaration the parser cannot map to a parameter kind fails the build, naming the file, the
//! kernel and the parameter.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Files in `dir` with extension `ext`, sorted for a reproducible table.
fn files_with_ext(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.extension().map(|x| x == ext).unwrap_or(false))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The source with `//` and `/* */` comments blanked out (newlines kept, so positions still map to
/// lines), so a commented-out declaration is not taken for an entry point. The kernels hold no
/// string literals, so no quoting rules are needed.
fn strip_comments(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                out.push(b' ');
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let end = src[i + 2..]
                .find("*/")
                .map(|e| i + 2 + e + 2)
                .unwrap_or(b.len());
            out.extend(
                b[i..end]
                    .iter()
                    .map(|&c| if c == b'\n' { b'\n' } else { b' ' }),
            );
            i = end;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).expect("comments were replaced byte for byte")
}

/// The `ArgKind` expression for one C parameter type (whitespace-normalised, `*` attached, without
/// the parameter name and `__restrict__`), or `None` for a type lockstep cannot pass.
fn arg_kind(ty: &str) -> Option<String> {
    let (konst, base) = match ty.strip_prefix("const ") {
        Some(rest) => (true, rest),
        None => (false, ty),
    };
    let elem = |c: &str| -> Option<&'static str> {
        Some(match c {
            "float" => "F32",
            "double" => "F64",
            "int" => "I32",
            "long long" => "I64",
            "unsigned char" => "U8",
            "signed char" => "I8",
            "bf16_t" => "BF16",
            "f16_t" => "F16",
            // A table of `struct BucketEntry` (data.cu): three 8-byte words per entry, uploaded
            // as i64 (its Rust twin is `train::device::kernels::BucketEntry`).
            "BucketEntry" => "I64",
            _ => return None,
        })
    };
    match base.strip_suffix('*') {
        Some(pointee) => {
            let d = elem(pointee.trim_end())?;
            Some(if konst {
                format!("ArgKind::Ptr(Dtype::{d})")
            } else {
                format!("ArgKind::PtrMut(Dtype::{d})")
            })
        }
        // Scalars are passed by value; a `const int` parameter is still an `int`.
        None if !matches!(base, "bf16_t" | "f16_t" | "BucketEntry") => {
            elem(base).map(|d| format!("ArgKind::Scalar(Dtype::{d})"))
        }
        None => None,
    }
}

/// One parsed entry point: its name and the `ArgKind` expression of each parameter.
struct Entry {
    name: String,
    args: Vec<String>,
}

/// Every `extern "C" __global__` declaration of `src` (file `file`), in source order.
fn entry_points(file: &str, src: &str) -> Result<Vec<Entry>, String> {
    let code = strip_comments(src);
    let mut out = Vec::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("extern \"C\"") {
        let line = code[..code.len() - rest.len() + at].matches('\n').count() + 1;
        let here = |what: &str| format!("kernels/{file}:{line}: {what}");
        rest = rest[at + "extern \"C\"".len()..].trim_start();
        let Some(r) = rest.strip_prefix("__global__") else {
            return Err(here("`extern \"C\"` not followed by `__global__` (only kernels may be extern \"C\" here)"));
        };
        let Some(r) = r.trim_start().strip_prefix("void") else {
            return Err(here("a kernel must return void"));
        };
        let mut r = r.trim_start();
        if let Some(lb) = r.strip_prefix("__launch_bounds__") {
            let close = lb
                .find(')')
                .ok_or_else(|| here("unterminated __launch_bounds__("))?;
            r = lb[close + 1..].trim_start();
        }
        let name_len = r
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(r.len());
        let name = &r[..name_len];
        if name.is_empty() {
            return Err(here("no kernel name after `extern \"C\" __global__ void`"));
        }
        let r = r[name_len..].trim_start();
        let Some(r) = r.strip_prefix('(') else {
            return Err(here(&format!("{name}: no parameter list")));
        };
        let close = r
            .find(')')
            .ok_or_else(|| here(&format!("{name}: unterminated parameter list")))?;
        let mut args = Vec::new();
        for (k, p) in r[..close].split(',').enumerate() {
            let words: Vec<&str> = p
                .split_whitespace()
                .filter(|w| *w != "__restrict__")
                .collect();
            // The last word is the parameter name (possibly with the `*` attached to it).
            let joined = words.join(" ");
            let split = joined
                .rfind([' ', '*'])
                .ok_or_else(|| here(&format!("{name}: parameter {k} `{p}` has no name")))?;
            let ty = joined[..=split].trim_end().replace(" *", "*");
            let ty = ty.trim();
            let kind = arg_kind(ty).ok_or_else(|| {
                here(&format!("{name}: parameter {k} has type `{ty}`, which lockstep cannot pass (add it to build.rs arg_kind)"))
            })?;
            args.push(kind);
        }
        out.push(Entry {
            name: name.to_string(),
            args,
        });
        rest = &r[close..];
    }
    if out.is_empty() {
        return Err(format!(
            "kernels/{file}: no `extern \"C\" __global__` entry point"
        ));
    }
    Ok(out)
}

/// `conv2d.cu` -> `CONV2D`.
fn static_name(file: &str) -> String {
    let stem = file.trim_end_matches(".cu").to_ascii_uppercase();
    let s: String = stem
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    if s.starts_with(|c: char| c.is_ascii_digit()) {
        format!("K_{s}")
    } else {
        s
    }
}

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("kernels");
    // Re-run when a file is added or removed, and when any file changes.
    println!("cargo:rerun-if-changed={}", dir.display());
    let sources = files_with_ext(&dir, "cu");
    let headers = files_with_ext(&dir, "cuh");
    for f in sources.iter().chain(&headers) {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let mut out = String::from("// @generated by build.rs from kernels/: do not edit.\n");
    out.push_str(
        "/// Every `kernels/*.cuh`: (file name, source), passed to NVRTC as in-memory headers.\npub(crate) const KERNEL_HEADERS: &[(&str, &str)] = &[\n",
    );
    for f in &headers {
        let file = f.file_name().unwrap().to_string_lossy();
        writeln!(
            out,
            "    ({file:?}, include_str!({:?})),",
            f.display().to_string()
        )
        .unwrap();
    }
    out.push_str("];\n");
    let mut all = Vec::new();
    for f in &sources {
        let file = f.file_name().unwrap().to_string_lossy().into_owned();
        let text =
            std::fs::read_to_string(f).unwrap_or_else(|e| panic!("read {}: {e}", f.display()));
        let entries = entry_points(&file, &text).unwrap_or_else(|e| panic!("{e}"));
        let ident = static_name(&file);
        let names: Vec<String> = entries.iter().map(|e| format!("`{}`", e.name)).collect();
        writeln!(out, "/// `kernels/{file}`: {}.", names.join(", ")).unwrap();
        writeln!(
            out,
            "pub(crate) static {ident}: KernelSource = KernelSource {{"
        )
        .unwrap();
        writeln!(out, "    name: {file:?},").unwrap();
        writeln!(
            out,
            "    source: include_str!({:?}),",
            f.display().to_string()
        )
        .unwrap();
        out.push_str("    headers: KERNEL_HEADERS,\n    functions: &[\n");
        for e in &entries {
            writeln!(
                out,
                "        KernelSig {{ name: {:?}, args: &[{}] }},",
                e.name,
                e.args.join(", ")
            )
            .unwrap();
        }
        out.push_str("    ],\n};\n");
        all.push(ident);
    }
    out.push_str("/// Every embedded `kernels/*.cu`, in file-name order (the registry test checks it against `KernelId::ALL`).\n#[cfg(test)]\npub(crate) static ALL_SOURCES: &[&KernelSource] = &[");
    out.push_str(
        &all.iter()
            .map(|i| format!("&{i}"))
            .collect::<Vec<_>>()
            .join(", "),
    );
    out.push_str("];\n");
    let dest = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("kernels.rs");
    std::fs::write(&dest, out).expect("write OUT_DIR/kernels.rs");
}
