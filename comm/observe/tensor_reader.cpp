/* The flight recorder's tensor reader: a tensor's dims and bytes, read from torch's C++ tensor.
 *
 * flight_ring.c records every comm call's shape. Through torch's Python getters (ndim, nbytes,
 * shape) that cost ~95 ns of an 8-byte allreduce's ~4.2 us, more than the rest of the entry:
 * each getter checks for __torch_function__, boxes an int and is unboxed again. Here the same
 * numbers are a few loads from the at::Tensor the Python object holds (BENCHMARKS.md, "The
 * watchdog's cost").
 *
 * The price is torch's C++ ABI: this file is compiled against the installed torch's headers
 * (setup.py, when torch is importable at build time) and must only run under that same torch,
 * since the THPVariable and TensorImpl layouts change between releases. The module therefore
 * touches no tensor until asked: `built_for` names the torch it was compiled against, and the
 * comm layer hands `reader` to the rings only when that is the torch it imported
 * (communicator.py). Without this module the rings use torch's getters, as before.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <torch/csrc/autograd/python_variable.h>
#include <torch/headeronly/version.h>

#include "tensor_reader.h"

/* The reader (tensor_reader.h): dims into `dims` (at most `maxdim`), their count into `ndim`,
 * the bytes returned; SOAP_READ_UNKNOWN for anything it does not read, so that the caller asks
 * torch's Python getters instead: a Tensor subclass other than Parameter (its attributes may
 * be overridden in Python), symbolic sizes, more than `maxdim` dims. Never raises. */
static long long read_tensor(PyObject *obj, long long *dims, int maxdim, int *ndim) {
    if (!THPVariable_CheckExact(obj)) return SOAP_READ_UNKNOWN;
    try {
        const at::Tensor &t = THPVariable_Unpack(obj);
        const c10::TensorImpl *impl = t.unsafeGetTensorImpl();
        if (impl->has_symbolic_sizes_strides()) return SOAP_READ_UNKNOWN;
        c10::IntArrayRef sizes = impl->sizes();
        size_t n = sizes.size();
        if (n > (size_t)maxdim) return SOAP_READ_UNKNOWN;
        for (size_t i = 0; i < n; i++) dims[i] = sizes[i];
        *ndim = (int)n;
        return (long long)(impl->numel() * (int64_t)impl->itemsize());
    } catch (...) {
        return SOAP_READ_UNKNOWN;
    }
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tensor_reader",
    "A tensor's dims and bytes from torch's C++ tensor, for the flight recorder's rings.", -1,
    nullptr};

PyMODINIT_FUNC PyInit__tensor_reader(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == nullptr) return nullptr;
    PyObject *reader = PyCapsule_New((void *)read_tensor, SOAP_READER_CAPSULE, nullptr);
    if (reader == nullptr || PyModule_AddObject(m, "reader", reader) < 0 ||
        PyModule_AddStringConstant(m, "built_for", TORCH_VERSION) < 0) {
        Py_XDECREF(reader);
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
