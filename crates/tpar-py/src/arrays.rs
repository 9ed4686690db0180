//! What the Python edge reads of the arrays it is given: torch tensors (CPU, CUDA, meta and
//! others) and numpy arrays and scalars, each read once per call with a few attribute lookups
//! (no Python code runs on tpar's side), and why one cannot be reduced as a typed refusal
//! (`tpar.TparRefused`: its dtype, layout, device or size), where `should_use` and an engine's
//! `should_custom_ar` then say False. The torch and numpy objects these compare against are
//! looked up once per process, when the module was imported by the program.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use tpar::DType;

use crate::errors::{refused, TparError};

/// Why an array cannot be reduced here: a [`refused`] error's reason code and message.
#[derive(Debug)]
pub(crate) struct Refusal {
    pub reason: &'static str,
    pub message: String,
}

impl Refusal {
    fn new(reason: &'static str, message: String) -> Refusal {
        Refusal { reason, message }
    }

    pub(crate) fn into_err(self) -> PyErr {
        refused(None, self.reason, self.message)
    }
}

/// Where an array's memory is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    /// Host memory (a numpy array, a torch CPU tensor).
    Host,
    /// A CUDA device's memory, by ordinal.
    Cuda(usize),
}

/// A place as torch names a device: "cpu" or "cuda:N".
pub(crate) fn device_name(place: Place) -> String {
    match place {
        Place::Host => "cpu".to_owned(),
        Place::Cuda(d) => format!("cuda:{d}"),
    }
}

/// Which library made an array (operands of one call must come from one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Library {
    Torch,
    Numpy,
}

/// What a call needs to know of one array.
#[derive(Debug)]
pub(crate) struct Array {
    pub library: Library,
    pub place: Place,
    pub dtype: DType,
    pub address: u64,
    pub count: usize,
    /// False for read-only numpy arrays and numpy scalars.
    pub writeable: bool,
    /// A numpy scalar (`numpy.float32(1)`): reduced only into `out=`.
    pub scalar: bool,
}

impl Array {
    pub(crate) fn bytes(&self) -> u64 {
        (self.count * self.dtype.size()) as u64
    }
}

/// The torch objects the edge compares against, once torch is imported.
pub(crate) struct Torch {
    tensor: Py<PyType>,
    dtypes: [(Py<PyAny>, DType); 3],
    /// `torch._C._cuda_getCurrentRawStream` (the current stream of a device as an integer),
    /// where this torch has it.
    raw_stream: Option<Py<PyAny>>,
    cuda: Py<PyAny>,
    empty_like: Py<PyAny>,
}

/// The numpy objects the edge compares against, once numpy is imported.
pub(crate) struct Numpy {
    ndarray: Py<PyType>,
    generic: Py<PyType>,
    empty_like: Py<PyAny>,
}

static TORCH: PyOnceLock<Torch> = PyOnceLock::new();
static NUMPY: PyOnceLock<Numpy> = PyOnceLock::new();

/// `sys.modules[name]`, where the program imported it (tpar imports neither torch nor numpy).
fn imported<'py>(py: Python<'py>, name: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
    let modules = py
        .import(intern!(py, "sys"))?
        .getattr(intern!(py, "modules"))?;
    let modules = modules.cast_into::<PyDict>()?;
    modules.get_item(name)
}

/// torch's objects, or None where the program has not imported torch (then nothing it passes
/// is a torch tensor).
pub(crate) fn torch(py: Python<'_>) -> PyResult<Option<&'static Torch>> {
    if let Some(t) = TORCH.get(py) {
        return Ok(Some(t));
    }
    let Some(module) = imported(py, "torch")? else {
        return Ok(None);
    };
    let dtype = |name: &str| module.getattr(name).map(Bound::unbind);
    let raw_stream = module
        .getattr("_C")
        .and_then(|c| c.getattr("_cuda_getCurrentRawStream"))
        .ok()
        .map(Bound::unbind);
    let loaded = Torch {
        tensor: module.getattr("Tensor")?.cast_into::<PyType>()?.unbind(),
        dtypes: [
            (dtype("float32")?, DType::F32),
            (dtype("float16")?, DType::F16),
            (dtype("bfloat16")?, DType::Bf16),
        ],
        raw_stream,
        cuda: module.getattr("cuda")?.unbind(),
        empty_like: module.getattr("empty_like")?.unbind(),
    };
    Ok(Some(TORCH.get_or_init(py, || loaded)))
}

fn numpy(py: Python<'_>) -> PyResult<Option<&'static Numpy>> {
    if let Some(n) = NUMPY.get(py) {
        return Ok(Some(n));
    }
    let Some(module) = imported(py, "numpy")? else {
        return Ok(None);
    };
    let loaded = Numpy {
        ndarray: module.getattr("ndarray")?.cast_into::<PyType>()?.unbind(),
        generic: module.getattr("generic")?.cast_into::<PyType>()?.unbind(),
        empty_like: module.getattr("empty_like")?.unbind(),
    };
    Ok(Some(NUMPY.get_or_init(py, || loaded)))
}

impl Torch {
    /// Whether `object` is a torch tensor.
    pub(crate) fn is_tensor(&self, object: &Bound<'_, PyAny>) -> bool {
        object
            .is_instance(self.tensor.bind(object.py()))
            .unwrap_or(false)
    }

    /// The current CUDA stream of `device` as torch orders work on it.
    pub(crate) fn current_stream(&self, py: Python<'_>, device: usize) -> PyResult<usize> {
        match &self.raw_stream {
            Some(f) => f.bind(py).call1((device,))?.extract(),
            None => self
                .cuda
                .bind(py)
                .call_method1(intern!(py, "current_stream"), (device,))?
                .getattr(intern!(py, "cuda_stream"))?
                .extract(),
        }
    }

    fn dtype(&self, dtype: &Bound<'_, PyAny>) -> Option<DType> {
        self.dtypes
            .iter()
            .find(|(object, _)| dtype.is(object))
            .map(|(_, d)| *d)
    }
}

/// What tpar reads of `object` (a torch tensor or a numpy array or scalar), or why it cannot
/// be reduced (a refusal), or Ok(None) for anything else (the caller says what to pass).
pub(crate) fn describe(object: &Bound<'_, PyAny>) -> PyResult<Option<Result<Array, Refusal>>> {
    let py = object.py();
    if let Some(torch) = torch(py)? {
        if torch.is_tensor(object) {
            return describe_tensor(torch, object).map(Some);
        }
    }
    if let Some(numpy) = numpy(py)? {
        let scalar = object.is_instance(numpy.generic.bind(py))?;
        if scalar || object.is_instance(numpy.ndarray.bind(py))? {
            return describe_numpy(object, scalar).map(Some);
        }
    }
    Ok(None)
}

/// The message for an object that is neither a torch tensor nor a numpy array.
pub(crate) fn not_an_array(object: &Bound<'_, PyAny>) -> PyErr {
    let name = object
        .get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |n| n.to_string());
    TparError::new_err(format!(
        "cannot reduce a {name}: pass a torch tensor or a numpy array"
    ))
}

fn unsupported_dtype(dtype: &Bound<'_, PyAny>) -> Refusal {
    Refusal::new(
        "dtype",
        format!("dtype {dtype} is not supported; use float32, float16 or bfloat16"),
    )
}

fn describe_tensor(torch: &Torch, t: &Bound<'_, PyAny>) -> PyResult<Result<Array, Refusal>> {
    let py = t.py();
    let place = if t.getattr(intern!(py, "is_cuda"))?.is_truthy()? {
        Place::Cuda(t.call_method0(intern!(py, "get_device"))?.extract()?)
    } else if t.getattr(intern!(py, "is_cpu"))?.is_truthy()? {
        Place::Host
    } else {
        let device = t.getattr(intern!(py, "device"))?;
        let why = if t.getattr(intern!(py, "is_meta"))?.is_truthy()? {
            "tensor is on the meta device: it has a shape but no data; pass a tensor on the CPU or a GPU".to_owned()
        } else {
            format!("tensor is on {device}: tpar reduces CPU and CUDA tensors")
        };
        return Ok(Err(Refusal::new("device", why)));
    };
    let dtype_object = t.getattr(intern!(py, "dtype"))?;
    let Some(dtype) = torch.dtype(&dtype_object) else {
        return Ok(Err(unsupported_dtype(&dtype_object)));
    };
    if !t.call_method0(intern!(py, "is_contiguous"))?.is_truthy()? {
        return Ok(Err(Refusal::new(
            "contiguous",
            "tensor is not contiguous; call .contiguous() first".to_owned(),
        )));
    }
    Ok(Ok(Array {
        library: Library::Torch,
        place,
        dtype,
        address: t.call_method0(intern!(py, "data_ptr"))?.extract()?,
        count: t.call_method0(intern!(py, "numel"))?.extract()?,
        writeable: true,
        scalar: false,
    }))
}

fn describe_numpy(a: &Bound<'_, PyAny>, scalar: bool) -> PyResult<Result<Array, Refusal>> {
    let py = a.py();
    let dtype_object = a.getattr(intern!(py, "dtype"))?;
    let name: String = dtype_object.getattr(intern!(py, "name"))?.extract()?;
    let dtype = match name.as_str() {
        "float32" => DType::F32,
        "float16" => DType::F16,
        "bfloat16" => DType::Bf16,
        _ => return Ok(Err(unsupported_dtype(&dtype_object))),
    };
    let flags = a.getattr(intern!(py, "flags"))?;
    if !flags.getattr(intern!(py, "c_contiguous"))?.is_truthy()? {
        return Ok(Err(Refusal::new(
            "contiguous",
            "array is not C-contiguous; use numpy.ascontiguousarray first".to_owned(),
        )));
    }
    let interface = a.getattr(intern!(py, "__array_interface__"))?;
    let data = interface
        .get_item(intern!(py, "data"))?
        .cast_into::<PyTuple>()?;
    Ok(Ok(Array {
        library: Library::Numpy,
        place: Place::Host,
        dtype,
        address: data.get_item(0)?.extract()?,
        count: a.getattr(intern!(py, "size"))?.extract()?,
        writeable: flags.getattr(intern!(py, "writeable"))?.is_truthy()? && !scalar,
        scalar,
    }))
}

/// A new, uninitialised array like `a` (a torch tensor or numpy array that [`describe`]
/// read), and its address.
pub(crate) fn empty_like<'py>(a: &Bound<'py, PyAny>) -> PyResult<(Bound<'py, PyAny>, u64)> {
    let py = a.py();
    if let Some(t) = torch(py)?.filter(|t| t.is_tensor(a)) {
        let new = t.empty_like.bind(py).call1((a,))?;
        let address = new.call_method0(intern!(py, "data_ptr"))?.extract()?;
        return Ok((new, address));
    }
    let numpy = numpy(py)?.expect("a numpy array was read");
    let new = numpy.empty_like.bind(py).call1((a,))?;
    let interface = new.getattr(intern!(py, "__array_interface__"))?;
    let data = interface
        .get_item(intern!(py, "data"))?
        .cast_into::<PyTuple>()?;
    Ok((new, data.get_item(0)?.extract()?))
}

/// Whether `a` and `b` have the same shape (torch.Size or numpy's tuple).
pub(crate) fn same_shape(a: &Bound<'_, PyAny>, b: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = a.py();
    let shape = intern!(py, "shape");
    a.getattr(shape)?.eq(b.getattr(shape)?)
}

/// The shape of `a` as Python prints it (a tuple).
pub(crate) fn shape_text(a: &Bound<'_, PyAny>) -> String {
    a.getattr("shape")
        .and_then(|s| {
            let t = PyTuple::new(a.py(), s.try_iter()?.collect::<PyResult<Vec<_>>>()?)?;
            Ok(t.repr()?.to_string())
        })
        .unwrap_or_else(|_| "?".to_owned())
}
