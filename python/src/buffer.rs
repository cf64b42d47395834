//! Python buffers as collective buffers: torch tensors (read directly, see [`torch_view`]), the
//! buffer protocol (numpy arrays, bytearray, memoryview, array.array, anything exporting
//! `Py_buffer`) or else DLPack (other array libraries' tensors) turned into an address, a length
//! and a [`Dtype`], with every check the collective cannot make itself (contiguity, writability,
//! alignment, element type).
//!
//! The buffer protocol is only part of the limited API from Python 3.11, while this module is
//! built for abi3 from 3.9 (one wheel for every CPython). `PyObject_GetBuffer`/`PyBuffer_Release`
//! and the `Py_buffer` layout have been exported unchanged by every CPython since 3.3 (3.11
//! declared them stable as they were), so they are declared here rather than taken from pyo3,
//! which hides them below 3.11 under abi3.

use std::ffi::{c_char, c_int, c_void, CStr};

use lockstep::types::{MemSpace, RawMem};
use lockstep::Dtype;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi::{PyObject, Py_ssize_t};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// CPython's `Py_buffer` (Include/pybuffer.h), identical from 3.3 to today.
#[repr(C)]
struct PyBufferRaw {
    buf: *mut c_void,
    obj: *mut PyObject,
    len: Py_ssize_t,
    itemsize: Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut Py_ssize_t,
    strides: *mut Py_ssize_t,
    suboffsets: *mut Py_ssize_t,
    internal: *mut c_void,
}

/// `PyBUF_STRIDES | PyBUF_FORMAT` (= `PyBUF_RECORDS_RO`): shape, strides and the element format,
/// read-only exporters accepted (writability is checked here, with a better message). No
/// `PyBUF_INDIRECT`: exporters that need suboffsets refuse, and are refused.
const PYBUF_RECORDS_RO: c_int = 0x0010 | 0x0008 | 0x0004;

extern "C" {
    fn PyObject_GetBuffer(obj: *mut PyObject, view: *mut PyBufferRaw, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut PyBufferRaw);
}

/// What keeps a view's memory alive and pinned while a collective uses it.
enum Holder {
    /// An exported `Py_buffer`, released on drop.
    Buffer(Box<PyBufferRaw>),
    /// A DLPack capsule, left unconsumed: the producer's deleter runs when it is collected.
    Capsule(#[allow(dead_code)] Py<PyAny>),
    /// A torch tensor read through its own accessors, or a `__cuda_array_interface__` exporter
    /// (held so that its memory stays alive).
    Tensor(#[allow(dead_code)] Py<PyAny>),
}

/// A buffer exported by a Python object, held (and so kept alive and unresizable) until drop.
/// Dropping needs the GIL, which every holder has: views are made and dropped in the bodies of
/// `#[pymethods]`, and only their [`Mem`] crosses into code that runs detached.
pub struct View {
    holder: Holder,
    addr: usize,
    /// Element type from the format string and item size (or the DLPack dtype).
    pub dtype: Dtype,
    /// Number of elements.
    pub len: usize,
    /// The exporter refuses writes.
    pub readonly: bool,
    /// Where the exporter says the memory is.
    pub loc: Loc,
    /// The memory space handed to the collective: host, or the device the communicator checked
    /// (see `PyComm::view`; `__cuda_array_interface__` does not name the device).
    pub space: MemSpace,
}

/// Where a buffer's memory lives, as its exporter describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loc {
    /// Host memory (the buffer protocol, CPU tensors, DLPack CPU or CUDA-host memory).
    Host,
    /// CUDA device memory, on this device when the exporter says which (torch and DLPack do,
    /// `__cuda_array_interface__` does not).
    Cuda(Option<i32>),
}

impl Drop for View {
    fn drop(&mut self) {
        if let Holder::Buffer(raw) = &mut self.holder {
            // SAFETY: `raw` was filled by a successful PyObject_GetBuffer and is released exactly
            // once; the GIL is held (see the type's docs).
            unsafe { PyBuffer_Release(&mut **raw) };
        }
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

fn not_contiguous(what: &str, shape: &[usize], strides: &[isize], unit: &str) -> PyErr {
    PyValueError::new_err(format!(
        "{what} is not C-contiguous (shape {shape:?}, strides {strides:?} in {unit}): collectives read and write one dense \
block; pass a contiguous copy (numpy.ascontiguousarray(x), tensor.contiguous()) and copy the result back for an in-place call"
    ))
}

impl View {
    /// The view of `len` elements of `dtype` at `addr`, kept alive by `holder`, once its alignment
    /// is checked; its space is the host's until the communicator places it (`PyComm::view`).
    fn aligned(
        holder: Holder,
        addr: usize,
        dtype: Dtype,
        len: usize,
        readonly: bool,
        loc: Loc,
        what: &str,
    ) -> PyResult<View> {
        let v = View {
            holder,
            addr,
            dtype,
            len,
            readonly,
            loc,
            space: MemSpace::Host,
        };
        v.check_aligned(what)?;
        Ok(v)
    }

    /// A view of `t`, known to be a CPU torch tensor (`t.is_cpu` read by the caller), or None
    /// when `t` is not a torch tensor (or torch was not looked up yet): then use [`View::new`].
    pub fn torch_cpu(t: &Bound<'_, PyAny>, what: &str) -> Option<PyResult<View>> {
        let torch = Torch::get(t.py())?;
        match t.is_instance(torch.tensor.bind(t.py())) {
            Ok(true) => Some(torch.view(t, what, Some(true))),
            Ok(false) => None,
            Err(e) => Some(Err(e)),
        }
    }

    /// Export `obj`'s memory: through the buffer protocol, or else through DLPack (torch tensors,
    /// which have no buffer protocol). `what` names the argument in messages ("send", "recv", ...).
    pub fn new(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<View> {
        if let Some(t) = Torch::get(obj.py()) {
            if obj.is_instance(t.tensor.bind(obj.py()))? {
                return t.view(obj, what, None);
            }
        }
        // SAFETY: PyBufferRaw is plain data (pointers and integers); all-zero is a valid value to
        // hand to PyObject_GetBuffer, which fills it.
        let mut raw: Box<PyBufferRaw> = Box::new(unsafe { std::mem::zeroed() });
        // SAFETY: `obj` is a live object (borrowed under the GIL held by `Bound`), `raw` points to
        // writable memory of the declared layout.
        let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *raw, PYBUF_RECORDS_RO) };
        if rc != 0 {
            let cause = PyErr::take(obj.py());
            if obj.hasattr("__cuda_array_interface__").unwrap_or(false) {
                return View::from_cuda_array_interface(obj, what);
            }
            if obj.hasattr("__dlpack__").unwrap_or(false) {
                // A torch tensor met before torch was looked up: take the direct path from now on.
                if let Some(t) = Torch::init(obj.py())? {
                    if obj.is_instance(t.tensor.bind(obj.py()))? {
                        return t.view(obj, what, None);
                    }
                }
                return View::from_dlpack(obj, what);
            }
            let err = PyTypeError::new_err(format!(
                "{what}: a {} is not a buffer lockstep can use (it needs the buffer protocol or DLPack: a numpy array, \
bytearray, memoryview, array.array, a torch CPU tensor)",
                type_name(obj)
            ));
            err.set_cause(obj.py(), cause);
            return Err(err);
        }
        // From here `raw` is owned by a View, so every early return releases it.
        let addr = raw.buf as usize;
        let mut v = View {
            holder: Holder::Buffer(raw),
            addr,
            dtype: Dtype::U8,
            len: 0,
            readonly: false,
            loc: Loc::Host,
            space: MemSpace::Host,
        };
        let Holder::Buffer(r) = &v.holder else {
            unreachable!("just built")
        };
        v.readonly = r.readonly != 0;
        let itemsize = usize::try_from(r.itemsize).unwrap_or(0);
        let ndim = usize::try_from(r.ndim).unwrap_or(0);
        let format = if r.format.is_null() {
            "B".to_string()
        } else {
            // SAFETY: a non-null format is a NUL-terminated string owned by the view.
            unsafe { CStr::from_ptr(r.format) }
                .to_string_lossy()
                .into_owned()
        };
        v.dtype = dtype_of(&format, itemsize)
            .map_err(|m| PyTypeError::new_err(format!("{what}: {m}")))?;
        // Shape and strides (NULL shape: one dimension of len/itemsize; NULL strides: C order).
        let shape: Vec<usize> = if ndim == 0 {
            Vec::new()
        } else if r.shape.is_null() {
            vec![usize::try_from(r.len).unwrap_or(0) / itemsize.max(1)]
        } else {
            // SAFETY: with PyBUF_ND the exporter fills `shape` with `ndim` entries.
            unsafe { sizes(r.shape, ndim) }
        };
        if !r.strides.is_null() && ndim > 0 {
            // SAFETY: with PyBUF_STRIDES the exporter fills `strides` with `ndim` entries.
            let st = unsafe { std::slice::from_raw_parts(r.strides, ndim) };
            check_dense(what, &shape, st, itemsize as isize, "bytes")?;
        }
        v.len = shape.iter().product();
        v.check_aligned(what)?;
        Ok(v)
    }

    /// The DLPack path (legacy unversioned capsules, which every producer still gives when no
    /// `max_version` is asked for). Host memory only.
    fn from_dlpack(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<View> {
        let capsule = obj.call_method0("__dlpack__").map_err(|e| {
            let err = PyTypeError::new_err(format!(
                "{what}: the {}'s __dlpack__() failed: {e}",
                type_name(obj)
            ));
            err.set_cause(obj.py(), Some(e));
            err
        })?;
        // SAFETY: PyCapsule_GetPointer checks the object is a capsule with this exact name and
        // returns NULL (with an exception set) otherwise.
        let p = unsafe { pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), c"dltensor".as_ptr()) };
        if p.is_null() {
            let cause = PyErr::take(obj.py());
            let err = PyTypeError::new_err(format!(
                "{what}: the {}'s __dlpack__() did not return a DLPack capsule",
                type_name(obj)
            ));
            err.set_cause(obj.py(), cause);
            return Err(err);
        }
        // SAFETY: a "dltensor" capsule holds a DLManagedTensor, valid while the capsule lives
        // (we hold it, unconsumed, for the life of the view).
        let t = unsafe { &(*(p as *const DLManagedTensor)).dl_tensor };
        let loc = match t.device.device_type {
            DL_CPU | DL_CUDA_HOST => Loc::Host,
            DL_CUDA => Loc::Cuda(Some(t.device.device_id)),
            other => {
                return Err(PyTypeError::new_err(format!(
                    "{what} lives on DLPack device type {other} (device {}); lockstep takes host memory and CUDA device \
memory (move it with .cpu())",
                    t.device.device_id
                )))
            }
        };
        let dtype = dl_dtype(t.dtype).map_err(|m| PyTypeError::new_err(format!("{what}: {m}")))?;
        let ndim = usize::try_from(t.ndim).unwrap_or(0);
        let shape: Vec<usize> = if ndim == 0 || t.shape.is_null() {
            Vec::new()
        } else {
            // SAFETY: DLPack gives `ndim` shape entries.
            unsafe { sizes(t.shape, ndim) }
        };
        let len: usize = shape.iter().product();
        if !t.strides.is_null() && ndim > 0 {
            // SAFETY: non-NULL strides have `ndim` entries (in elements).
            let st: Vec<isize> = unsafe { std::slice::from_raw_parts(t.strides, ndim) }
                .iter()
                .map(|&s| s as isize)
                .collect();
            check_dense(what, &shape, &st, 1, "elements")?;
        }
        let addr = (t.data as usize).wrapping_add(t.byte_offset as usize);
        let holder = Holder::Capsule(capsule.unbind());
        View::aligned(holder, addr, dtype, len, false, loc, what)
    }

    /// CUDA device memory described by `__cuda_array_interface__` (version 2 or 3: CuPy, Numba,
    /// torch). The producer's stream is not used: a device communicator synchronises the device
    /// before each call (see `PyComm::run`), which covers work on every stream.
    fn from_cuda_array_interface(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<View> {
        let bad = |m: String| PyTypeError::new_err(format!("{what}: __cuda_array_interface__ {m}"));
        let cai = obj.getattr("__cuda_array_interface__")?;
        let item = |k: &str| {
            cai.get_item(k)
                .map_err(|_| bad(format!("has no {k:?} entry")))
        };
        let (addr, readonly): (usize, bool) = item("data")?
            .extract()
            .map_err(|_| bad("\"data\" is not (pointer, read-only flag)".into()))?;
        let shape: Vec<usize> = item("shape")?
            .extract()
            .map_err(|_| bad("\"shape\" is not a tuple of sizes".into()))?;
        let typestr: String = item("typestr")?
            .extract()
            .map_err(|_| bad("\"typestr\" is not a string".into()))?;
        if cai.get_item("mask").is_ok_and(|m| !m.is_none()) {
            return Err(bad("has a mask; masked arrays are not supported".into()));
        }
        // numpy's typestr: byte order ('|' for single bytes), kind letter, item size in bytes.
        let b = typestr.as_bytes();
        let native = match b.first() {
            Some(b'|') => true,
            Some(b'<') => cfg!(target_endian = "little"),
            Some(b'>') => cfg!(target_endian = "big"),
            _ => false,
        };
        let itemsize: usize = typestr.get(2..).and_then(|n| n.parse().ok()).unwrap_or(0);
        if !native || itemsize == 0 {
            return Err(bad(format!(
                "typestr {typestr:?} is not an element type in this machine's byte order"
            )));
        }
        let kind = b[1];
        let letter = match (kind, itemsize) {
            (b'f', 2) => "e",
            (b'f', 4) => "f",
            (b'f', 8) => "d",
            (b'i', _) => "q",
            (b'u', _) => "Q",
            _ => "?",
        };
        let dtype = dtype_of(letter, itemsize).map_err(|_| {
            bad(format!(
                "typestr {typestr:?} is not a lockstep element type"
            ))
        })?;
        let len: usize = shape.iter().product();
        if let Ok(st) = cai.get_item("strides") {
            if !st.is_none() {
                let st: Vec<isize> = st
                    .extract()
                    .map_err(|_| bad("\"strides\" is not a tuple of byte strides".into()))?;
                check_dense(what, &shape, &st, itemsize as isize, "bytes")?;
            }
        }
        let holder = Holder::Tensor(obj.clone().unbind());
        View::aligned(holder, addr, dtype, len, readonly, Loc::Cuda(None), what)
    }

    fn check_aligned(&self, what: &str) -> PyResult<()> {
        let align = self.dtype.size();
        if self.len > 0 && !self.addr.is_multiple_of(align) {
            return Err(PyValueError::new_err(format!(
                "{what} starts at address {:#x}, not aligned to its {align}-byte elements ({}); pass an aligned copy \
(numpy.require(x, requirements='A'))",
                self.addr, self.dtype
            )));
        }
        Ok(())
    }

    /// This view for reading.
    pub fn mem(&self) -> Mem {
        let addr = if self.len == 0 {
            self.dtype.size()
        } else {
            self.addr
        };
        Mem {
            addr,
            len: self.len,
            space: self.space,
        }
    }

    /// This view for writing: refused when the exporter is read-only.
    pub fn mem_mut(&self, what: &str) -> PyResult<Mem> {
        if self.readonly {
            return Err(PyValueError::new_err(format!(
                "{what} is read-only, but the collective writes its result there; pass a writable buffer (for numpy, \
x.copy() or x.setflags(write=True) where allowed)"
            )));
        }
        Ok(self.mem())
    }

    /// The byte range `[start, end)` the view covers.
    pub fn range(&self) -> (usize, usize) {
        (self.addr, self.addr + self.len * self.dtype.size())
    }

    /// Whether this view and `other` share any byte.
    pub fn overlaps(&self, other: &View) -> bool {
        let ((a0, a1), (b0, b1)) = (self.range(), other.range());
        a0 < b1 && b0 < a1
    }
}

/// What the direct path for torch tensors needs from torch: the tensor type and the element types
/// lockstep has, compared by identity (torch's dtypes are singletons).
///
/// Why not DLPack or `tensor.numpy()`: `__dlpack__` is Python code with its own checks and builds
/// a capsule per call (about 4 µs), `numpy()` builds an array (about 1.2 µs); reading `data_ptr()`,
/// `numel()`, `dtype` and `is_contiguous()` costs a fraction of that, and an 8-byte all-reduce
/// through torch.distributed is otherwise dominated by it.
pub(crate) struct Torch {
    tensor: Py<PyType>,
    dtypes: Vec<(Py<PyAny>, Dtype)>,
}

static TORCH: PyOnceLock<Option<Torch>> = PyOnceLock::new();

impl Torch {
    /// The table, if it was built already (never imports anything).
    fn get(py: Python<'_>) -> Option<&Torch> {
        TORCH.get(py).and_then(Option::as_ref)
    }

    /// Build the table once torch is imported (`lockstep.torch` calls this; so does the first
    /// torch tensor that reaches [`View::new`]). None while torch is not imported: lockstep never
    /// imports it itself (several seconds, and CUDA state a forking launcher must not inherit).
    pub(crate) fn init(py: Python<'_>) -> PyResult<Option<&Torch>> {
        if let Some(t) = TORCH.get(py) {
            return Ok(t.as_ref());
        }
        let modules = py.import("sys")?.getattr("modules")?;
        let Some(torch) = modules.get_item("torch").ok().filter(|m| !m.is_none()) else {
            return Ok(None);
        };
        let tensor = torch.getattr("Tensor")?.cast_into::<PyType>()?.unbind();
        let mut dtypes = Vec::new();
        for (name, d) in [
            ("float32", Dtype::F32),
            ("float64", Dtype::F64),
            ("float16", Dtype::F16),
            ("bfloat16", Dtype::BF16),
            ("int8", Dtype::I8),
            ("int32", Dtype::I32),
            ("int64", Dtype::I64),
            ("uint8", Dtype::U8),
            // From torch 2.3 on.
            ("uint32", Dtype::U32),
            ("uint64", Dtype::U64),
        ] {
            if let Some(dt) = torch.getattr_opt(name)? {
                dtypes.push((dt.unbind(), d));
            }
        }
        // Another thread may have won the race; either table is the same.
        let _ = TORCH.set(py, Some(Torch { tensor, dtypes }));
        Ok(Torch::get(py))
    }

    /// A view of a torch tensor `t`; `is_cpu` when the caller has read `t.is_cpu` already (the
    /// torch backend's all-reduce does, to route CUDA tensors).
    fn view(&self, t: &Bound<'_, PyAny>, what: &str, is_cpu: Option<bool>) -> PyResult<View> {
        let py = t.py();
        let cpu = match is_cpu {
            Some(c) => c,
            None => t.getattr(pyo3::intern!(py, "is_cpu"))?.is_truthy()?,
        };
        let loc = if cpu {
            Loc::Host
        } else if t.getattr(pyo3::intern!(py, "is_cuda"))?.is_truthy()? {
            Loc::Cuda(Some(
                t.call_method0(pyo3::intern!(py, "get_device"))?.extract()?,
            ))
        } else {
            let device = t.getattr(pyo3::intern!(py, "device"))?;
            return Err(PyTypeError::new_err(format!(
                "{what} is a torch tensor on {device}; lockstep takes CPU tensors (host communicators) and CUDA tensors \
(device communicators): move it with .cpu() or .cuda()"
            )));
        };
        let dt = t.getattr(pyo3::intern!(py, "dtype"))?;
        let Some(&(_, dtype)) = self.dtypes.iter().find(|(d, _)| d.bind(py).is(&dt)) else {
            return Err(PyTypeError::new_err(format!(
                "{what}: torch {dt} is not a lockstep element type (float32/64, float16, bfloat16, int8/32/64, \
uint8/32/64; bool, int16 and complex are not)"
            )));
        };
        let len: usize = t.call_method0(pyo3::intern!(py, "numel"))?.extract()?;
        if len > 0
            && !t
                .call_method0(pyo3::intern!(py, "is_contiguous"))?
                .is_truthy()?
        {
            let shape: Vec<usize> = t.getattr(pyo3::intern!(py, "shape"))?.extract()?;
            let strides: Vec<isize> = t.call_method0(pyo3::intern!(py, "stride"))?.extract()?;
            return Err(not_contiguous(what, &shape, &strides, "elements"));
        }
        let addr: usize = t.call_method0(pyo3::intern!(py, "data_ptr"))?.extract()?;
        let holder = Holder::Tensor(t.clone().unbind());
        View::aligned(holder, addr, dtype, len, false, loc, what)
    }
}

/// Look torch up for the direct tensor path (`lockstep.torch` calls it at import).
#[pyfunction]
pub fn _register_torch(py: Python<'_>) -> PyResult<bool> {
    Ok(Torch::init(py)?.is_some())
}

// DLPack's ABI (dlpack.h, unchanged for the legacy unversioned tensor since v0.2).
const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;
const DL_CUDA_HOST: i32 = 3;

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// The lockstep element type of a DLPack dtype (kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4).
fn dl_dtype(t: DLDataType) -> Result<Dtype, String> {
    let d = match (t.code, t.bits, t.lanes) {
        (2, 32, 1) => Dtype::F32,
        (2, 64, 1) => Dtype::F64,
        (2, 16, 1) => Dtype::F16,
        (4, 16, 1) => Dtype::BF16,
        (0, 8, 1) => Dtype::I8,
        (0, 32, 1) => Dtype::I32,
        (0, 64, 1) => Dtype::I64,
        (1, 8, 1) => Dtype::U8,
        (1, 32, 1) => Dtype::U32,
        (1, 64, 1) => Dtype::U64,
        (code, bits, lanes) => {
            return Err(format!(
                "DLPack dtype (code {code}, {bits} bits, {lanes} lanes) is not a lockstep element type (float32/64, \
float16, bfloat16, int8/32/64, uint8/32/64; bool, int16 and complex are not)"
            ))
        }
    };
    Ok(d)
}

/// `n` dimensions at `p`, as an exporter gives them (a negative one, which none should give, as 0).
///
/// # Safety
/// `p` points to `n` readable entries.
unsafe fn sizes<T: Copy + TryInto<usize>>(p: *const T, n: usize) -> Vec<usize> {
    // SAFETY: forwarded contract.
    unsafe { std::slice::from_raw_parts(p, n) }
        .iter()
        .map(|&s| s.try_into().unwrap_or(0))
        .collect()
}

/// Refuse `what` unless `strides` (counted in `unit`s, `itemsize` of them per element) lay out
/// `shape` densely in C order; an empty view is dense whatever its strides.
fn check_dense(
    what: &str,
    shape: &[usize],
    strides: &[isize],
    itemsize: isize,
    unit: &str,
) -> PyResult<()> {
    let empty = shape.iter().product::<usize>() == 0;
    if empty || c_contiguous(shape, strides, itemsize) {
        Ok(())
    } else {
        Err(not_contiguous(what, shape, strides, unit))
    }
}

/// Whether `shape`/`strides` (in bytes, or in elements with `itemsize` 1) describe a dense C-order block. Dimensions of extent 1
/// may have any stride (numpy gives them arbitrary ones).
fn c_contiguous(shape: &[usize], strides: &[isize], itemsize: isize) -> bool {
    let mut expect = itemsize;
    for (&n, &s) in shape.iter().zip(strides).rev() {
        if n != 1 && s != expect {
            return false;
        }
        expect = expect.saturating_mul(n as isize);
    }
    true
}

/// The lockstep element type of a buffer-protocol format (struct module syntax) and item size.
/// Native byte order only; the integer width comes from the item size, since `l`/`L` are 8 bytes
/// in native mode (`@`) but 4 in standard mode (`=`, `<`).
pub fn dtype_of(format: &str, itemsize: usize) -> Result<Dtype, String> {
    let little = cfg!(target_endian = "little");
    let body = match format.as_bytes().first() {
        Some(b'@') | Some(b'=') => &format[1..],
        Some(b'<') if little => &format[1..],
        Some(b'>') | Some(b'!') if !little => &format[1..],
        Some(b'<') | Some(b'>') | Some(b'!') => {
            return Err(format!(
                "buffer format {format:?} is not in this machine's byte order; convert it first (numpy: x.astype(x.dtype.newbyteorder('='))"
            ))
        }
        _ => format,
    };
    let kind = match body {
        "f" | "d" | "e" => 'f',
        "b" | "h" | "i" | "l" | "q" | "n" => 'i',
        "B" | "H" | "I" | "L" | "Q" | "N" => 'u',
        _ => {
            return Err(format!(
                "buffer format {format:?} is not a lockstep element type (float32 'f', float64 'd', float16 'e', int8 'b', \
int32, int64, uint8 'B', uint32, uint64; bool and complex are not, nor bfloat16, which has no buffer-protocol format)"
            ))
        }
    };
    let d = match (kind, itemsize) {
        ('f', 4) => Dtype::F32,
        ('f', 8) => Dtype::F64,
        ('f', 2) => Dtype::F16,
        ('i', 1) => Dtype::I8,
        ('i', 4) => Dtype::I32,
        ('i', 8) => Dtype::I64,
        ('u', 1) => Dtype::U8,
        ('u', 4) => Dtype::U32,
        ('u', 8) => Dtype::U64,
        _ => {
            return Err(format!(
                "buffer format {format:?} with {itemsize}-byte items is not a lockstep element type (16-bit integers are not \
supported: NCCL has none either)"
            ))
        }
    };
    Ok(d)
}

/// A host buffer by address, as the collectives take it. Built only from a live [`View`] (or as
/// an empty buffer), which the caller keeps until the collective has returned.
#[derive(Clone, Copy, Debug)]
pub struct Mem {
    addr: usize,
    len: usize,
    space: MemSpace,
}

impl Mem {
    /// An empty buffer for arguments a rank does not use (gather's recv off the root), at an
    /// address aligned for any element type, in the communicator's memory space.
    pub fn empty(space: MemSpace) -> Mem {
        Mem {
            addr: 8,
            len: 0,
            space,
        }
    }
}

impl Mem {
    /// The descriptor a [`Call`](lockstep::comm::Call) carries. What makes handing it to
    /// `Communicator::run` sound: a Mem is made from a View that the caller holds for the whole
    /// collective (a buffer-protocol exporter keeps the memory alive and unresizable while
    /// exported; a DLPack capsule or a held torch tensor keeps its storage alive, and resizing a
    /// tensor from another thread while a collective uses it is a data race on the caller's side,
    /// as with torch's own backends, which read `data_ptr()` the same way), covering `len`
    /// elements of the view's dtype, checked aligned, and the call is made with that dtype. An
    /// empty Mem covers no byte. `mem_mut` only hands out writable views, and out-of-place calls
    /// are refused when send and recv overlap, so nothing else reaches the bytes during the call.
    pub fn raw(&self) -> RawMem {
        RawMem {
            addr: self.addr,
            len: self.len,
            space: self.space,
        }
    }
}
