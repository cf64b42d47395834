#!/usr/bin/env python3
"""Compile every kernels/*.cu with the real NVRTC (no GPU, no CUDA toolkit needed).

What it checks, per file and per configuration:
  * the file compiles to PTX for each virtual arch (compute_80, compute_90) and, through NVRTC's
    built-in ptxas, to CUBIN for each real arch (sm_80, sm_90) - the Rust runtime
    (src/cuda/compile.rs compile_cubin_cached) asks NVRTC for CUBIN, so ptxas-level errors such as
    bad inline-asm operands must be caught here too;
  * the compile log is empty (any warning is a failure unless --allow-warnings);
  * every expected extern "C" entry point appears as a `.entry` in the PTX, and no unexpected one;
  * tensor-core instructions (mma.sync) are present in the PTX of conv2d.cu / linear.cu on
    sm_80+, and absent when built with -DLOCKSTEP_NO_TENSOR_CORES (the fallback path is compiled
    and checked as a separate configuration, plus one pre-Ampere arch, compute_75).
It prints ptxas register/spill statistics for the CUBIN builds (-Xptxas -v equivalent).

common.cuh is handed to NVRTC as an in-memory header, as build.rs (KERNEL_HEADERS) does, so no -I
is involved: the kernels need no toolkit headers at all.

Setup (only the NVRTC wheel is needed):
  pip download --no-deps nvidia-cuda-nvrtc-cu12 -d /tmp/nvrtcwhl
  mkdir -p /tmp/nvrtc && unzip -q -o /tmp/nvrtcwhl/nvidia_cuda_nvrtc_cu12-*.whl -d /tmp/nvrtc
  python3 kernels/check_nvrtc.py --nvrtc /tmp/nvrtc/nvidia/cuda_nvrtc/lib/libnvrtc.so.12
(or set LOCKSTEP_NVRTC to the library path). Exit status is non-zero on any failure.
"""

import argparse
import ctypes
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# The stable file list (one Rust KernelId variant per .cu) and the entry points each must export.
EXPECTED = {
    "conv2d.cu": [
        "conv2d_forward_f32", "conv2d_forward_bf16",
        "conv2d_backward_input_f32", "conv2d_backward_input_bf16",
        "conv2d_backward_weight_f32", "conv2d_backward_weight_bf16",
        "conv2d_backward_bias_f32", "conv2d_backward_bias_bf16",
    ],
    "linear.cu": [
        "linear_forward_f32", "linear_forward_bf16",
        "linear_backward_input_f32", "linear_backward_input_bf16",
        "linear_backward_weight_f32", "linear_backward_weight_bf16",
        "linear_backward_bias_f32", "linear_backward_bias_bf16",
    ],
    "batchnorm.cu": [
        "batchnorm2d_forward_train_f32", "batchnorm2d_forward_eval_f32", "batchnorm2d_backward_f32",
    ],
    "activation.cu": ["relu_forward_f32", "relu_backward_f32"],
    "pool.cu": ["maxpool2d_forward_f32", "maxpool2d_backward_f32"],
    "loss.cu": ["softmax_xent_forward_f32", "softmax_xent_backward_f32"],
    "optim.cu": ["adam_step_f32", "sgd_step_f32"],
    "data.cu": [
        "gather_batch_f32", "bucket_flatten_f32", "bucket_unflatten_f32", "cast_f32_bf16", "cast_bf16_f32",
    ],
}
HEADERS = ["common.cuh"]
# Files whose GEMM kernels must use tensor cores on sm_80+.
MMA_FILES = {"conv2d.cu", "linear.cu"}

DEFAULT_LIBS = [
    os.environ.get("LOCKSTEP_NVRTC", ""),
    "/tmp/nvrtc/nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
    "libnvrtc.so.12",
    "libnvrtc.so",
]


class Nvrtc:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.path = path
        L = self.lib
        L.nvrtcGetErrorString.restype = ctypes.c_char_p
        L.nvrtcCreateProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_char_p,
                                         ctypes.c_int, ctypes.POINTER(ctypes.c_char_p),
                                         ctypes.POINTER(ctypes.c_char_p)]
        L.nvrtcCompileProgram.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        for f in ("nvrtcGetProgramLogSize", "nvrtcGetPTXSize", "nvrtcGetCUBINSize"):
            getattr(L, f).argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        for f in ("nvrtcGetProgramLog", "nvrtcGetPTX", "nvrtcGetCUBIN"):
            getattr(L, f).argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        L.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p)]

    def version(self):
        a, b = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(a), ctypes.byref(b))
        return a.value, b.value

    def _err(self, rc):
        return self.lib.nvrtcGetErrorString(rc).decode()

    def compile(self, name, src, headers, opts, cubin):
        """Returns (ok, log, output_bytes_or_None)."""
        L = self.lib
        prog = ctypes.c_void_p()
        hsrc = (ctypes.c_char_p * len(headers))(*[h[1].encode() for h in headers])
        hname = (ctypes.c_char_p * len(headers))(*[h[0].encode() for h in headers])
        rc = L.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), len(headers), hsrc, hname)
        if rc != 0:
            return False, "nvrtcCreateProgram: " + self._err(rc), None
        copts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = L.nvrtcCompileProgram(prog, len(opts), copts)
        n = ctypes.c_size_t()
        L.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        L.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace").strip()
        out = None
        if rc == 0:
            getsz, get = (L.nvrtcGetCUBINSize, L.nvrtcGetCUBIN) if cubin else (L.nvrtcGetPTXSize, L.nvrtcGetPTX)
            m = ctypes.c_size_t()
            getsz(prog, ctypes.byref(m))
            ob = ctypes.create_string_buffer(m.value)
            get(prog, ob)
            out = ob.raw[: m.value]
        else:
            log = "nvrtcCompileProgram: %s\n%s" % (self._err(rc), log)
        L.nvrtcDestroyProgram(ctypes.byref(prog))
        return rc == 0, log, out


def load_nvrtc(explicit):
    cands = [explicit] if explicit else [c for c in DEFAULT_LIBS if c]
    errs = []
    for c in cands:
        try:
            return Nvrtc(c)
        except OSError as e:
            errs.append("%s: %s" % (c, e))
    sys.exit("check_nvrtc: cannot load libnvrtc:\n  " + "\n  ".join(errs))


# ptxas -v lines look like: "ptxas info    : Used 128 registers, used 1 barriers, 18432 bytes smem, ..."
# preceded by "ptxas info    : Compiling entry function 'name' for 'sm_80'".
def ptxas_stats(log):
    stats, cur = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = m.group(1)
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            stats.setdefault(cur, {})["spill"] = int(m.group(1)) + int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            stats.setdefault(cur, {})["regs"] = int(m.group(1))
    return stats


def is_ptxas_info(line):
    return line.startswith("ptxas") or not line.strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nvrtc", help="path to libnvrtc.so.12 (default: $LOCKSTEP_NVRTC, the unpacked wheel, system)")
    ap.add_argument("--archs", default="80,90", help="comma-separated SM versions to check (default 80,90)")
    ap.add_argument("--allow-warnings", action="store_true", help="do not fail on a non-empty compile log")
    ap.add_argument("--verbose", action="store_true", help="print per-kernel ptxas register/spill stats")
    args = ap.parse_args()

    nv = load_nvrtc(args.nvrtc)
    print("NVRTC %d.%d from %s" % (nv.version() + (nv.path,)))
    headers = [(h, open(os.path.join(HERE, h)).read()) for h in HEADERS]
    present = sorted(f for f in os.listdir(HERE) if f.endswith(".cu"))
    failures = []
    missing_files = sorted(set(EXPECTED) - set(present))
    if missing_files:
        failures.append("missing kernel files: %s" % missing_files)
    # Files another branch adds (e.g. the runtime's own elementwise.cu) must compile cleanly too,
    # but their entry points are theirs to check.
    extra_files = sorted(set(present) - set(EXPECTED))
    if extra_files:
        print("note: also compiling %s (no expected entry list)" % ", ".join(extra_files))

    archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    base = ["-default-device", "--std=c++17"]
    # (label, options, output is cubin, expect mma.sync in the GEMM files)
    configs = []
    for a in archs:
        tc = int(a) >= 80
        configs.append(("compute_%s" % a, ["--gpu-architecture=compute_%s" % a] + base, False, tc))
        # CUBIN with exactly the options src/cuda/module.rs passes (it relies on NVRTC 12's default
        # C++17), plus -v so ptxas reports registers and spills.
        configs.append(("sm_%s" % a, ["--gpu-architecture=sm_%s" % a, "-default-device", "--ptxas-options=-v"],
                        True, None))
    # The fallback GEMM path must compile too: forced on an Ampere target, and natural on Turing.
    configs.append(("compute_80 -DLOCKSTEP_NO_TENSOR_CORES",
                    ["--gpu-architecture=compute_80", "-DLOCKSTEP_NO_TENSOR_CORES"] + base, False, False))
    configs.append(("compute_80 -DLOCKSTEP_NO_TF32", ["--gpu-architecture=compute_80", "-DLOCKSTEP_NO_TF32"] + base,
                    False, True))
    configs.append(("compute_75", ["--gpu-architecture=compute_75"] + base, False, False))

    total_entries = 0
    spills = []
    for label, opts, cubin, want_mma in configs:
        n_ok = 0
        for f in sorted(set(EXPECTED) | set(extra_files)):
            path = os.path.join(HERE, f)
            if not os.path.exists(path):
                failures.append("%s: missing" % f)
                continue
            src = open(path).read()
            ok, log, out = nv.compile(f, src, headers, opts, cubin)
            real_log = "\n".join(l for l in log.splitlines() if not is_ptxas_info(l)) if cubin else log
            if not ok:
                failures.append("%s [%s] failed:\n%s" % (f, label, log))
                continue
            if real_log.strip() and not args.allow_warnings:
                failures.append("%s [%s] compiled with warnings:\n%s" % (f, label, real_log))
            if cubin:
                for k, s in sorted(ptxas_stats(log).items()):
                    if args.verbose:
                        print("  %-8s %-32s regs %3s spill %s" % (label, k, s.get("regs"), s.get("spill", 0)))
                    if s.get("spill", 0):
                        spills.append("%s %s: %d bytes spilled" % (label, k, s["spill"]))
                n_ok += 1
                continue
            ptx = out.decode(errors="replace")
            entries = re.findall(r"^\s*\.(?:visible\s+)?\.entry\s+([A-Za-z_][A-Za-z0-9_]*)", ptx, re.M)
            missing = sorted(set(EXPECTED.get(f, [])) - set(entries))
            extra = sorted(set(entries) - set(EXPECTED[f])) if f in EXPECTED else []
            if missing:
                failures.append("%s [%s]: missing entry points %s" % (f, label, missing))
            if extra:
                failures.append("%s [%s]: unexpected entry points %s" % (f, label, extra))
            if f in MMA_FILES and want_mma is not None:
                has = "mma.sync" in ptx
                if has != want_mma:
                    failures.append("%s [%s]: mma.sync %s" % (f, label, "missing" if want_mma else "present"))
                # TF32 for the f32 GEMMs exactly when tensor cores are on and NO_TF32 is not set.
                want_tf32 = want_mma and "-DLOCKSTEP_NO_TF32" not in opts
                if ("f32.tf32.tf32.f32" in ptx) != want_tf32:
                    failures.append("%s [%s]: TF32 mma %s" % (f, label, "missing" if want_tf32 else "present"))
            if label == "compute_%s" % archs[0]:
                total_entries += len(entries)
                print("  %-14s %s" % (f, " ".join(entries)))
            n_ok += 1
        print("%-40s %d/%d files ok" % (label, n_ok, len(set(EXPECTED) | set(extra_files))))

    if spills:
        print("register spills (not failures):\n  " + "\n  ".join(spills))
    if failures:
        print("\nFAILED (%d):" % len(failures))
        for x in failures:
            print("---\n" + x)
        return 1
    print("OK: %d kernels in %d files, archs %s (PTX + CUBIN), fallback and compute_75 paths"
          % (total_entries, len(set(EXPECTED) | set(extra_files)), ", ".join("sm_" + a for a in archs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
